"""The remote tier: between the local disk store and a compile.

    memory -> local disk -> bundles -> remote (this) -> compile

A ``ReadTier`` (quack.cache.contract), registered in the runtime's lookup chain
(quack.runtime.tiers, order REMOTE). ``fetch`` returns a verified object
(quack.remote.objects checks signature, key, stamp, source, size, SHA-256); the
chain publishes it into the local store with its normal atomic publish (lock,
check again, temp file, metadata last) and loads it from there. Nothing
unverified is ever written locally or loaded.

``push`` signs a local entry and stores it if the remote has none (first writer
wins). Only with ``write = true`` and a signing key; a reader needs no secret.
When the name is taken, the object there is read and verified under the writer's
trusted keys (and its own public key): one that verifies stays (first writer
wins), one that would be refused (signed by a key no longer trusted after a key
rotation, truncated, altered, ...) is replaced by a compare-and-swap
(``Backend.replace``), so a valid object written in between is never clobbered.
Replacements are counted (``replaced``, by reason) and summed up in one warning
(``warn_replaced``). A writer without trusted keys never replaces anything.

Failures never propagate: every problem is a miss (or a failed or skipped push, counted),
with one warning per kind per process. A connection error or a time-out
switches the remote off for the rest of the process (one warning), so a dead
host costs one connect time-out, not one per kernel."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from quack.cache import fsutil
from quack.cache.contract import Fetched
from quack.cache.entry import Entry, EntryRef
from quack.errors import KeyFileError, ObjectRejected, RemoteError, RemoteWarning
from quack.remote import objects
from quack.remote.backend import open_backend
from quack.remote.base import CONNECT_TIMEOUT, Backend, redact
from quack.remote.stats import Counters, append_line
from quack.signing import SigningKey, TrustedKeys

log = logging.getLogger("quack.remote")


# Per process, across tier instances (settings may be re-resolved): which URLs
# are switched off, and which warnings were given.
_offline: dict[str, str] = {}
_warned: set[tuple[str, str]] = set()
_state_lock = threading.Lock()


def _warn_once(url: str, kind: str, message: str) -> None:
    with _state_lock:
        if (url, kind) in _warned:
            return
        _warned.add((url, kind))
    warnings.warn(message, RemoteWarning, stacklevel=4)


class RemoteTier:
    """One remote cache as seen by this process: a ReadTier (``fetch``) that can
    also ``push``. Thread-safe."""

    name = "remote"

    def __init__(
        self, backend: Backend, *, trusted: TrustedKeys, signer: SigningKey | None = None, write: bool = False
    ):
        self.backend = backend
        self.url = redact(backend.url)
        self.trusted = trusted
        self.signer = signer
        self.write = bool(write and signer is not None)
        self.counters = Counters()
        self._lock = threading.Lock()
        self._push_off = ""
        self._replaced_why: Counter = Counter()  # (reason, signer) -> objects replaced, not warned yet

    # -- state -----------------------------------------------------------------------
    @property
    def offline(self) -> bool:
        return self.url in _offline

    def _count(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self.counters, k, getattr(self.counters, k) + v)

    def _failed(self, e: RemoteError, op: str) -> None:
        self._count(errors=1)
        why = str(e).rstrip(".")
        if e.offline or (op == "get" and e.reason == "denied"):
            # Every later call would fail the same way (and a time-out would cost
            # OP_TIMEOUT each): off for the process.
            with _state_lock:
                first = self.url not in _offline
                _offline.setdefault(self.url, str(e))
            if first:
                log.info("remote %s off for this process: %s", self.url, e)
                _warn_once(
                    self.url,
                    "offline",
                    f"quack: {why}; the remote cache is off for the rest of this "
                    "process (kernels come from the local cache or are compiled)",
                )
        elif op == "put" and e.reason in ("full", "denied"):
            self._push_off = str(e)
            _warn_once(
                self.url,
                "push-" + e.reason,
                f"quack: {why}; not pushing to it for the rest of this process (reads continue)",
            )
        else:
            _warn_once(self.url, "error-" + op, f"quack: {why}; treated as a miss")

    def _rejected(self, e: ObjectRejected) -> None:
        with self._lock:
            self.counters.rejected += 1
            self.counters.rejected_by_reason[e.reason] += 1
        log.info("remote object refused: %s", e)
        _warn_once(
            self.url,
            "rejected",
            f"quack: {e}. Refused objects are never loaded nor stored; "
            "the kernel is compiled locally (rejections are counted in `quack cache stats` "
            "and the build summary)",
        )

    def _backend_call(self, fn, *args):
        """``fn(*args)`` with the backend contract enforced: any failure is a RemoteError.
        A backend that leaks a client library's own exception (redis-py's AttributeError
        on a server answering +OK to everything) must make a miss, not crash a build."""
        try:
            return fn(*args)
        except RemoteError:
            raise
        except Exception as e:  # noqa: BLE001
            raise RemoteError(
                f"remote cache {self.url}: unexpected failure ({type(e).__name__}: {e})",
                url=self.url,
                reason="protocol",
            ) from None

    # -- reading (the ReadTier contract, quack.cache.contract) -------------------------
    def fetch(self, ref: EntryRef) -> Fetched | None:
        """The verified object for ``ref``, or None. Never raises for a remote or
        verification problem (a miss, counted, one warning per kind). The caller
        publishes it into the local store (quack.runtime.tiers.publish_fetched)."""
        if self.offline or not len(self.trusted):
            return None
        name = objects.object_name(ref)
        try:
            blob = self._backend_call(self.backend.get, name)
        except RemoteError as e:
            if e.reason == "size":  # over the cap, refused unread: an object refused for its size
                self._rejected(objects.reject(ref, "size", str(e)))
            else:
                self._failed(e, "get")
            return None
        if blob is None:
            self._count(misses=1)
            log.debug("remote miss %s key %s", ref.kernel, ref.key[:16])
            return None
        self._count(bytes_down=len(blob))
        try:
            data, header = objects.unpack(blob, ref, self.trusted)
        except ObjectRejected as e:
            self._rejected(e)
            return None
        self._count(hits=1)
        log.info(
            "remote hit %s key %s (%d bytes, signed by %s)",
            ref.kernel,
            ref.key[:16],
            len(data),
            header.get("signer"),
        )
        meta = {"params": header.get("params"), "compile_s": header.get("compile_s"), "created": time.time()}
        return Fetched(ref, data, meta, f"remote:{self.url}")

    def has(self, ref: EntryRef) -> bool | None:
        """Whether the remote holds an object for ``ref`` (None: unknown, remote off)."""
        if self.offline:
            return None
        try:
            return self._backend_call(self.backend.exists, objects.object_name(ref))
        except RemoteError as e:
            self._failed(e, "get")
            return None

    # -- writing ---------------------------------------------------------------------
    def push(self, store, entry: Entry) -> str:
        """Sign and store a local entry unless the remote has a valid object for it.
        Returns ``pushed``, ``exists`` (a valid one is there), ``replaced`` (a refused
        one was there: swapped for this one), ``failed``, ``skipped`` (not tried,
        counted: pushing was switched off after the remote was full or denied a write,
        or the remote is off), or ``off`` (read-only: this tier never pushes)."""
        if not self.write:
            return "off"
        if self.offline or self._push_off:
            # Counted: after the first failure, a build of 100 keys into a full remote said
            # "push failed 1" while 99 went silently unpushed.
            self._count(push_skipped=1)
            return "skipped"
        ref = entry.ref
        try:
            data = fsutil.read_nofollow(entry.obj_path)
        except OSError as e:
            self._count(push_failed=1)
            _warn_once(self.url, "push-read", f"quack: can't read {entry.obj_path} to push it ({e})")
            return "failed"
        if hashlib.sha256(data).hexdigest() != entry.meta.get("sha256"):
            self._count(push_failed=1)  # changed under us: never sign what the store did not verify
            return "failed"
        signer = self.signer
        assert signer is not None  # self.write implies a signer (see __init__)
        try:
            blob = objects.pack(
                ref, entry.meta.get("params") or {}, data, signer, compile_s=entry.meta.get("compile_s")
            )
        except ValueError as e:  # over the object size cap: no reader would take it
            self._count(push_failed=1)
            _warn_once(self.url, "push-size", f"quack: not pushing {e}")
            return "failed"
        name = objects.object_name(ref)
        added = self._add(ref, name, blob)
        return self._taken(ref, name, blob) if added == "taken" else added

    def _add(self, ref: EntryRef, name: str, blob: bytes) -> str:
        """Store ``blob`` at ``name`` unless something is there: ``pushed``, ``failed``
        (counted, the failure reported) or ``taken`` (nothing counted yet)."""
        try:
            stored = self._backend_call(self.backend.put_if_absent, name, blob)
        except RemoteError as e:
            self._count(push_failed=1)
            self._failed(e, "put")
            return "failed"
        if not stored:
            return "taken"
        self._count(pushed=1, bytes_up=len(blob))
        log.info("pushed %s key %s (%d bytes)", ref.kernel, ref.key[:16], len(blob))
        return "pushed"

    def _taken(self, ref: EntryRef, name: str, blob: bytes) -> str:
        """The name holds an object already: keep it if it verifies under this writer's
        trusted keys (or its own public key), else replace it by compare-and-swap.
        ``exists``, ``pushed`` (it was gone when looked at), ``replaced`` or ``failed``."""
        signer = self.signer
        assert signer is not None
        if not len(self.trusted):
            # Nothing verifies without trusted keys: valid objects could not be told from
            # refused ones, so nothing is ever replaced.
            self._count(push_exists=1)
            return "exists"
        try:
            cur = self._backend_call(self.backend.get_current, name)
        except RemoteError as e:
            self._failed(e, "get")  # the object there could not be checked: it stays
            self._count(push_exists=1)
            return "exists"
        if cur is None:  # gone since the put (evicted, deleted): one more add, no loop
            added = self._add(ref, name, blob)
            if added != "taken":
                return added
            self._count(push_exists=1)
            return "exists"
        if cur.data is None:
            why, by = "size", ""  # over the size cap: no reader takes it, and no writer signs one
        else:
            try:
                objects.unpack(cur.data, ref, self.trusted.including(signer.public))
            except ObjectRejected as e:
                why, by = e.reason, e.signer
            else:
                self._count(push_exists=1)  # a valid object: first writer wins
                return "exists"
        try:
            done = self._backend_call(self.backend.replace, name, blob, cur.tag)
        except RemoteError as e:
            self._count(push_failed=1)
            self._failed(e, "put")
            return "failed"
        if not done:
            # Another writer stored an object between the read and the replace: the
            # compare-and-swap left it (if it is refused too, the next push replaces it).
            log.info(
                "remote object for %s key %s changed while being replaced: left", ref.kernel, ref.key[:16]
            )
            self._count(push_exists=1)
            return "exists"
        with self._lock:
            self.counters.replaced += 1
            self.counters.bytes_up += len(blob)
            self.counters.replaced_by_reason[why] += 1
            self._replaced_why[(why, by if why in _BY_SIGNER else "")] += 1
        log.info("replaced the refused (%s) remote object for %s key %s", why, ref.kernel, ref.key[:16])
        return "replaced"

    def warn_replaced(self) -> None:
        """One warning for the objects replaced since the last call (none: no warning),
        naming why, e.g. ``2 objects at their names were signed by ci-1, which this writer
        does not trust: replaced``. Called at the end of a build and of ``quack cache push``."""
        with self._lock:
            groups, self._replaced_why = self._replaced_why, Counter()
        if not groups:
            return
        parts = [_why_replaced(n, why, by) for (why, by), n in sorted(groups.items())]
        me = self.signer.name if self.signer is not None else "?"
        warnings.warn(
            f"quack: remote cache {self.url}: {'; '.join(parts)}: replaced, now signed by {me} "
            "(an object that verifies under this writer's trusted keys is never replaced)",
            RemoteWarning,
            stacklevel=2,
        )

    # -- statistics ------------------------------------------------------------------
    def record(self, root: Path) -> None:
        """Append this process's counters to ``<cache>/remote-stats.jsonl`` (for
        ``quack cache stats``); never raises."""
        with self._lock:  # hand over the counters: recording twice never counts twice
            counters, self.counters = self.counters, Counters()
        if not counters.any():
            return
        c = counters.to_json()
        line = json.dumps({"t": time.time(), "url": self.url, **c}, sort_keys=True) + "\n"
        try:
            if not Path(root).is_dir():
                return
            append_line(Path(root), line)
        except OSError:
            pass

    def close(self) -> None:
        self.backend.close()


# Why an object was replaced, as a reader would have refused it (quack.remote.objects.REASONS).
_BY_SIGNER = ("untrusted", "bad-signature")
_WHY = {
    "unsigned": "unsigned",
    "malformed": "not a readable quack object (malformed)",
    "wrong-key": "signed for another key (copied there)",
    "wrong-stamp": "built with another toolchain (copied there)",
    "wrong-source": "built from other kernel source (copied there)",
    "size": "truncated, padded or over the size cap",
    "checksum": "altered (bytes that do not match their signed checksum)",
}


def _why_replaced(n: int, why: str, by: str) -> str:
    were = f"{n} objects at their names were" if n != 1 else "1 object at its name was"
    by = by or "an unnamed key"
    if why == "untrusted":
        return f"{were} signed by {by}, which this writer does not trust"
    if why == "bad-signature":
        return f"{were} carrying a signature by {by} that does not verify"
    return f"{were} {_WHY.get(why, f'refused ({why})')}"


# --- from settings ----------------------------------------------------------------------


def from_settings(s, *, strict: bool = False) -> RemoteTier | None:
    """The tier configured by ``s`` (None without ``remote_url``). A bad URL or key
    file is warned about once and leaves the remote off, unless ``strict`` (the
    explicit ``quack cache push|pull``), where it raises ValueError/KeyFileError."""
    if not s.remote_url:
        return None
    from quack import signing

    url = redact(s.remote_url)
    try:
        backend = open_backend(
            s.remote_url, connect_timeout=min(CONNECT_TIMEOUT, s.remote_timeout), op_timeout=s.remote_timeout
        )
        trusted = signing.trusted_keys_from_settings(s)
        signer = signing.signing_key_from_settings(s) if s.remote_write else None
    except (ValueError, KeyFileError, ImportError) as e:
        if strict:
            raise
        _warn_once(url, "config", f"quack: remote cache {url} not used: {e}")
        return None
    if s.remote_write and signer is None:
        _warn_once(
            url,
            "no-key",
            f"quack: remote cache {url}: write = true but no signing key "
            "(QUACK_SIGNING_KEY / [remote] signing_key); reading only",
        )
    if not len(trusted):
        _warn_once(
            url,
            "no-trust",
            f"quack: remote cache {url}: no trusted keys (QUACK_TRUSTED_KEYS / "
            "[remote] trusted_keys), so nothing from it can be accepted; not reading from it",
        )
    return RemoteTier(backend, trusted=trusted, signer=signer, write=s.remote_write)


_current: tuple[Any, RemoteTier | None] | None = None  # (Settings, its tier)
_current_lock = threading.Lock()
_atexit_armed = False


def current(s) -> RemoteTier | None:
    """The process's tier for settings ``s`` (made once per settings object; its
    counters are appended to the stats file when replaced and at exit)."""
    global _current, _atexit_armed
    with _current_lock:
        if _current is not None and _current[0] is s:
            return _current[1]
        old = _current
        tier = from_settings(s)
        _current = (s, tier)
        if not _atexit_armed:
            import atexit

            atexit.register(_record_current)
            _atexit_armed = True
    if old is not None and old[1] is not None:
        old[1].record(Path(old[0].cache_dir))
    return tier


def _record_current() -> None:
    cur = _current
    if cur is not None and cur[1] is not None:
        cur[1].record(Path(cur[0].cache_dir))


def offline_reason(url: str) -> str:
    """Why the remote ``url`` (redacted) is off in this process ("" if it is not)."""
    with _state_lock:
        return _offline.get(url, "")


def reset_offline_for_tests() -> None:
    """For tests and benchmarks only (a process that turned a remote off keeps it off, by
    design): switch every remote back on and re-arm the once-only warnings."""
    with _state_lock:
        _offline.clear()
        _warned.clear()
