"""One kernel loaded in this process (``Loaded``: its function and usage counters) and
loading a store's entry into one (``load``). Shared by the jit front end
(quack.runtime.jit) and the miss path (quack.runtime.miss), which imports neither
back."""

from __future__ import annotations

import time


class Loaded:
    """One loaded kernel in this process, with its usage counters."""

    __slots__ = (
        "fn",
        "module",
        "key",
        "params",
        "arch",
        "hits",
        "misses",
        "compiles",
        "load_s",
        "compile_s",
        "how",
        "tier",
        "waits",
        "wait_s",
        "sizes",
    )

    def __init__(self, fn, module, key, params, arch, how, tier="cache"):
        self.fn, self.module, self.key, self.params, self.arch, self.how = fn, module, key, params, arch, how
        self.tier = tier  # where it came from: "cache", "bundle:<name>" or "compile"
        self.hits = self.misses = self.compiles = 0
        self.load_s = self.compile_s = 0.0
        # A miss another process (or worker) was already compiling: waited for, not compiled.
        self.waits = 0
        self.wait_s = 0.0
        # The problem sizes of its calls (quack.tuning.at_problem) -> calls, for a kernel that
        # declares them (the GEMM's m, n, k): note_sizes, at most MAX_SIZES of them.
        self.sizes: dict[tuple[int, ...], int] | None = None


# A server calling the GEMM at every sequence length would grow this without end; the
# journal and quack prewarm need the sizes used most, which come first.
MAX_SIZES = 64


def note_sizes(ld: Loaded, sizes: dict, names: tuple[str, ...]) -> None:
    """Count one call of ``ld`` at ``sizes`` (``at_problem``'s dict; ``names`` its kernel's
    ``problem`` order). A size past the first MAX_SIZES is not kept; one that is not a set
    of ints naming every size is ignored (a journal note must never fail a call)."""
    try:
        t = tuple(int(sizes[n]) for n in names)
    except (KeyError, TypeError, ValueError):
        return
    d = ld.sizes
    if d is None:
        d = ld.sizes = {}
    if t in d:
        d[t] += 1
    elif len(d) < MAX_SIZES:
        d[t] = 1


def load(store, entry, params, key, arch, *, miss: bool) -> Loaded:
    """Load a store's entry (its use touched for eviction), counted as a hit or a miss."""
    from quack.runtime import loader

    t0 = time.perf_counter()
    fn, module, how = loader.load_entry(store, entry)
    store.touch(entry)
    loaded = Loaded(fn, module, key, params, arch, how)
    loaded.load_s = time.perf_counter() - t0
    if miss:
        loaded.misses = 1
    else:
        loaded.hits = 1
    return loaded
