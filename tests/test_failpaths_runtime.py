"""Run-time failure paths: prebuilt mode never compiles, whatever the cache's state;
a failed compile is remembered per process (bugs 2 and 4 of issue 9)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import relkernels
from conftest import use_settings
from reliability_support import NO_TORCH, env

from quack.errors import CacheWarning, KernelNotPrebuilt


@pytest.fixture
def counter(tmp_path, monkeypatch):
    """Every rel_copy compile appends a line here (real counting, no mock)."""
    c = tmp_path / "compiles.txt"
    monkeypatch.setenv("QUACK_TEST_COUNTER", str(c))
    monkeypatch.setenv("QUACK_TEST_OBJ", "/nonexistent")  # an export would fail loudly
    return lambda: len(c.read_text().splitlines()) if c.exists() else 0


def _call_prebuilt(i: int):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with pytest.raises(KernelNotPrebuilt) as ei:
            relkernels.rel_copy(i)
    return ei.value, [str(x.message) for x in w if issubclass(x.category, CacheWarning)]


def test_prebuilt_with_cache_disabled_raises(quack_settings, counter):
    use_settings(mode="prebuilt", cache_enabled=False)
    err, warned = _call_prebuilt(11)
    assert counter() == 0
    assert "cache is disabled" in str(err) and "QUACK_CACHE_ENABLED" in str(err)
    assert err.kernel == "rel_copy" and err.params == {"i": 11}
    assert warned == []


@pytest.mark.parametrize("how", ["world-writable", "symlink"])
def test_prebuilt_with_unusable_cache_raises_with_one_warning(quack_settings, counter, tmp_path, how):
    real = tmp_path / "real"
    real.mkdir()
    if how == "world-writable":
        real.chmod(0o777)
        root = real
    else:
        root = tmp_path / "link"
        root.symlink_to(real, target_is_directory=True)
    use_settings(mode="prebuilt", cache_dir=str(root))
    err, warned = _call_prebuilt(12)
    err2, warned2 = _call_prebuilt(13)  # a second miss: the same refusal, no second warning
    assert counter() == 0
    assert "cache is unusable" in str(err) and str(root) in str(err)
    assert len(warned) == 1 and "unusable" in warned[0], warned
    assert warned2 == [] and "cache is unusable" in str(err2)
    assert not any(p.suffix == ".o" for p in real.rglob("*"))


def test_first_error_line_of_a_python_failure_and_compile_error_without_ansi():
    import pickle
    import traceback

    from quack.compile.diagnostics import first_error_line
    from quack.errors import CompileError

    try:
        raise TypeError("export_to_c() got an unexpected keyword argument 'object_file_path'")
    except TypeError as e:
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    assert (
        first_error_line(text) == "TypeError: export_to_c() got an unexpected keyword argument "
        "'object_file_path'"
    )
    assert (
        first_error_line("ValueError: a\x00b " + "x" * 1000, limit=40)
        == "ValueError: a\\x00b " + "x" * 18 + "..."
    )
    err = CompileError("k", {"n": 1}, "sm_90a", "\x1b[91merror:\x1b[0m bad\n")
    assert err.detail == "error: bad\n" and "\x1b" not in str(err)
    assert pickle.loads(pickle.dumps(err)).detail == "error: bad\n"


_REMEMBER = r"""
import json, os, sys, time
from pathlib import Path
from quack.errors import CompileError
mod = Path(sys.argv[1]) / "fp_edit_kernel.py"
mod.write_text("from relkernels import rel_fail as _f\n"
               "from quack import jit_cache\nfrom quack.params import Int\n\n"
               "@jit_cache('fp_edit', params={'i': Int(min=0)})\n"
               "def fp_edit(i: int = 0):\n    return _f.compile_uncached(i)\n")
sys.path.insert(0, sys.argv[1])
import fp_edit_kernel
counter = Path(os.environ["QUACK_TEST_FAIL_COUNTER"])
attempts = lambda: len(counter.read_text().splitlines()) if counter.exists() else 0
errs = []
for _ in range(4):
    try:
        fp_edit_kernel.fp_edit(5)
    except CompileError as e:
        errs.append(e)
out = {"errors": len(errs), "same": all(e is errs[0] for e in errs), "attempts": attempts(),
       "text": str(errs[0])}
time.sleep(0.01)
mod.write_text(mod.read_text() + "# edited\n")   # a kernel edit: a new source fingerprint
try:
    fp_edit_kernel.fp_edit(5)
except CompileError:
    out["after_edit"] = attempts()
