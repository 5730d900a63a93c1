"""The worked example of examples/third_party built once per test module (for the CPU
checks in test_third_party_example.py and the launch in test_third_party_example_gpu.py)."""

from __future__ import annotations

import json
import shutil

import pytest
from reliability_support import ROOT, env, run_quack

EXAMPLE = ROOT / "examples" / "third_party"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    proj = tmp / "third_party"
    shutil.copytree(EXAMPLE, proj, ignore=shutil.ignore_patterns("__pycache__"))
    e = env(QUACK_CACHE_DIR=tmp / "cache")
    e.pop("CUTE_DSL_ARCH", None)  # the example's quack.toml says the arch
    r = run_quack(["build", "--jobs", "2", "--json"], cwd=proj, timeout=600, env_=e)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return proj, e, json.loads(r.stdout)
