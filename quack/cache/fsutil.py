"""Small, careful filesystem helpers: private directories, no-follow reads,
atomic writes (temp beside the target, fsync, os.replace, fsync the dir)."""

from __future__ import annotations

import errno
import os
import select
import stat
import time
import uuid
from pathlib import Path
from typing import BinaryIO, Iterable

from quack.errors import CacheError

TMP_MARK = ".tmp-"


# Why a cache directory can't be reached or read, in the words of an error message.
_REACH_REASONS = {
    errno.ENOTDIR: "not a directory",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ELOOP: "too many levels of symbolic links",
    errno.ENAMETOOLONG: "file name too long",
}


def reach_error(root: Path, e: OSError) -> CacheError:
    """The CacheError for a cache directory that can't be reached or read: a component
    of its path is a file (ENOTDIR), a directory on the way has no permission (EACCES).
    Names the root, the reason and the path at fault. Without it these escaped the CLI
    as a NotADirectoryError / PermissionError traceback."""
    if isinstance(e, CacheError):
        return e
    reason = _REACH_REASONS.get(e.errno or 0) or e.strerror or str(e)
    at = os.fspath(e.filename) if e.filename is not None else os.fspath(root)
    hint = "use a cache directory you can read and write"
    if e.errno == errno.ENOTDIR:
        # The file in the way (the path's first component that exists and is not a
        # directory): what the user has to move or rename.
        for p in (*reversed(Path(at).parents), Path(at)):
            if os.path.lexists(p) and not os.path.isdir(p):
                at = f"{p} is {'a file' if os.path.isfile(p) else 'not a directory'}"
                break
    elif e.errno in (errno.EACCES, errno.EPERM):
        hint = f"give yourself access to it and the directories above it (chmod u+rwx), or {hint}"
    where = f" ({at})" if at != os.fspath(root) else ""
    return CacheError(f"cache directory {root}: {reason}{where}; {hint}", path=os.fspath(root))


