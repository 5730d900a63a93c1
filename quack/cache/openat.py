"""Reading under a directory that someone else may have planted things in, never leaving it:
an ``openat`` walk. Every directory on the way is opened relative to the one before it
with ``O_NOFOLLOW | O_DIRECTORY``, the file itself with ``O_NOFOLLOW | O_NONBLOCK`` and
read only when ``fstat`` says it is a regular file within the caller's cap, with a read
bounded by that cap. Issue 30 found both failures this guards against, in the two places
that share it: an installed bundle (quack/bundles/files.py), where ``v1/`` replaced by a
symlink to a folder outside was followed, and the ``file://`` remote cache
(quack/remote/file_backend.py), where a FIFO at an object's name blocked ``open`` for ever.

The callers own their messages: each failure is handed to a callback that builds the
exception the caller raises (a BundleError, a RemoteError)."""

from __future__ import annotations

import errno
import os
import stat
from typing import Callable, Sequence

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK on a directory is harmless, and a FIFO swapped in for one opens at once
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
CHUNK = 1 << 20
# What O_NOFOLLOW | O_DIRECTORY gives for a symlink or a non-directory (ENOTDIR on some
# systems, EMLINK on some BSDs): a planted link, not a missing or unreadable directory.
LINK_ERRNOS = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)


def walk_dirs(
    root_fd: int,
    parts: Sequence[str],
    *,
    refuse: Callable[[int, int, OSError], BaseException],
    create: bool = False,
    missing_ok: bool = False,
) -> int | None:
    """A new descriptor of ``root_fd/parts...``, opened component by component with
    O_NOFOLLOW. A component that is a link or not a directory raises
    ``refuse(i, parent_fd, err)`` (``i`` its index in ``parts``, ``parent_fd`` the
    directory it is in, open until the call returns); ``create`` makes missing
    directories (mode 0o777, the umask applies, then the parent's group bits are added:
    a group-shared tree stays shared); with ``missing_ok`` a missing component gives
    None, else its FileNotFoundError propagates. The caller closes the descriptor;
    ``root_fd`` is kept."""
    fd = os.dup(root_fd)
    try:
        for i, part in enumerate(parts):
            made = False
            if create:
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                    made = True
                except FileExistsError:
                    pass
            try:
                nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if create or not missing_ok:
                    raise
                os.close(fd)
                return None
            except OSError as e:
                if e.errno not in LINK_ERRNOS:
                    raise
                raise refuse(i, fd, e) from None
            if made:
                _share_like_parent(fd, nfd)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _share_like_parent(parent_fd: int, fd: int) -> None:
    """Give a directory just made the group permissions of its parent, whatever the umask.
    A store shared through a group (``chmod 2775 DIR``, as docs/remote-cache.md says)
    got directories narrowed by its first writer's umask (drwxr-sr-x): every other member
    of the group was then denied and stopped pushing. A private parent (the local cache's
    0700 directories) has no group bits, so nothing is widened there."""
    group = stat.S_IMODE(os.fstat(parent_fd).st_mode) & stat.S_IRWXG
    mode = stat.S_IMODE(os.fstat(fd).st_mode)  # keeps the set-group-ID bit mkdir inherited
    if group & ~mode:
        os.fchmod(fd, mode | group)


def read_regular(
    fd: int,
    cap: int,
    *,
    not_regular: Callable[[int], BaseException],
    too_large: Callable[[int | None], BaseException],
) -> bytes:
    """The bytes of the open file ``fd``: ``not_regular(st_mode)`` is raised for anything
    but a regular file, ``too_large(size)`` for one over ``cap`` bytes before a byte is
    read, and ``too_large(None)`` for one that grew past ``cap`` while read (the read
    stops at cap + 1)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(st.st_mode)
    if st.st_size > cap:
        raise too_large(st.st_size)
    chunks, total = [], 0
    while total <= cap:
        b = os.read(fd, min(CHUNK, cap + 1 - total))
        if not b:
            break
        chunks.append(b)
        total += len(b)
    if total > cap:
        raise too_large(None)
    return b"".join(chunks)
