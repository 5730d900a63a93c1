"""The pool's claim on a key (quack.compile.claims): the key's lock is taken when the
pool decides to compile it and handed to the worker with the task. Unit tests of the
store's non-blocking claim and of a fork's copies; end to end, a coordinator killed
mid-compile leaves the lock with its worker, which publishes under it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import toykernels
from interrupt_support import wait_for
from reliability_support import NO_TORCH

from quack.cache.store import DiskStore
from quack.compile import builder, claims, external
from quack.errors import CacheError, LockTimeout

SPEC = toykernels.toy_scale.spec


def _ref():
    return builder.entry_ref(SPEC, SPEC.bind(("float32", 32, False), {}), "sm_90a")


def test_a_claim_is_the_key_lock_and_excludes_every_other_holder(cache_dir):
    store, ref = DiskStore(cache_dir), _ref()
    lock = str(store.paths(ref)["lock"])
    fd = store.claim(ref)
    assert fd is not None and external.lock_held(lock)
    try:
        assert store.claim(ref) is None  # a second open file: refused, not queued
        with pytest.raises(LockTimeout):  # the same flock as Store.lock (filelock)
            with store.lock(ref, timeout=0.2):
                raise AssertionError("Store.lock was granted while a claim held the key")
    finally:
        os.close(fd)
    assert not external.lock_held(lock)
    with store.lock(ref, timeout=5):  # and the other way round
        assert store.claim(ref) is None
    fd2 = store.claim(ref)
    assert fd2 is not None
    os.close(fd2)


def test_a_planted_lock_file_is_refused_by_name(cache_dir, tmp_path):
    store, ref = DiskStore(cache_dir), _ref()
    store.claim(ref) and None  # creates the entry directory (and the lock file)
    lock = store.paths(ref)["lock"]
    os.unlink(lock)
    os.symlink(tmp_path / "elsewhere", lock)
    with pytest.raises(CacheError) as ei:
        store.claim(ref)
    assert str(lock) in str(ei.value) and "symbolic link" in str(ei.value)
    assert not (tmp_path / "elsewhere").exists()
    os.unlink(lock)
    os.mkfifo(lock)  # opens at once (O_NONBLOCK), then refused
    with pytest.raises(CacheError) as ei:
        store.claim(ref)
    assert "not a regular file" in str(ei.value)


# Python 3.12 warns on any fork of a process with threads (the xdist worker has some); this
# child runs no Python of theirs: it reports on one descriptor and exits.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_drops_its_copies_of_the_claims(cache_dir):
    """A child forked while a claim is held (a fork-started worker, a DataLoader worker)
    must not keep the key locked for its life: it closes its copies at once."""
    store, ref = DiskStore(cache_dir), _ref()
    fd = claims.track(store.claim(ref))
    r, w = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # the child: report whether it still has the descriptor, then wait
            try:
                os.fstat(fd)
                os.write(w, b"kept")
            except OSError:
                os.write(w, b"gone")
            time.sleep(30)
            os._exit(0)
        try:
            assert os.read(r, 4) == b"gone"
            claims.release(fd)
            # the child is alive, yet the lock is free: only this process held it
            assert not external.lock_held(str(store.paths(ref)["lock"]))
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    finally:
        claims.release(fd)
        os.close(r)
        os.close(w)
    assert claims.held() == 0


_COORDINATOR = r"""
import sys, relkernels
relkernels.rel_copy(55)
print("loaded")
"""

_LOAD = (
    NO_TORCH
    + r"""
