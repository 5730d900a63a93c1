"""A ``@jit_cache`` key the local store doesn't hold: the read-only tiers (installed
bundles, remote; ``from_tiers``), then the miss policy (``on_miss``). Prebuilt mode
raises KernelNotPrebuilt (saying why when it is not a plain miss); jit mode compiles
it: in a compile worker, settling with the pool (inside a pool_scope a pending key
raises CompilePending); in a compile worker and unstored (its object's bytes loaded from
a private copy, bounded by compile_timeout) when another process holds the key's lock
past lock_timeout or the cache can't take the object (read-only, full, its entry gone
right after the compile) or the cache is disabled or unusable; in this process only for
a kernel a worker can't import.

Imported only by a local miss (quack.runtime.jit's ``JitKernel._resolve``): a hit never
imports it, nor the pool, the builder or the tier chain it reaches
(tests/test_coldstart.py). Each step runs at a fixed frame depth under the kernel's
caller, which its warnings' stacklevels count (see ``JitKernel._resolve``).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import TYPE_CHECKING, Any

from quack.errors import (
    CacheError,
    CacheWarning,
    CompileError,
    CompilePending,
    CompileTimeout,
    EntryVanished,
    KernelNotPrebuilt,
    LockTimeout,
)
from quack.runtime.loaded import Loaded, load

if TYPE_CHECKING:
    from quack.runtime.jit import JitKernel

log = logging.getLogger("quack.jit")


def from_tiers(k: JitKernel, ref, store, params, key, arch, s) -> Loaded | None:
    """The read-only tiers, in order (quack.runtime.tiers). An in-place tier's entry
    (installed bundles: already on this machine, verified where it lies) is loaded
    where it is, so it serves a read-only or disabled cache too; any other tier's hit
    is published into the local store, then loaded from there, or, when the store
    can't take it (read-only, full), loaded unstored from its verified bytes."""
    from quack.cache.contract import InPlaceTier
    from quack.runtime import loader, tiers

    for tier in tiers.read_tiers(s):
        if isinstance(tier, InPlaceTier):
            entry = tier.open(ref)
            if entry is None:
                continue
            t0 = time.perf_counter()
            try:
                fn, module, how = loader.load_in_place(entry, store)
            except EntryVanished:  # uninstalled meanwhile: a miss here
                log.info("tier %s: %s %s vanished before loading", tier.name, k.spec.name, key[:16])
                continue
            loaded = Loaded(fn, module, key, params, arch, how, tier=entry.meta.get("source", tier.name))
            loaded.load_s = time.perf_counter() - t0
            loaded.hits = 1
            log.debug("tier %s: hit %s %s (%s)", loaded.tier, k.spec.name, key[:16], how)
            return loaded
        if store is None:
            continue  # the cache is disabled or unusable: no local lookups, no fetches
        got = tiers.fetch_one(tier, ref)
        if got is None:
            continue
        entry = tiers.publish_fetched(store, got)
        if entry is not None:
            log.info("tier %s: hit %s %s, published into %s", tier.name, ref.kernel, key[:16], store.root)
            try:
                loaded = load(store, entry, params, key, arch, miss=True)
                loaded.tier = tier.name
                return loaded
            except EntryVanished:
                log.info("tier %s: %s %s vanished before loading", tier.name, k.spec.name, key[:16])
        # Not stored (a read-only or full cache) or evicted at once: the bytes in hand
        # are verified (signed by a trusted key), so they are loaded as they are. Dropped,
        # they cost a KernelNotPrebuilt with no reason, or a compile in this process.
        unstored = load_unstored(got, params, key, arch, tier.name)
        if unstored is not None:
            return unstored
    return None


def load_unstored(got, params, key, arch, tier_name: str) -> Loaded | None:
    """A read-only tier's verified object the local store did not keep, loaded from a
    private copy of its bytes (quack.runtime.loader.load_fetched); None when no such copy
    can be made (warned about once), a miss."""
    from quack.runtime import loader

    t0 = time.perf_counter()
    try:
        fn, module, how = loader.load_fetched(got.ref, got.data)
    except EntryVanished:
        return None
    loaded = Loaded(fn, module, key, params, arch, how, tier=tier_name)
    loaded.load_s = time.perf_counter() - t0
    loaded.misses = 1
    log.info("tier %s: %s %s loaded unstored (%s)", tier_name, got.ref.kernel, key[:16], how)
    return loaded


