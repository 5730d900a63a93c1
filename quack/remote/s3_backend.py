"""``s3://bucket/prefix``: one S3 object per cache object (boto3).

The endpoint, region and credentials come from boto3's usual chain
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, profiles, instance roles), so a
MinIO, Ceph, R2 or moto endpoint works as AWS does. Writes are conditional
(``If-None-Match: *``): the first writer wins and an object is never replaced.
botocore's own retries are off; the time-outs bound every call."""

from __future__ import annotations

from urllib.parse import urlsplit

from quack.errors import RemoteError
from quack.remote.base import CONNECT_TIMEOUT, MAX_VALUE, OP_TIMEOUT, too_large, unreachable

_ABSENT = ("NoSuchKey", "404", "NotFound")
_EXISTS = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")
_DENIED = (
    "AccessDenied",
    "403",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
)
_FULL = ("QuotaExceeded", "EntityTooLarge", "XMinioStorageFull", "507")


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

    @staticmethod
    def _code(e) -> tuple[str, str]:
        r = getattr(e, "response", None) or {}
        return (
            str(r.get("Error", {}).get("Code", "")),
            str(r.get("ResponseMetadata", {}).get("HTTPStatusCode", "")),
        )

    def get(self, name: str) -> bytes | None:
        import botocore.exceptions as bx

        try:
            r = self._s3.get_object(Bucket=self.bucket, Key=self._key(name))
            body = r["Body"]
            try:
                # The declared length first: a value over the cap is refused before its
                # body is read; the read itself is bounded too (a length that lies).
                n = r.get("ContentLength")
                if isinstance(n, int) and n > self.max_bytes:
                    raise too_large(self.url, name, n, self.max_bytes)
                data = body.read(self.max_bytes + 1)
                if len(data) > self.max_bytes:
                    raise too_large(self.url, name, None, self.max_bytes)
                return data
            finally:
                body.close()
        except RemoteError:
            raise
        except bx.ClientError as e:
            code, status = self._code(e)
            if code in _ABSENT or status == "404" and code != "NoSuchBucket":
                return None
            raise self._err(e, f"GET {name}") from None
        except (bx.BotoCoreError, OSError) as e:
            raise self._err(e, f"GET {name}") from None

    def put_if_absent(self, name: str, data: bytes) -> bool:
        import botocore.exceptions as bx

        try:
            self._s3.put_object(Bucket=self.bucket, Key=self._key(name), Body=bytes(data), IfNoneMatch="*")
            return True
        except bx.ClientError as e:
            code, status = self._code(e)
            if code in _EXISTS or status in ("412", "409"):
                return False
            raise self._err(e, f"PUT {name}") from None
        except (bx.BotoCoreError, OSError) as e:
            raise self._err(e, f"PUT {name}") from None

    def exists(self, name: str) -> bool:
        import botocore.exceptions as bx

        try:
            self._s3.head_object(Bucket=self.bucket, Key=self._key(name))
            return True
        except bx.ClientError as e:
            code, status = self._code(e)
            if code in _ABSENT or status == "404":
                return False
            raise self._err(e, f"HEAD {name}") from None
        except (bx.BotoCoreError, OSError) as e:
            raise self._err(e, f"HEAD {name}") from None

    def close(self) -> None:
        try:
            self._s3.close()
        except Exception:  # noqa: BLE001
            pass
