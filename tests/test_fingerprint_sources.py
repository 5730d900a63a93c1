"""Issue 24, item 3, end to end: a kernel's fingerprint covers the source it depends on
outside its own package (a helper package beside it, a PYTHONPATH folder's module, its
``depends_on`` files and modules) and the installed distributions it imports by version.
One real toy kernel is built once; each edit must make ``quack build -n`` say it needs
compiling and make a prebuilt process miss instead of loading the old object."""

from __future__ import annotations

import compileall
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from reliability_support import run_quack

from quack.cache import fpmemo

KERNEL = """
import importlib

import helperpkg.consts  # a helper package beside the kernel package
from quack import jit_cache
from quack.params import Dtype


@jit_cache("gp_scale", params={"dtype": Dtype()}, depends_on=["../tables/", "qkgen"])
def gp_scale(dtype: str):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    import fakedist  # an installed distribution (a dist-info beside it)
    import pplib  # a module of a PYTHONPATH folder

    gen = importlib.import_module("qkgen")  # not an import statement: declared in depends_on
    dt = {"float32": cutlass.Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[dtype]
    scale = helperpkg.consts.SCALE * pplib.FACTOR * gen.G * fakedist.F

    @cute.kernel
    def k(gx: cute.Tensor, gy: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 128 + tidx
        if i < cute.size(gx, mode=[0]):
            gy[i] = (gx[i].to(cutlass.Float32) * scale).to(gy.element_type)

    @cute.jit
    def launch(x: cute.Tensor, y: cute.Tensor, stream):
        n = cute.size(x, mode=[0])
        k(x, y).launch(grid=((n + 127) // 128, 1, 1), block=(128, 1, 1), stream=stream)

    n = cute.sym_int()
    x = make_fake_tensor(dt, (n,), stride=(1,))
    y = make_fake_tensor(dt, (n,), stride=(1,))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, x, y, stream, options="--enable-tvm-ffi")
"""

CHILD = r"""
import json, sys
from quack.errors import KernelNotPrebuilt
from quack.cache import fpmemo, sources
from quack import settings
if sys.argv[1] == "no-walk":  # a memo hit must not walk the imports, parse or hash
    def boom(*a, **k):
        raise AssertionError("the imports were walked on a memo hit")
    sources.coverage = sources.imported_names = boom
import gemmprobe.scale as m
out = {}
try:
    m.gp_scale("bfloat16")
    out["how"] = m.gp_scale.usage()[0]["how"]
except KernelNotPrebuilt:
    out["not_prebuilt"] = True
memo = fpmemo.for_root(settings.get().cache_dir)
out["memo"] = [memo.hits, memo.misses]
print(json.dumps(out))
"""


def _dist(root, version):
    info = root / f"fakedist-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakedist\nVersion: {version}\n\n")
    (info / "RECORD").write_text(
        f"fakedist/__init__.py,,\nfakedist-{version}.dist-info/METADATA,,\nfakedist-{version}.dist-info/RECORD,,\n"
    )


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    base = tmp_path_factory.mktemp("fpsrc")
    p, pp, dd = base / "proj", base / "pp", base / "dists"
    files = {
        p / "quack.toml": '[build]\nkernel_packages = ["gemmprobe"]\nmanifests = ["m.toml"]\n',
        p / "m.toml": '[[kernel]]\nname = "gp_scale"\n[kernel.params]\ndtype = "bfloat16"\n',
        p / "gemmprobe" / "__init__.py": "",
        p / "gemmprobe" / "scale.py": KERNEL,
        p / "helperpkg" / "__init__.py": "",
        p / "helperpkg" / "consts.py": "SCALE = 2.0\n",
        p / "tables" / "coef.txt": "1 2 3\n",
        pp / "pplib.py": "FACTOR = 1.0\n",
        pp / "qkgen.py": "G = 1.0\n",
        dd / "fakedist" / "__init__.py": "F = 1.0\n",
    }
    for f, text in files.items():
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    _dist(dd, "1.0")
    for d in (p, pp, dd):
        assert compileall.compile_dir(str(d), quiet=1)  # __pycache__ made before the racy window
    env = {k: v for k, v in os.environ.items() if not k.startswith("QUACK_")}
    env.update(
        QUACK_CACHE_DIR=str(base / "cache"),
        QUACK_ARCH="sm_90a",
        PYTHONPATH=os.pathsep.join([str(p), str(pp), str(dd), os.environ.get("PYTHONPATH", "")]),
    )
    time.sleep(fpmemo.RACY_NS / 1e9 + 0.1)  # the sources are older than the memo's racy window
    r = run_quack(["build", "-j", "1", "--json"], cwd=p, env_=env, timeout=400, check_rc=0)
    assert json.loads(r.stdout)["compiled"] == 1
    return {"proj": p, "pp": pp, "dists": dd, "env": env}