def on_miss(k: JitKernel, ref, store, params, key, s, unusable: str) -> Loaded:
    """The miss policy: prebuilt mode raises KernelNotPrebuilt; jit mode compiles in a
    compile worker, into the store when it can take the object, else unstored (in this
    process for a kernel a worker can't import)."""
    arch = s.arch
    if s.mode == "prebuilt":
        not_prebuilt(k, params, key, s, unusable or stale_entry(store, ref))
    if store is None:  # cache disabled or unusable (warned about): nothing to publish into
        if k.spec.shippable:
            return compile_unstored(k, ref, params, key, arch, unusable or "the cache is not used")
        return compile_in_process(k, params, key, arch)
    if not store.writable():
        log.info("%s is not writable: compiling %s %s unstored", s.cache_dir, k.spec.name, key[:16])
        from quack.cache.problems import warn_once

        # Read-only cache: hits still load from it; misses compile in a worker, unstored
        # (in this process only for a kernel a worker can't import), one warning.
        warn_once(
            f"read-only:{s.cache_dir}",
            f"quack: cache {s.cache_dir} is not writable; kernels missing from it are "
            f"compiled in a compile worker (in this process for a kernel a worker can't "
            f"import) and not stored",
            stacklevel=6,
        )
        if k.spec.shippable:
            return compile_unstored(k, ref, params, key, arch, f"cache {s.cache_dir} is not writable")
        return compile_in_process(k, params, key, arch)
    return compile_stored(k, store, ref, params, key, arch)


def compile_stored(k: JitKernel, store, ref, params, key, arch) -> Loaded:
    """Compile a miss into the store (in a worker, or here for a kernel that can't
    be shipped to one) and load it; a compile the store can't take runs unstored."""
    t0 = time.perf_counter()
    if not k.spec.shippable:
        built = build_here(k, store, params, key, arch)
        if built is None:
            return compile_in_process(k, params, key, arch)
        entry, compiled, compile_s = built
    else:
        entry, report = compile_in_worker(k, store, ref, params, key, arch)
        if entry is None and report is not None:  # a worker compiled it unstored
            return load_worker_unstored(k, ref, params, key, arch, report)
        if entry is None:  # the cache can't take the object (warned about)
            log.info("fallback: compiling %s %s unstored in a worker", k.spec.name, key[:16])
            return compile_unstored(k, ref, params, key, arch, "the cache can't take the object")
        compiled = bool(report and report.get("compiled"))
        compile_s = float((report or {}).get("compile_s") or 0.0)
    try:
        loaded = load(store, entry, params, key, arch, miss=True)
    except EntryVanished:  # evicted right after its compile: run it uncached
        if k.spec.shippable:
            log.info("%s %s vanished after its compile: compiling it unstored", k.spec.name, key[:16])
            return compile_unstored(k, ref, params, key, arch, "its entry vanished right after its compile")
        return compile_in_process(k, params, key, arch)
    # Count a compile once, where it happened: when another process (or an earlier
    # submission) built the key, this call waited for it (stats would otherwise count
    # one compile per waiting process, each with the whole wait as its compile time).
    elapsed = time.perf_counter() - t0 - loaded.load_s
    if compiled:
        loaded.compiles = 1
        loaded.tier = "compile"
        loaded.compile_s = compile_s or elapsed
    else:
        loaded.waits = 1
        loaded.wait_s = elapsed
    log.debug("%s %s %s (%.3f s)", "compiled" if compiled else "waited for", k.spec.name, key[:16], elapsed)
    return loaded


