"""Publishing what a remote worker compiled: the coordinator is the cache's only writer.

A remote worker returns the object's bytes with its size, SHA-256, key, source
fingerprint and toolchain stamp; this checks all of them against the coordinator's
own and publishes through the store's normal atomic publish (temp file, rename,
metadata last) under the key's lock."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from quack.errors import ExecutorError
from quack_build.executors import WorkItem


def check_result(ref, item: WorkItem, res: dict) -> str:
    """What is wrong with ``res`` for the entry ``ref`` ("" when nothing)."""
    data = res.get("obj") or b""
    if res.get("key") != item.key:
        return f"it computed key {str(res.get('key'))[:16]}, the coordinator {item.key[:16]}"
    if res.get("srcfp") != ref.srcfp:
        return f"it compiled sources with fingerprint {res.get('srcfp')}, this checkout has {ref.srcfp}"
    if res.get("stamp") != ref.stamp:
        return f"its toolchain stamp is {res.get('stamp')!r}, the coordinator's {ref.stamp!r}"
    if len(data) != res.get("size"):
        return f"received {len(data)} bytes, it sent {res.get('size')} (truncated in transit)"
    if hashlib.sha256(data).hexdigest() != res.get("sha256"):
        return "the object's SHA-256 does not match what it sent (corrupted in transit)"
    return ""


def publish_result(
    store, item: WorkItem, res: dict, *, worker: str, executor: str = "ray", address: str = ""
) -> bool:
    """Check ``res`` (key, srcfp, stamp, obj, size, sha256, compile_s, host, pid; optionally
    so + so_sha256, the .so the worker linked) and publish it into ``store``. True if
    published here; False if another process published the key first.

    Raises ExecutorError for a result that does not match (nothing is published), and
    what the Store raises (CacheError, CacheWriteError, LockTimeout)."""
    from quack.cache import fsutil
    from quack.compile import builder
    from quack.runtime import loader

    ref = builder.entry_ref(item.spec, item.bound, item.arch)
    problem = check_result(ref, item, res)
    if problem:
        raise ExecutorError(
            f"refusing the object for {item.kernel} key {item.key[:16]} from {worker}: "
            f"{problem}; nothing was published",
            executor=executor,
            address=address,
        )
    if not item.force and store.lookup(ref) is not None:
        return False
    with store.lock(ref):
        if not item.force and store.lookup(ref) is not None:
            return False
        tmp = store.tmp_obj(ref)
        try:
            write_into(tmp, res["obj"])
            meta = {
                "params": item.params,
                "compile_s": res.get("compile_s", 0.0),
                "host": res.get("host", ""),
                "pid": res.get("pid", 0),
                "created": time.time(),
                "executor": executor,
            }
            entry = store.publish(ref, tmp, meta)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        so = res.get("so")
        if so is not None and hashlib.sha256(so).hexdigest() == res.get("so_sha256"):
            tmp_so = fsutil.reserve_tmp(store.paths(ref)["so"])
            try:
                write_into(tmp_so, so)
                store.write_so(entry, tmp_so)
            except OSError:
                pass  # a derived file: the loader links the .o on first use
            finally:
                if os.path.lexists(tmp_so):
                    os.unlink(tmp_so)
        else:
            loader.link_entry(store, entry)
    return True


def write_into(tmp: Path, data: bytes) -> None:
    """Fill a temp file the store reserved (O_EXCL, ours): no symlink is followed."""
    fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
