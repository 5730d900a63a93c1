"""The contract every remote backend implements: the ``Backend`` protocol, the bounds on
its waits and sizes, and the errors it raises (``too_large``, ``unreachable``).

A backend moves opaque bytes under names (``quack/v1/...``); it knows nothing
of signatures, keys or the local store (quack.remote.tier does). Kept apart from the
URL dispatch (quack.remote.backend) so that the backends import the contract without
importing the module that imports them."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Protocol

from quack.errors import RemoteError

# Bounds on every network wait (issue 11): a dead host costs at most the
# connect time-out once, then the remote is off for the process.
CONNECT_TIMEOUT = 0.5
OP_TIMEOUT = 5.0
SCHEMES = ("redis", "rediss", "s3", "file")
# The size caps (issue 30): what a backend reads for one object is bounded, and checked
# before reading (STRLEN, ContentLength, fstat), so a hostile 200 MB value at an object's
# name costs one small request, not the memory and time of downloading it. A compiled
# kernel is tens of KB to a few MB; a header a few hundred bytes.
MAX_BODY = 64 * 1024 * 1024  # the .o bytes of one object
MAX_HEADER = 64 * 1024  # the signed header line (quack.remote.objects)
MAX_VALUE = MAX_BODY + MAX_HEADER + 64  # a whole stored object: magic + header + newline + body


OVER_CAP = "over-cap"  # the tag of a value over the size cap (Current.data None)


@dataclasses.dataclass(frozen=True)
class Current:
    """What a name holds, read for a compare-and-swap (``Backend.get_current``): the
    bytes, None for a value over the size cap (refused unread), and ``tag``, which names
    exactly this value for ``Backend.replace``: Redis the value's SHA-1 and length, S3 its
    ETag, a shared directory its SHA-256; ``OVER_CAP`` for any value over the cap (a valid
    object never is one)."""

    data: bytes | None
    tag: str


class Backend(Protocol):
    """Bytes in, bytes out, one object per name.

    get(name): the object, or None if there is none.
    put_if_absent(name, data): True if this call stored it, False if an
      object was already there (first writer wins; it is not replaced).
    get_current(name): the object with its compare-and-swap tag (a
      :class:`Current`), or None if there is none. A value over the size cap
      is a Current with ``data`` None, not an error.
    replace(name, data, tag): store ``data`` under the name if, atomically
      with the write, the name still holds the value ``tag`` names (or
      nothing); True if stored, False if it holds another value now (left
      as it is). Only for a value the caller refused: a writer replaces a
      refused object, and a concurrent write in between is never clobbered.
    exists(name): whether an object is stored under the name.
    close(): release connections (idempotent).

    Every method raises :class:`quack.errors.RemoteError` and nothing else for
    a failure of the remote: ``reason`` ``unreachable`` / ``timeout`` (the
    caller switches the remote off), ``full``, ``denied``, ``protocol``. The
    backend never retries on its own: the caller decides."""

    url: str
    max_bytes: int

    def get(self, name: str) -> bytes | None: ...
    def put_if_absent(self, name: str, data: bytes) -> bool: ...
    def get_current(self, name: str) -> Current | None: ...
    def replace(self, name: str, data: bytes, tag: str) -> bool: ...
    def exists(self, name: str) -> bool: ...
    def close(self) -> None: ...


def redact(url: str) -> str:
    """The URL without a password, for messages and logs (one definition, shared with the
    settings' error messages)."""
    from quack.settings.fields import redact_url

    return redact_url(url)


def too_large(url: str, name: str, size: int | None, limit: int) -> RemoteError:
    """The refusal of a value over the cap; ``size`` None when only a bounded read found it."""
    got = f"{size} bytes" if size is not None else "more than that"
    return RemoteError(
        f"remote cache {redact(url)}: {name} is {got}, over the {limit}-byte cap on an object; "
        "refused unread",
        url=redact(url),
        reason="size",
    )


def unreachable(url: str, e: BaseException, reason: str = "unreachable") -> RemoteError:
    return RemoteError(
        f"remote cache {redact(url)} {'timed out' if reason == 'timeout' else 'unreachable'}: "
        f"{type(e).__name__}: {e}",
        url=redact(url),
        reason=reason,
    )


def bounded(
    url: str,
    timeout: float,
    what: str,
    fn: Callable[..., Any],
    *args: Any,
    hint: str = "",
    abort: Callable[[], None] | None = None,
) -> Any:
    """``fn(*args)`` on a daemon thread, waited on for at most ``timeout`` seconds: past it a
    RemoteError ``timeout`` (the tier switches the remote off). Every backend's operations
    go through here. A client's own time-outs bound each socket read, not the operation:
    a server trickling 1 KB/s kept a 20 KB GET going for 20 s (a 64 MiB one for hours),
    stalling builds and first kernel calls; a hung file system blocks where no time-out
    reaches at all. ``abort`` (best effort, e.g. closing the connections) lets the
    abandoned thread end sooner; as a daemon it cannot keep the process alive anyway."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="quack-remote-op", daemon=True).start()
    if not done.wait(timeout):
        if abort is not None:
            try:
                abort()
            except Exception:  # noqa: BLE001 - the time-out is what the caller must see
                pass
        raise RemoteError(
            f"remote cache {redact(url)}: {what} took longer than the {timeout:g}s time-out "
            f"(QUACK_REMOTE_TIMEOUT / [remote] timeout){' ' + hint if hint else ''}",
            url=redact(url),
            reason="timeout",
        )
    if "error" in box:
        raise box["error"]
    return box["value"]
