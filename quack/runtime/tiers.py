"""The runtime's lookup chain, as an explicit ordered list of tiers:

    memory -> local store -> read-only tiers (bundles, remote, ...) -> compile

*memory* is ``@jit_cache``'s per-process table (quack.runtime.jit), *local* the
settings' ``Store`` (quack.cache.store.DiskStore), *compile* the miss policy
(a compile worker in jit mode, ``KernelNotPrebuilt`` in prebuilt mode). Between
local and compile sit the read-only tiers (quack.cache.contract.ReadTier),
consulted in ``order``. A tier hit is published into the local store through
its one atomic publish (lock, temp file, ``Store.publish``: metadata last), so
the next lookup, in this or any process, is a local hit and the loader only
ever loads verified local entries. A hit the store can't take (read-only, full)
is loaded unstored from a private copy of its verified bytes
(quack.runtime.loader.load_fetched), never dropped.

Adding a tier: ``register_tier("remote", factory, order=REMOTE)``, where
``factory(settings)`` returns a ReadTier or None (not configured). Factories
run once per Settings object (the chain is rebuilt when settings change)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from quack.cache.contract import Fetched, ReadTier, Store
from quack.errors import CacheError, LockTimeout

if TYPE_CHECKING:
    from quack.cache.entry import Entry, EntryRef
    from quack.settings import Settings

log = logging.getLogger("quack.tiers")

#: Suggested ``order`` values: installed bundles before a remote cache.
BUNDLES, REMOTE = 100, 200

TierFactory = Callable[["Settings"], "ReadTier | None"]


@dataclasses.dataclass(frozen=True)
class _Registration:
    name: str
    factory: TierFactory
    order: int


_registry: dict[str, _Registration] = {}
_built: dict[int, tuple[object, tuple[ReadTier, ...]]] = {}
_lock = threading.Lock()


def register_tier(name: str, factory: TierFactory, *, order: int) -> None:
    """Add (or replace) the read-only tier ``name``; lower ``order`` is asked first."""
    with _lock:
        _registry[name] = _Registration(name, factory, order)
        _built.clear()


def unregister_tier(name: str) -> None:
    """Remove the tier ``name`` (if registered): the undo of ``register_tier``, for code
    that adds a tier for a while (a plugin's teardown, a test's)."""
    with _lock:
        _registry.pop(name, None)
        _built.clear()


def read_tiers(settings: Settings) -> tuple[ReadTier, ...]:
    """The configured read-only tiers for ``settings``, in lookup order. A factory
    that raises is reported once (warning) and left out: a broken tier is a miss."""
    with _lock:
        hit = _built.get(id(settings))
        if hit is not None and hit[0] is settings:
            return hit[1]
        regs = sorted(_registry.values(), key=lambda r: (r.order, r.name))
    tiers: list[ReadTier] = []
    for r in regs:
        try:
            t = r.factory(settings)
        except Exception as e:  # noqa: BLE001 - a tier's set-up problem is a miss, shown once
            from quack.cache.problems import warn_once

            warn_once(
                f"tier:{r.name}", f"quack: cache tier {r.name!r} is unusable ({e}); looking up without it"
            )
            continue
        if t is not None:
            tiers.append(t)
    out = tuple(tiers)
    with _lock:
        _built[id(settings)] = (settings, out)
    return out


def fetch_one(tier: ReadTier, ref: EntryRef) -> Fetched | None:
    """One read-only tier's verified object for ``ref``, or None. Never raises: a tier
    that raises (a bug: the contract says None) is a miss with one warning, and an
    object for another ref is ignored."""
    try:
        got = tier.fetch(ref)
    except Exception as e:  # noqa: BLE001 - the contract says None; a bug is a miss + warning
        from quack.cache.problems import warn_once

        warn_once(
            f"tier-bug:{tier.name}",
            f"quack: cache tier {tier.name!r} raised {type(e).__name__}: {e}; treating it as a miss",
        )
        return None
    if got is None:
        log.debug("tier %s: miss %s %s", tier.name, ref.kernel, ref.key[:16])
        return None
    if got.ref != ref:
        log.warning("tier %s returned %s for %s; ignored", tier.name, got.ref.key[:16], ref.key[:16])
        return None
    return got


def fetch_into(store: Store, ref: EntryRef, tiers: tuple[ReadTier, ...]) -> tuple[Entry | None, str]:
    """Ask each read-only tier in turn; publish the first hit into ``store``.
    Returns (entry, tier name) or (None, ""). Never raises for a cache problem: a
    tier that fails, or a local store that can't take the object, is a miss (the
    runtime's chain, quack.runtime.miss, loads such an object unstored instead)."""
    for tier in tiers:
        got = fetch_one(tier, ref)
        if got is None:
            continue
        entry = publish_fetched(store, got)
        if entry is not None:
            log.info("tier %s: hit %s %s, published into %s", tier.name, ref.kernel, ref.key[:16], store.root)
            return entry, tier.name
    return None, ""


def publish_fetched(store: Store, got: Fetched) -> Entry | None:
    """Publish a tier's object into the local store (check, lock, check again),
    or None if the store can't take it (read-only, full, lock held too long)."""
    ref = got.ref
    if not store.writable():
        log.info(
            "tier %s: hit %s %s, but %s is not writable; not stored",
            got.source,
            ref.kernel,
            ref.key[:16],
            store.root,
        )
        return None
    try:
        return store_fetched(store, got)
    except (CacheError, LockTimeout, OSError) as e:
        log.warning(
            "tier %s: could not publish %s %s into %s: %s",
            got.source,
            ref.kernel,
            ref.key[:16],
            store.root,
            e,
        )
        return None


def store_fetched(store: Store, got: Fetched) -> Entry:
    """As publish_fetched, but a store that can't take the object raises: CacheError
    (not writable), CacheWriteError (disk full, read-only: quack.cache.problems), or
    LockTimeout. ``quack cache pull`` reports these as failures (issue 30: a full disk
    was counted as remote misses and the command exited 0)."""
    from quack.cache.problems import write_error

    ref = got.ref
    if not store.writable():
        raise CacheError(
            f"the quack cache {store.root} is not writable: {ref.kernel} key {ref.key[:16]} "
            f"from {got.source} not stored",
            path=str(store.root),
        )
    with store.lock(ref):
        e = store.lookup(ref, locked=True)
        if e is not None:
            return e  # another process published it meanwhile
        tmp = store.tmp_obj(ref)
        try:
            try:
                with open(tmp, "wb") as f:
                    f.write(got.data)
            except OSError as err:
                raise write_error(err, Path(store.root), f"storing {ref.kernel} key {ref.key[:16]}") from None
            # Only the documented fields (docs/cache-layout.md); the store sets
            # the identity, size and checksum fields itself.
            meta = {
                k: v for k, v in got.meta.items() if k in ("params", "compile_s", "host", "pid", "created")
            }
            return store.publish(ref, tmp, meta)
        finally:
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass


def _installed_bundles(settings: Settings) -> ReadTier:
    """Installed bundles (quack.bundles), an InPlaceTier: the factory only makes the view;
    the entry points are read at the view's first lookup, once per process."""
    from quack.bundles.tier import view

    return view(settings)


register_tier("bundles", _installed_bundles, order=BUNDLES)


def _remote(settings: Settings) -> ReadTier | None:
    """The shared remote cache (quack.remote), when ``[remote] url`` / QUACK_REMOTE is
    set. Imported only then: no redis, boto3 or cryptography import otherwise."""
    if not settings.remote_url:
        return None
    from quack.remote.tier import current

    return current(settings)


register_tier("remote", _remote, order=REMOTE)
