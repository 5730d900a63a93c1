"""Third-party projects (issue 9, friction): quack.toml is found from the manifest's
directory, the bundled demo kernels stay out of a project that doesn't ask for them,
kernels in subpackages register, and 'no such kernel' says what was scanned."""

from __future__ import annotations

import json
from pathlib import Path

from reliability_support import env, run_quack

KERNEL = """
from quack import jit_cache
from quack.params import Int


@jit_cache("{name}", params={{"n": Int(min=1, max=100)}})
def {name}(n: int = 1):
    raise NotImplementedError  # never compiled here: --dry-run
"""


def _project(d: Path, packages: str | None = '["thirdk"]') -> Path:
    (d / "thirdk" / "sub").mkdir(parents=True)
    (d / "thirdk" / "__init__.py").write_text("")
    (d / "thirdk" / "top.py").write_text(KERNEL.format(name="third_top"))
    (d / "thirdk" / "sub" / "__init__.py").write_text("")
    (d / "thirdk" / "sub" / "deep.py").write_text(KERNEL.format(name="third_deep"))
    (d / "thirdk" / "_hidden.py").write_text(KERNEL.format(name="third_hidden"))
    (d / "quack.toml").write_text(
        "[build]\n" + (f"kernel_packages = {packages}\n" if packages else "") + '[runtime]\narch = "sm_90a"\n'
    )
    (d / "m.toml").write_text('[[kernel]]\nname = "third_top"\n[[kernel]]\nname = "third_deep"\n')
    return d / "m.toml"


def _dry(args, cwd: Path, extra_path: Path):
    e = env(QUACK_CACHE_DIR=cwd / "cache")
    e["PYTHONPATH"] = f"{extra_path}:{e['PYTHONPATH']}"
    return run_quack(["build", "--dry-run", "--json", *map(str, args)], cwd=cwd, timeout=120, env_=e)


def test_manifest_finds_its_own_quack_toml_and_subpackage_kernels(tmp_path):
    proj = tmp_path / "proj"
    m = _project(proj)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()  # no quack.toml here: the manifest's directory has one
    r = _dry([m], elsewhere, proj)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(k["kernel"] for k in json.loads(r.stdout)["keys"]) == ["third_deep", "third_top"]


def test_unknown_kernel_says_what_was_scanned_and_demo_kernels_stay_out(tmp_path):
    proj = tmp_path / "proj"
    _project(proj)
    m = proj / "other.toml"
    m.write_text('[[kernel]]\nname = "third_hidden"\n[[kernel]]\nname = "rmsnorm_fwd"\n')
    r = _dry([m], proj, proj)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert f"[build] kernel_packages in {proj / 'quack.toml'}: thirdk" in out
    assert "except modules and subpackages whose name starts with '_'" in out
    assert "registered kernels: third_deep, third_top." in out  # no quack_kernels demo kernels
    assert out.count("no kernel is registered under this name") == 2

    proj2 = tmp_path / "proj2"
    _project(proj2, packages=None)  # a quack.toml without kernel_packages: none, not the demos
    r = _dry([proj2 / "m.toml"], proj2, proj2)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "registered kernels: (none)" in out and "kernel_packages" in out, out


def test_cache_pull_finds_the_manifests_quack_toml(tmp_path):
    # `quack cache pull/push` read quack.toml from the working directory only, so a
    # project's [remote] url and kernel_packages were ignored when run from elsewhere
    # ("no remote cache configured") although `quack build` of the same manifest used them.
    proj = tmp_path / "proj"
    m = _project(proj)
    shared = tmp_path / "shared"
    shared.mkdir()
    from quack import signing

    _key, pub = signing.write_keypair("reader", proj)  # a pull without trusted keys is refused
    with open(proj / "quack.toml", "a") as f:
        f.write(f'[remote]\nurl = "file://{shared}"\ntrusted_keys = ["{pub.name}"]\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    e = env(QUACK_CACHE_DIR=elsewhere / "cache")
    e["PYTHONPATH"] = f"{proj}:{e['PYTHONPATH']}"
    r = run_quack(["cache", "pull", "--json", str(m)], cwd=elsewhere, timeout=120, env_=e)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "no remote cache configured" not in out
    rep = json.loads(r.stdout)
    assert rep["url"] == f"file://{shared}" and rep["total"] == 2 and rep["missing"] == 2, out


def test_the_scan_leaves_out_what_a_package_names_in_quack_scan_skip(tmp_path, monkeypatch):
    """quack_kernels.ops imports torch (torch.library ops) and registers nothing: scanned,
    it put torch into every build coordinator (the Ray test's 'IMPORTED torch=True')."""
    import sys

    from quack import registry

    pkg = tmp_path / "skippkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('QUACK_SCAN_SKIP = ("ops",)\n')
    (pkg / "ops.py").write_text("raise RuntimeError('the scan must not import me')\n")
    (pkg / "kern.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.load_packages(["skippkg"])
    assert "skippkg.kern" in sys.modules and "skippkg.ops" not in sys.modules
    for m in [m for m in sys.modules if m.split(".")[0] == "skippkg"]:
        del sys.modules[m]


def test_building_the_bundled_kernels_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys\nfrom quack import registry\nregistry.load_packages(['quack_kernels'])\n"
        "print('torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr
