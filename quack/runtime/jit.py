"""``@jit_cache``: memory -> disk -> compile worker, for tensor-free compile functions.

This module is the hit path: the memory tier (``JitKernel.__call__``, one dict lookup
a hit) and, for a key new to this process, the local store (``Loaded``, ``load``); the
per-process memory of failed keys; and the usage counters (``usage``, ``cache_stats``,
the journal written at exit). A key the local store doesn't hold goes to
quack.runtime.miss (the read-only tiers, then the miss policy: KernelNotPrebuilt, or a
compile), which a hit never imports.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from quack import registry
from quack.errors import CacheError, CompileError, CompileTimeout, EntryVanished
from quack.runtime import generation
from quack.runtime.loaded import Loaded, load, note_sizes

# Importing a kernel module runs only @jit_cache, which needs the registry; the settings,
# the store, the loader, the tier chain and the journal are imported on the first call
# that misses this process's memory (issue 15: the kernel modules' import, after torch,
# was 12.6 ms, half of it these modules, none of it used before a kernel is asked for).
# The hot path (a hit in ``_memo``) never reaches those imports.
if TYPE_CHECKING:
    from quack.params import Param

_ALL: list["JitKernel"] = []
log = logging.getLogger("quack.jit")


class JitKernel:
    """The decorated compile function. Calling it returns the kernel's callable."""

    def __init__(self, spec: registry.KernelSpec):
        self.spec = spec
        self._memo: dict = {}
        self._by_key: dict[str, Loaded] = {}
        # key -> (source fingerprint, error): a failed compile, or a compile past compile_timeout
        self._failed: dict[str, tuple[str, CompileError | CompileTimeout]] = {}
        self._gen = generation.value
        self._lock = threading.RLock()  # the dicts above; never held across a compile
        # key -> set once the thread resolving it is done: other threads asking for that key
        # wait for it (one compile per key), threads asking for any other key go on.
        self._inflight: dict[str, threading.Event] = {}
        self.warned_unshippable = False  # its one warning: a worker can't import it (quack.runtime.miss)
        functools.update_wrapper(self, spec.fn)
        _ALL.append(self)

    # The hot path: one dict lookup on the call's arguments.
    def __call__(self, *args, **kwargs):
        try:
            # Types are part of the memo key: True == 1 and 4096 == 4096.0 hash alike,
            # and must not share an entry (nor skip the slow path's validation).
            hit = (
                self._memo[
                    (args, tuple(map(type, args)), tuple(kwargs.items()), tuple(map(type, kwargs.values())))
                ]
                if self._gen == generation.value
                else None
            )
        except (KeyError, TypeError):
            hit = None
        if hit is not None:
            hit.hits += 1
            return hit.fn
        return self._slow(args, kwargs)

    def compile_uncached(self, *args, arch: str | None = None, **kwargs):
        """Compile here, now, and return the ``cute.compile`` result: no cache tier is read
        or written. For one thing only: a compile function that builds its kernel with
        another's (the outer key caches the result; a cached inner call would hand back a
        loaded kernel, not a compile result to export). The arguments are bound and checked
        as a call's are (types, ranges, rules, a derived configuration), so it never runs a
        configuration the cache would refuse. Tuning does not need it: a candidate is a
        configuration, which is in the key (``quack.tuning.use_config``)."""
        from quack import settings as _settings
        from quack.compile.builder import call_compile

        arch = arch or _settings.get().arch
        return call_compile(self.spec, self.spec.bind(args, kwargs, arch=arch), arch)

    def key(self, *args, arch: str | None = None, **kwargs) -> str:
        from quack import settings as _settings

        arch = arch or _settings.get().arch
        params = self.spec.bind(args, kwargs, arch=arch)
        return self.spec.key(params, arch)

    def _slow(self, args, kwargs):
        from quack import settings as _settings

        # The lock guards the dicts only. Held across _resolve (a compile: seconds to
        # minutes), it serialized every thread calling this kernel: three threads on three
        # cold keys took three compiles' time, and a loaded key waited behind another
        # thread's compile. A key being resolved has an event its other callers wait on,
        # so one key still compiles once however many threads ask for it.
        while True:
            with self._lock:
                if self._gen != generation.value:
                    self._memo.clear()
                    self._by_key.clear()
                    self._failed.clear()
                    self._gen = generation.value
                s = _settings.get()
                params = self.spec.bind(args, kwargs, arch=s.arch)
                key = self.spec.key(params, s.arch)
                loaded = self._by_key.get(key)
                if loaded is not None:
                    loaded.hits += 1
                    return self._memoize(args, kwargs, loaded)
                self._raise_if_failed(key)
                busy = self._inflight.get(key)
                if busy is None:
                    mine = self._inflight[key] = threading.Event()
                    break
            # Another thread is resolving this key: its outcome (loaded, a remembered
            # failure; a transient failure makes this thread try) is read on the next pass.
            busy.wait()
        try:
            loaded = self._resolve(params, key, s)
        except (CompileError, CompileTimeout) as e:
            if remembered(e):
                with self._lock:
                    self._remember_failure(key, e)
            raise
        else:
            with self._lock:  # recorded before the waiters wake: they find it, none compiles
                self._by_key[key] = loaded
        finally:
            with self._lock:
                del self._inflight[key]
            mine.set()
        with self._lock:
            return self._memoize(args, kwargs, loaded)

    def _memoize(self, args, kwargs, loaded: Loaded):
        """Remember this spelling of the arguments for the hot path; caller holds the lock."""
        try:
            self._memo[
                (args, tuple(map(type, args)), tuple(kwargs.items()), tuple(map(type, kwargs.values())))
            ] = loaded
        except TypeError:
            pass  # unhashable argument spelling: still correct, just the slow path
        return loaded.fn

    # A configuration that failed to compile fails the same way until its source changes:
    # compiling it again on every call (minutes for a large kernel) tells nothing new. So
    # does one whose compile ran past compile_timeout (its worker killed): N tests asking
    # for a wedged key took N times compile_timeout. Settings installed anew (a larger
    # compile_timeout through quack.settings.override) bump the generation, which clears
    # this memory (_slow).
    def _raise_if_failed(self, key: str) -> None:
        hit = self._failed.get(key)
        if hit is None:
            return
        fp, err = hit
        if fp == self.spec.source_fingerprint():
            # Without the earlier raise's frames: they held that caller's locals (a test's
            # tensors) for as long as the error was remembered.
            raise err.with_traceback(None)
        del self._failed[key]  # the kernel was edited: compile it again

    def _remember_failure(self, key: str, err: CompileError | CompileTimeout) -> None:
        if key not in self._failed and hasattr(err, "add_note"):  # Python 3.11+
            if isinstance(err, CompileTimeout):
                err.add_note(
                    f"quack: {self.spec.name} key {key[:16]} timed out in this process; it will "
                    f"not be compiled again in this process until its source changes or "
                    f"compile_timeout is raised (QUACK_COMPILE_TIMEOUT or [runtime] "
                    f"compile_timeout for a new process; quack.settings.override("
                    f"compile_timeout=...) in this one): later calls raise this error at once"
                )
            else:
                err.add_note(
                    f"quack: {self.spec.name} key {key[:16]} will not be compiled again in this "
                    f"process until its source changes"
                )
        self._failed[key] = (self.spec.source_fingerprint(), err)

    # Where warnings point: at the line that called the kernel. Every step below runs at a
    # fixed depth under it (caller <- __call__ <- _slow <- _resolve <- step <- ...; the steps
    # in quack.runtime.miss take the kernel as their first argument), and each stacklevel
    # counts those frames; moving a step up or down changes its numbers.
    def _resolve(self, params: dict, key: str, s) -> Loaded:
        """The tiers after memory: local cache -> read-only tiers (installed bundles,
        remote, ...) -> the miss policy: the last two in quack.runtime.miss (the chain:
        quack.runtime.tiers; docs/architecture.md)."""
        # The ref from the key already made, not builder.entry_ref: a hit never imports
        # the builder (its imports were ~1.5 ms of a fresh process's first load).
        from quack.cache.entry import EntryRef

        ref = EntryRef(self.spec.name, key, s.arch, self.spec.source_fingerprint())
        store, loaded, unusable = self._from_local(ref, params, key, s)
        if loaded is not None:
            return loaded
        from quack.runtime import miss  # a local miss only: a hit never imports the rest

        tiered = miss.from_tiers(self, ref, store, params, key, s.arch, s)
        if tiered is not None:
            return tiered
        return miss.on_miss(self, ref, store, params, key, s, unusable)

    def _from_local(self, ref, params, key, s) -> tuple[Any, Loaded | None, str]:
        """The local store: (store or None, a loaded hit or None, why the cache can't be
        used or ""). A cache that can't be read is no store at all (one warning); an
        entry cleaned between lookup and load is a plain miss."""
        # Prebuilt mode never compiles, whatever the cache's state: every path after
        # this one that would compile raises KernelNotPrebuilt instead, saying why when
        # it is not a plain miss (a disabled or unusable cache).
        from quack.cache.store import local_store

        if not s.cache_enabled:
            return None, None, "the cache is disabled (QUACK_CACHE_ENABLED=0 or [cache] enabled = false)"
        store = local_store(s)
        try:
            entry = store.lookup(ref)
        except (CacheError, OSError) as e:
            from quack.cache.problems import warn_once

            # Once per process per cause, in both modes: every call of every kernel meets
            # the same unusable cache, and a warning per call (15 calls, 15 warnings) buried
            # the one line that says what is wrong.
            if s.mode == "prebuilt":
                warn_once(
                    f"unusable:{s.cache_dir}", f"quack: cache {s.cache_dir} unusable ({e})", stacklevel=6
                )
            else:
                warn_once(
                    f"unusable-jit:{s.cache_dir}:{type(e).__name__}:{getattr(e, 'errno', None)}",
                    f"quack: cache {s.cache_dir} unusable ({e}); not using it: kernels it "
                    f"would hold compile in a compile worker (in this process for a kernel "
                    f"a worker can't import), unstored",
                    stacklevel=6,
                )
            return None, None, f"the cache is unusable ({e})"
        if entry is not None:
            try:
                loaded = load(store, entry, params, key, s.arch, miss=False)
                log.debug("local hit %s %s (%s)", self.spec.name, key[:16], loaded.how)
                return store, loaded, ""
            except EntryVanished:
                pass  # cleaned between lookup and load: a plain miss
        return store, None, ""

    def usage(self) -> list[dict]:
        out = []
        for ld in list(self._by_key.values()):
            out.append(
                {
                    "kernel": self.spec.name,
                    "key": ld.key,
                    "arch": ld.arch,
                    "params": self.spec.plain(ld.params),
                    "hits": ld.hits,
                    "misses": ld.misses,
                    "compiles": ld.compiles,
                    "load_s": round(ld.load_s, 6),
                    "compile_s": round(ld.compile_s, 4),
                    "how": ld.how,
                    "tier": ld.tier,
                    "waits": ld.waits,
                    "wait_s": round(ld.wait_s, 4),
                }
            )
            if self.spec.derived_params:
                out[-1]["derived"] = self._is_table_choice(ld)
            if ld.sizes:
                out[-1]["problems"] = [list(t) for t, _ in sorted(ld.sizes.items(), key=lambda tc: -tc[1])]
        return out

    def _is_table_choice(self, ld: Loaded) -> bool:
        """Is ``ld``'s configuration the one the tuning table (or the heuristic) chooses for
        its other parameters, at one of its calls' problem sizes? A torch-facing op derives
        it and passes it in (``rmsnorm_fwd``, ``gemm``); quack tune's candidates
        (``use_config``) and a configuration a caller spelled out are not. quack prewarm
        builds the table's choice of its own day for the first kind (after a re-tune too),
        the configuration as used for the second. Asked when the journal is written, not
        on a call: state the key and its sizes already hold."""
        import warnings

        names = self.spec.derived_params
        want = self.spec.encode({n: ld.params[n] for n in names})
        try:
            with warnings.catch_warnings():  # the table's "no rows for this GPU" was the calls' to say
                warnings.simplefilter("ignore")
                for sizes in [dict(zip(self.spec.problem, t)) for t in ld.sizes or ()] or [{}]:
                    at = self.spec.derive_at(ld.params, sizes, ld.arch, names)
                    if self.spec.encode({n: at[n] for n in names}) == want:
                        return True
        except Exception:  # noqa: BLE001 - a journal note must never fail the process's exit
            return False
        return False


