"""The contract every remote backend implements, and the URL dispatch.

A backend moves opaque bytes under names (``quack/v1/...``); it knows nothing
of signatures, keys or the local store (quack.remote.tier does). Backends live
one per module and import their client library lazily, so a process that never
configures a remote never imports redis or boto3."""

from __future__ import annotations

from typing import Protocol
from urllib.parse import urlsplit

from quack.errors import RemoteError

# Bounds on every network wait (issue 11): a dead host costs at most the
# connect time-out once, then the remote is off for the process.
CONNECT_TIMEOUT = 0.5
OP_TIMEOUT = 5.0
SCHEMES = ("redis", "rediss", "s3", "file")


class Backend(Protocol):
    """Bytes in, bytes out, one object per name.

    get(name): the object, or None if there is none.
    put_if_absent(name, data): True if this call stored it, False if an
      object was already there (first writer wins; it is not replaced).
    exists(name): whether an object is stored under the name.
    close(): release connections (idempotent).

    Every method raises :class:`quack.errors.RemoteError` and nothing else for
    a failure of the remote: ``reason`` ``unreachable`` / ``timeout`` (the
    caller switches the remote off), ``full``, ``denied``, ``protocol``. The
    backend never retries on its own: the caller decides."""

    url: str

    def get(self, name: str) -> bytes | None: ...
    def put_if_absent(self, name: str, data: bytes) -> bool: ...
    def exists(self, name: str) -> bool: ...
    def close(self) -> None: ...


def redact(url: str) -> str:
    """The URL without a password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (
            f":{parts.port}" if parts.port else ""
        )
        return parts._replace(netloc=netloc).geturl()
    return url


def open_backend(
    url: str, *, connect_timeout: float = CONNECT_TIMEOUT, op_timeout: float = OP_TIMEOUT
) -> Backend:
    """The backend for ``url``. Raises ValueError for an unsupported or malformed
    URL (a settings problem, named with the fix). Connects lazily: opening never
    touches the network."""
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("redis", "rediss"):
        _need("redis", scheme)
        from quack.remote.redis_backend import RedisBackend

        return RedisBackend(url, connect_timeout=connect_timeout, op_timeout=op_timeout)
    if scheme == "s3":
        _need("boto3", scheme)
        from quack.remote.s3_backend import S3Backend

        return S3Backend(url, connect_timeout=connect_timeout, op_timeout=op_timeout)
    if scheme == "file":
        from quack.remote.file_backend import FileBackend

        return FileBackend(url)
    raise ValueError(
        f"remote URL {redact(url)!r}: unsupported scheme {scheme or '(none)'!r}; use "
        "redis://host:port/db, s3://bucket/prefix or file:///shared/path"
    )


def _need(module: str, scheme: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"the {scheme}:// remote cache needs the {module} package: pip install 'quack-cache[remote]'"
        )


def unreachable(url: str, e: BaseException, reason: str = "unreachable") -> RemoteError:
    return RemoteError(
        f"remote cache {redact(url)} {'timed out' if reason == 'timeout' else 'unreachable'}: "
        f"{type(e).__name__}: {e}",
        url=redact(url),
        reason=reason,
    )
