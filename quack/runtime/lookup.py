"""A ``@jit_cache`` call that missed this process's memory: the lookup through the tiers
after memory (local store -> read-only tiers), handing a miss to the miss policy
(quack.runtime.miss), and ``Loaded``, the record of one kernel loaded in this process.

Imported by a kernel's first call, never by a kernel module's import nor a memory hit
(tests/test_coldstart.py); the tier chain, the contract and the miss policy are imported
only where the local store has no entry.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING, Any

from quack.errors import CacheError, CacheWarning, EntryVanished

if TYPE_CHECKING:
    from quack.runtime.jit import JitKernel

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


# Where warnings point: at the line that called the kernel. Every step below runs at a
# fixed depth under it (caller <- JitKernel.__call__ <- JitKernel._slow <- resolve <- step
# <- ...; the miss policy's steps in quack.runtime.miss likewise), and each stacklevel
# counts those frames; moving a step up or down changes its numbers (tests/test_jit.py).
def resolve(k: JitKernel, params: dict, key: str, s) -> Loaded:
    """The tiers after memory: local cache -> read-only tiers (installed bundles,
    remote, ...) -> the miss policy (quack.runtime.tiers; docs/architecture.md)."""
    # The ref from the key already made, not builder.entry_ref: a hit never imports
    # the builder (its imports were ~1.5 ms of a fresh process's first load).
    from quack.cache.store import EntryRef

    ref = EntryRef(k.spec.name, key, s.arch, k.spec.source_fingerprint())
    store, loaded, unusable = from_local(k, ref, params, key, s)
    if loaded is not None:
        return loaded
    tiered = from_tiers(k, ref, store, params, key, s.arch, s)
    if tiered is not None:
        return tiered
    from quack.runtime import miss  # a miss only: a hit never imports the miss policy

    return miss.on_miss(k, ref, store, params, key, s, unusable)


def from_local(k: JitKernel, ref, params, key, s) -> tuple[Any, Loaded | None, str]:
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
            warn_once(f"unusable:{s.cache_dir}", f"quack: cache {s.cache_dir} unusable ({e})", stacklevel=6)
        else:
            warnings.warn(
                f"quack: cache {s.cache_dir} unusable ({e}); not using it for "
                f"{k.spec.name} (a compile runs in this process, unstored)",
                CacheWarning,
                stacklevel=5,
            )
        return None, None, f"the cache is unusable ({e})"
    if entry is not None:
        try:
            loaded = load(store, entry, params, key, s.arch, miss=False)
            log.debug("local hit %s %s (%s)", k.spec.name, key[:16], loaded.how)
            return store, loaded, ""
        except EntryVanished:
            pass  # cleaned between lookup and load: a plain miss
    return store, None, ""


def from_tiers(k: JitKernel, ref, store, params, key, arch, s) -> Loaded | None:
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
                log.info("tier %s: %s %s vanished before loading", tier.name, k.spec.name, key[:16])
                continue
            loaded = Loaded(fn, module, key, params, arch, how, tier=entry.meta.get("source", tier.name))
            loaded.load_s = time.perf_counter() - t0
            loaded.hits = 1
            log.debug("tier %s: hit %s %s (%s)", loaded.tier, k.spec.name, key[:16], how)
            return loaded
        if store is None:
            continue  # nowhere to publish a fetched copy
        entry, name = tiers.fetch_into(store, ref, (tier,))
        if entry is not None:
            try:
                loaded = load(store, entry, params, key, arch, miss=True)
                loaded.tier = name
                return loaded
            except EntryVanished:
                log.info("tier %s: %s %s vanished before loading", name, k.spec.name, key[:16])
    return None


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