def load_worker_unstored(k: JitKernel, ref, params, key, arch, report: dict, *, warn: bool = True) -> Loaded:
    """A key a compile worker compiled unstored (within compile_timeout, as any compile):
    another process held its lock past lock_timeout without publishing it (the holder
    publishes it if it ever finishes), or the cache can't take it (``compile_unstored``).
    Its object is loaded from a private copy of the bytes in the pool's report. One
    warning, saying why (``warn`` False: the caller gave it)."""
    from quack.runtime import loader

    if warn:
        warnings.warn(
            f"quack: {report.get('why') or 'another process held the lock'}; compiled "
            f"{k.spec.name} key {key[:16]} in a compile worker (within compile_timeout) and "
            f"loaded it unstored",
            CacheWarning,
            stacklevel=7,
        )
    t0 = time.perf_counter()
    try:
        fn, module, how = loader.load_fetched(ref, report["data"])
    except EntryVanished:  # no private copy could be made (warned about once)
        raise CompileError(
            k.spec.name,
            k.spec.plain(params),
            arch,
            f"compiled unstored ({report.get('why')}), but no private copy of its object "
            f"could be made to load it",
            transient=True,
        ) from None
    loaded = Loaded(fn, module, key, params, arch, how, tier="compile")
    loaded.load_s = time.perf_counter() - t0
    loaded.misses = loaded.compiles = 1
    loaded.compile_s = float(report.get("compile_s") or 0.0)
    log.info("%s %s compiled unstored in a worker, loaded (%s)", k.spec.name, key[:16], how)
    return loaded


def build_here(k: JitKernel, store, params, key, arch) -> tuple[Any, bool, float] | None:
    """A kernel defined where a worker can't import it (a test function, __main__):
    build and publish it in this process (one warning per kernel). Returns (entry,
    compiled, compile_s), or None when the store can't take it (one warning)."""
    from quack.compile import builder

    if not k.warned_unshippable:
        warnings.warn(
            f"quack: kernel {k.spec.name} is defined in {k.spec.module} "
            f"({k.spec.qualname}) and can't be sent to a compile worker; "
            f"compiling it in this process",
            CacheWarning,
            stacklevel=7,
        )
        k.warned_unshippable = True
    try:
        entry, compiled = builder.build(k.spec, params, arch, store)
    except (OSError, LockTimeout) as e:
        warnings.warn(
            f"quack: can't store {k.spec.name} key {key[:16]} ({e}); running it uncached",
            CacheWarning,
            stacklevel=7,
        )
        return None
    return entry, compiled, float(entry.meta.get("compile_s") or 0.0) if compiled else 0.0


def stale_entry(store, ref) -> str:
    """Why a prebuilt miss is not a plain one: the key was built, but for an older
    source of the kernel (an edit since the build moved it to a new fingerprint)."""
    if store is None:
        return ""
    d = store.entry_dir(ref)
    try:
        with os.scandir(d.parent) as it:
            old = sorted(
                e.name
                for e in it
                if e.name != d.name
                and e.is_dir(follow_symlinks=False)
                and os.path.isfile(os.path.join(e.path, ref.key + ".json"))
            )
    except OSError:
        return ""
    if not old:
        return ""
    return (
        f"it was built for an older source of the kernel (fingerprint {old[-1]}; now "
        f"{ref.srcfp}): the kernel's source changed since, so `quack build` (or `quack "
        f"prewarm`) must rebuild it"
    )


def not_prebuilt(k: JitKernel, params, key, s, reason: str):
    """Raise KernelNotPrebuilt for the key (with the manifest line that would build it
    and the bundles searched), recorded with the pool's scope first."""
    from quack.cache.contract import ListsSearched
    from quack.manifest_line import manifest_line
    from quack.runtime import tiers
    from quack.tuning import current_problem

    plain = k.spec.plain(params)
    err = KernelNotPrebuilt(
        k.spec.name,
        plain,
        s.arch,
        key,
        str(s.cache_dir),
        manifest_line(k.spec.name, plain, s.arch, current_problem() if k.spec.problem else None),
        bundles=next(
            (
                t.searched()
                for t in tiers.read_tiers(s)
                if t.name == "bundles" and isinstance(t, ListsSearched)
            ),
            (),
        ),
        reason=reason,
        tuned_for=_tuned_for(k),
    )
    from quack.compile import scope  # on a miss only: a hit never needs the pool

    scope.note_not_prebuilt(err, s)
    raise err


def _tuned_for(k: JitKernel) -> str:
    """ "H100 (this machine's GPU, through NVML)" for a kernel with a table-derived
    configuration parameter, else ""."""
    from quack.tuning import gpu_choice

    if not k.spec.derived_params:
        return ""
    model, why = gpu_choice()
    return f"GPU {model} ({why})" if model else f"each table's default GPU ({why})"


