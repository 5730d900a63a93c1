"""A jit-mode miss whose object the cache can't take (a read-only cache, a worker whose
publish fails with a CacheError) is compiled by a compile worker unstored, bounded by
compile_timeout, and loaded from a private copy of its bytes: the calling process never
compiles it (the design card: "the process that launches kernels never compiles
in-process"), and nothing is written to the cache. Real pool, real compiles."""

import glob
import os
import random
import tempfile
import time
import warnings
from pathlib import Path

import poolkernels
import pytest
import toykernels
from conftest import use_settings
from reliability_support import made_read_only

from quack.cache.store import DiskStore
from quack.compile import builder
from quack.compile import pool as qpool
from quack.compile import scope as qscope
from quack.compile import tasks as qtasks
from quack.errors import CacheWarning, CompilePending, CompileTimeout
from quack.runtime import loader


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _left_tmp(pool) -> list[str]:
    """What the pool's workers left of their unstored compiles' private temp directories."""
    tmp = glob.escape(tempfile.gettempdir())
    return [
        d
        for pid in pool.worker_pids()
        for d in glob.glob(os.path.join(tmp, builder.unstored_tmp_prefix(pid) + "*"))
    ]


@pytest.fixture
def pool(quack_settings):
    p = qpool.CompilePool(1)
    yield p
    p.shutdown(wait=True)


@pytest.fixture
def read_only_cache(quack_settings, tmp_path):
    """The test's cache made read-only for real (a read-only bind mount as root, chmod
    a-w otherwise), installed as the cache of this process's settings."""
    src = Path(quack_settings.cache_dir)
    (src / "v1").mkdir(mode=0o700, parents=True)
    src.chmod(0o700)
    with made_read_only(src, tmp_path / "ro") as ro:
        use_settings(cache_dir=str(ro))
        assert not DiskStore(ro).writable()
        yield ro


@pytest.fixture
def in_process_compiles(monkeypatch):
    """Every compile function this process runs itself (the in-process compile's only
    way to the kernel's code: builder.call_compile); workers are other processes."""
    calls = []
    real = builder.call_compile

    def spy(spec, params, arch):
        calls.append(spec.name)
        return real(spec, params, arch)

    monkeypatch.setattr(builder, "call_compile", spy)
    return calls


