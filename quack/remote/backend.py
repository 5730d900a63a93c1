"""The URL dispatch: a remote URL -> its backend (the contract they implement is
quack.remote.base). Backends live one per module and import their client library
lazily, so a process that never configures a remote never imports redis or boto3."""

from __future__ import annotations

from quack.remote.base import CONNECT_TIMEOUT, MAX_VALUE, OP_TIMEOUT, SCHEMES, Backend, redact


def open_backend(
    url: str,
    *,
    connect_timeout: float = CONNECT_TIMEOUT,
    op_timeout: float = OP_TIMEOUT,
    max_bytes: int = MAX_VALUE,
) -> Backend:
    """The backend for ``url``. Raises ValueError for an unsupported or malformed
    URL (a settings problem, named with the fix). Connects lazily: opening never
    touches the network. ``max_bytes``: the largest value ``get`` reads (tests lower it)."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in SCHEMES:
        from quack.settings.fields import check_remote_url

        try:
            check_remote_url(url)
        except ValueError as e:
            raise ValueError(f"remote URL {redact(url)!r}: {e}") from None
    if scheme in ("redis", "rediss"):
        _need("redis", scheme)
        from quack.remote.redis_backend import RedisBackend

        return RedisBackend(url, connect_timeout=connect_timeout, op_timeout=op_timeout, max_bytes=max_bytes)
    if scheme == "s3":
        _need("boto3", scheme)
        from quack.remote.s3_backend import S3Backend

        return S3Backend(url, connect_timeout=connect_timeout, op_timeout=op_timeout, max_bytes=max_bytes)
    if scheme == "file":
        from quack.remote.file_backend import FileBackend

        return FileBackend(url, op_timeout=op_timeout, max_bytes=max_bytes)
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