def compile_in_worker(k: JitKernel, store, ref, params, key, arch):
    """A miss, compiled by the pool. Inside a pool_scope: submit and raise
    CompilePending. Outside: submit to the default pool and wait. Either way a failed
    key is raised once, as CompileError (the worker's traceback text) or CompileTimeout,
    and then forgotten by the pool: the kernel remembers a compile error and its own
    worker's time-out and raises them again at once (``JitKernel._failed``); a transient
    failure is retried by the next call. A key whose lock another process held past
    lock_timeout without publishing it is compiled by a worker unstored (the pool's
    ``unstored_fallback``); past compile_timeout it raises CompileTimeout. Returns (entry,
    the pool's report of the key: ``compiled`` False when another process built it),
    (None, a report with the unstored object's ``data``), or (None, None) when the
    cache can't take the object (warned about; the caller has a worker compile it
    unstored: ``compile_unstored``)."""
    from quack import settings as _settings
    from quack.compile.pool import unstored_root
    from quack.compile.tasks import DONE, FAILED, NEW

    s = _settings.get()
    pool, scoped = pool_for(k, params, arch, s)
    root = s.cache_dir
    if pool.state(key, unstored_root(root)) != NEW:
        # A worker compiles (or compiled) it unstored already: an earlier call of this key
        # found the cache can't take it, and raised CompilePending (a pool_scope's retry).
        return None, None
    for _ in range(3):
        st, err = settle_in_pool(k, pool, scoped, params, key, arch, s)
        if st == FAILED:
            pool.forget(key, root)  # reported once; a later call may retry
            worker_failed(k, err, params, key, arch)
            return None, None
        if st == DONE:
            entry = store.lookup(ref)
            if entry is not None:
                return entry, pool.report(key, root)
            report = pool.report(key, root)
            if report and report.get("unstored"):  # another process's lock: compiled unstored
                return None, report
            # Done, yet no valid entry (cleaned, or quarantined as corrupt): build again.
            pool.forget(key, root)
            if pool.state(key, root) != NEW:
                break
    warnings.warn(
        f"quack: the pool reported {k.spec.name} key {key[:16]} done but the cache "
        f"has no valid entry; compiling it in a compile worker, unstored",
        CacheWarning,
        stacklevel=7,
    )
    return None, None


def pool_for(k: JitKernel, params, arch, s):
    """(the pool a miss goes to, whether it is a pool_scope's): the active scope's, else
    the default pool; at interpreter exit, once that shut down, a CompileError."""
    from quack.compile import pool as _pool  # not at import: a prebuilt hit never needs it
    from quack.compile import scope

    pool = scope.active_pool(s.cache_dir)
    if pool is not None:
        return pool, True
    if _pool.exiting():  # at interpreter exit, after the pool's atexit shutdown
        raise CompileError(
            k.spec.name,
            k.spec.plain(params),
            arch,
            "not compiled: the interpreter is shutting down and quack's compile pool has "
            "shut down (its atexit hook ran before the hook that called this kernel). Call "
            "it before exit, or build it beforehand (`quack build`)",
            transient=True,
        )
    return _pool.default_pool(), False


def compile_unstored(k: JitKernel, ref, params, key, arch, why: str) -> Loaded:
    """A shippable kernel's miss the cache can't take (read-only, full, disabled,
    unusable, its entry gone right after the compile; ``why``, warned about by the
    caller where the cache is not plainly disabled): a compile worker
    compiles it into its private temp directory, publishing nothing and taking no lock,
    bounded by compile_timeout like any compile, and its object is loaded from a private
    copy of the bytes (``load_worker_unstored``). Inside a pool_scope a pending key raises
    CompilePending. The pool keeps the key apart from a stored compile of it
    (``unstored_root``) and forgets it once loaded: the kernel keeps the loaded function.
    A failure is raised: CompileError, CompileTimeout, or CacheWriteError (the worker's
    temp directory can't take the object)."""
    from quack import settings as _settings
    from quack.compile import pool as _pool
    from quack.compile.tasks import DONE

    s = _settings.get()
    pool, scoped = pool_for(k, params, arch, s)
    root = _pool.unstored_root(s.cache_dir)
    st, err = settle_in_pool(k, pool, scoped, params, key, arch, s, unstored=why)
    report = pool.report(key, root) if st == DONE else None
    pool.forget(key, root)  # once: the bytes are not kept; a later miss compiles it again
    if report is None or "data" not in report:
        if isinstance(err, (CompileError, CompileTimeout, CacheError)):
            raise err
        raise CompileError(
            k.spec.name,
            k.spec.plain(params),
            arch,
            f"compiling it unstored ({why}) in a compile worker failed: {err or 'no object came back'}",
        )
    return load_worker_unstored(k, ref, params, key, arch, dict(report, why=why), warn=False)


