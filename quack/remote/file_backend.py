"""``file:///shared/path``: a shared directory (NFS, a mounted volume).

Objects are files under the root, named as everywhere (``quack/v1/...``).
put_if_absent writes a private temp file, fsyncs it and hard-links it into
place: link(2) fails if the name exists (first writer wins, also over NFS,
where O_EXCL on create historically was not atomic), and a reader sees either
no file or the whole object, never a partial one."""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path
from urllib.parse import unquote, urlsplit

from quack.errors import RemoteError

_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


class FileBackend:
    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"remote URL {url!r}: expected file:///absolute/path (three slashes)")
        self.url = url
        self.root = Path(unquote(parts.path))

    def _path(self, name: str) -> Path:
        parts = name.split("/")
        if any(p in ("", ".", "..") or "\0" in p for p in parts):
            raise ValueError(f"invalid object name {name!r}")
        return self.root.joinpath(*parts)

    def _err(self, e: OSError, what: str) -> RemoteError:
        reason = "full" if e.errno in _FULL else "denied" if e.errno in _DENIED else "unreachable"
        return RemoteError(
            f"remote cache {self.url}: {what} failed: {e.strerror or e}", url=self.url, reason=reason
        )

    def get(self, name: str) -> bytes | None:
        p = self._path(name)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            if not self.root.is_dir():
                raise RemoteError(
                    f"remote cache {self.url}: directory {self.root} does not exist",
                    url=self.url,
                    reason="unreachable",
                ) from None
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RemoteError(
                    f"remote cache {self.url}: {p} is a symbolic link; refused",
                    url=self.url,
                    reason="protocol",
                ) from None
            raise self._err(e, f"reading {p}") from None
        try:
            with os.fdopen(fd, "rb") as f:
                return f.read()
        except OSError as e:
            raise self._err(e, f"reading {p}") from None

    def put_if_absent(self, name: str, data: bytes) -> bool:
        p = self._path(name)
        if not self.root.is_dir():
            raise RemoteError(
                f"remote cache {self.url}: directory {self.root} does not exist",
                url=self.url,
                reason="unreachable",
            )
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(p):
                return False
            tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                try:
                    os.link(tmp, p)
                except FileExistsError:
                    return False
                return True
            finally:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
        except OSError as e:
            raise self._err(e, f"writing {p}") from None

    def exists(self, name: str) -> bool:
        return os.path.lexists(self._path(name))

    def close(self) -> None:
        pass
