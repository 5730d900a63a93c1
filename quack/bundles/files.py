"""Reading a file of an installed bundle without leaving its package directory: the
``openat`` walk of quack.cache.openat from the package directory (every directory on the
way opened with ``O_NOFOLLOW | O_DIRECTORY``, the file with ``O_NOFOLLOW | O_NONBLOCK``,
a regular file no larger than the caller's cap, checked before a byte is read). Issue 30:
``v1/`` replaced by a symlink to a folder outside the bundle was followed (only the last
component was opened with ``O_NOFOLLOW``), and a FIFO would block ``open`` for ever.
Paths given here are the index's rebuilt, validated ones."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from quack.cache import openat
from quack.errors import BundleError


def _refused(err: OSError, where: Path) -> BundleError | OSError:
    # O_NOFOLLOW on a symlink gives ELOOP (ENOTDIR with O_DIRECTORY on some systems):
    # a planted link, said plainly rather than as "too many levels of symbolic links".
    if err.errno in openat.LINK_ERRNOS:
        return BundleError(
            f"{where} is a symbolic link or not a directory; a bundle's files are read only "
            f"inside its package directory, never through a link",
            path=str(where),
        )
    return err


def open_root(root: Path) -> int:
    """A descriptor of the package directory itself, refusing a symlink there."""
    try:
        return os.open(root, openat.DIR_FLAGS)
    except OSError as e:
        raise _refused(e, root) from None


def read_under(root: Path, rel: str, cap: int) -> bytes:
    """The bytes of ``root/rel``: a regular file of at most ``cap`` bytes reached with no
    symlink on the way. BundleError for a link, a non-regular or an oversized file;
    OSError (FileNotFoundError, ...) for the rest."""
    parts = rel.split("/")
    if not parts or any(p in ("", ".", "..") for p in parts):
        raise BundleError(f"refusing bundle path {rel!r}", path=str(root))
    root_fd = open_root(root)
    try:
        dfd = openat.walk_dirs(
            root_fd, parts[:-1], refuse=lambda i, _parent, e: _refused(e, root.joinpath(*parts[: i + 1]))
        )
    finally:
        os.close(root_fd)
    assert dfd is not None  # without missing_ok, a missing directory raises
    where = root.joinpath(*parts)
    try:
        try:
            fd = os.open(parts[-1], openat.FILE_FLAGS, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _refused(e, where) from None
            raise
        try:
            return openat.read_regular(
                fd,
                cap,
                not_regular=lambda _mode: BundleError(f"{where} is not a regular file", path=str(where)),
                too_large=lambda size: BundleError(
                    f"{where} is {size} bytes, more than the {cap} a bundle allows (refused unread)"
                    if size is not None
                    else f"{where} grew past {cap} bytes while read",
                    path=str(where),
                ),
            )
        finally:
            os.close(fd)
    finally:
        os.close(dfd)
