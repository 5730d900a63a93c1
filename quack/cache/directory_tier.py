"""A read-only tier backed by another cache directory (a team's shared, read-only
cache on NFS, a cache baked into a container image): the smallest real
``ReadTier``, and the model for the bundle and remote tiers."""

from __future__ import annotations

import hashlib
from pathlib import Path

from quack.cache import fsutil
from quack.cache.contract import CORRUPT, Fetched
from quack.cache.entry import EntryRef
from quack.cache.problems import warn_once
from quack.cache.store import DiskStore
from quack.errors import CacheError


class DirectoryTier:
    """Serves verified objects from the cache at ``root`` without writing to it."""

    def __init__(self, root: Path, *, name: str = "directory"):
        self.name = name
        self.store = DiskStore(root)

    def fetch(self, ref: EntryRef) -> Fetched | None:
        try:
            found = self.store.inspect(ref)
            if found.status == CORRUPT:
                warn_once(
                    f"{self.name}:{self.store.root}:{ref.key}",
                    f"quack: {self.name} cache {self.store.root}: entry {ref.kernel} key "
                    f"{ref.key[:16]} is corrupt ({found.problem}); not using it",
                )
                return None
            if not found.ok:
                return None
            data = fsutil.read_nofollow(found.obj)
        except (CacheError, OSError) as e:
            warn_once(
                f"{self.name}:{self.store.root}",
                f"quack: {self.name} cache {self.store.root} is unusable ({e}); looking up without it",
            )
            return None
        # Read again after the check: what is handed over is what matches the record.
        if hashlib.sha256(data).hexdigest() != found.meta.get("sha256"):
            return None  # replaced between the check and the read: a miss
        return Fetched(ref, data, dict(found.meta), f"{self.name}:{self.store.root}")
