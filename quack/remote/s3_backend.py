"""``s3://bucket/prefix``: one S3 object per cache object (boto3).

The endpoint, region and credentials come from boto3's usual chain
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, profiles, instance roles), so a
MinIO, Ceph, R2 or moto endpoint works as AWS does. Writes are conditional
(``If-None-Match: *``): the first writer wins. A writer replaces an object it
refused (``replace``) with ``If-Match: <the refused object's ETag>``: the store
takes the PUT only if the object is still that one, so a valid object written in
between is never clobbered (AWS S3 honours If-Match on PUT; a store that
ignores it makes the replace unconditional, see docs/remote-cache.md).
botocore's own retries are off; the time-outs bound every call.

Every response body botocore reads itself (an error's XML, a PUT's reply) is read
through ``_bounded_send``, at most ``MAX_RESPONSE`` bytes: botocore reads such a body
whole, so a hostile or spoofed endpoint answering 500 with a 1.5 GB body made one fetch
allocate 5 GB and run past its time-out. An object's own body (a GET's 200) is read by
``_get``, bounded by the cap on an object."""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any
from urllib.parse import urlsplit

from quack.errors import RemoteError
from quack.remote.base import (
    CONNECT_TIMEOUT,
    MAX_VALUE,
    OP_TIMEOUT,
    Current,
    bounded,
    too_large,
    unreachable,
)

# What says "no such object". A GET's 404 carries S3's XML error body, so it must say
# NoSuchKey: a plain web server's HTML 404 (an endpoint that is not S3 at all) gives code
# "404" and used to look like an empty cache, with no warning. A HEAD has no body, so
# S3 itself answers a missing key with a bare 404 (botocore's code "404"): that stays absent.
_GET_ABSENT = ("NoSuchKey",)
_HEAD_ABSENT = ("NoSuchKey", "NotFound", "404")
_EXISTS = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")
# An If-Match PUT on a name that holds nothing any more (AWS answers 404 NoSuchKey).
_PUT_ABSENT = ("NoSuchKey", "NotFound", "404")
_DENIED = (
    "AccessDenied",
    "403",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
)
_CHUNK = 64 * 1024
# What botocore may read of a response it reads whole: S3's error bodies are a few hundred
# bytes of XML, a PUT's reply is empty.
MAX_RESPONSE = 1024 * 1024
_FULL = ("QuotaExceeded", "EntityTooLarge", "XMinioStorageFull", "507")


@dataclasses.dataclass(frozen=True)
class _Got:
    data: bytes | None  # None: over the cap, its body unread
    etag: str
    size: int | None


class ResponseTooLarge(Exception):
    """A response body over ``MAX_RESPONSE`` that botocore would have read whole: refused,
    the connection dropped, the rest never read."""

    def __init__(self, status: int, limit: int):
        self.status, self.limit = status, limit
        super().__init__(
            f"an HTTP {status} response whose body runs past the {limit}-byte cap; the rest is not read"
        )


@functools.cache
def _bounded_response_class() -> type:
    """botocore's AWSResponse whose ``content`` (what botocore reads of an error or of a
    non-streaming reply) reads at most ``MAX_RESPONSE`` bytes, else ResponseTooLarge."""
    import botocore.awsrequest
    import botocore.exceptions as bx
    import urllib3.exceptions as ux

    class BoundedResponse(botocore.awsrequest.AWSResponse):
        limit = MAX_RESPONSE
        _content: bytes | None

        @property
        def content(self) -> bytes:
            if self._content is None:
                raw, limit = self.raw, self.limit
                chunks, total = [], 0
                try:
                    while True:
                        b = raw.read(min(_CHUNK, limit + 1 - total))
                        if not b:
                            break
                        chunks.append(b)
                        total += len(b)
                        if total > limit:
                            raw.close()  # drop the connection: the rest is never read
                            raise ResponseTooLarge(self.status_code, limit)
                except ux.ReadTimeoutError as e:  # as botocore's own reads report them
                    raise bx.ReadTimeoutError(endpoint_url=self.url, error=e) from None
                except (ux.HTTPError, OSError) as e:
                    raise bx.ResponseStreamingError(error=e) from None
                self._content = b"".join(chunks)
            return self._content

    return BoundedResponse


