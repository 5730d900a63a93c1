"""Shared helpers of the reliability / security suites (tests/test_reliability_*.py,
tests/test_security_*.py): one real toy_scale .o compiled once per session and
reused across fault cases by copying; subprocess runners; cache walkers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent
PY = sys.executable
# The CLI as this interpreter runs it: works whether or not the venv's bin/ is on PATH.
QUACK = [PY, "-m", "quack_build"]


# Put first in the scripts of the multi-process cache tests that load or compile kernels
# but never hand one a tensor (no GPU on the CPU tier; what they test is the cache): tvm_ffi
# imports torch whenever it can, ~3 of each such process's ~4 CPU-s on 2 cores, so it is
# imported with torch hidden, as the compile forkserver does (quack.runtime.ffi).
NO_TORCH = "from quack.runtime.ffi import torch_hidden\nwith torch_hidden():\n    import tvm_ffi\n"


def env(**extra) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), str(ROOT), e.get("PYTHONPATH", "")) if p)
    e.setdefault("CUTE_DSL_ARCH", "sm_90a")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def run_py(code: str, *, timeout: float = 300, check: bool = True, **envextra) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [PY, "-c", code], env=env(**envextra), capture_output=True, text=True, timeout=timeout, cwd=str(TESTS)
    )
    if check and r.returncode != 0:
        raise AssertionError(f"subprocess failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def run_quack(
    args, *, timeout: float = 240, cwd=None, env_=None, check_rc=None
) -> subprocess.CompletedProcess:
    """``quack ARGS`` as a subprocess of this interpreter, bounded: past ``timeout`` the
    whole process group (the build, its forkserver and workers) is killed and the test
    fails, so a build that never ends cannot stall the suite."""
    import signal

    p = subprocess.Popen(
        [*QUACK, *map(str, args)],
        cwd=None if cwd is None else str(cwd),
        env=env_ if env_ is not None else env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate(timeout=30)
        raise AssertionError(
            f"`quack {' '.join(map(str, args))}` did not end within {timeout} s:\n"
            f"{out[-2000:]}\n{err[-4000:]}"
        ) from None
    finally:
        try:  # nothing of it outlives the call (workers of a killed or finished build)
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group had already ended: nothing left to kill
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    if check_rc is not None and r.returncode != check_rc:
        raise AssertionError(f"exit {r.returncode} (expected {check_rc}):\n{out}\n{err}")
    return r


def last_json(r: subprocess.CompletedProcess):
    return json.loads(r.stdout.strip().splitlines()[-1])


_COMPILE_ONE = """
import json, sys
from quack.compile import builder
from quack import registry
import toykernels
spec = registry.get("toy_scale")
out = {}
for dtype, block in (("float32", 128), ("float16", 64)):
    p = spec.bind((), {"dtype": dtype, "block": block})
    path = sys.argv[1] + f"/toy_{dtype}_{block}.o"
    builder.compile_to(spec, p, "sm_90a", path)
    out[dtype] = {"path": path, "params": spec.plain(p), "key": spec.key(p, "sm_90a"),
                  "srcfp": spec.source_fingerprint()}
print(json.dumps(out))
"""


def compile_objects(dest: Path) -> dict:
    """Two real toy_scale objects (float32/128 and float16/64) for sm_90a: 2 compiles."""
    dest.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        [PY, "-c", _COMPILE_ONE, str(dest)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(TESTS),
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def session_objects(tmp_path_factory) -> dict:
    """compile_objects once per test session, shared by every module and, under xdist, by
    every worker (read-only: tests copy them): each of four workers compiling its own pair
    cost ~8 s of the two cores' time apiece (issue 25). The first worker compiles under a
    lock in the run's shared temporary root; the others wait for it, then read."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-USER/pytest-N: this run's, shared by its workers
    d = root / "quack-toy-objects"
    done = d / "objects.json"
    with FileLock(str(root / "quack-toy-objects.lock"), timeout=600):
        if not done.exists():
            info = compile_objects(d)
            done.write_text(json.dumps(info))
    return json.loads(done.read_text())


def toy_ref(info: dict, arch: str = "sm_90a"):
    from quack.cache.entry import EntryRef

    return EntryRef("toy_scale", info["key"], arch, info["srcfp"])


def copy_publish(store, ref, obj: Path, meta: dict | None = None):
    """Publish a copy of a real .o through the store's own path (lock, temp, publish)."""
    with store.lock(ref):
        tmp = store.tmp_obj(ref)
        shutil.copyfile(obj, tmp)
        return store.publish(ref, tmp, dict(meta or {}, compile_s=0.0))


def tree(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).rglob("*"))


def debris(root: Path) -> list[Path]:
    return [p for p in tree(root) if ".tmp-" in p.name]


def can_mount() -> bool:
    """Root with CAP_SYS_ADMIN: tmpfs and read-only bind mounts are real."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    probe = Path(f"/tmp/quack-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        ok = (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(probe)], capture_output=True
            ).returncode
            == 0
        )
        if ok:
            subprocess.run(["umount", str(probe)], capture_output=True)
        return ok
    finally:
        probe.rmdir()


TOY_MANIFEST = """
[[kernel]]
name = "toy_scale"
params = { dtype = ["float32"], block = [128], bias = [false] }
"""


def write_toy_project(d: Path, manifest: str = TOY_MANIFEST) -> Path:
    """A project dir whose quack.toml builds the toy kernel (tests/toykernels.py)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "quack.toml").write_text(
        '[runtime]\narch = "sm_90a"\n[build]\nkernel_packages = ["toykernels"]\nmanifests = ["toy.toml"]\n'
    )
    (d / "toy.toml").write_text(manifest)
    return d / "toy.toml"


@contextlib.contextmanager
def made_read_only(src: Path, ro: Path):
    """``src`` made read-only for real (its path, or ``ro``): a read-only bind mount
    at ``ro`` as root, or chmod a-w as an ordinary user."""
    if os.geteuid() != 0:
        for p in [src, *src.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)
        try:
            yield src
        finally:
            for p in [src, *src.rglob("*")]:
                p.chmod(p.stat().st_mode | 0o200)
    elif can_mount():
        ro.mkdir(mode=0o700)
        subprocess.run(["mount", "--bind", str(src), str(ro)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True)
            yield ro
        finally:
            subprocess.run(["umount", str(ro)], capture_output=True)
    else:
        pytest.skip("root without mount: no way to make a directory read-only for root")
