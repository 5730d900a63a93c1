"""@jit_cache end to end with real CuTe DSL compiles for sm_90a on the CPU."""

import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import toykernels
from conftest import use_settings

from quack import jit_cache
from quack.errors import CacheWarning, CompileError, KernelNotPrebuilt, ParamError
from quack.params import Int


def entry_files(cache_dir, kernel="toy_scale"):
    return sorted(
        p.name.split(".", 1)[1]
        for p in cache_dir.rglob("*")
        if p.is_file() and p.parent.parent.name == kernel
    )


def test_miss_compiles_in_worker_then_hits(quack_settings, cache_dir):
    n0 = len(toykernels.COMPILES)
    fn = toykernels.toy_scale("bfloat16", 128, False)
    assert callable(fn)
    assert len(toykernels.COMPILES) == n0, "the caller must never compile in-process"
    assert entry_files(cache_dir) == ["json", "lock", "o", "so", "so.json"]
    assert toykernels.toy_scale(dtype="bfloat16", block=128, bias=False) is fn
    (u,) = [u for u in toykernels.toy_scale.usage() if u["params"]["dtype"] == "bfloat16"]
    assert (u["misses"], u["compiles"], u["hits"], u["how"]) == (1, 1, 1, "so")
    meta = json.loads(next(cache_dir.rglob("*.json")).read_text())
    assert meta["kernel"] == "toy_scale" and meta["arch"] == "sm_90a"
    assert meta["params"] == {"dtype": "bfloat16", "block": 128, "bias": False}
    assert meta["compile_s"] > 0 and meta["size"] > 1000 and len(meta["sha256"]) == 64


_FRESH = """
import sys, json, time
t = time.perf_counter()
import toykernels
fn = toykernels.toy_scale("float16", 64, True)
dt = time.perf_counter() - t
u = toykernels.toy_scale.usage()[0]
print(json.dumps({"compiles": len(toykernels.COMPILES), "usage": u,
                  "cute_imported": "cutlass.cute" in sys.modules, "fn": type(fn).__name__}))
"""


def test_fresh_process_loads_without_compiling(quack_settings, cache_dir):
    toykernels.toy_scale("float16", 64, True)  # fills the cache through a worker
    env = dict(os.environ, QUACK_CACHE_DIR=str(cache_dir), QUACK_ARCH="sm_90a", QUACK_MODE="prebuilt")
    r = subprocess.run([sys.executable, "-c", _FRESH], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["compiles"] == 0 and out["usage"]["hits"] == 1 and out["usage"]["misses"] == 0
    assert out["usage"]["how"] == "so"
    assert out["cute_imported"] is False, "loading a prebuilt kernel must not import the compiler"
    assert out["fn"] == "Function"


def test_prebuilt_mode_miss_is_a_clear_error(quack_settings):
    use_settings(mode="prebuilt")
    n0 = len(toykernels.COMPILES)
    with pytest.raises(KernelNotPrebuilt) as e:
        toykernels.toy_scale("float32", 256, True)
    msg = str(e.value)
    assert "toy_scale" in msg and "'block': 256" in msg and "sm_90a" in msg
    assert 'name = "toy_scale"' in msg and "quack build --arch sm_90a" in msg
    assert len(toykernels.COMPILES) == n0
    e2 = pickle.loads(pickle.dumps(e.value))
    assert str(e2) == msg and e2.params == {"dtype": "float32", "block": 256, "bias": True}


def test_corrupt_entry_is_quarantined_and_rebuilt(quack_settings, cache_dir):
    toykernels.toy_scale("float32", 32, False)
    (obj,) = [p for p in cache_dir.rglob("*.o") if p.parent.parent.name == "toy_scale"]
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, flipped byte
    obj.write_bytes(bytes(data))
    use_settings()  # a new generation: drop this process's in-memory table
    with pytest.warns(CacheWarning, match=r"toy_scale key [0-9a-f]{16} was corrupt \(object file checksum"):
        fn = toykernels.toy_scale("float32", 32, False)
    assert callable(fn)
    q = list((cache_dir / "quarantine").iterdir())
    assert any(p.name.endswith(".reason") for p in q) and any(p.name.endswith(".o") for p in q)
    (u,) = [u for u in toykernels.toy_scale.usage() if u["params"]["dtype"] == "float32"]
    assert u["compiles"] == 1
    use_settings()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        toykernels.toy_scale("float32", 32, False)  # now a clean hit
    (u,) = [u for u in toykernels.toy_scale.usage() if u["params"]["dtype"] == "float32"]
    assert (u["hits"], u["compiles"]) == (1, 0)


def test_worker_compile_error_reaches_caller(quack_settings):
    with pytest.raises(CompileError) as e:
        toykernels.toy_fail(True)
    assert "toy_fail: boom requested" in str(e.value)
    assert "Traceback" in e.value.detail and "toykernels.py" in e.value.detail
    assert e.value.kernel == "toy_fail" and e.value.params == {"boom": True}
    assert str(pickle.loads(pickle.dumps(e.value))) == str(e.value)


def test_compile_uncached_checks_like_a_call_and_touches_no_cache(quack_settings):
    """The one way to the compile result of a registered kernel (a compile function
    building its kernel with another's): its arguments checked as a call's, the cache
    neither read nor written. The old bypass (``.raw``, the bare function) is gone."""
    with pytest.raises(ParamError, match="block"):
        toykernels.toy_scale.compile_uncached("float32", 16, False)  # below Int(min=32)
    compiled = toykernels.toy_scale.compile_uncached("float32", 64, False)
    assert hasattr(compiled, "export_to_c")
    assert not list(Path(quack_settings.cache_dir).rglob("*.o"))
    assert not hasattr(toykernels.toy_scale, "raw")


def test_unshippable_compile_function_compiles_here_with_one_warning(quack_settings):
    @jit_cache("test_local_kernel", params={"block": Int(min=32, max=1024)})
    def local(block: int):
        return toykernels.toy_scale.compile_uncached("float32", block, True)

    with pytest.warns(CacheWarning, match="can't be sent to a compile worker"):
        assert callable(local(64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert callable(local(96))  # one warning per kernel, not per call


@pytest.mark.parametrize("case", ["unshippable", "unusable-jit", "unusable-prebuilt"])
def test_miss_path_warnings_point_at_the_callers_line(quack_settings, tmp_path, case):
    """A warning of the miss path names the line that called the kernel: each
    stacklevel counts JitKernel's own frames, which a refactor must keep in step."""
    if case == "unshippable":

        @jit_cache("test_local_kernel_where", params={"block": Int(min=32, max=1024)})
        def kern(block: int):
            return toykernels.toy_scale.compile_uncached("float32", block, True)

        args: tuple = (64,)
    else:
        root = tmp_path / "ww"
        root.mkdir()
        root.chmod(0o777)  # world-writable: the store refuses it
        use_settings(cache_dir=str(root), mode="prebuilt" if case == "unusable-prebuilt" else "jit")
        kern, args = toykernels.toy_scale, ("float32", 224, False)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        try:
            kern(*args)
            line = sys._getframe().f_lineno - 1
        except KernelNotPrebuilt:
            line = sys._getframe().f_lineno - 3
    (w,) = [w for w in got if issubclass(w.category, CacheWarning)]
    assert (Path(w.filename).name, w.lineno) == (Path(__file__).name, line), w


def test_cache_disabled_compiles_in_a_worker_unstored(quack_settings, cache_dir):
    """A disabled cache: the miss is compiled by a compile worker, unstored (bounded by
    compile_timeout), and loaded; never in this process, nothing written."""
    from quack.compile import pool as qpool
    from quack.compile import scope as qscope
    from quack.compile import tasks as qtasks
    from quack.errors import CompilePending

    use_settings(cache_enabled=False)
    n0 = len(toykernels.COMPILES)
    pool = qpool.CompilePool(1)
    try:
        with warnings.catch_warnings(record=True) as w, qscope.pool_scope(pool):
            warnings.simplefilter("always")
            with pytest.raises(CompilePending) as ei:
                toykernels.toy_scale("float32", 512, False)
            assert ei.value.root == qpool.unstored_root(cache_dir)
            assert pool.wait(ei.value.key, timeout=120, root=ei.value.root) == (qtasks.DONE, None)
            fn = toykernels.toy_scale("float32", 512, False)
        st = pool.stats()
    finally:
        pool.shutdown(wait=True)
    assert callable(fn) and len(toykernels.COMPILES) == n0, "compiled in this process"
    assert (st["submitted"], st["compiled"], st["unstored"]) == (1, 1, 1), st
    assert [x for x in w if issubclass(x.category, CacheWarning)] == []  # disabled: no warning
    assert not cache_dir.exists() or not list(cache_dir.rglob("*"))


def test_journal_records_usage(cache_dir):
    code = (
        "import toykernels; toykernels.toy_scale('bfloat16', 128, False); "
        "toykernels.toy_scale('bfloat16', 128, False)"
    )
    env = dict(os.environ, QUACK_CACHE_DIR=str(cache_dir), QUACK_ARCH="sm_90a")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300, capture_output=True)
    lines = [json.loads(x) for x in (cache_dir / "journal.jsonl").read_text().splitlines()]
    (rec,) = lines
    assert rec["kernel"] == "toy_scale" and rec["misses"] == 1 and rec["hits"] == 1 and rec["compiles"] == 1
    assert rec["params"] == {"dtype": "bfloat16", "block": 128, "bias": False}