class SizedJitKernel(JitKernel):
    """A kernel that declares problem sizes (``jit_cache(problem=...)``: the GEMM's m, n, k,
    which its parameters do not carry): each call also counts, against the key it resolved
    to, the sizes ``quack.tuning.at_problem`` set, for the usage journal. Without them
    quack prewarm could only rebuild a GEMM's configuration pinned, which a re-tune leaves
    behind, and ``--emit-manifest`` wrote it pinned. Its own hot path: calling
    JitKernel.__call__ would add a frame, and the warnings' stack levels count frames."""

    def __init__(self, spec):
        # imported here, not at the top: quack.tuning (its tables) is ~8 ms that a process
        # whose kernels declare no sizes never needs (issue 15)
        from quack.tuning.problem import current_problem

        super().__init__(spec)
        self._problem = current_problem

    def __call__(self, *args, **kwargs):
        try:
            hit = (
                self._memo[
                    (args, tuple(map(type, args)), tuple(kwargs.items()), tuple(map(type, kwargs.values())))
                ]
                if self._gen == generation.value
                else None
            )
        except (KeyError, TypeError):
            hit = None
        if hit is not None:
            hit.hits += 1
            sizes = self._problem()
            if sizes is not None:
                note_sizes(hit, sizes, self.spec.problem)
            return hit.fn
        return self._slow(args, kwargs)

    def _memoize(self, args, kwargs, loaded: Loaded):
        sizes = self._problem()
        if sizes is not None:
            note_sizes(loaded, sizes, self.spec.problem)
        return super()._memoize(args, kwargs, loaded)


