"""Issue 13, end to end: `quack bundle` of the default manifest (real objects from the
project's cache; what is missing is built), the wheel installed with pip into fresh
virtual environments (the project reached through a .pth file), fresh interpreters
loading every configuration in prebuilt mode from an empty, a disabled and a
read-only cache; tampering, two bundles, another toolchain's bundle, uninstalling,
signatures; the CLI (inspect, verify --bundles, cache stats)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from reliability_support import NO_TORCH

from quack import settings
from quack.runtime import loader

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "manifests" / "default.toml"
T = 600  # every subprocess has this time-out (seconds)


def quack_cli(*args, env=None, python=sys.executable, timeout=T):
    return subprocess.run(
        [str(python), "-m", "quack_build", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env or os.environ.copy(),
        timeout=timeout,
    )


@functools.cache
def project_cache() -> Path:
    """The session's cache, holding the default manifest. README command 1 built it there;
    where that did not run (a fresh cache: README command 2 alone, as on the GPU machine),
    it is built here through the cache like a user's build, once per process (a no-op in
    0.3 s when it is there). Before, these tests failed with "not in the cache"."""
    cache = settings.resolve(cwd=ROOT).cache_dir
    r = quack_cli("build", DEFAULT, "--cache-dir", cache)
    assert r.returncode == 0, f"building the default manifest failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}"
    return cache


def default_configs() -> list[dict]:
    from quack import registry
    from quack_build.manifest.read import expand

    registry.load_packages(["quack_kernels"])
    exp = expand([DEFAULT], archs=("sm_90a",))
    return [{"kernel": c.kernel, "params": c.plain_params, "key": c.key} for c in exp.configs]


@pytest.fixture(scope="module")
def default_wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    r = quack_cli(
        "bundle",
        DEFAULT,
        "--name",
        "e2e-default",
        "--version",
        "1.0",
        "-o",
        out,
        "--cache-dir",
        project_cache(),
        "--json",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["entries"] == len(default_configs()) == 51
    from quack.tuning import gpu_choice

    # the model whose rows chose the configurations, as this machine's build chose it
    model = gpu_choice()[0]
    assert res["tune_gpu"]["models"] == ([model] if model else []) and res["tune_gpu"]["source"], res[
        "tune_gpu"
    ]
    return Path(res["wheel"])


def fresh_venv(d: Path) -> Path:
    """A new virtual environment that sees this one's packages (the project, torch,
    cutlass) through a .pth file; its own site-packages come first."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d)], check=True, timeout=T)
    py = d / "bin" / "python"
    site_dir = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=T,
    ).stdout.strip()
    parent = sysconfig.get_paths()["purelib"]
    Path(site_dir, "_quack_test_parent.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    return py


def pip(py: Path, *args):
    r = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=T,
        env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r


# the loads only: no tensor reaches a kernel (NO_TORCH: ~3 CPU-s less a process)
_LOAD = (
    NO_TORCH
    + r"""
import json, sys, warnings
warnings.simplefilter("always")
import quack
from quack import registry
from quack.runtime import jit
from quack.errors import CacheWarning
registry.load_packages(["quack_kernels"])
cfgs = json.load(open(sys.argv[1]))
out = {"loaded": [], "missing": [], "message": "", "warnings": []}
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    for c in cfgs:
        try:
            fn = jit.kernel(c["kernel"])(**c["params"])
            assert callable(fn)
            out["loaded"].append(c["key"])
        except quack.KernelNotPrebuilt as e:
            out["missing"].append(c["key"])
            out["message"] = str(e)
out["warnings"] = [str(x.message) for x in w if issubclass(x.category, CacheWarning)]
usage = [u for n in sorted({c["kernel"] for c in cfgs}) for u in jit.kernel(n).usage()]
out["tiers"] = sorted({u["tier"] for u in usage})
out["hows"] = sorted({u["how"] for u in usage})
out["compiles"] = sum(u["compiles"] for u in usage)
out["cutlass"] = sorted(m for m in sys.modules if m == "cutlass" or m.startswith("cutlass."))
print(json.dumps(out))
"""
)


def load_all(py: Path, tmp: Path, cfgs: list[dict], **env_over) -> dict:
    (tmp / "cfgs.json").write_text(json.dumps(cfgs))
    env = dict(os.environ, QUACK_MODE="prebuilt", QUACK_ARCH="sm_90a", CUDA_VISIBLE_DEVICES="")
    env.update({k: str(v) for k, v in env_over.items()})
    r = subprocess.run(
        [str(py), "-c", _LOAD, str(tmp / "cfgs.json")],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
        timeout=T,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def assert_all_from_bundle(out: dict, n: int, name: str):
    assert len(out["loaded"]) == n and not out["missing"], out["message"]
    assert out["tiers"] == [f"bundle:{name}"], out["tiers"]
    assert out["compiles"] == 0 and out["cutlass"] == [], out
    assert out["warnings"] == [], out["warnings"]


@pytest.fixture(scope="module")
def installed(default_wheel, tmp_path_factory):
    d = tmp_path_factory.mktemp("venv")
    py = fresh_venv(d / "v")
    pip(py, "install", "--no-deps", "--no-index", default_wheel)
    return py


def empty_cache(tmp: Path) -> Path:
    c = tmp / "cache"
    c.mkdir(mode=0o700)
    return c


def test_every_default_configuration_loads_from_the_bundle_empty_cache(installed, tmp_path):
    cfgs = default_configs()
    cache = empty_cache(tmp_path)
    out = load_all(installed, tmp_path, cfgs, QUACK_CACHE_DIR=cache)
    assert_all_from_bundle(out, 51, "e2e-default")
    assert out["hows"] == ["so"]
    assert not list(cache.rglob("*.o")) and not list(cache.rglob("*.so")), "the bundle's .so is used in place"


def test_every_default_configuration_loads_with_the_cache_disabled(installed, tmp_path):
    cache = tmp_path / "never-created"
    out = load_all(installed, tmp_path, default_configs(), QUACK_CACHE_DIR=cache, QUACK_CACHE_ENABLED="0")
    assert_all_from_bundle(out, 51, "e2e-default")
    assert not cache.exists()


@pytest.fixture
def read_only_empty_cache(tmp_path):
    from reliability_support import can_mount

    src = empty_cache(tmp_path)
    if os.geteuid() != 0:
        src.chmod(0o500)
        yield src
        src.chmod(0o700)
    elif can_mount():
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o700)
        subprocess.run(["mount", "--bind", str(src), str(ro)], check=True, timeout=60)
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True, timeout=60)
            yield ro
        finally:
            subprocess.run(["umount", str(ro)], capture_output=True, timeout=60)
    else:
        pytest.skip("root without mount: no way to make a directory read-only for root")


