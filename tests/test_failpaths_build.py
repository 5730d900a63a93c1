"""`quack build` after a failed configuration: it ends (exit 1, a summary naming the failed
and the not-built configurations) within a bounded time, fail-fast and --keep-going, at one
and two workers, for a kernel that raises, a full disk and a planted lock symlink.

Each build runs as a real subprocess under a time-out, so a regression (a build that
never exits) fails here instead of stalling CI."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from reliability_support import can_mount, env, run_quack, session_objects

N = 24  # more configurations than the submit window (jobs + 2) at one and two workers
FAIL = {0, 9}  # i=0 is first in the manifest: fail-fast stops right there


def _project(d: Path, n: int = N) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "quack.toml").write_text(
        '[runtime]\narch = "sm_90a"\n[build]\nkernel_packages = ["relkernels"]\nmanifests = ["m.toml"]\n'
    )
    (d / "m.toml").write_text(f'[[kernel]]\nname = "rel_fail"\nparams = {{ i = {list(range(n))} }}\n')
    return d


@pytest.fixture(scope="module")
def obj(tmp_path_factory) -> str:
    return session_objects(tmp_path_factory)["float32"]["path"]


def _build(proj: Path, cache: Path, obj: str, *args, fail=FAIL, gate=None) -> subprocess.CompletedProcess:
    extra = {"QUACK_TEST_FAIL_GATE": str(gate)} if gate else {}
    return run_quack(
        ["build", "--json", "--cache-dir", cache, *args],
        cwd=proj,
        timeout=180,
        env_=env(QUACK_TEST_OBJ=obj, QUACK_TEST_FAIL=",".join(map(str, sorted(fail))), **extra),
    )


@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.parametrize("keep_going", [False, True], ids=["fail-fast", "keep-going"])
def test_failed_configuration_ends_the_build(tmp_path, obj, jobs, keep_going):
    proj = _project(tmp_path / "proj")
    r = _build(
        proj,
        tmp_path / "cache",
        obj,
        "--jobs",
        str(jobs),
        *(["--keep-going"] if keep_going else []),
        gate=tmp_path / "failed-once",
    )
    assert r.returncode == 1, r.stdout + r.stderr
    res = json.loads(r.stdout)
    st = {k["params"]["i"]: k["status"] for k in res["keys"]}
    assert len(st) == N
    if keep_going:
        assert {i for i, s in st.items() if s == "failed"} == FAIL
        assert res["compiled"] == N - len(FAIL) and res["not_built"] == 0
    else:
        assert [i for i, s in st.items() if s == "failed"] == [0]
        # The others finish only after i=0 raised (the gate), so what ran is the window
        # (jobs + 2) plus at most a refill per DONE that reached the scheduler before the
        # FAILED did; the exact window is tests/test_build_scheduler.py's, with a scripted
        # executor. Timing-free: on a busy machine two workers finished in either order and
        # the old bound (N - window) failed.
        assert N - 2 * (jobs + 2) <= res["not_built"] <= N - 1
        assert res["compiled"] + res["failed"] + res["not_built"] == N
        assert "not built (the build stopped at the first failure; --keep-going builds the rest)" in r.stderr
    assert "rel_fail: configuration i=0 does not compile" in r.stderr


@pytest.mark.skipif(not can_mount(), reason="needs root with mount (a real tmpfs)")
def test_full_disk_build_ends(tmp_path, obj):
    """A 96 KiB tmpfs as the cache: the objects (~10 KiB each) fill it after a few keys;
    every later key fails on the full disk and the build still exits 1."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        proj = _project(tmp_path / "proj")
        r = _build(proj, mnt / "cache", obj, "--jobs", "2", fail=())
        assert r.returncode == 1, r.stdout + r.stderr
        res = json.loads(r.stdout)
        assert res["failed"] >= 1 and res["compiled"] + res["failed"] + res["not_built"] == N
        assert "disk full" in r.stderr, r.stderr
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def _fill(d: Path) -> None:
    """Take every byte left on d's file system (a tmpfs the test mounted)."""
    fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:  # ends: the mount has 96 KiB
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


