"""What `quack cache stats` must not do, so that it stays cheap enough for scripts and
prompts with hundreds of entries (issue 24 item 5: 1.1 s on a loaded machine with 228
entries; well under 1 s wanted on a quiet one). Asserted on what a fresh process loads
and opens, not on durations: the table a user reads imports no compiler (cutlass,
tvm_ffi), no torch, no typer and no compile pool; `--json` not even rich; and neither
opens a cached object (`.o` / `.so`): the inventory is a walk of names and stat() sizes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quack.cache import keys

TESTS = Path(__file__).parent
ROOT = TESTS.parent
ENTRIES = 40

_PROBE = r"""
import json, sys
opened = []
def hook(event, args):
    # Every file a stats run opens: a cached object's bytes must never be read.
    if event == "open" and isinstance(args[0], str) and args[0].endswith((".o", ".so")):
        opened.append(args[0])
sys.addaudithook(hook)
from quack_build.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert not e.code, e.code
mods = ("torch", "cutlass", "tvm_ffi", "typer", "rich", "numpy", "quack.compile", "quack.compile.pool")
sys.stderr.write("PROBE " + json.dumps({"opened": opened, "loaded": [m for m in mods if m in sys.modules]}) + "\n")
"""


@pytest.fixture
def cache(tmp_path):
    """A project registering the toy kernels and a cache of ENTRIES current entries (with
    their linked .so) of one kernel, built without compiling."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "quack.toml").write_text('[build]\nkernel_packages = ["toykernels"]\n')
    d = root / "v1" / keys.toolchain_stamp("sm_90a") / "toy_scale" / "0123456789abcdef"
    d.mkdir(parents=True, mode=0o700)
    for i in range(ENTRIES):
        key = hashlib.sha256(str(i).encode()).hexdigest()
        data = os.urandom(2000)
        (d / f"{key}.o").write_bytes(data)
        (d / f"{key}.so").write_bytes(b"x" * 500)
        (d / f"{key}.so.json").write_text("{}")
        meta = {"format": 1, "key": key, "size": 2000, "sha256": hashlib.sha256(data).hexdigest()}
        (d / f"{key}.json").write_text(json.dumps(meta))
    return root, proj


def _stats(root: Path, proj: Path, *args: str) -> tuple[dict, str]:
    env = dict(os.environ, QUACK_CACHE_DIR=str(root), PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
    r = subprocess.run(
        [sys.executable, "-c", _PROBE, "cache", "stats", *args],
        cwd=proj,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    probe = [ln for ln in r.stderr.splitlines() if ln.startswith("PROBE ")]
    assert len(probe) == 1, r.stderr
    return json.loads(probe[0][len("PROBE ") :]), r.stdout


def test_stats_table_imports_no_compiler_torch_or_typer_and_reads_no_object(cache):
    got, out = _stats(*cache)
    assert f"{ENTRIES} entries" in out, out
    # rich draws the tables: the one heavy import the human-readable output needs.
    assert got["loaded"] == ["rich"], got["loaded"]
    assert got["opened"] == [], got["opened"][:5]


def test_stats_json_imports_not_even_rich_and_reads_no_object(cache):
    got, out = _stats(*cache, "--json")
    assert json.loads(out)["totals"]["entries"] == ENTRIES
    assert got["loaded"] == [], got["loaded"]
    assert got["opened"] == [], got["opened"][:5]