class S3Backend:
    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = CONNECT_TIMEOUT,
        op_timeout: float = OP_TIMEOUT,
        max_bytes: int = MAX_VALUE,
    ):
        parts = urlsplit(url)
        if not parts.netloc:
            raise ValueError(f"remote URL {url!r}: expected s3://bucket/prefix")
        import boto3
        from botocore.config import Config

        self.url = url
        self.max_bytes = int(max_bytes)
        self.op_timeout = float(op_timeout)
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        # Path-style addressing: works on AWS and on every S3-compatible server
        # (an endpoint on an IP address has no per-bucket host names).
        cfg = Config(
            connect_timeout=connect_timeout,
            read_timeout=op_timeout,
            retries={"total_max_attempts": 1, "mode": "standard"},
            s3={"addressing_style": "path"},
        )
        self._s3 = boto3.session.Session().client("s3", config=cfg)
        # Every request is sent by _bounded_send (botocore's before-send event: a response
        # returned there is the response), through the client's own HTTP session.
        http = getattr(getattr(self._s3, "_endpoint", None), "http_session", None)
        if not callable(getattr(http, "send", None)):
            raise ImportError(
                "botocore's S3 client has no HTTP session (client._endpoint.http_session) to "
                "bound responses with; quack supports botocore 1.35 and later"
            )
        self._http: Any = http
        self._s3.meta.events.register("before-send.s3", self._bounded_send)

    def _bounded_send(self, request: Any, **_: Any) -> Any:
        """Send ``request`` as botocore would, but read no body whole past MAX_RESPONSE:
        botocore reads a non-streaming reply right after sending it (here: bounded), and an
        error's body in its parse (the returned response's bounded ``content``)."""
        whole = not request.stream_output
        request.stream_output = True  # botocore's send would read the body whole now
        try:
            sent = self._http.send(request)
            response = _bounded_response_class()(sent.url, sent.status_code, sent.headers, sent.raw)
        finally:
            request.stream_output = not whole
        if whole:
            response.content  # noqa: B018 - read now, as botocore's send does (bounded)
        return response

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _err(self, e: Exception, what: str) -> RemoteError:
        import botocore.exceptions as bx

        if isinstance(e, (bx.ConnectTimeoutError, bx.ReadTimeoutError)):
            return unreachable(self.url, e, "timeout")
        if isinstance(
            e, (bx.EndpointConnectionError, bx.ConnectionClosedError, bx.ConnectionError, bx.HTTPClientError)
        ):
            return unreachable(self.url, e)
        if isinstance(e, bx.NoCredentialsError):
            return RemoteError(
                f"remote cache {self.url}: no AWS credentials found for {what}", url=self.url, reason="denied"
            )
        if isinstance(e, bx.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code == "NoSuchBucket":
                return RemoteError(
                    f"remote cache {self.url}: bucket {self.bucket!r} does not exist",
                    url=self.url,
                    reason="unreachable",
                )
            if code in _DENIED or status == "403":
                return RemoteError(
                    f"remote cache {self.url}: {what} denied ({code})", url=self.url, reason="denied"
                )
            if status == "404" and code in ("404", ""):
                return RemoteError(
                    f"remote cache {self.url}: {what} got a 404 without an S3 error code: the "
                    "endpoint does not answer as S3 does; check AWS_ENDPOINT_URL (or the "
                    "profile's endpoint_url)",
                    url=self.url,
                    reason="protocol",
                )
            if code in _FULL or status == "507":
                return RemoteError(
                    f"remote cache {self.url}: {what}: storage full ({code})", url=self.url, reason="full"
                )
            return RemoteError(
                f"remote cache {self.url}: {what} failed ({code or status}: {e})",
                url=self.url,
                reason="protocol",
            )
        return RemoteError(
            f"remote cache {self.url}: {what} failed ({type(e).__name__}: {e})",
            url=self.url,
            reason="protocol",
        )

    def _too_large(self, e: ResponseTooLarge, what: str) -> RemoteError:
        return RemoteError(f"remote cache {self.url}: {what}: {e}", url=self.url, reason="protocol")

    @staticmethod
    def _code(e) -> tuple[str, str]:
        r = getattr(e, "response", None) or {}
        return (
            str(r.get("Error", {}).get("Code", "")),
            str(r.get("ResponseMetadata", {}).get("HTTPStatusCode", "")),
        )

    # -- the contract: each operation bounded as a whole (quack.remote.base.bounded) ----------
    # botocore's read_timeout bounds each socket read only: a trickling server kept one GET
    # going for as long as it kept sending.
    def get(self, name: str) -> bytes | None:
        stop = threading.Event()  # set on the time-out: the abandoned read stops at a chunk
        got = bounded(self.url, self.op_timeout, f"GET {name}", self._get, name, stop, abort=stop.set)
        if got is None:
            return None
        if got.data is None:
            raise too_large(self.url, name, got.size, self.max_bytes)
        return got.data

    def get_current(self, name: str) -> Current | None:
        stop = threading.Event()
        got = bounded(self.url, self.op_timeout, f"GET {name}", self._get, name, stop, abort=stop.set)
        if got is None:
            return None
        # The ETag names this value, over the cap or not (it comes with the headers, before
        # the body). None sent: an empty tag, which replace never acts on.
        return Current(got.data, got.etag)

    def replace(self, name: str, data: bytes, tag: str) -> bool:
        return bounded(self.url, self.op_timeout, f"PUT {name}", self._cas, name, bytes(data), tag)

    def put_if_absent(self, name: str, data: bytes) -> bool:
        return bounded(self.url, self.op_timeout, f"PUT {name}", self._put, name, bytes(data))

    def exists(self, name: str) -> bool:
        return bounded(self.url, self.op_timeout, f"HEAD {name}", self._exists, name)

    def _get(self, name: str, stop: threading.Event) -> _Got | None:
        """The object (``data`` None when over the cap: its body is left unread) and its ETag."""
        import botocore.exceptions as bx

        try:
            r = self._s3.get_object(Bucket=self.bucket, Key=self._key(name))
            body = r["Body"]
            etag = str(r.get("ETag") or "")
            try:
                # The declared length first: a value over the cap is refused before its
                # body is read; the read itself is bounded too (a length that lies).
                n = r.get("ContentLength")
                if isinstance(n, int) and n > self.max_bytes:
                    return _Got(None, etag, n)
                chunks, total = [], 0
                while total <= self.max_bytes and not stop.is_set():
                    b = body.read(min(_CHUNK, self.max_bytes + 1 - total))
                    if not b:
                        break
                    chunks.append(b)
                    total += len(b)
                if stop.is_set():  # abandoned: never hand on a truncated body
                    raise RemoteError(f"remote cache {self.url}: GET {name} abandoned", reason="timeout")
                data = b"".join(chunks)
                if len(data) > self.max_bytes:
                    return _Got(None, etag, None)
                return _Got(data, etag, len(data))
            finally:
                body.close()
        except RemoteError:
            raise
        except ResponseTooLarge as e:
            raise self._too_large(e, f"GET {name}") from None
        except bx.ClientError as e:
            code, status = self._code(e)
            if code in _GET_ABSENT:
                return None
            raise self._err(e, f"GET {name}") from None
        except (bx.BotoCoreError, OSError) as e:
            raise self._err(e, f"GET {name}") from None

    def _put(self, name: str, data: bytes) -> bool:
        import botocore.exceptions as bx

        try:
            self._s3.put_object(Bucket=self.bucket, Key=self._key(name), Body=data, IfNoneMatch="*")
            return True
        except ResponseTooLarge as e:
            raise self._too_large(e, f"PUT {name}") from None
        except bx.ClientError as e:
            code, status = self._code(e)
            if code in _EXISTS or status in ("412", "409"):
                return False
            raise self._err(e, f"PUT {name}") from None
        except (bx.BotoCoreError, OSError) as e:
            raise self._err(e, f"PUT {name}") from None

    def _cas(self, name: str, data: bytes, tag: str) -> bool:
        import botocore.exceptions as bx

        if not tag:
            return False  # no ETag to make the PUT conditional on: never an unconditional replace
        try:
            self._s3.put_object(Bucket=self.bucket, Key=self._key(name), Body=data, IfMatch=tag)
            return True
        except bx.ClientError as e:
            code, status = self._code(e)
            if code in _EXISTS or status in ("412", "409"):
                return False  # another object there now: left as it is
            if code in _PUT_ABSENT or status == "404":
                return self._put(name, data)  # gone in between: first writer wins, as ever
            raise self._err(e, f"PUT {name}") from None
        except (bx.BotoCoreError, OSError) as e:
            raise self._err(e, f"PUT {name}") from None

    def _exists(self, name: str) -> bool:
        import botocore.exceptions as bx

        try:
            self._s3.head_object(Bucket=self.bucket, Key=self._key(name))
            return True
        except ResponseTooLarge as e:
            raise self._too_large(e, f"HEAD {name}") from None
        except bx.ClientError as e:
            code, status = self._code(e)
            if code in _HEAD_ABSENT and status == "404":
                return False
            raise self._err(e, f"HEAD {name}") from None
        except (bx.BotoCoreError, OSError) as e:
            raise self._err(e, f"HEAD {name}") from None

    def close(self) -> None:
        try:
            self._s3.close()
        except Exception:  # noqa: BLE001
            pass