def check_root(root: Path) -> None:
    """Refuse a cache root that is a symlink, not ours, open to others, or
    inside a directory others can write without the sticky bit; or one that can't
    be reached (a file on its path, no permission): CacheError (``reach_error``)."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise reach_error(root, e) from None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise CacheError(
                f"cache directory {root} is a symbolic link; quack refuses to follow it. "
                f"Point QUACK_CACHE_DIR at a real directory you own.",
                path=str(root),
            )
        if not stat.S_ISDIR(st.st_mode):
            raise CacheError(f"cache directory {root} exists and is not a directory", path=str(root))
        if st.st_uid != os.getuid():
            raise CacheError(
                f"cache directory {root} is owned by uid {st.st_uid}, not you "
                f"(uid {os.getuid()}); use a cache directory of your own (QUACK_CACHE_DIR)",
                path=str(root),
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CacheError(
                f"cache directory {root} is writable by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):o}); fix it with: chmod 700 {root}",
                path=str(root),
            )
    for parent in root.absolute().parents:
        try:
            pst = os.stat(parent)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise reach_error(root, e) from None
        if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
            raise CacheError(
                f"cache directory {root} lies inside {parent}, which anyone can write "
                f"(mode {stat.S_IMODE(pst.st_mode):o}, no sticky bit); others could swap "
                f"its files. Move the cache (QUACK_CACHE_DIR) or chmod o-w {parent}",
                path=str(root),
            )


def under_root(path: Path, root: Path) -> Path:
    """``path`` if it lies strictly inside ``root`` (lexically: no '..', no NUL);
    else CacheError. Every path the store builds goes through this."""
    sp, sr = os.fspath(path), os.fspath(root)
    if "\0" in sp:
        raise CacheError(f"refusing a cache path with a NUL byte: {sp!r}", path=sr)
    try:
        rel = Path(sp).relative_to(sr)
    except ValueError:
        rel = None
    if rel is None or not rel.parts or ".." in rel.parts:
        raise CacheError(f"refusing a path outside the cache directory {sr}: {sp!r}", path=sr)
    return path


def check_tree(path: Path, root: Path) -> bool:
    """lstat every component from ``root`` down to ``path`` (a directory):
    True if all exist as real directories, False if one is missing; CacheError
    if one is a symlink or not a directory (someone planted it: refuse), or can't be
    reached (no permission on the way: ``reach_error``, whose ``path`` is the root)."""
    parts = () if path == root else Path(under_root(path, root)).relative_to(root).parts
    cur = root
    for part in (None, *parts):
        if part is not None:
            cur = cur / part
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise reach_error(root, e) from None
        if stat.S_ISLNK(st.st_mode):
            # The remedy before the (long) path: a one-line summary cut at its end keeps it.
            raise CacheError(
                f"a symbolic link in the cache (planted; quack refuses to follow it: run "
                f"quack cache clean, or rm it): {cur}",
                path=str(cur),
            )
        if not stat.S_ISDIR(st.st_mode):
            raise CacheError(
                f"not a directory where the cache needs one (planted; refusing to use it: "
                f"run quack cache clean, or rm it): {cur}",
                path=str(cur),
            )
    return True


def ensure_dir(path: Path, root: Path) -> Path:
    """Create ``path`` (under ``root``) with mode 0700, refusing symlinked components."""
    rel = Path(path).relative_to(root) if path != root else Path()
    if path != root:
        under_root(path, root)
    cur = root
    if not os.path.lexists(root):
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CacheError(
            f"cache directory {root} is a symbolic link or not a directory; "
            f"quack refuses to follow it. Point QUACK_CACHE_DIR at a real directory you own.",
            path=str(root),
        )
    for part in rel.parts:
        cur = cur / part
        try:
            os.mkdir(cur, 0o700)
        except FileExistsError:
            st = os.lstat(cur)
            if not stat.S_ISDIR(st.st_mode):
                raise CacheError(
                    f"{cur} in the cache is not a directory (a symlink or file); "
                    f"refusing to use it. Remove it or run quack cache clean.",
                    path=str(cur),
                ) from None
    return path


def read_nofollow(path: Path) -> bytes:
    """Read a regular file without following a symlink at the last component.
    Anything else (a FIFO, a device, a socket) raises OSError "not a regular file"."""
    # O_NONBLOCK: opening a FIFO planted in the cache would otherwise wait for a writer
    # forever (the runtime, quack build and quack verify all hung on one); with it the
    # open returns at once and the S_ISREG check below refuses it. O_NOCTTY: a terminal
    # device planted there must not become our controlling terminal.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def open_regular(path: Path) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file, never blocking nor
    following a link: lstat first (a device is never opened), then O_NOFOLLOW (a link
    swapped in is ELOOP) and O_NONBLOCK (a FIFO swapped in opens at once instead of
    waiting for a writer for ever), and fstat again. Anything but a regular file is
    OSError(EINVAL). For the cache root's own files, where one may have been planted (the
    journal, the remote stats): a FIFO there hung `quack cache stats` and `prewarm`."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_lines_regular(path: Path, what: str, once_key: str, *, lost: str = "was not read") -> list[bytes]:
    """The lines of one of the cache root's own files (``open_regular``). Missing: no
    lines. Unreadable or not a regular file (planted): no lines and one warning per
    process (``once_key``) naming ``what``, never a crash and never a wait."""
    from quack.cache.problems import warn_once

    try:
        with open_regular(path) as f:
            return f.readlines()
    except FileNotFoundError:
        return []
    except OSError as e:
        if e.errno == errno.EINVAL:
            why = "it is not a regular file (planted); `quack cache clean` removes it, or rm it"
        else:
            why = f"{e.strerror or e}; check its permissions"
        warn_once(once_key, f"quack: {what} {path} {lost}: {why}")
        return []


def append_regular(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` (created 0600 if absent) in one write, only if it is a
    regular file. O_APPEND: whole writes land at the end even with several writers.
    O_NONBLOCK: a FIFO planted there fails to open (ENXIO) instead of blocking the
    process's exit until some reader comes; O_NOFOLLOW: never through a link. Anything
    but a regular file is OSError(EINVAL). For the cache root's journal and remote stats,
    appended at every process's exit."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.write(fd, data)
    finally:
        os.close(fd)


def tmp_beside(target: Path) -> Path:
    """A fresh temp name beside ``target``: ``<name>.tmp-<pid>-<rand>`` (the pid lets a
    sweep tell a live writer's file from a dead one's)."""
    return target.with_name(f"{target.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def reserve_tmp(target: Path) -> Path:
    """Create (O_EXCL, no-follow, 0600) and return an empty temp file beside ``target``,
    so a tool that later opens it by name (cutlass's export) writes our own regular
    file, never something planted there."""
    for _ in range(16):
        tmp = tmp_beside(target)
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600
            )
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise OSError(errno.EEXIST, "could not reserve a temp file", str(target))


def tmp_owner_pid(name: str) -> int | None:
    """The writer pid encoded in a temp file's name, or None if it isn't one of ours."""
    _, mark, rest = name.rpartition(TMP_MARK)
    if not mark:
        return None
    pid, _, rand = rest.partition("-")
    return int(pid) if pid.isdigit() and rand else None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` may still write: False once it is gone or a zombie (or dying: it
    runs no more user code). A zombie answers ``kill(pid, 0)``: counted alive, a killed
    compile worker whose parent had not reaped it yet kept its temp files from the
    sweep of the build that had just killed it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else: its state still tells a zombie
    except OSError:
        return True  # can't tell: assume alive, so its files are left alone
    return process_state(pid) not in ("Z", "X", "x")


def wait_gone(pids: Iterable[int], timeout: float) -> set[int]:
    """Wait at most ``timeout`` seconds for each of ``pids`` (processes that were sent
    SIGKILL) to be gone (ended, or a zombie: its files are closed); returns the ones
    still alive then. Woken by each process's exit through a pidfd where the kernel has
    them (Linux 5.3), else by a short poll: they need not be our children, so there is
    no waitpid (a forkserver's workers are its children)."""
    deadline = time.monotonic() + timeout
    left = {pid for pid in pids if pid_alive(pid)}
    for pid in sorted(left):
        try:
            fd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            fd = None
        try:
            while pid_alive(pid):
                rest = deadline - time.monotonic()
                if rest <= 0:
                    break
                if fd is not None:
                    select.select([fd], [], [], min(rest, 0.1))  # readable once it exited
                else:
                    time.sleep(min(rest, 0.01))
        finally:
            if fd is not None:
                os.close(fd)
    return {pid for pid in left if pid_alive(pid)}


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` from ``/proc/<pid>/stat`` ("R", "S", "Z" for a
    zombie, ...), or None where there is no procfs or no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ...": comm may hold spaces and parentheses, so split after the last ")"
    _, paren, rest = stat.rpartition(b")")
    fields = rest.split()
    return fields[0].decode("ascii", "replace") if paren and fields else None


def remove_tree(path: Path) -> int:
    """Remove the directory ``path`` (one planted where the cache has a file) and all it
    holds, following no symbolic link: one inside is unlinked, one at ``path`` itself
    refused (shutil.rmtree's descriptor-based walk). Returns the bytes it held. Raises
    NotADirectoryError when ``path`` is not a directory (no longer: replaced meanwhile),
    OSError where this platform's rmtree could follow links, or its failure."""
    import shutil

    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    if not shutil.rmtree.avoids_symlink_attacks:
        raise OSError(errno.EPERM, "not removed: this platform's rmtree may follow links", str(path))
    size = tree_bytes(path)
    shutil.rmtree(path)
    return size


def tree_bytes(path: Path) -> int:
    """The bytes of what the directory ``path`` holds (lstat: links not followed)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):  # never into a linked directory
        for name in dirnames + filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(
        path, os.O_RDONLY | os.O_NOFOLLOW | (os.O_DIRECTORY if directory else 0) | getattr(os, "O_CLOEXEC", 0)
    )
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(target: Path, data: bytes, *, fsync: bool = True) -> None:
    """Temp file beside the target, fsync, os.replace, fsync the directory.
    On any error the temp file is removed and the target is untouched."""
    tmp = tmp_beside(target)
    # Nothing to clean up if the temp file can't be created (a directory missing, or a
    # file where one is needed: unlinking it then raised a second, chained error).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        # Whatever failed (a full disk, the target a directory: os.replace's
        # IsADirectoryError), the temp goes and the original error is the one raised;
        # a failing unlink must not replace it.
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        fsync_path(target.parent, directory=True)


def publish_file(tmp: Path, target: Path, *, fsync: bool = True) -> None:
    """Move an already-written temp file into place atomically (fsync it first)."""
    fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise OSError(errno.EINVAL, "temp file is not a private regular file", str(tmp))
        if fsync:
            os.fsync(fd)
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    os.replace(tmp, target)
    if fsync:
        fsync_path(target.parent, directory=True)
