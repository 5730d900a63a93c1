"""Preloaded into compile workers ([build] preload) by tests/test_pool_unstored.py: the
cache's disk is full for them, so a worker's publish fails with a CacheWriteError (the
store's temp file is the first thing a publish writes), while the calling process still
sees a writable cache."""

import errno

from quack.cache.problems import write_error
from quack.cache.store import DiskStore


def _full(self, ref):
    raise write_error(
        OSError(errno.ENOSPC, "No space left on device", str(self.root)), self.root, "creating a temp file"
    )


DiskStore.tmp_obj = _full  # type: ignore[method-assign]