@pytest.mark.skipif(not can_mount(), reason="needs root with mount (a real tmpfs)")
def test_full_disk_keys_are_reported_as_not_stored_not_as_compile_failures(tmp_path, obj):
    """Keys that compiled but did not fit in the cache are "failed to store", apart from
    compile failures; the summary points at the build log only when it holds something
    (its own writes fail on the full disk: it pointed at a 0-byte log)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        proj = _project(tmp_path / "proj", n=12)
        r = _build(proj, mnt / "cache", obj, "--jobs", "1", "--keep-going", fail={3})
        assert r.returncode == 1, r.stdout + r.stderr
        res = json.loads(r.stdout)
        failure = {k["params"]["i"]: k.get("failure") for k in res["keys"] if k["status"] == "failed"}
        assert failure[3] == "compile" and list(failure.values()).count("store") >= 1, failure
        assert res["failed_to_store"] == len(failure) - 1
        assert "1 configuration failed to compile:" in r.stderr, r.stderr
        assert f"{res['failed_to_store']} configuration" in r.stderr
        assert "compiled but failed to store:" in r.stderr and "disk full" in r.stderr

        _fill(mnt)  # now the build log cannot be written either
        r = _build(proj, mnt / "cache", obj, "--jobs", "1", "--keep-going", fail=())
        assert r.returncode == 1, r.stdout + r.stderr
        res = json.loads(r.stdout)
        assert res["failed"] == res["failed_to_store"] >= 1, res
        assert "failed to compile" not in r.stderr and "compiled but failed to store:" in r.stderr
        empty = [p for p in (mnt / "cache" / "logs").iterdir() if p.stat().st_size == 0]
        assert empty, "the log was written: the disk was not full"
        assert not any(str(p) in r.stderr for p in empty), r.stderr
        assert "full compiler output" not in r.stderr and "full error text" not in r.stderr
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_lock_symlink_build_ends(tmp_path, obj):
    """A lock file planted as a symlink fails its key (never followed); the build ends."""
    proj = _project(tmp_path / "proj", n=8)
    cache = tmp_path / "cache"
    r = _build(proj, cache, obj, "--dry-run", "--jobs", "1")
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout)["keys"][0]
    target = tmp_path / "victim"
    target.write_text("do not touch\n")
    import relkernels  # noqa: F401, PLC0415

    from quack import registry  # noqa: PLC0415
    from quack.cache.store import DiskStore  # noqa: PLC0415
    from quack.compile import builder  # noqa: PLC0415

    spec = registry.get("rel_fail")
    ref = builder.entry_ref(spec, spec.bind((), first["params"]), "sm_90a")
    lock = DiskStore(cache).paths(ref)["lock"]
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.symlink_to(target)
    r = _build(proj, cache, obj, "--jobs", "1", fail=())
    assert r.returncode == 1, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["failed"] >= 1 and res["compiled"] + res["failed"] + res["not_built"] == 8
    assert target.read_text() == "do not touch\n"


def test_failure_line_is_the_compilers_error_without_ansi(tmp_path):
    """A real CuTe compiler error: the FAILED line and the summary show the compiler's own
    error (not its closing "Re-run with CUTE_DSL_SHOW_STACKTRACE" advice), no ANSI codes
    in non-terminal output; the build log keeps the whole text."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "quack.toml").write_text('[build]\nkernel_packages = ["toykernels"]\n')
    (proj / "m.toml").write_text('[[kernel]]\nname = "toy_badcopy"\nparams = { dtype = "bfloat16" }\n')
    r = run_quack(["build", "--jobs", "1", "--cache-dir", tmp_path / "cache", "m.toml"], cwd=proj)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "\x1b" not in out
    failed = [ln for ln in out.splitlines() if "FAILED" in ln]
    assert len(failed) == 1, out
    assert "'cute.copy' op dst expects shared based memref" in failed[0], failed[0]
    assert "suggestion" not in failed[0] and "CUTE_DSL_SHOW_STACKTRACE" not in failed[0]
    logs = list((tmp_path / "cache" / "logs").glob("build-*.log"))
    assert len(logs) == 1
    log = logs[0].read_text()
    assert "CUTE_DSL_SHOW_STACKTRACE" in log and "Traceback" in log and "\x1b" not in log


def test_missing_tvm_ffi_option_is_named(tmp_path):
    """A compile function that forgot options="--enable-tvm-ffi": the build says so,
    instead of export_to_c's 'unexpected keyword argument' TypeError."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "quack.toml").write_text('[build]\nkernel_packages = ["toykernels"]\n')
    (proj / "m.toml").write_text('[[kernel]]\nname = "toy_noffi"\n')
    r = run_quack(["build", "--jobs", "1", "--cache-dir", tmp_path / "cache", "m.toml"], cwd=proj)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    failed = [ln for ln in out.splitlines() if "FAILED" in ln]
    assert len(failed) == 1 and 'pass options="--enable-tvm-ffi" to cute.compile' in failed[0], out


LONG_ERROR_KERNEL = """
from quack import jit_cache
from quack.params import Int


@jit_cache("long_err", params={"i": Int(min=0, max=9)})
def long_err(i: int = 0):
    raise ValueError("long_err: " + "the compiler explains at length " * 7 + "END-OF-ERROR")
"""


def test_failed_line_stays_one_line_in_a_log(tmp_path):
    """Plain (non-terminal) output is one line per key: an error longer than the
    console's width stays on its FAILED line and on its summary line, unwrapped."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "longerr.py").write_text(LONG_ERROR_KERNEL)
    (proj / "quack.toml").write_text('[build]\nkernel_packages = ["longerr"]\n')
    (proj / "m.toml").write_text('[[kernel]]\nname = "long_err"\n')
    e = env()
    e.pop("COLUMNS", None)  # the width of a CI log (160)
    e["PYTHONPATH"] = f"{proj}:{e['PYTHONPATH']}"
    r = run_quack(["build", "--jobs", "1", "--cache-dir", tmp_path / "cache", "m.toml"], cwd=proj, env_=e)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    failed = [ln for ln in lines if "FAILED" in ln]
    assert len(failed) == 1 and failed[0].rstrip().endswith("END-OF-ERROR"), r.stdout
    assert len(failed[0]) > 160
    summary = [ln for ln in lines if ln.startswith("      ValueError: long_err: ")]
    assert len(summary) == 1 and summary[0].rstrip().endswith("END-OF-ERROR"), r.stdout
