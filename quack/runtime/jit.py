"""``@jit_cache``: memory -> disk -> compile worker, for tensor-free compile functions."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable

from quack import registry
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
from quack.runtime import _generation

# Importing a kernel module runs only @jit_cache, which needs the registry; the settings,
# the store, the loader, the tier chain and the journal are imported on the first call
# that misses this process's memory (issue 15: the kernel modules' import, after torch,
# was 12.6 ms, half of it these modules, none of it used before a kernel is asked for).
# The hot path (a hit in ``_memo``) never reaches those imports.
if TYPE_CHECKING:
    from quack.params import Param

_ALL: list["JitKernel"] = []
log = logging.getLogger("quack.jit")


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


class JitKernel:
    """The decorated compile function. Calling it returns the kernel's callable."""

    def __init__(self, spec: registry.KernelSpec):
        self.spec = spec
        self.raw = spec.fn
        self._memo: dict = {}
        self._by_key: dict[str, Loaded] = {}
        self._failed: dict[str, tuple[str, CompileError]] = {}  # key -> (source fingerprint, error)
        self._gen = _generation.value
        self._lock = threading.RLock()
        self._warned_local = False
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
                if self._gen == _generation.value
                else None
            )
        except (KeyError, TypeError):
            hit = None
        if hit is not None:
            hit.hits += 1
            return hit.fn
        return self._slow(args, kwargs)

    def key(self, *args, arch: str | None = None, **kwargs) -> str:
        from quack import settings as _settings

        params = self.spec.bind(args, kwargs)
        return self.spec.key(params, arch or _settings.get().arch)

    def _slow(self, args, kwargs):
        from quack import settings as _settings

        with self._lock:
            if self._gen != _generation.value:
                self._memo.clear()
                self._by_key.clear()
                self._failed.clear()
                self._gen = _generation.value
            s = _settings.get()
            params = self.spec.bind(args, kwargs)
            key = self.spec.key(params, s.arch)
            loaded = self._by_key.get(key)
            if loaded is None:
                self._raise_if_failed(key)
                try:
                    loaded = self._resolve(params, key, s)
                except CompileError as e:
                    if not e.transient:
                        self._remember_failure(key, e)
                    raise
                self._by_key[key] = loaded
            else:
                loaded.hits += 1
            try:
                self._memo[
                    (args, tuple(map(type, args)), tuple(kwargs.items()), tuple(map(type, kwargs.values())))
                ] = loaded
            except TypeError:
                pass  # unhashable argument spelling: still correct, just the slow path
            return loaded.fn

    # A configuration that failed to compile fails the same way until its source changes:
    # compiling it again on every call (minutes for a large kernel) tells nothing new.
    def _raise_if_failed(self, key: str) -> None:
        hit = self._failed.get(key)
        if hit is None:
            return
        fp, err = hit
        if fp == self.spec.source_fingerprint():
            raise err
        del self._failed[key]  # the kernel was edited: compile it again

    def _remember_failure(self, key: str, err: CompileError) -> None:
        if key not in self._failed and hasattr(err, "add_note"):  # Python 3.11+
            err.add_note(
                f"quack: {self.spec.name} key {key[:16]} will not be compiled again in this "
                f"process until its source changes"
            )
        self._failed[key] = (self.spec.source_fingerprint(), err)

    # Where warnings point: at the line that called the kernel. Every step below runs at a
    # fixed depth under it (caller <- __call__ <- _slow <- _resolve <- step <- ...), and
    # each stacklevel counts those frames; moving a step up or down changes its numbers.
    def _resolve(self, params: dict, key: str, s) -> Loaded:
        """The tiers after memory: local cache -> read-only tiers (installed bundles,
        remote, ...) -> the miss policy (quack.runtime.tiers; docs/architecture.md)."""
        # The ref from the key already made, not builder.entry_ref: a hit never imports
        # the builder (its imports were ~1.5 ms of a fresh process's first load).
        from quack.cache.store import EntryRef

        ref = EntryRef(self.spec.name, key, s.arch, self.spec.source_fingerprint())
        store, loaded, unusable = self._from_local(ref, params, key, s)
        if loaded is not None:
            return loaded
        tiered = self._from_tiers(ref, store, params, key, s.arch, s)
        if tiered is not None:
            return tiered
        return self._on_miss(ref, store, params, key, s, unusable)

    def _from_local(self, ref, params, key, s) -> tuple[Any, Loaded | None, str]:
        """The local store: (store or None, a loaded hit or None, why the cache can't be
        used or ""). A cache that can't be read is no store at all (one warning); an
        entry cleaned between lookup and load is a plain miss."""
        # Prebuilt mode never compiles, whatever the cache's state: every path after
        # this one that would compile raises KernelNotPrebuilt instead, saying why when
        # it is not a plain miss (a disabled or unusable cache).
        from quack.cache.store import local_store, warn_once

        if not s.cache_enabled:
            return None, None, "the cache is disabled (QUACK_CACHE_ENABLED=0 or [cache] enabled = false)"
        store = local_store(s)
        try:
            entry = store.lookup(ref)
        except (CacheError, OSError) as e:
            if s.mode == "prebuilt":
                warn_once(
                    f"unusable:{s.cache_dir}", f"quack: cache {s.cache_dir} unusable ({e})", stacklevel=6
                )
            else:
                warnings.warn(
                    f"quack: cache {s.cache_dir} unusable ({e}); not using it for "
                    f"{self.spec.name} (a compile runs in this process, unstored)",
                    CacheWarning,
                    stacklevel=5,
                )
            return None, None, f"the cache is unusable ({e})"
        if entry is not None:
            try:
                loaded = self._load(store, entry, params, key, s.arch, miss=False)
                log.debug("local hit %s %s (%s)", self.spec.name, key[:16], loaded.how)
                return store, loaded, ""
            except EntryVanished:
                pass  # cleaned between lookup and load: a plain miss
        return store, None, ""

    def _on_miss(self, ref, store, params, key, s, unusable: str) -> Loaded:
        """The miss policy: prebuilt mode raises KernelNotPrebuilt; jit mode compiles,
        into the store when it can take the object, else in this process, unstored."""
        arch = s.arch
        if s.mode == "prebuilt":
            self._not_prebuilt(params, key, s, unusable or self._stale_entry(store, ref))
        if store is None:  # cache disabled or unusable
            return self._compile_in_process(params, key, arch)
        if not store.writable():
            log.info(
                "%s is not writable: compiling %s %s in this process", s.cache_dir, self.spec.name, key[:16]
            )
            from quack.cache.store import warn_once

            # Read-only cache: hits still load from it; misses run uncached, one warning.
            warn_once(
                f"read-only:{s.cache_dir}",
                f"quack: cache {s.cache_dir} is not writable; "
                f"kernels missing from it are compiled in this process and not stored",
                stacklevel=6,
            )
            return self._compile_in_process(params, key, arch)
        return self._compile_stored(store, ref, params, key, arch)

    def _compile_stored(self, store, ref, params, key, arch) -> Loaded:
        """Compile a miss into the store (in a worker, or here for a kernel that can't
        be shipped to one) and load it; a compile the store can't take runs unstored."""
        t0 = time.perf_counter()
        if not self.spec.shippable:
            built = self._build_here(store, params, key, arch)
            if built is None:
                return self._compile_in_process(params, key, arch)
            entry, compiled, compile_s = built
        else:
            entry, report = self._compile_in_worker(store, ref, params, key, arch)
            if entry is None:
                log.info("fallback: compiling %s %s in this process", self.spec.name, key[:16])
                return self._compile_in_process(params, key, arch)
            compiled = bool(report and report.get("compiled"))
            compile_s = float((report or {}).get("compile_s") or 0.0)
        try:
            loaded = self._load(store, entry, params, key, arch, miss=True)
        except EntryVanished:  # evicted right after its compile: run it uncached
            return self._compile_in_process(params, key, arch)
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
        log.debug(
            "%s %s %s (%.3f s)", "compiled" if compiled else "waited for", self.spec.name, key[:16], elapsed
        )
        return loaded

    def _build_here(self, store, params, key, arch) -> tuple[Any, bool, float] | None:
        """A kernel defined where a worker can't import it (a test function, __main__):
        build and publish it in this process (one warning per kernel). Returns (entry,
        compiled, compile_s), or None when the store can't take it (one warning)."""
        from quack.compile import builder

        if not self._warned_local:
            warnings.warn(
                f"quack: kernel {self.spec.name} is defined in {self.spec.module} "
                f"({self.spec.qualname}) and can't be sent to a compile worker; "
                f"compiling it in this process",
                CacheWarning,
                stacklevel=7,
            )
            self._warned_local = True
        try:
            entry, compiled = builder.build(self.spec, params, arch, store)
        except (OSError, LockTimeout) as e:
            warnings.warn(
                f"quack: can't store {self.spec.name} key {key[:16]} ({e}); running it uncached",
                CacheWarning,
                stacklevel=7,
            )
            return None
        return entry, compiled, float(entry.meta.get("compile_s") or 0.0) if compiled else 0.0

    @staticmethod
    def _stale_entry(store, ref) -> str:
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

    def _not_prebuilt(self, params, key, s, reason: str):
        from quack.cache.contract import ListsSearched
        from quack.manifest_line import manifest_line
        from quack.runtime import tiers

        plain = self.spec.plain(params)
        err = KernelNotPrebuilt(
            self.spec.name,
            plain,
            s.arch,
            key,
            str(s.cache_dir),
            manifest_line(self.spec.name, plain, s.arch),
            bundles=next(
                (
                    t.searched()
                    for t in tiers.read_tiers(s)
                    if t.name == "bundles" and isinstance(t, ListsSearched)
                ),
                (),
            ),
            reason=reason,
        )
        from quack.compile import pool as _pool  # on a miss only: a hit never needs the pool

        _pool.note_not_prebuilt(err, s)
        raise err

    def _compile_in_worker(self, store, ref, params, key, arch):
        """A miss, compiled by the pool. Inside a pool_scope: submit and raise
        CompilePending. Outside: submit to the default pool and wait. Either way a
        failed key is raised once as CompileError (the worker's traceback text) and
        then forgotten, so a later call compiles it again; a key past its time-out
        (wedged worker, or a lock held elsewhere that never publishes) returns None:
        the caller compiles in this process. Returns (entry, the pool's report of the
        key: ``compiled`` False when another process built it) or (None, None)."""
        from quack import settings as _settings
        from quack.compile import pool as _pool  # not at import: a prebuilt hit never needs it

        s = _settings.get()
        pool = _pool.active_pool(s.cache_dir)
        scoped = pool is not None
        if pool is None:
            pool = _pool.default_pool()
        root = s.cache_dir
        for _ in range(3):
            st, err = self._settle_in_pool(pool, scoped, params, key, arch, s)
            if st == _pool.FAILED:
                pool.forget(key, root)  # reported once; a later call may retry
                self._worker_failed(err, params, key, arch)
                return None, None
            if st == _pool.DONE:
                entry = store.lookup(ref)
                if entry is not None:
                    return entry, pool.report(key, root)
                # Done, yet no valid entry (cleaned, or quarantined as corrupt): build again.
                pool.forget(key, root)
                if pool.state(key, root) != _pool.NEW:
                    break
        warnings.warn(
            f"quack: the pool reported {self.spec.name} key {key[:16]} done but the cache "
            f"has no valid entry; compiling it in this process",
            CacheWarning,
            stacklevel=7,
        )
        return None, None

    def _settle_in_pool(self, pool, scoped: bool, params, key, arch, s) -> tuple[str, BaseException | None]:
        """Submit the key unless the pool has it, then wait until it is no longer pending
        (state, error); in a pool_scope a pending key raises CompilePending instead."""
        from quack.compile import pool as _pool

        root = s.cache_dir
        st, err = pool.poll(key, root)
        if st == _pool.NEW:
            st = pool.submit(self.spec, params, arch, key, settings=s)
        if st == _pool.PENDING:
            if scoped:
                exc = CompilePending(self.spec.name, key)
                exc.root = str(root)
                exc.pool = pool
                _pool.note_pending(exc)
                raise exc
            st, err = pool.wait(key, root=root)
        return st, err

    def _worker_failed(self, err, params, key, arch) -> None:
        """A key the pool failed: a time-out or a cache that can't take the object
        returns (one warning; the caller compiles in this process, unstored); a compile
        error is raised."""
        if isinstance(err, CompileTimeout):
            warnings.warn(
                f"quack: {err}; compiling {self.spec.name} key {key[:16]} in this process",
                CacheWarning,
                stacklevel=8,
            )
            return
        if isinstance(err, (CacheError, LockTimeout)):  # the cache (full, read-only), not the kernel
            warnings.warn(
                f"quack: can't store {self.spec.name} key {key[:16]} ({err}); "
                f"compiling it in this process, uncached",
                CacheWarning,
                stacklevel=8,
            )
            return
        if isinstance(err, CompileError):
            raise err
        raise CompileError(self.spec.name, self.spec.plain(params), arch, str(err))

    def _from_tiers(self, ref, store, params, key, arch, s) -> Loaded | None:
        """The read-only tiers, in order (quack.runtime.tiers). An in-place tier's entry
        (installed bundles: already on this machine, verified where it lies) is loaded
        where it is, so it serves a read-only or disabled cache too; any other tier's hit
        is published into the local store, then loaded from there."""
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
                    log.info("tier %s: %s %s vanished before loading", tier.name, self.spec.name, key[:16])
                    continue
                loaded = Loaded(fn, module, key, params, arch, how, tier=entry.meta.get("source", tier.name))
                loaded.load_s = time.perf_counter() - t0
                loaded.hits = 1
                log.debug("tier %s: hit %s %s (%s)", loaded.tier, self.spec.name, key[:16], how)
                return loaded
            if store is None:
                continue  # nowhere to publish a fetched copy
            entry, name = tiers.fetch_into(store, ref, (tier,))
            if entry is not None:
                try:
                    loaded = self._load(store, entry, params, key, arch, miss=True)
                    loaded.tier = name
                    return loaded
                except EntryVanished:
                    log.info("tier %s: %s %s vanished before loading", name, self.spec.name, key[:16])
        return None

    def _load(self, store, entry, params, key, arch, *, miss: bool) -> Loaded:
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

    def _compile_in_process(self, params, key, arch) -> Loaded:
        """No usable cache: compile here and keep the JIT function in memory."""
        from quack import settings as _settings
        from quack.compile import builder

        s = _settings.get()
        if s.mode == "prebuilt":  # the last guard: no path may compile in prebuilt mode
            self._not_prebuilt(params, key, s, "")
        builder.pin_arch(arch)
        t0 = time.perf_counter()
        try:
            fn = self.spec.fn(**params)
        except Exception as e:  # noqa: BLE001 - any error of the kernel's code is its CompileError
            import traceback

            raise CompileError(
                self.spec.name,
                self.spec.plain(params),
                arch,
                "".join(traceback.format_exception(type(e), e, e.__traceback__)),
            ) from None
        loaded = Loaded(fn, None, key, params, arch, "jit", tier="compile")
        loaded.misses = loaded.compiles = 1
        loaded.compile_s = time.perf_counter() - t0
        return loaded

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
        return out


def jit_cache(
    name: str, params: dict[str, Param], *, version: int = 0, reference: str | None = None, rules=()
) -> Callable[[Callable], JitKernel]:
    """Register a tensor-free compile function as kernel ``name`` and cache it.
    ``rules``: quack.params.Rule constraints across parameters, checked (with each
    parameter's own check) by manifests and on every call, before anything compiles."""

    def deco(fn: Callable) -> JitKernel:
        return JitKernel(
            registry.register(name, fn, params, version=version, reference=reference, rules=rules)
        )

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
