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
    )

    def __init__(self, fn, module, key, params, arch, how, tier="cache"):
        self.fn, self.module, self.key, self.params, self.arch, self.how = fn, module, key, params, arch, how
        self.tier = tier  # where it came from: "cache", "bundle:<name>" or "compile"
        self.hits = self.misses = self.compiles = 0
        self.load_s = self.compile_s = 0.0
        # A miss another process (or worker) was already compiling: waited for, not compiled.
        self.waits = 0
        self.wait_s = 0.0


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