import json, relkernels
relkernels.rel_copy(55)
u = relkernels.rel_copy.usage()[0]
print(json.dumps({k: u[k] for k in ("compiles", "waits", "hits")}))
"""
)


def test_coordinator_killed_mid_compile_leaves_the_lock_with_its_worker(tmp_path, tmp_path_factory):
    """The pool's copy of the lock goes once the worker has its own: killing the process
    that asked must neither release the key to a second compile nor lose the object."""
    import json

    from reliability_support import session_objects
    from test_failpaths_runtime import env

    obj = session_objects(tmp_path_factory)["float32"]["path"]
    cache, counter = tmp_path / "cache", tmp_path / "compiles"
    e = env(
        QUACK_CACHE_DIR=cache,
        QUACK_MODE="jit",
        QUACK_TEST_OBJ=obj,
        QUACK_TEST_COUNTER=counter,
        QUACK_TEST_COMPILE_SLEEP=3.0,
        QUACK_COMPILE_JOBS=1,
    )
    p = subprocess.Popen([sys.executable, "-c", _COORDINATOR], env=e, cwd=str(tmp_path))
    try:
        # the worker is inside the compile (it writes its line, then sleeps 3 s)
        line = wait_for(lambda: counter.exists() and counter.read_text().strip(), 120, "the worker's compile")
        assert line, "the worker never started the compile"
        worker_pid = int(line.split()[0])
        assert worker_pid != p.pid
        locks = list(cache.glob("v1/**/*.lock"))
        assert len(locks) == 1 and external.lock_held(str(locks[0]))
        p.send_signal(signal.SIGKILL)
        p.wait(60)
        # the coordinator is gone; the worker still holds the key
        assert external.lock_held(str(locks[0]))
        meta = locks[0].with_suffix(".json")
        assert wait_for(meta.exists, 120), "the worker never published"
        assert wait_for(lambda: not external.lock_held(str(locks[0])), 120), "the lock was never released"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(60)
    e.pop("QUACK_TEST_COMPILE_SLEEP")
    r = subprocess.run(
        [sys.executable, "-c", _LOAD], env=e, cwd=str(tmp_path), capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr[-2000:]
    u = json.loads(r.stdout.strip().splitlines()[-1])
    assert u["compiles"] == 0 and u["waits"] == 0 and u["hits"] == 1, u
    assert len(counter.read_text().splitlines()) == 1  # one compile in all


# -- through a real pool ------------------------------------------------------------------------


@pytest.fixture
def pool(quack_settings):
    from quack.compile import pool as qpool

    p = qpool.CompilePool(2)
    yield p
    p.shutdown()


def _pending_key(call) -> str:
    from quack.errors import CompilePending

    with pytest.raises(CompilePending) as ei:
        call()
    return ei.value.key


def test_claims_held_at_once_are_capped_and_all_let_go(pool, monkeypatch):
    """Each queued key's claim is an open descriptor: past MAX_HELD a key is queued
    unclaimed (its worker locks it), so a pool given hundreds of keys can't run out."""
    import poolkernels

    from quack.compile import scope as qscope
    from quack.compile import tasks as qtasks

    monkeypatch.setattr(claims, "MAX_HELD", 2)
    base = random_tag()
    with qscope.pool_scope(pool):
        keys = [_pending_key(lambda i=i: poolkernels.pool_fault("ok", base + i)) for i in range(5)]
        assert claims.held() <= 2
        for k in keys:
            assert pool.wait(k, timeout=240) == (qtasks.DONE, None)
    reports = [pool.report(k) for k in keys]
    assert all(r["compiled"] for r in reports)
    # at least the first two went out claimed (more if a worker took one before the rest
    # were submitted: the cap counts claims held, not claims ever taken)
    assert sum(r["claimed"] for r in reports) >= 2, reports
    assert claims.held() == 0


def test_a_worker_killed_mid_compile_releases_the_claimed_key(pool, cache_dir):
    import poolkernels

    from quack.compile import scope as qscope
    from quack.compile import tasks as qtasks

    tag = random_tag()
    pf = poolkernels.pid_file(tag)
    with qscope.pool_scope(pool):
        key = _pending_key(lambda: poolkernels.pool_fault("die", tag))
        locks = lambda: [p for p in cache_dir.glob("v1/**/*.lock") if key in p.name]  # noqa: E731
        assert wait_for(lambda: os.path.exists(pf) and open(pf).read().strip(), 120), "worker never started"
        (lock,) = locks()
        assert external.lock_held(str(lock)) and claims.held() == 0  # the worker's alone now
        os.kill(int(open(pf).read()), signal.SIGKILL)
        os.unlink(pf)
        st, err = pool.wait(key, timeout=60)
    assert st == qtasks.FAILED and "SIGKILL" in str(err), err
    assert not external.lock_held(str(lock))


def random_tag() -> int:
    import random

    return random.randrange(1, 1 << 30)


def test_a_failed_lock_hand_over_replaces_the_worker_and_every_key_still_compiles(
    quack_settings, monkeypatch
):
    """The request reached the worker but the lock did not: that worker can build nothing
    (and would read the next request as the descriptor). It is replaced and the key queued
    again, claimed; with more keys queued than workers, all of them compile."""
    from multiprocessing import reduction

    import poolkernels

    from quack.compile import dispatch
    from quack.compile import pool as qpool
    from quack.compile import scope as qscope
    from quack.compile import tasks as qtasks

    calls = []

    class FailOnce:
        @staticmethod
        def send_handle(conn, fd, pid):
            calls.append(pid)
            if len(calls) == 1:
                raise OSError("injected: the descriptor did not go")
            return reduction.send_handle(conn, fd, pid)

    monkeypatch.setattr(dispatch, "reduction", FailOnce)
    p = qpool.CompilePool(1)
    try:
        base = random_tag()
        with qscope.pool_scope(p):
            keys = [_pending_key(lambda i=i: poolkernels.pool_fault("ok", base + i)) for i in range(3)]
            for k in keys:
                assert p.wait(k, timeout=240) == (qtasks.DONE, None)
        reports = [p.report(k) for k in keys]
        st = p.stats()
    finally:
        p.shutdown()
    assert all(r["compiled"] and r["claimed"] for r in reports), reports
    assert len(calls) == 4 and calls[0] != calls[1]  # the first worker's hand-over failed, then 3 went
    assert st["workers_started"] == 2 and st["worker_deaths"] == 0 and st["failed"] == 0, st
    assert claims.held() == 0
