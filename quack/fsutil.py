"""Small, careful filesystem helpers: private directories, no-follow reads,
atomic writes (temp beside the target, fsync, os.replace, fsync the dir)."""
from __future__ import annotations

import errno
import os
import stat
import uuid
from pathlib import Path

from quack.errors import CacheError

TMP_MARK = ".tmp-"


def check_root(root: Path) -> None:
    """Refuse a cache root that is a symlink, not ours, open to others, or
    inside a directory others can write without the sticky bit."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        st = None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise CacheError(f"cache directory {root} is a symbolic link; quack refuses to follow it. "
                             f"Point QUACK_CACHE_DIR at a real directory you own.", path=str(root))
        if not stat.S_ISDIR(st.st_mode):
            raise CacheError(f"cache directory {root} exists and is not a directory", path=str(root))
        if st.st_uid != os.getuid():
            raise CacheError(f"cache directory {root} is owned by uid {st.st_uid}, not you "
                             f"(uid {os.getuid()}); use a cache directory of your own (QUACK_CACHE_DIR)",
                             path=str(root))
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CacheError(f"cache directory {root} is writable by group or others "
                             f"(mode {stat.S_IMODE(st.st_mode):o}); fix it with: chmod 700 {root}",
                             path=str(root))
    for parent in root.absolute().parents:
        try:
            pst = os.stat(parent)
        except FileNotFoundError:
            continue
        if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
            raise CacheError(f"cache directory {root} lies inside {parent}, which anyone can write "
                             f"(mode {stat.S_IMODE(pst.st_mode):o}, no sticky bit); others could swap "
                             f"its files. Move the cache (QUACK_CACHE_DIR) or chmod o-w {parent}",
                             path=str(root))


def ensure_dir(path: Path, root: Path) -> Path:
    """Create ``path`` (under ``root``) with mode 0700, refusing symlinked components."""
    rel = path.relative_to(root)
    cur = root
    if not root.exists():
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    for part in rel.parts:
        cur = cur / part
        try:
            os.mkdir(cur, 0o700)
        except FileExistsError:
            st = os.lstat(cur)
            if not stat.S_ISDIR(st.st_mode):
                raise CacheError(f"{cur} in the cache is not a directory (a symlink or file); "
                                 f"refusing to use it. Remove it or run quack cache clean.",
                                 path=str(cur)) from None
    return path


def read_nofollow(path: Path) -> bytes:
    """Read a regular file without following a symlink at the last component."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
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


def tmp_beside(target: Path) -> Path:
    return target.with_name(f"{target.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, (os.O_RDONLY | (os.O_DIRECTORY if directory else 0)))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(target: Path, data: bytes, *, fsync: bool = True) -> None:
    """Temp file beside the target, fsync, os.replace, fsync the directory.
    On any error the temp file is removed and the target is untouched."""
    tmp = tmp_beside(target)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
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
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if fsync:
        fsync_path(target.parent, directory=True)


def publish_file(tmp: Path, target: Path, *, fsync: bool = True) -> None:
    """Move an already-written temp file into place atomically."""
    st = os.lstat(tmp)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "temp file is not a regular file", str(tmp))
    if fsync:
        fsync_path(tmp)
    os.chmod(tmp, 0o600)
    os.replace(tmp, target)
    if fsync:
        fsync_path(target.parent, directory=True)
