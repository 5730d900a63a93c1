"""Reading a file of an installed bundle without leaving its package directory.

A bundle's files are read by a walk of ``openat`` calls from the package directory:
every directory on the way is opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to
the one before it, the file itself with ``O_NOFOLLOW | O_NONBLOCK`` and must be a
regular file no larger than the caller's cap (checked with ``fstat`` before a byte is
read). Issue 30: ``v1/`` replaced by a symlink to a folder outside the bundle was
followed (only the last component was opened with ``O_NOFOLLOW``), and a FIFO would
block ``open`` for ever. Paths given here are the index's rebuilt, validated ones."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from quack.errors import BundleError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
CHUNK = 1 << 20


def _refused(err: OSError, where: Path) -> BundleError | OSError:
    # O_NOFOLLOW on a symlink gives ELOOP (ENOTDIR with O_DIRECTORY on some systems):
    # a planted link, said plainly rather than as "too many levels of symbolic links".
    if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return BundleError(
            f"{where} is a symbolic link or not a directory; a bundle's files are read only "
            f"inside its package directory, never through a link",
            path=str(where),
        )
    return err


def open_root(root: Path) -> int:
    """A descriptor of the package directory itself, refusing a symlink there."""
    try:
        return os.open(root, _DIR_FLAGS)
    except OSError as e:
        raise _refused(e, root) from None


def read_under(root: Path, rel: str, cap: int) -> bytes:
    """The bytes of ``root/rel``: a regular file of at most ``cap`` bytes reached with no
    symlink on the way. BundleError for a link, a non-regular or an oversized file;
    OSError (FileNotFoundError, ...) for the rest."""
    parts = rel.split("/")
    if not parts or any(p in ("", ".", "..") for p in parts):
        raise BundleError(f"refusing bundle path {rel!r}", path=str(root))
    fds = [open_root(root)]
    try:
        where = root
        for part in parts[:-1]:
            where = where / part
            try:
                fds.append(os.open(part, _DIR_FLAGS, dir_fd=fds[-1]))
            except OSError as e:
                raise _refused(e, where) from None
        where = where / parts[-1]
        try:
            fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=fds[-1])
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _refused(e, where) from None
            raise
        fds.append(fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BundleError(f"{where} is not a regular file", path=str(where))
        if st.st_size > cap:
            raise BundleError(
                f"{where} is {st.st_size} bytes, more than the {cap} a bundle allows (refused unread)",
                path=str(where),
            )
        chunks, total = [], 0
        while total <= cap:  # a file growing while read is cut at cap + 1: refused below
            b = os.read(fd, min(CHUNK, cap + 1 - total))
            if not b:
                break
            chunks.append(b)
            total += len(b)
        if total > cap:
            raise BundleError(f"{where} grew past {cap} bytes while read", path=str(where))
        return b"".join(chunks)
    finally:
        for fd in reversed(fds):
            os.close(fd)
