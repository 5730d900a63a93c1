"""``file:///shared/path``: a shared directory (NFS, a mounted volume).

Objects are files under the root, named as everywhere (``quack/v1/...``).
put_if_absent writes a private temp file, fsyncs it and hard-links it into
place: link(2) fails if the name exists (first writer wins, also over NFS,
where O_EXCL on create historically was not atomic), and a reader sees either
no file or the whole object, never a partial one.

A writer replaces an object it refused (``replace``): its object goes to a temp
file first; then, holding an ``flock`` on the directory's ``.quack-replace.lock``
(every replacing writer takes it), the name is read again and the temp file is
renamed over it only if it still holds the refused bytes (same SHA-256), so two
replacing writers never clobber each other's object and a reader sees the old
object or the new one, whole. The one write that takes no lock is an add
(link(2)), and it only ever fills an empty name.

What a shared directory can hold that a server cannot (issue 30), each refused:

* Anything but a regular file at an object's name. A FIFO there made ``open``
  block for ever (a build hung, and Ctrl-C could not end it): every object is
  ``lstat``-ed, then opened ``O_NONBLOCK | O_NOFOLLOW`` and ``fstat``-ed.
* A symbolic link on the way down: every directory under the root is opened
  relative to its parent with ``O_NOFOLLOW`` (an ``openat`` walk), so a link
  planted at ``quack/v1/<stamp>`` is neither read through nor written through.
* A root anyone can write (mode o+w), like the local cache's root; and a root
  that is not a store: it must hold quack's marker file ``.quack-remote``, or
  nothing but quack's own ``quack/`` tree (an empty directory is a new store; a
  writer then adds the marker). ``file:///etc`` or a home directory is refused.
* A value over the size cap (``fstat`` before reading, and a bounded read).

A hung file system (a dead NFS server) blocks in the kernel where no time-out
reaches, so every operation runs on a daemon thread and the caller waits at most
the remote time-out, as with redis and S3; past it the remote is reported timed
out (and switched off by the tier). The stuck thread is a daemon: it cannot keep
the process from exiting."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import secrets
import stat
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar
from urllib.parse import unquote, urlsplit

from quack.cache import openat
from quack.errors import RemoteError
from quack.filekind import describe
from quack.remote.base import MAX_VALUE, OP_TIMEOUT, OVER_CAP, Current, bounded, too_large

MARKER = ".quack-remote"
REPLACE_LOCK = ".quack-replace.lock"  # in each object's directory: taken by every replace
_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)

_T = TypeVar("_T")


def _flock_until(fd: int, stop: threading.Event) -> bool:
    """An exclusive ``flock`` on ``fd``, asked without blocking and asked again until it is
    got (True) or ``stop`` is set (False: the caller has timed out). A blocking flock here
    never returned while another writer (a stopped process, a lost NFS client) held the
    lock: the caller gave up at its time-out, but the operation's thread stayed blocked
    for the life of the process, holding its temporary object and the lock file open."""
    delay = 0.002
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if stop.wait(delay):
            return False
        delay = min(delay * 2, 0.05)


def _kind(mode: int) -> str:
    return describe(mode)


class FileBackend:
    def __init__(self, url: str, *, op_timeout: float = OP_TIMEOUT, max_bytes: int = MAX_VALUE):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"remote URL {url!r}: expected file:///absolute/path (three slashes)")
        self.url = url
        self.root = Path(unquote(parts.path))
        self.op_timeout = float(op_timeout)
        self.max_bytes = int(max_bytes)
        # The root was found to be a store: 1 checked (a reader needs no more), 2 marked.
        self._store_ok = 0

    # -- the contract: each operation bounded by the time-out -----------------------------
    def get(self, name: str) -> bytes | None:
        parts = self._parts(name)
        return self._bounded(f"reading {name}", self._get, parts)

    def put_if_absent(self, name: str, data: bytes) -> bool:
        parts = self._parts(name)
        return self._bounded(f"writing {name}", self._put, parts, bytes(data))

    def get_current(self, name: str) -> Current | None:
        parts = self._parts(name)
        return self._bounded(f"reading {name}", self._get_current, parts)

    def replace(self, name: str, data: bytes, tag: str) -> bool:
        parts = self._parts(name)
        stop = threading.Event()  # set on the time-out: a lock got after it replaces nothing
        return self._bounded(
            f"replacing {name}", self._replace, parts, bytes(data), tag, stop, abort=stop.set
        )

    def exists(self, name: str) -> bool:
        parts = self._parts(name)
        return self._bounded(f"looking up {name}", self._exists, parts)

    def close(self) -> None:
        pass

    def _bounded(
        self, what: str, fn: Callable[..., Any], *args: Any, abort: Callable[[], None] | None = None
    ) -> Any:
        hint = f"(is the file system under {self.root} hung?)"
        return bounded(self.url, self.op_timeout, what, fn, *args, hint=hint, abort=abort)

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _parts(name: str) -> list[str]:
        parts = name.split("/")
        if any(p in ("", ".", "..") or "\0" in p for p in parts):
            raise ValueError(f"invalid object name {name!r}")
        return parts

    def _err(self, e: OSError, what: str) -> RemoteError:
        reason = "full" if e.errno in _FULL else "denied" if e.errno in _DENIED else "unreachable"
        return RemoteError(
            f"remote cache {self.url}: {what} failed: {e.strerror or e}", url=self.url, reason=reason
        )

    def _refuse(self, message: str, reason: str = "protocol") -> RemoteError:
        return RemoteError(f"remote cache {self.url}: {message}", url=self.url, reason=reason)

    def _open_root(self, *, writing: bool) -> int:
        """A descriptor of the root, checked: a directory, not writable by others, a store."""
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise self._refuse(f"directory {self.root} does not exist", "unreachable") from None
        except NotADirectoryError:
            raise self._refuse(f"{self.root} is not a directory", "denied") from None
        except OSError as e:
            raise self._err(e, f"opening {self.root}") from None
        try:
            mode = os.fstat(fd).st_mode
            if mode & stat.S_IWOTH:
                # As the local cache's root (quack.cache.fsutil.check_root): anyone could
                # plant links, FIFOs or huge files, or delete the objects.
                raise self._refuse(
                    f"directory {self.root} is writable by anyone (mode {stat.S_IMODE(mode):o}); "
                    f"refused. Share it through a group instead: chmod o-w {self.root}",
                    "denied",
                )
            if self._store_ok < (2 if writing else 1):
                self._check_store(fd, writing=writing)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _check_store(self, fd: int, *, writing: bool) -> None:
        """The root must be a quack store: the marker, or nothing but ``quack/`` (an
        empty directory is a new store). A writer marks a store it starts."""
        try:
            st = os.stat(MARKER, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise self._err(e, f"looking for {self.root / MARKER}") from None
        if st is None:
            with os.scandir(fd) as it:
                foreign = next((e.name for e in it if e.name not in ("quack", MARKER)), None)
            if foreign is not None:
                raise self._refuse(
                    f"{self.root} is not a quack remote cache: it holds {foreign!r} and no "
                    f"{MARKER} marker. Point the URL at an empty directory (quack marks it "
                    f"on its first write), or mark this one: touch {self.root / MARKER}",
                    "denied",
                )
            if writing:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                try:
                    os.close(os.open(MARKER, flags, 0o644, dir_fd=fd))
                except FileExistsError:
                    pass
                except OSError as e:
                    raise self._err(e, f"marking {self.root} as a quack store") from None
                self._store_ok = 2
            else:
                self._store_ok = max(self._store_ok, 1)
        elif not stat.S_ISREG(st.st_mode):
            raise self._refuse(
                f"{self.root / MARKER} is {_kind(st.st_mode)}, not quack's marker file", "denied"
            )
        else:
            self._store_ok = 2

    def _walk(self, root_fd: int, dirs: list[str], *, create: bool) -> int | None:
        """A descriptor of the object's directory, opened component by component with
        O_NOFOLLOW (quack.cache.openat: a symlinked directory is refused, never followed);
        None if a component is missing and ``create`` is false."""

        def refuse(i: int, parent: int, _e: OSError) -> RemoteError:
            st = os.stat(dirs[i], dir_fd=parent, follow_symlinks=False)
            here = self.root.joinpath(*dirs[: i + 1])
            return self._refuse(f"{here} is {_kind(st.st_mode)}, not a directory; refused")

        return openat.walk_dirs(root_fd, dirs, refuse=refuse, create=create, missing_ok=not create)

    # -- the operations (on the daemon thread) ------------------------------------------------
    def _get(self, parts: list[str]) -> bytes | None:
        return self._in_dir(parts, self._read_at)

    def _in_dir(self, parts: list[str], read: Callable[[int, str, Path], _T]) -> _T | None:
        """``read(dir fd, leaf, path)`` in the object's directory, opened without following
        links; None when the directory is not there (nothing was ever stored under it)."""
        p = self.root.joinpath(*parts)
        dfd = self._dir_fd(parts, create=False, doing="reading")
        if dfd is None:
            return None
        try:
            return read(dfd, parts[-1], p)
        finally:
            os.close(dfd)

    def _dir_fd(self, parts: list[str], *, create: bool, doing: str) -> int | None:
        """The object's directory, opened (``create``: made) without following links; None
        when it is not there and not ``create``. RemoteError naming ``doing`` the object."""
        root_fd = self._open_root(writing=create)
        try:
            return self._walk(root_fd, parts[:-1], create=create)
        except OSError as e:
            p = self.root.joinpath(*parts)
            raise e if isinstance(e, RemoteError) else self._err(e, f"{doing} {p}") from None
        finally:
            os.close(root_fd)

    def _read_at(self, dfd: int, leaf: str, p: Path) -> bytes | None:
        """The object ``leaf`` of the open directory ``dfd`` (``p`` its path, for messages)."""
        try:
            try:
                st = os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return None
            if not stat.S_ISREG(st.st_mode):
                raise self._refuse(f"{p} is {_kind(st.st_mode)}, not a regular file; refused")
            # O_NONBLOCK: should a FIFO be swapped in after the lstat, open returns at once.
            fd = os.open(leaf, openat.FILE_FLAGS, dir_fd=dfd)
            try:
                return openat.read_regular(
                    fd,
                    self.max_bytes,
                    not_regular=lambda mode: self._refuse(
                        f"{p} is {_kind(mode)}, not a regular file; refused"
                    ),
                    too_large=lambda size: too_large(self.url, str(p), size, self.max_bytes),
                )
            finally:
                os.close(fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise self._refuse(f"{p} is a symbolic link; refused") from None
            raise e if isinstance(e, RemoteError) else self._err(e, f"reading {p}") from None

    def _tag_at(self, dfd: int, leaf: str, p: Path) -> Current | None:
        try:
            v = self._read_at(dfd, leaf, p)
        except RemoteError as e:
            if e.reason == "size":
                return Current(None, OVER_CAP)
            raise
        return None if v is None else Current(v, hashlib.sha256(v).hexdigest())

    def _get_current(self, parts: list[str]) -> Current | None:
        return self._in_dir(parts, self._tag_at)

    def _write_temp(self, dfd: int, leaf: str, data: bytes) -> str:
        """A private temp file next to ``leaf`` holding ``data``, fsynced; its name."""
        tmp = f".{leaf}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd
        )
        try:
            # In a group-shared store (its directories g+w) the group must read every
            # object; a writer's umask 077 made them 0600, readable by that writer only.
            if os.fstat(dfd).st_mode & stat.S_IWGRP:
                os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) | stat.S_IRGRP)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise
        os.close(fd)
        return tmp

    def _put(self, parts: list[str], data: bytes) -> bool:
        p = self.root.joinpath(*parts)
        dfd = self._dir_fd(parts, create=True, doing="writing")
        assert dfd is not None  # create=True never answers None
        leaf = parts[-1]
        try:
            try:
                os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
                return False
            except FileNotFoundError:
                pass
            tmp = self._write_temp(dfd, leaf, data)
            try:
                return _link_new(dfd, tmp, leaf)
            finally:
                _drop(dfd, tmp)
        except OSError as e:
            raise e if isinstance(e, RemoteError) else self._err(e, f"writing {p}") from None
        finally:
            os.close(dfd)

    def _replace(self, parts: list[str], data: bytes, tag: str, stop: threading.Event) -> bool:
        p = self.root.joinpath(*parts)
        dfd = self._dir_fd(parts, create=True, doing="replacing")
        assert dfd is not None  # create=True never answers None
        leaf = parts[-1]
        try:
            tmp = self._write_temp(dfd, leaf, data)  # before the lock: held for a read and a rename
            try:
                lock = self._open_lock(dfd, p.parent / REPLACE_LOCK)
                try:
                    if not _flock_until(lock, stop) or stop.is_set():  # released by close
                        return False  # the caller timed out and reported so: nothing is done
                    cur = self._tag_at(dfd, leaf, p)
                    if cur is None:  # gone in between: first writer wins, as ever
                        return _link_new(dfd, tmp, leaf)
                    if cur.tag != tag:
                        return False  # another object there now: left as it is
                    os.rename(tmp, leaf, src_dir_fd=dfd, dst_dir_fd=dfd)
                    return True
                finally:
                    os.close(lock)
            finally:
                _drop(dfd, tmp)
        except OSError as e:
            raise e if isinstance(e, RemoteError) else self._err(e, f"replacing {p}") from None
        finally:
            os.close(dfd)

    def _open_lock(self, dfd: int, path: Path) -> int:
        """The directory's replace lock file, opened (made if missing; group-readable in a
        group-shared store, so every member can lock it). Anything but a regular file
        there is refused: O_NOFOLLOW, O_NONBLOCK, then fstat."""
        flags = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(REPLACE_LOCK, flags, 0o644, dir_fd=dfd)
        except OSError as e:
            if e.errno in openat.LINK_ERRNOS or e.errno == errno.EISDIR:
                raise self._refuse(f"{path} is not a regular file; refused") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._refuse(f"{path} is {_kind(st.st_mode)}, not a regular file; refused")
            if (
                os.fstat(dfd).st_mode & stat.S_IWGRP
                and not st.st_mode & stat.S_IRGRP
                and st.st_uid == os.geteuid()
            ):
                os.fchmod(fd, stat.S_IMODE(st.st_mode) | stat.S_IRGRP)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _exists(self, parts: list[str]) -> bool:
        p = self.root.joinpath(*parts)
        root_fd = self._open_root(writing=False)
        try:
            dfd = self._walk(root_fd, parts[:-1], create=False)
        except OSError as e:
            raise e if isinstance(e, RemoteError) else self._err(e, f"looking up {p}") from None
        finally:
            os.close(root_fd)
        if dfd is None:
            return False
        try:
            os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            raise self._err(e, f"looking up {p}") from None
        finally:
            os.close(dfd)


def _link_new(dfd: int, tmp: str, leaf: str) -> bool:
    """``tmp`` linked in as ``leaf`` of the directory ``dfd``, unless a file is there
    already (the first writer wins): True if it was."""
    try:
        os.link(tmp, leaf, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
    except FileExistsError:
        return False
    return True


def _drop(dfd: int, tmp: str) -> None:
    """The temp file ``tmp`` of the directory ``dfd`` removed, if still there."""
    try:
        os.unlink(tmp, dir_fd=dfd)
    except FileNotFoundError:
        pass