print(json.dumps(out))
"""


def test_failed_compile_is_remembered_until_the_source_changes(tmp_path):
    """Four calls of one failing key in one process: one compile (in a worker), the same
    CompileError four times; after an edit of the kernel's source it compiles again."""
    r = subprocess.run(
        [sys.executable, "-c", _REMEMBER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=str(tmp_path),
        env=env(
            QUACK_CACHE_DIR=tmp_path / "cache",
            QUACK_MODE="jit",
            QUACK_TEST_FAIL="5",
            QUACK_TEST_FAIL_COUNTER=tmp_path / "attempts",
            QUACK_COMPILE_JOBS=1,
        ),
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["errors"], out["same"], out["attempts"]) == (4, True, 1), out
    assert "rel_fail: configuration i=5 does not compile" in out["text"]
    assert out["after_edit"] == 2, out


_STAMPEDE = (
    NO_TORCH
    + r"""
import json, sys, time
from pathlib import Path
import relkernels
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.005)
relkernels.rel_copy(77)
u = relkernels.rel_copy.usage()[0]
from quack.compile import pool
c = pool.default_pool().counts
out = {k: u[k] for k in ("compiles", "waits", "misses", "compile_s")}
print(json.dumps({**out, "workers_started": c["workers_started"], "awaited": c["awaited_external"]}))
"""
)


def test_stampede_counts_one_compile_and_the_waits(tmp_path, tmp_path_factory):
    """Eight processes ask for one cold key at once: one real compile, and the journal
    and `quack cache stats` say one compile (where it happened) and seven waits. The
    process that compiles locks the key when it asks for it (the pool's claim, handed to
    its worker), so the seven await it without starting a compile worker of their own
    (each was a forkserver importing cutlass: ~3 CPU-s apiece, for nothing)."""
    from reliability_support import run_quack, session_objects

    obj = session_objects(tmp_path_factory)["float32"]["path"]
    cache, counter, go = tmp_path / "cache", tmp_path / "compiles", tmp_path / "go"
    e = env(
        QUACK_CACHE_DIR=cache,
        QUACK_MODE="jit",
        QUACK_TEST_OBJ=obj,
        QUACK_TEST_COUNTER=counter,
        QUACK_TEST_COMPILE_SLEEP=1.0,
        QUACK_COMPILE_JOBS=1,
    )
    ps = [
        subprocess.Popen(
            [sys.executable, "-c", _STAMPEDE, str(go)],
            env=e,
            cwd=str(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    try:
        go.touch()
        outs = [p.communicate(timeout=240) for p in ps]
    finally:
        for p in ps:
            p.kill()
    assert all(p.returncode == 0 for p in ps), [o[1][-2000:] for o in outs]
    rs = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert len(counter.read_text().splitlines()) == 1  # one real compile
    assert sum(r["compiles"] for r in rs) == 1 and sum(r["waits"] for r in rs) == 7, rs
    assert all(r["misses"] == 1 for r in rs)
    assert sum(r["workers_started"] for r in rs) == 1 and sum(r["awaited"] for r in rs) == 7, rs

    r = run_quack(
        ["cache", "stats", "--json", "--cache-dir", cache],
        cwd=tmp_path,
        timeout=120,
        env_=env(QUACK_CACHE_DIR=cache),
    )
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)["journal"]
    assert j["kernels"]["rel_copy"]["compiles"] == 1 and j["kernels"]["rel_copy"]["waits"] == 7
    assert len(j["slowest"]) == 1


def test_prebuilt_miss_after_an_edit_names_the_older_build(quack_settings, tmp_path_factory, counter):
    """The key was built for an older source of the kernel: the refusal says so, and
    that quack build / prewarm rebuilds it."""
    from pathlib import Path

    from reliability_support import copy_publish, session_objects

    from quack.cache.entry import EntryRef
    from quack.cache.store import DiskStore

    obj = Path(session_objects(tmp_path_factory)["float32"]["path"])
    spec = relkernels.rel_copy.spec
    key = spec.key(spec.bind((), {"i": 21}), "sm_90a")
    old = EntryRef("rel_copy", key, "sm_90a", "0123456789abcdef")
    copy_publish(DiskStore(quack_settings.cache_dir), old, obj)
    use_settings(mode="prebuilt")
    err, _ = _call_prebuilt(21)
    assert "built for an older source of the kernel (fingerprint 0123456789abcdef" in str(err)
    assert "quack build" in err.reason and "quack prewarm" in err.reason
    err2, _ = _call_prebuilt(22)  # a plain miss says nothing of the kind
    assert err2.reason == "" and counter() == 0


_UNUSABLE_CALLS = """
import json, os, warnings
warnings.simplefilter("always")
import relkernels
from quack.errors import CacheWarning
with warnings.catch_warnings(record=True) as w:
    for _ in range(15):
        assert callable(relkernels.rel_copy(3))
        assert callable(relkernels.rel_copy(i=4))
print(json.dumps({"pid": os.getpid(), "warnings": [str(x.message) for x in w if issubclass(x.category, CacheWarning)]}))
"""


def test_unusable_cache_warns_once_per_process_not_per_call(tmp_path, tmp_path_factory):
    """QUACK_CACHE_DIR naming a regular file: 30 calls of two keys (each spelled anew, so
    none is served by the hot path's memo) gave 30 identical warnings; now one. The two
    misses compile in a compile worker, unstored (QUACK_TEST_COUNTER: no line of this
    process), not in the calling process."""
    from reliability_support import session_objects

    obj = session_objects(tmp_path_factory)["float32"]["path"]
    counter = tmp_path / "compiles"
    not_a_dir = tmp_path / "cachefile"
    not_a_dir.write_text("not a directory\n")
    r = subprocess.run(
        [sys.executable, "-c", _UNUSABLE_CALLS],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=str(tmp_path),
        env=env(QUACK_CACHE_DIR=not_a_dir, QUACK_MODE="jit", QUACK_TEST_OBJ=obj, QUACK_TEST_COUNTER=counter),
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    warned = out["warnings"]
    unusable = [m for m in warned if "unusable" in m]
    assert len(unusable) == 1 and len(warned) == 1, warned
    assert str(not_a_dir) in unusable[0] and "compile in a compile worker" in unusable[0]
    compiles = [line.split() for line in counter.read_text().splitlines()]
    assert sorted(i for _, i in compiles) == ["3", "4"], compiles  # one compile a key
    assert all(pid != str(out["pid"]) for pid, _ in compiles), "compiled in the calling process"