def remembered(err: CompileError | CompileTimeout) -> bool:
    """Is this failure the key's own, to be raised again at once by later calls in this
    process (``JitKernel._failed``)? A compile error that ran to its end, and a compile
    past compile_timeout in this process's own worker; not a transient one (a worker
    killed, the pool shut down) nor another process's lock held past its time-out (that
    process may still publish the key)."""
    if isinstance(err, CompileTimeout):
        return not err.external
    return not err.transient


def jit_cache(
    name: str,
    params: dict[str, Param],
    *,
    version: int = 0,
    reference: str | None = None,
    rules=(),
    depends_on=(),
    search_space: Callable | None = None,
    bench: str | None = None,
    problem: tuple[str, ...] = (),
) -> Callable[[Callable], JitKernel]:
    """Register a tensor-free compile function as kernel ``name`` and cache it.
    ``rules``: quack.params.Rule constraints across parameters, checked (with each
    parameter's own check) by manifests and on every call, before anything compiles.
    ``depends_on``: files, directories (paths containing '/', relative to the module's
    directory) or modules (dotted names) the fingerprint covers beyond what the kernel's
    module imports (docs/writing-kernels.md).
    ``search_space`` / ``bench``: what ``quack tune`` measures (docs/tuning.md); ``problem``:
    the sizes a tuning problem names beyond the parameters (the GEMM's ("m", "n", "k"); a
    tuning manifest lists them, ``problems = [[...], ...]``)."""

    def deco(fn: Callable) -> JitKernel:
        spec = registry.register(
            name,
            fn,
            params,
            version=version,
            reference=reference,
            rules=rules,
            depends_on=depends_on,
            search_space=search_space,
            bench=bench,
            problem=problem,
        )
        return SizedJitKernel(spec) if spec.problem else JitKernel(spec)

    return deco


def kernel(name: str) -> JitKernel:
    """The ``@jit_cache``d kernel registered as ``name`` (its module must be imported)."""
    for k in _ALL:
        if k.spec.name == name:
            return k
    from quack.errors import UnknownKernel

    raise UnknownKernel(name, tuple(sorted(registry.all_specs())))


def cache_stats() -> dict[str, Any]:
    """This process's counters, summed over kernels."""
    tot = {"hits": 0, "misses": 0, "compiles": 0, "load_s": 0.0, "compile_s": 0.0}
    for k in _ALL:
        for u in k.usage():
            for f in tot:
                tot[f] += u[f]
    return tot


@atexit.register
def _write_journal() -> None:
    records = [u for k in _ALL for u in k.usage()]
    if not records:  # nothing loaded: no settings to resolve, nothing to import at exit
        return
    from quack import settings as _settings
    from quack.cache import journal

    try:
        s = _settings.get()
    except Exception:  # noqa: BLE001
        return
    t = journal.now()
    for u in records:
        u["t"] = t
    if s.cache_enabled:
        journal.append(s.cache_dir, records)
