"""``redis://host:port/db`` (and ``rediss://``): one Redis string per object.

``SET NX`` makes the first writer win atomically; readers never write. A writer
replaces an object it refused (``replace``) with a Lua script, atomic on the
server: SET only if the value there still has the refused value's SHA-1 and
length (or, for a value over the size cap, is still over it), so a valid object
written in between is never clobbered. The client never retries on its own
(redis-py's default retries with back-off would turn one dead host into seconds
of waiting): a failure is reported at once and the tier switches the remote off.

Every reply is read through a bounded parser (``_bounded_parser``): redis-py reads
whatever length a bulk reply's ``$N`` header announces, so a hostile or spoofed server
that answered ``STRLEN`` honestly and then sent a 1.5 GB ``GETRANGE`` reply made one
fetch allocate 4 GB and run past its time-out. A bulk over the cap is refused from its
header, before its bytes are read, and no reply (a line without an end, an array of
many bulks) is read past the cap and some framing."""

from __future__ import annotations

import hashlib
from typing import Any

from quack.errors import RemoteError
from quack.remote.base import (
    CONNECT_TIMEOUT,
    MAX_VALUE,
    OP_TIMEOUT,
    OVER_CAP,
    Current,
    bounded,
    redact,
    too_large,
    unreachable,
)

# The compare-and-swap (one script, atomic on the server). KEYS[1]: the name; ARGV: the new
# value, the refused value's SHA-1 hex (or OVER_CAP), its length (or the cap). Nothing there
# any more: stored as SET NX would. Returns 1 if stored, 0 if the name holds another value.
_REPLACE = """
local n = redis.call('STRLEN', KEYS[1])
if n == 0 and redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SET', KEYS[1], ARGV[1])
  return 1
end
local same
if ARGV[2] == '@OVER_CAP@' then
  same = n > tonumber(ARGV[3])
else
  same = n == tonumber(ARGV[3]) and redis.sha1hex(redis.call('GET', KEYS[1])) == ARGV[2]
end
if same then
  redis.call('SET', KEYS[1], ARGV[1])
  return 1
end
return 0
""".replace("@OVER_CAP@", OVER_CAP)

# What one reply may hold beyond the cap on a value: its framing ($N and CRLFs, far less)
# plus what one socket read takes ahead (redis-py reads 64 KiB at a time).
_FRAMING = 128 * 1024


class ReplyTooLarge(Exception):
    """A reply announcing (``size``) or sending (``size`` None) more than ``limit`` bytes:
    refused before its bytes are read. Raised inside redis-py's read of the reply, which
    then drops the connection (the rest of the reply is never read)."""

    def __init__(self, size: int | None, limit: int):
        self.size, self.limit = size, limit
        if size is not None:
            super().__init__(f"a reply announcing {size} bytes, over the {limit}-byte cap")
        else:
            super().__init__(f"a reply running past the {limit}-byte cap")


