"""``redis://host:port/db`` (and ``rediss://``): one Redis string per object.

``SET NX`` makes the first writer win atomically; readers never write. The
client never retries on its own (redis-py's default retries with back-off
would turn one dead host into seconds of waiting): a failure is reported at
once and the tier switches the remote off."""

from __future__ import annotations

from quack.errors import RemoteError
from quack.remote.base import CONNECT_TIMEOUT, MAX_VALUE, OP_TIMEOUT, bounded, redact, too_large, unreachable


class RedisBackend:
    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = CONNECT_TIMEOUT,
        op_timeout: float = OP_TIMEOUT,
        max_bytes: int = MAX_VALUE,
    ):
        import threading

        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url
        self.max_bytes = int(max_bytes)
        self.op_timeout = float(op_timeout)
        kw = dict(
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )
        try:
            self._r = redis.Redis.from_url(url, socket_timeout=op_timeout, **kw)
            # First contact is a PING that must answer within the connect time-out:
            # a server that accepts connections but never replies (hung, or a
            # firewall black hole behind a proxy) then costs 0.5 s, not a whole
            # operation time-out. Later operations get op_timeout (large objects).
            self._probe_client = redis.Redis.from_url(url, socket_timeout=connect_timeout, **kw)
        except ValueError as e:
            raise ValueError(f"remote URL {redact(url)!r}: {e} (expected redis://host:port/db)") from None
        self._probed = False
        self._probe_lock = threading.Lock()

    def _probe(self) -> None:
        with self._probe_lock:
            if self._probed:
                return
            # A PING that fails with a protocol error or gives no PONG: not a Redis server
            # at the other end. Every later call would fail the same, so it is reported
            # unreachable and the tier switches the remote off with one warning.
            try:
                pong = self._call(self._probe_client.ping)
            except RemoteError as e:
                if e.reason != "protocol":
                    raise
                raise RemoteError(
                    f"{e}; is it a Redis server? check the host and port", url=e.url, reason="unreachable"
                ) from None
            finally:
                self._probe_client.close()
            if pong is not True:
                raise RemoteError(
                    f"remote cache {redact(self.url)}: PING gave {pong!r}, not PONG; is it a Redis "
                    "server? check the host and port",
                    url=redact(self.url),
                    reason="unreachable",
                )
            self._probed = True

    def _call(self, fn, *args, **kw):
        import redis.exceptions as rx

        try:
            return fn(*args, **kw)
        except rx.TimeoutError as e:
            raise unreachable(self.url, e, "timeout") from None
        except rx.ConnectionError as e:  # refused, reset, DNS, closed mid-reply
            if isinstance(e, rx.AuthenticationError):
                raise RemoteError(
                    f"remote cache {redact(self.url)}: authentication failed ({e})",
                    url=redact(self.url),
                    reason="denied",
                ) from None
            raise unreachable(self.url, e) from None
        except rx.OutOfMemoryError as e:
            raise RemoteError(
                f"remote cache {redact(self.url)} is full ({e}); raise its maxmemory or "
                "let it evict (maxmemory-policy allkeys-lru)",
                url=redact(self.url),
                reason="full",
            ) from None
        except (rx.NoPermissionError, rx.AuthenticationError, rx.AuthorizationError) as e:
            raise RemoteError(
                f"remote cache {redact(self.url)}: permission denied ({e})",
                url=redact(self.url),
                reason="denied",
            ) from None
        except rx.RedisError as e:
            raise RemoteError(
                f"remote cache {redact(self.url)}: {type(e).__name__}: {e}",
                url=redact(self.url),
                reason="protocol",
            ) from None
        except OSError as e:
            raise unreachable(self.url, e) from None
        except Exception as e:  # noqa: BLE001
            # Not Redis at the other end: redis-py fails in its own code on a reply it did
            # not expect (a server answering +OK to everything gave AttributeError from
            # on_connect_check_health), which crashed `quack build` with a traceback.
            raise RemoteError(
                f"remote cache {redact(self.url)}: a reply the Redis client could not read "
                f"({type(e).__name__}: {e})",
                url=redact(self.url),
                reason="protocol",
            ) from None

    # -- the contract: each operation bounded as a whole (quack.remote.base.bounded) ----------
    def get(self, name: str) -> bytes | None:
        return bounded(self.url, self.op_timeout, f"GET {name}", self._get, name, abort=self._abort)

    def put_if_absent(self, name: str, data: bytes) -> bool:
        return bounded(
            self.url, self.op_timeout, f"SET {name}", self._put, name, bytes(data), abort=self._abort
        )

    def exists(self, name: str) -> bool:
        return bounded(self.url, self.op_timeout, f"EXISTS {name}", self._exists, name, abort=self._abort)

    def _abort(self) -> None:
        # Shut the sockets down, in-use ones too: the abandoned operation's blocked read
        # ends at once instead of trickling on (the remote is off for the process now).
        self._r.connection_pool.disconnect()

    def _get(self, name: str) -> bytes | None:
        if not self._probed:
            self._probe()
        # STRLEN first: a value over the cap is refused without transferring it; then
        # GETRANGE bounded by the cap, so one grown in between is not read whole either.
        n = self._call(self._r.strlen, name)
        if not isinstance(n, int):
            raise RemoteError(
                f"remote cache {redact(self.url)}: STRLEN {name} gave {type(n).__name__}",
                url=redact(self.url),
                reason="protocol",
            )
        if n > self.max_bytes:
            raise too_large(self.url, name, n, self.max_bytes)
        if n == 0:
            v = self._call(self._r.get, name)  # absent (None), or an empty value
        else:
            v = self._call(self._r.getrange, name, 0, self.max_bytes)
            if isinstance(v, bytes) and len(v) > self.max_bytes:
                raise too_large(self.url, name, None, self.max_bytes)
            if v == b"" and not self._call(self._r.exists, name):
                v = None  # deleted between the two calls
        if v is not None and not isinstance(v, bytes):
            raise RemoteError(
                f"remote cache {redact(self.url)}: GET {name} gave {type(v).__name__}",
                url=redact(self.url),
                reason="protocol",
            )
        return v

    def _put(self, name: str, data: bytes) -> bool:
        if not self._probed:
            self._probe()
        return bool(self._call(self._r.set, name, data, nx=True))

    def _exists(self, name: str) -> bool:
        if not self._probed:
            self._probe()
        return bool(self._call(self._r.exists, name))

    def close(self) -> None:
        try:
            self._r.close()
        except Exception:  # noqa: BLE001 - closing a broken connection must not raise
            pass