def _miss_in_worker(pool, call, root):
    """Call a kernel inside the pool's scope: the miss raises CompilePending for the
    unstored compile (kept apart from a stored one: its pool root is unstored_root), wait
    for it, then call again to load it. Returns (function, the CacheWarnings' texts)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with qscope.pool_scope(pool):
            with pytest.raises(CompilePending) as ei:
                call()
            assert ei.value.root == qpool.unstored_root(root), ei.value.root
            assert pool.state(ei.value.key, root) == qtasks.NEW  # no stored compile of it
            assert pool.wait(ei.value.key, timeout=120, root=ei.value.root) == (qtasks.DONE, None)
            fn = call()
    return fn, [str(x.message) for x in w if issubclass(x.category, CacheWarning)]


def test_read_only_cache_miss_compiles_in_a_worker_unstored(pool, read_only_cache, in_process_compiles):
    root = read_only_cache
    before = _files(root)
    n0 = len(toykernels.COMPILES)
    fn, msgs = _miss_in_worker(pool, lambda: toykernels.toy_scale("float32", 288, True), root)
    assert callable(fn)
    assert in_process_compiles == [] and len(toykernels.COMPILES) == n0, "compiled in this process"
    assert len(msgs) == 1 and "not writable" in msgs[0] and "compiled in a compile worker" in msgs[0], msgs
    u = next(x for x in toykernels.toy_scale.usage() if x["params"]["block"] == 288)
    assert (u["tier"], u["compiles"], u["how"]) == ("compile", 1, "so" if loader.can_link() else "o"), u
    st = pool.stats()
    assert (st["submitted"], st["compiled"], st["unstored"], st["awaited_external"], st["failed"]) == (
        1,
        1,
        1,
        0,
        0,
    ), st
    assert _files(root) == before, "a read-only cache was written to"
    assert pool.report(u["key"], qpool.unstored_root(root)) is None, "the object's bytes kept in the pool"


def test_worker_publish_failing_with_a_cache_error_compiles_unstored_in_a_worker(
    pool, quack_settings, in_process_compiles
):
    """The calling process sees a writable cache; the worker's publish fails (disk full,
    tests/cachefull_preload.py): the key is compiled again by a worker, unstored (its temp
    file in the worker's own temp directory, not the full cache), and loaded."""
    root = Path(quack_settings.cache_dir)
    use_settings(preload=["cachefull_preload"])
    n0 = len(toykernels.COMPILES)
    call = lambda: toykernels.toy_scale("float16", 288, False)  # noqa: E731
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with qscope.pool_scope(pool):
            with pytest.raises(CompilePending) as ei:
                call()  # the stored compile: its publish fails
            key = ei.value.key
            st, err = pool.wait(key, timeout=120, root=root)
            assert st == qtasks.FAILED and "disk full" in str(err), (st, err)
            fn, msgs = _miss_in_worker(pool, call, root)
    assert callable(fn)
    assert in_process_compiles == [] and len(toykernels.COMPILES) == n0, "compiled in this process"
    msgs += [str(x.message) for x in w if issubclass(x.category, CacheWarning)]
    assert len(msgs) == 1 and "can't store" in msgs[0] and "disk full" in msgs[0], msgs
    assert "in a compile worker, unstored" in msgs[0], msgs
    st = pool.stats()
    assert (st["submitted"], st["unstored"], st["failed"]) == (2, 1, 1), st
    assert not any(f.endswith((".o", ".so", ".json")) for f in _files(root)), _files(root)
    assert _left_tmp(pool) == [], "the unstored compile's temp directory was left"


def test_wedged_unstored_compile_is_bounded_by_compile_timeout(pool, read_only_cache, in_process_compiles):
    """A read-only cache's miss wedges in its worker (poolkernels' wedge mode; in this
    process it would compile at once): the worker is killed at compile_timeout, the miss
    raises CompileTimeout, and the worker's private temp directory is swept."""
    use_settings(compile_timeout=3.0)
    root = read_only_cache
    before = _files(root)
    tag = random.randrange(1, 1 << 30)
    call = lambda: poolkernels.pool_fault("wedge", tag)  # noqa: E731
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        with qscope.pool_scope(pool):
            with pytest.raises(CompilePending) as ei:
                call()
            assert ei.value.root == qpool.unstored_root(root)
            st, err = pool.wait(ei.value.key, timeout=120, root=ei.value.root)
            assert st == qtasks.FAILED and isinstance(err, CompileTimeout), (st, err)
            with pytest.raises(CompileTimeout):
                call()
    assert time.monotonic() - t0 < 100, "not bounded by compile_timeout"
    assert in_process_compiles == [], "compiled in this process"
    assert pool.stats()["timeouts"] == 1
    assert _left_tmp(pool) == [], "the killed worker's temp directory was left"
    assert _files(root) == before
    try:
        os.unlink(poolkernels.pid_file(tag))
    except FileNotFoundError:
        pass


@pytest.mark.parametrize("where", ["mkdtemp", "export"])
def test_unstored_compile_on_a_full_temp_dir_is_a_clear_cache_write_error(
    quack_settings, tmp_path, monkeypatch, where
):
    """The unstored compile writes only into a private temp directory: one that can't be
    created, or can't take the object (disk full), is a CacheWriteError naming it and
    TMPDIR, never a crash, and nothing of it is left."""
    import errno
    import tempfile as _tempfile

    from quack.errors import CacheWriteError

    spec = toykernels.toy_scale.spec
    params = spec.bind(("float32", 320, False))
    monkeypatch.setattr(_tempfile, "tempdir", str(tmp_path / ("missing" if where == "mkdtemp" else "tmp")))
    (tmp_path / "tmp").mkdir()
    if where == "export":

        def full(spec, params, arch, out_path):
            with open(out_path, "wb") as f:
                f.write(b"\x7fELF half")
            raise OSError(errno.ENOSPC, "No space left on device", str(out_path))

        monkeypatch.setattr(builder, "compile_to", full)
    with pytest.raises(CacheWriteError) as ei:
        builder.compile_unstored(spec, params, "sm_90a")
    msg = str(ei.value)
    assert "compile worker's temp directory" in msg and "TMPDIR" in msg, msg
    assert str(tmp_path) in msg and ("disk full" in msg if where == "export" else "unstored" in msg), msg
    assert list((tmp_path / "tmp").iterdir()) == [], "the private temp directory was left"