def _bounded_parser(limit: int) -> type:
    """redis-py's RESP2 parser, reading through a buffer that refuses a bulk string longer
    than ``limit`` from its ``$N`` header, before reading it, and any reply of more than
    ``limit + _FRAMING`` bytes. redis-py (5 to 8) has no such option: its parser asks the
    socket buffer for the announced length, and this buffer says no. RESP2 because the
    connection's handshake swaps a RESP3 parser for redis-py's own on a fallback; every
    Redis speaks RESP2, and these commands need nothing more."""
    from redis._parsers.resp2 import _RESP2Parser
    from redis._parsers.socket import SocketBuffer
    from redis.exceptions import InvalidResponse

    budget = limit + _FRAMING

    class BoundedBuffer(SocketBuffer):
        received = 0  # bytes taken from the socket for the reply being read

        def read(self, length: int, *args: Any, **kw: Any) -> bytes:
            if length < 0:  # only $-1 (nil) is negative, and the parser handles that itself
                raise InvalidResponse(f"Protocol Error: a bulk string of length {length}")
            if length > limit:
                raise ReplyTooLarge(length, limit)
            if self.received + length > budget:  # many bulks, each under the cap
                raise ReplyTooLarge(None, limit)
            return super().read(length, *args, **kw)

        def _read_from_socket(self, *args: Any, **kw: Any) -> bool:
            if self.received > budget:
                raise ReplyTooLarge(None, limit)
            before = self._unread()
            try:
                return super()._read_from_socket(*args, **kw)
            finally:
                self.received += max(0, self._unread() - before)

        def _unread(self) -> int:
            try:
                return self.unread_bytes()
            except Exception:  # noqa: BLE001 - closed under us: the read reports it
                return 0

    class BoundedRESP2Parser(_RESP2Parser):
        def on_connect(self, connection: Any) -> None:
            super().on_connect(connection)
            sock: Any = self._sock
            self._buffer = BoundedBuffer(sock, self.socket_read_size, connection.socket_timeout)

        def read_response(self, *args: Any, **kw: Any) -> Any:
            if isinstance(self._buffer, BoundedBuffer):
                self._buffer.received = 0
            return super().read_response(*args, **kw)

    return BoundedRESP2Parser


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
        try:
            parser = _bounded_parser(self.max_bytes + 1)  # GETRANGE 0 max_bytes: max_bytes + 1
        except ImportError as e:  # a redis-py without the parser this bounds: not used, one warning
            raise ImportError(
                f"redis {getattr(redis, '__version__', '?')} has no redis._parsers.resp2 parser "
                f"to bound replies with ({e}); quack supports redis-py 5 to 8"
            ) from None
        kw: dict[str, Any] = dict(
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            protocol=2,
            parser_class=parser,
        )
        # No CLIENT SETINFO in the handshake: informative only, and a server that is not
        # Redis (one +OK for two pipelined commands) would time out on it instead of failing
        # its PING, which names the problem. redis-py 8 says so with driver_info=None (its
        # lib_name is deprecated), 5 to 7 with lib_name=None.
        import inspect

        base = getattr(redis.connection, "AbstractConnection", redis.connection.Connection)
        if "driver_info" in inspect.signature(base.__init__).parameters:
            kw["driver_info"] = None
        else:
            kw.update(lib_name=None, lib_version=None)
        try:
            self._r = redis.Redis.from_url(url, socket_timeout=op_timeout, **kw)
            # First contact is a PING that must answer within the connect time-out:
            # a server that accepts connections but never replies (hung, or a
            # firewall black hole behind a proxy) then costs 0.5 s, not a whole
            # operation time-out. Later operations get op_timeout (large objects).
            self._probe_client = redis.Redis.from_url(url, socket_timeout=connect_timeout, **kw)
        except ValueError as e:
            raise ValueError(f"remote URL {redact(url)!r}: {e} (expected redis://host:port/db)") from None
        for client in (self._r, self._probe_client):
            # Query arguments win over keywords in from_url: ?protocol=3 must not unbind them.
            client.connection_pool.connection_kwargs.update(protocol=2, parser_class=parser)
        self._probed = False
        self._probe_lock = threading.Lock()
        self._replace = self._r.register_script(_REPLACE)  # EVALSHA, EVAL on NOSCRIPT; no I/O here

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

    def _call(self, fn, *args, value_of: str | None = None, **kw):
        """``fn(*args)`` with redis-py's failures as RemoteError. ``value_of``: the reply is
        the object stored under that name, so one over the cap is a ``size`` refusal (any
        other reply over it is a protocol error)."""
        import redis.exceptions as rx

        try:
            return fn(*args, **kw)
        except ReplyTooLarge as e:
            if value_of is not None:
                raise too_large(self.url, value_of, e.size, self.max_bytes) from None
            raise RemoteError(
                f"remote cache {redact(self.url)}: {e}; refused unread",
                url=redact(self.url),
                reason="protocol",
            ) from None
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

    def get_current(self, name: str) -> Current | None:
        return bounded(self.url, self.op_timeout, f"GET {name}", self._get_current, name, abort=self._abort)

    def replace(self, name: str, data: bytes, tag: str) -> bool:
        return bounded(
            self.url,
            self.op_timeout,
            f"replacing {name}",
            self._cas,
            name,
            bytes(data),
            tag,
            abort=self._abort,
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
            v = self._call(self._r.get, name, value_of=name)  # absent (None), or an empty value
        else:
            # The reply is bounded too (_bounded_parser): a server whose STRLEN lied cannot
            # make this read more than the cap.
            v = self._call(self._r.getrange, name, 0, self.max_bytes, value_of=name)
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

    def _get_current(self, name: str) -> Current | None:
        try:
            v = self._get(name)
        except RemoteError as e:
            if e.reason == "size":
                return Current(None, f"{OVER_CAP}:{self.max_bytes}")
            raise
        if v is None:
            return None
        return Current(v, f"{hashlib.sha1(v).hexdigest()}:{len(v)}")  # what redis.sha1hex gives

    def _cas(self, name: str, data: bytes, tag: str) -> bool:
        if not self._probed:
            self._probe()
        digest, _, n = tag.rpartition(":")
        if not digest or not n.isdigit():
            raise ValueError(f"not a tag of this backend: {tag!r}")
        return self._call(self._replace, keys=[name], args=[data, digest, int(n)]) == 1

    def _exists(self, name: str) -> bool:
        if not self._probed:
            self._probe()
        return bool(self._call(self._r.exists, name))

    def close(self) -> None:
        try:
            self._r.close()
        except Exception:  # noqa: BLE001 - closing a broken connection must not raise
            pass
