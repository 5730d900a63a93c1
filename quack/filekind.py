"""What a path that should have been a regular file (or a directory) is, in words, for
the errors that refuse it: "... is a FIFO, not a key file". One table for every such
message (the TOML reader, the CLI's path checks, bundle inspect, key files, the file://
remote), which had grown four wordings of it."""

from __future__ import annotations

import stat

__all__ = ["describe"]

_KINDS = {
    stat.S_IFREG: "a file",
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFLNK: "a symbolic link",
}


def describe(mode: int) -> str:
    """``st_mode`` in words with its article ("a FIFO", "a directory", "a file"...)."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")
