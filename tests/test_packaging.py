"""Packaging: the distribution installs quack, quack_build and quack_kernels (the repository
folder kernels/, renamed so it cannot clash with Hugging Face's `kernels`), every subpackage
of the tree is listed, and a real non-editable install sits next to Hugging Face's
`kernels` with both importable."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _setuptools_cfg() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_is_listed_and_kernels_is_renamed():
    cfg = _setuptools_cfg()
    listed = set(cfg["packages"])
    assert cfg["package-dir"] == {"quack_kernels": "kernels"}
    assert "kernels" not in listed and "quack_kernels" in listed
    on_disk = {"quack_kernels"}
    for top in ("quack", "quack_build"):
        for init in (ROOT / top).rglob("__init__.py"):
            on_disk.add(".".join(init.parent.relative_to(ROOT).parts))
    assert listed == on_disk, f"pyproject [tool.setuptools] packages vs tree: {listed ^ on_disk}"


def test_kernels_package_imports_itself_relatively():
    """Nothing inside kernels/ names a top-level `kernels`: it installs as quack_kernels."""
    import ast

    for f in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_bytes())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            assert not [n for n in names if n.split(".")[0] == "kernels"], f"{f.name}: {names}"
        assert '"kernels.' not in f.read_text(), f"{f.name} names the module path kernels.*"


def _pip(py: Path, *args: str) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "-q",
            "--disable-pip-version-check",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(ROOT.parent),
    )
    out = r.stdout[-3000:] + r.stderr[-3000:]
    if r.returncode != 0 and "Failed to establish a new connection" in out and not os.environ.get("CI"):
        # A machine with no route to the package index (the GPU machine): nothing to
        # install from. CI has one, and fails there instead of skipping.
        pytest.skip(f"no package index reachable for pip install {' '.join(args)}")
    assert r.returncode == 0, f"pip install {' '.join(args)} failed:\n{out}"


@pytest.mark.slow
def test_non_editable_install_next_to_huggingface_kernels(tmp_path):
    """A fresh venv: Hugging Face's `kernels` with the light dependencies quack imports,
    then `pip install .` (not editable; the heavy GPU dependencies left out, they don't
    decide what lands in site-packages). Both packages import, each from its own files."""
    env_dir = tmp_path / "venv"
    # No pip of its own: this interpreter's pip installs into it (`pip --python`), as
    # test_bundles_e2e.py's venvs do. ensurepip was 9 of the test's 50 CPU-seconds.
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    # Hugging Face's package and quack's light dependencies in one resolve (one pip run
    # fewer: each costs seconds of start-up); then quack itself, --no-deps.
    _pip(py, "kernels", "numpy", "typer>=0.12,<0.29", "rich>=13", "tomli-w>=1.0", "filelock>=3.20.3")
    _pip(py, "--no-deps", str(ROOT))
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    code = (
        "import kernels, quack, quack_kernels\n"
        "import quack_kernels.rmsnorm, quack_kernels.softmax, quack_kernels.layernorm, "
        "quack_kernels.cross_entropy\n"
        "from quack import registry\n"
        "assert callable(kernels.get_kernel), 'not Hugging Face kernels'\n"
        "spec = registry.get('rmsnorm_fwd')\n"
        "print(kernels.__file__); print(quack_kernels.__file__); print(spec.module)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QUACK_CACHE_DIR")}
    r = subprocess.run(
        [str(py), "-c", code], capture_output=True, text=True, timeout=120, cwd=str(tmp_path), env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    hf_file, qk_file, module = r.stdout.split()
    assert hf_file == os.path.join(site, "kernels", "__init__.py")
    assert qk_file == os.path.join(site, "quack_kernels", "__init__.py")
    assert module == "quack_kernels.rmsnorm"
    # The Hugging Face package's files are its own, none of ours mixed in.
    ours = {p.name for p in (ROOT / "kernels").glob("*.py")} - {"__init__.py"}
    assert not ours & {p.name for p in (Path(site) / "kernels").glob("*.py")}
    # PEP 561: the type markers are installed with the packages.
    assert (Path(site) / "quack" / "py.typed").is_file() and (
        Path(site) / "quack_build" / "py.typed"
    ).is_file()
