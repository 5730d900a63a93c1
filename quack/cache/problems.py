"""How a cache problem reaches the user: a failed write becomes one CacheWriteError
naming the cache directory, the reason and the remedy (``write_error``); a problem a
lookup absorbs as a miss becomes ONE CacheWarning per process per tag (``warn_once``).
"""

from __future__ import annotations

import errno
import warnings
from pathlib import Path

from quack.errors import CacheWarning, CacheWriteError

_WRITE_REASONS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def write_reason(code: int | None) -> str | None:
    """What errno ``code`` says of the cache's disk ("disk full", "read-only file system",
    ...), or None when it is no refused write (then the failure is not the cache's)."""
    return _WRITE_REASONS.get(code or 0)


def write_error(e: OSError, root: Path, what: str) -> CacheWriteError:
    """A clear error for a failed cache write, naming the cache directory."""
    if isinstance(e, CacheWriteError):
        return e
    code = getattr(e, "errno", None) or 0
    reason = _WRITE_REASONS.get(code) or (e.strerror or str(e))
    hint = {
        errno.ENOSPC: "free some space (quack cache clean --max-size ...) and build again",
        errno.EDQUOT: "free some space (quack cache clean --max-size ...) and build again",
        errno.EROFS: "point QUACK_CACHE_DIR at a writable directory",
        errno.EACCES: "point QUACK_CACHE_DIR at a directory you can write",
        errno.EPERM: "point QUACK_CACHE_DIR at a directory you can write",
    }.get(code, "")
    msg = (
        f"cannot write to the quack cache {root}: {reason} while {what}"
        f" ({getattr(e, 'filename', None) or root}); nothing was published" + (f"; {hint}" if hint else "")
    )
    return CacheWriteError(msg, path=str(root), reason=reason, code=code)


_warned_once: set = set()


def warn_once(tag: str, message: str, stacklevel: int = 3) -> bool:
    """Issue ``message`` as a CacheWarning once per process per ``tag``."""
    if tag in _warned_once:
        return False
    _warned_once.add(tag)
    warnings.warn(message, CacheWarning, stacklevel=stacklevel)
    return True