def test_every_default_configuration_loads_with_a_read_only_cache(installed, tmp_path, read_only_empty_cache):
    out = load_all(installed, tmp_path, default_configs(), QUACK_CACHE_DIR=read_only_empty_cache)
    assert_all_from_bundle(out, 51, "e2e-default")
    assert list(read_only_empty_cache.iterdir()) == []


def _tamper(wheel: Path, out_dir: Path) -> tuple[Path, str]:
    """A copy of ``wheel`` with one object's bytes altered (RECORD left as built)."""
    out_dir.mkdir()
    dst = out_dir / wheel.name
    key = ""
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if not key and info.filename.endswith(".o"):
                b = bytearray(data)
                b[len(b) // 2] ^= 0xFF
                data = bytes(b)
                key = Path(info.filename).stem
            zout.writestr(info, data)
    return dst, key


def test_tampered_wheel_entry_refused_and_verify_fails(default_wheel, tmp_path):
    bad, key = _tamper(default_wheel, tmp_path / "bad")
    r = quack_cli("bundle", "inspect", bad)
    assert r.returncode == 1 and key[:12] in r.stdout, r.stdout + r.stderr
    assert quack_cli("bundle", "inspect", default_wheel).returncode == 0
    py = fresh_venv(tmp_path / "v")
    pip(py, "install", "--no-deps", "--no-index", bad)
    cfgs = default_configs()
    out = load_all(py, tmp_path, cfgs, QUACK_CACHE_DIR=empty_cache(tmp_path))
    assert out["missing"] == [key] and len(out["loaded"]) == 50 and out["compiles"] == 0
    assert "bundles searched: e2e-default 1.0" in out["message"]
    assert len(out["warnings"]) == 1 and "checksum mismatch" in out["warnings"][0], out["warnings"]
    r = quack_cli("verify", "--bundles", "--json", python=py)
    assert r.returncode == 1, r.stdout + r.stderr
    res = json.loads(r.stdout)
    bad_rows = [e for e in res["entries"] if e["problems"]]
    assert [e["key"] for e in bad_rows] == [key] and len(res["entries"]) == 51


def test_two_bundles_with_the_same_keys_both_checked(default_wheel, tmp_path):
    man = tmp_path / "one.toml"
    man.write_text(
        '[[kernel]]\nname = "softmax_fwd"\n[kernel.params]\ndtype = "bfloat16"\nn = [4096, 32768]\n'
    )
    r = quack_cli(
        "bundle",
        man,
        "--name",
        "e2e-extra",
        "-o",
        tmp_path / "dist",
        "--cache-dir",
        project_cache(),
        "--json",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    extra = Path(json.loads(r.stdout)["wheel"])
    py = fresh_venv(tmp_path / "v")
    pip(py, "install", "--no-deps", "--no-index", default_wheel, extra)
    out = load_all(py, tmp_path, default_configs(), QUACK_CACHE_DIR=empty_cache(tmp_path))
    assert len(out["loaded"]) == 51 and out["compiles"] == 0 and out["cutlass"] == []
    assert out["tiers"] == ["bundle:e2e-default"]  # first by name; both are fine
    r = quack_cli("verify", "--bundles", "--json", python=py)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert sorted(b["name"] for b in res["bundles"]) == ["e2e-default", "e2e-extra"]
    assert len(res["entries"]) == 53 and all(e.get("loaded") == "so" for e in res["entries"])
    r = quack_cli(
        "cache",
        "stats",
        python=py,
        env=dict(os.environ, QUACK_CACHE_DIR=str(tmp_path / "cache"), COLUMNS="200"),
    )
    assert r.returncode == 0 and "installed bundles" in r.stdout, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "e2e-" in ln]
    assert len(lines) == 2 and all("current" in ln for ln in lines), r.stdout


def test_other_toolchain_bundle_ignored_and_reported(tmp_path):
    from quack import registry
    from quack.cache.store import DiskStore
    from quack_build.bundle import wheel as bw
    from quack_build.manifest.read import expand

    registry.load_packages(["quack_kernels"])
    cfgs = expand([DEFAULT], archs=("sm_90a",)).configs[:2]
    files, problems = bw.collect(cfgs, DiskStore(project_cache()))
    assert not problems, problems
    for f in files:  # as if built with another cutlass-dsl
        f.entry = dataclasses.replace(f.entry, stamp=f.entry.stamp.replace("cutlass", "cutlass9.9.9-x"))
    whl, _ = bw.write_wheel(files, name="e2e-old", version="0.9", out_dir=tmp_path / "dist")
    py = fresh_venv(tmp_path / "v")
    pip(py, "install", "--no-deps", "--no-index", whl)
    c = [{"kernel": x.kernel, "params": x.plain_params, "key": x.key} for x in cfgs]
    out = load_all(py, tmp_path, c, QUACK_CACHE_DIR=empty_cache(tmp_path))
    assert out["loaded"] == [] and len(out["missing"]) == 2 and out["compiles"] == 0
    assert "e2e-old 0.9 (0 of 2 entries for this toolchain and sm_90a)" in out["message"]
    r = quack_cli(
        "cache", "stats", "--json", python=py, env=dict(os.environ, QUACK_CACHE_DIR=str(tmp_path / "cache"))
    )
    assert r.returncode == 0, r.stderr
    [b] = json.loads(r.stdout)["bundles"]
    assert b["name"] == "e2e-old" and b["current"] is False and b["entries"] == 2
    assert "cutlass9.9.9-x" in b["stamps"][0]
    r = quack_cli("verify", "--bundles", python=py)
    assert r.returncode == 1 and "none of its entries is for this toolchain and arch" in r.stdout, r.stdout


def test_uninstalled_bundle_entries_disappear(default_wheel, tmp_path):
    py = fresh_venv(tmp_path / "v")
    pip(py, "install", "--no-deps", "--no-index", default_wheel)
    cfgs = default_configs()[:3]
    out = load_all(py, tmp_path, cfgs, QUACK_CACHE_DIR=empty_cache(tmp_path))
    assert len(out["loaded"]) == 3
    pip(py, "uninstall", "-y", "e2e-default")
    out = load_all(py, tmp_path, cfgs, QUACK_CACHE_DIR=tmp_path / "cache")
    assert out["loaded"] == [] and len(out["missing"]) == 3 and out["compiles"] == 0
    assert "bundles searched: none installed" in out["message"]
    r = quack_cli(
        "cache", "stats", "--json", python=py, env=dict(os.environ, QUACK_CACHE_DIR=str(tmp_path / "cache"))
    )
    assert json.loads(r.stdout)["bundles"] == []
    r = quack_cli("verify", "--bundles", python=py)
    assert r.returncode == 1 and "no quack bundles are installed" in r.stdout, r.stdout + r.stderr


def test_signed_bundle_trusted_and_refused(tmp_path):
    keys = tmp_path / "keys"
    assert quack_cli("keygen", "ci-1", "-o", keys).returncode == 0
    assert quack_cli("keygen", "stranger", "-o", keys).returncode == 0
    man = tmp_path / "one.toml"
    man.write_text(
        '[[kernel]]\nname = "rmsnorm_fwd"\n[kernel.params]\ndtype = "bfloat16"\nn = 4096\n'
        "has_weight = true\nhas_bias = false\nhas_residual = false\n"
    )
    r = quack_cli(
        "bundle",
        man,
        "--name",
        "e2e-signed",
        "-o",
        tmp_path / "dist",
        "--sign",
        "--signing-key",
        keys / "ci-1.key",
        "--cache-dir",
        project_cache(),
        "--json",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    whl = Path(json.loads(r.stdout)["wheel"])
    assert json.loads(r.stdout)["signed_by"] == "ci-1"
    r = quack_cli(
        "bundle",
        man,
        "--name",
        "x",
        "--sign",
        "-o",
        tmp_path / "d2",
        "--cache-dir",
        project_cache(),
        env={k: v for k, v in os.environ.items() if k != "QUACK_SIGNING_KEY"},
    )
    assert r.returncode == 1 and "--sign needs a signing key" in r.stderr
    py = fresh_venv(tmp_path / "v")
    pip(py, "install", "--no-deps", "--no-index", whl)
    from quack import registry
    from quack_build.manifest.read import expand

    registry.load_packages(["quack_kernels"])
    cfgs = [
        {"kernel": c.kernel, "params": c.plain_params, "key": c.key}
        for c in expand([man], archs=("sm_90a",)).configs
    ]
    good = load_all(
        py, tmp_path, cfgs, QUACK_CACHE_DIR=empty_cache(tmp_path), QUACK_TRUSTED_KEYS=keys / "ci-1.pub"
    )
    assert_all_from_bundle(good, 1, "e2e-signed")
    bad = load_all(
        py, tmp_path, cfgs, QUACK_CACHE_DIR=tmp_path / "cache", QUACK_TRUSTED_KEYS=keys / "stranger.pub"
    )
    assert bad["loaded"] == [] and bad["compiles"] == 0
    assert len(bad["warnings"]) == 1 and "not a trusted key" in bad["warnings"][0], bad["warnings"]
    r = quack_cli(
        "verify", "--bundles", python=py, env=dict(os.environ, QUACK_TRUSTED_KEYS=str(keys / "stranger.pub"))
    )
    assert r.returncode == 1
    r = quack_cli(
        "bundle", "inspect", whl, "--json", env=dict(os.environ, QUACK_TRUSTED_KEYS=str(keys / "ci-1.pub"))
    )
    assert r.returncode == 0 and json.loads(r.stdout)["signer"] == "ci-1"


needs_link = pytest.mark.skipif(
    not loader.can_link(), reason="needs a C compiler and cutlass-dsl's runtime libraries"
)


@pytest.fixture(scope="module")
def noso(tmp_path_factory):
    """A bundle of two default configurations as built on a machine without a C
    compiler (objects only), installed into a fresh venv: (python, configs, files)."""
    from quack import registry
    from quack.cache.store import DiskStore
    from quack_build.bundle import wheel as bw
    from quack_build.manifest.read import expand

    tmp = tmp_path_factory.mktemp("noso")
    registry.load_packages(["quack_kernels"])
    cfgs = expand([DEFAULT], archs=("sm_90a",)).configs[:2]
    files, problems = bw.collect(cfgs, DiskStore(project_cache()))
    assert not problems
    for f in files:
        f.so = None
        f.entry = dataclasses.replace(f.entry, so_sha256=None, so_size=None)
    whl, _ = bw.write_wheel(files, name="e2e-noso", version="1", out_dir=tmp / "dist")
    py = fresh_venv(tmp / "v")
    pip(py, "install", "--no-deps", "--no-index", whl)
    return py, [{"kernel": x.kernel, "params": x.plain_params, "key": x.key} for x in cfgs], files


@needs_link
def test_bundle_without_so_links_into_the_local_cache_or_a_private_dir(noso, tmp_path):
    py, c, files = noso
    cache = empty_cache(tmp_path)
    out = load_all(py, tmp_path, c, QUACK_CACHE_DIR=cache)
    assert_all_from_bundle(out, 2, "e2e-noso")
    sos = sorted(cache.rglob("*.so"))
    assert sorted(p.stem for p in sos) == sorted(x["key"] for x in c) and not list(cache.rglob("*.o"))
    inodes = [p.stat().st_ino for p in sos]
    out = load_all(py, tmp_path, c, QUACK_CACHE_DIR=cache)  # reuses the derived .so, no relink
    assert_all_from_bundle(out, 2, "e2e-noso")
    assert [p.stat().st_ino for p in sorted(cache.rglob("*.so"))] == inodes
    off = tmp_path / "off"
    out = load_all(py, tmp_path, c, QUACK_CACHE_DIR=off, QUACK_CACHE_ENABLED="0")
    assert_all_from_bundle(out, 2, "e2e-noso")
    assert not off.exists()
    side = json.loads(next(cache.rglob(f"{files[0].entry.key}.so.json")).read_text())
    assert side["o_sha256"] == hashlib.sha256(files[0].obj).hexdigest()
    # `quack cache clean` keeps a bundle's derived .so, even an old one (it is no interrupted
    # publish, though it has no .o beside it); --all removes it.
    for p in [*cache.rglob("*.so"), *cache.rglob("*.so.json")]:
        os.utime(p, (p.stat().st_atime - 3600, p.stat().st_mtime - 3600))
    assert quack_cli("cache", "clean", "--cache-dir", cache).returncode == 0
    assert len(list(cache.rglob("*.so"))) == 2
    r = quack_cli("cache", "clean", "--all", "--json", "--cache-dir", cache)
    assert r.returncode == 0 and not list(cache.rglob("*.so")) and not list(cache.rglob("*.so.json"))
    assert (
        json.loads(r.stdout)["by_reason"]["derived .so of a bundle entry (relinked on next use)"]["files"]
        == 4
    )


@needs_link
def test_bundle_without_so_read_only_cache_links_privately(noso, tmp_path, read_only_empty_cache):
    py, c, _ = noso
    out = load_all(py, tmp_path, c, QUACK_CACHE_DIR=read_only_empty_cache)
    assert_all_from_bundle(out, 2, "e2e-noso")
    assert list(read_only_empty_cache.iterdir()) == []


def test_bundle_cli_usage_errors(tmp_path):
    r = quack_cli("bundle", DEFAULT, "--name", "Bad Name", "-o", tmp_path)
    assert r.returncode == 2 and "bundle name" in r.stderr
    r = quack_cli("bundle", DEFAULT, "--name", "ok", "--version", "not a version", "-o", tmp_path)
    assert r.returncode == 2 and "PEP 440" in r.stderr
    r = quack_cli("bundle", "inspect", DEFAULT)
    assert r.returncode == 1 and "not a readable wheel" in r.stderr
    # A bundle named like the runtime (as pip normalises names) or an installed package
    # replaced it when installed: refused before anything is built.
    for name, why in (("quack_cache", "runtime's own distribution"), ("numpy", "not a quack bundle")):
        r = quack_cli("bundle", DEFAULT, "--name", name, "-o", tmp_path)
        assert r.returncode == 2, r.stderr
        assert f"error: --name: bundle name {name!r}" in r.stderr and why in r.stderr
        assert "Traceback" not in r.stderr and "quack build" not in r.stdout + r.stderr
    assert not list(tmp_path.iterdir())