def dry(ctx) -> dict:
    r = run_quack(["build", "-n", "--json"], cwd=ctx["proj"], env_=ctx["env"], check_rc=0)
    d = json.loads(r.stdout)
    return {"cached": d["cached"], "to_compile": d["to_compile"]}


def child(ctx, mode="plain") -> dict:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        env=dict(ctx["env"], QUACK_MODE="prebuilt"),
        cwd=str(ctx["proj"]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_fresh_process_hits_through_the_memo_without_walking_imports(proj):
    got = child(proj, "no-walk")
    assert got["how"] == "so" and got["memo"] == [1, 0], got


EDITS = {
    "helper_package_beside": lambda c: c["proj"] / "helperpkg" / "consts.py",
    "pythonpath_module": lambda c: c["pp"] / "pplib.py",
    "depends_on_file": lambda c: c["proj"] / "tables" / "coef.txt",
    "depends_on_module": lambda c: c["pp"] / "qkgen.py",
}


@pytest.mark.parametrize("what", sorted(EDITS))
def test_an_edit_outside_the_kernel_package_is_never_served_stale(proj, what):
    assert dry(proj) == {"cached": 1, "to_compile": 0}
    f = EDITS[what](proj)
    old = f.read_bytes()
    f.write_bytes(old + b"\n# one more line\n")
    try:
        assert dry(proj) == {"cached": 0, "to_compile": 1}
        got = child(proj)
        assert got.get("not_prebuilt") is True and "how" not in got, got
    finally:
        f.write_bytes(old)
    assert dry(proj) == {"cached": 1, "to_compile": 0}  # the same bytes: the same fingerprint


def test_an_installed_distribution_enters_by_version_not_by_bytes(proj):
    dd = proj["dists"]
    init = dd / "fakedist" / "__init__.py"
    old = init.read_bytes()
    init.write_bytes(old + b"# installed files are not hashed\n")
    try:
        assert dry(proj) == {"cached": 1, "to_compile": 0}
    finally:
        init.write_bytes(old)
    shutil.rmtree(dd / "fakedist-1.0.dist-info")
    _dist(dd, "1.1")  # an upgrade
    try:
        assert dry(proj) == {"cached": 0, "to_compile": 1}
        got = child(proj)
        assert got.get("not_prebuilt") is True and "how" not in got, got
    finally:
        shutil.rmtree(dd / "fakedist-1.1.dist-info")
        _dist(dd, "1.0")
    assert dry(proj) == {"cached": 1, "to_compile": 0}


def test_build_verbose_lists_what_the_fingerprint_covers(proj):
    r = run_quack(["build", "-n", "-v"], cwd=proj["proj"], env_=proj["env"], check_rc=0)
    out = r.stdout + r.stderr
    p, pp = proj["proj"], proj["pp"]
    assert "sources of gp_scale (fingerprint " in out
    for f in (
        p / "gemmprobe" / "scale.py",
        p / "helperpkg" / "consts.py",
        p / "tables" / "coef.txt",
        pp / "pplib.py",
        pp / "qkgen.py",
    ):
        assert f"  file  {f}  (" in out, (f, out)
    assert "  dist  fakedist 1.0" in out and "  dist  nvidia-cutlass-dsl" in out
    assert str(proj["dists"] / "fakedist") not in out  # by version, not by its files
    assert "(importlib)" not in out  # the standard library: covered by the Python version