def settle_in_pool(
    k: JitKernel, pool, scoped: bool, params, key, arch, s, *, unstored: str = ""
) -> tuple[str, BaseException | None]:
    """Submit the key unless the pool has it, then wait until it is no longer pending
    (state, error); in a pool_scope a pending key raises CompilePending instead.
    ``unstored`` (why): a compile unstored from the start (``compile_unstored``)."""
    from quack.compile import pool as _pool
    from quack.compile import scope
    from quack.compile.tasks import NEW, PENDING

    root = _pool.unstored_root(s.cache_dir) if unstored else s.cache_dir
    st, err = pool.poll(key, root)
    if st == NEW:
        st = pool.submit(k.spec, params, arch, key, settings=s, unstored_fallback=True, unstored=unstored)
        if st != PENDING:  # settled at once (a shut-down pool): its error with it
            st, err = pool.poll(key, root)
    if st == PENDING:
        if scoped:
            exc = CompilePending(k.spec.name, key)
            exc.root = str(root)
            exc.pool = pool
            scope.note_pending(exc)
            raise exc
        st, err = pool.wait(key, root=root)
    return st, err


def worker_failed(k: JitKernel, err, params, key, arch) -> None:
    """A key the pool failed. A CompileTimeout is raised: its own worker's (the compile
    is what is slow) or another process's lock held past compile_timeout (its compile ran
    that long); compiling it again here would only move the hang into the caller,
    unbounded (compile_timeout promises a bound). A lock held past lock_timeout never
    fails a runtime miss (a worker compiles the key unstored instead: the pool's
    ``unstored_fallback``); the LockTimeout, should one come, is raised too. A cache that
    can't take the object returns (one warning; the caller has a compile worker compile
    it unstored: ``compile_unstored``); a compile error is raised."""
    if isinstance(err, (CompileTimeout, LockTimeout)):
        raise err
    if isinstance(err, CacheError):  # the cache (full, read-only), not the kernel
        warnings.warn(
            f"quack: can't store {k.spec.name} key {key[:16]} ({err}); "
            f"compiling it in a compile worker, unstored",
            CacheWarning,
            stacklevel=8,
        )
        return
    if isinstance(err, CompileError):
        raise err
    raise CompileError(k.spec.name, k.spec.plain(params), arch, str(err))


def compile_in_process(k: JitKernel, params, key, arch) -> Loaded:
    """Compile here and keep the JIT function in memory: only a kernel a compile worker
    can't import (defined in a test function, __main__) whose object the cache can't
    take (read-only, full, disabled, unusable). Nothing bounds it."""
    from quack import settings as _settings
    from quack.compile import builder

    s = _settings.get()
    if s.mode == "prebuilt":  # the last guard: no path may compile in prebuilt mode
        not_prebuilt(k, params, key, s, "")
    builder.pin_arch(arch)
    t0 = time.perf_counter()
    try:
        fn = builder.call_compile(k.spec, params, arch)
    except Exception as e:  # noqa: BLE001 - any error of the kernel's code is its CompileError
        import traceback

        raise CompileError(
            k.spec.name,
            k.spec.plain(params),
            arch,
            "".join(traceback.format_exception(type(e), e, e.__traceback__)),
        ) from None
    loaded = Loaded(fn, None, key, params, arch, "jit", tier="compile")
    loaded.misses = loaded.compiles = 1
    loaded.compile_s = time.perf_counter() - t0
    return loaded
