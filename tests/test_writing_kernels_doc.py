"""docs/writing-kernels.md builds: every block starting with `# file: PATH` is written
out as a project, `quack build` compiles its manifest for real (sm_90a, on CPU), `quack
verify` loads every entry in a fresh process, and prebuilt mode loads the kernel, refuses
a configuration that was not built and one its rule forbids."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from reliability_support import ROOT, env, run_quack

DOC = ROOT / "docs" / "writing-kernels.md"
BLOCK = re.compile(r"```(?:python|toml)\n# file: (?P<path>\S+)\n(?P<body>.*?)```", re.S)

_PREBUILT = r"""
import json
from quack.errors import KernelNotPrebuilt, ParamError
from mykernels.scale import compile_my_scale
out = {"callable": callable(compile_my_scale("bfloat16", 256, False))}
u = compile_my_scale.usage()[0]
out["how"], out["compiles"] = u["how"], u["compiles"]
try:
    compile_my_scale("bfloat16", 64, False)
except KernelNotPrebuilt as e:
    out["not_prebuilt"] = "[[kernel]]" in str(e)
try:
    compile_my_scale("bfloat16", 100, False)
except ParamError as e:
    out["rule"] = str(e)
print(json.dumps(out))
"""


def test_writing_kernels_example_builds_and_loads(tmp_path):
    files = {m.group("path"): m.group("body") for m in BLOCK.finditer(DOC.read_text())}
    assert set(files) == {
        "quack.toml",
        "mykernels/__init__.py",
        "mykernels/scale.py",
        "manifests/kernels.toml",
    }, sorted(files)
    proj = tmp_path / "myproject"
    for rel, body in files.items():
        (proj / rel).parent.mkdir(parents=True, exist_ok=True)
        (proj / rel).write_text(body)
    e = env(QUACK_CACHE_DIR=tmp_path / "cache")
    e["PYTHONPATH"] = f"{proj}:{e['PYTHONPATH']}"

    r = run_quack(["build", "--jobs", "2", "--json"], cwd=proj, timeout=400, env_=e)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert (res["total"], res["compiled"], res["failed"]) == (6, 6, 0), res
    r = run_quack(["verify", "--json"], cwd=proj, timeout=400, env_=e)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["total"] == 6

    e["QUACK_MODE"] = "prebuilt"
    p = subprocess.run(
        [sys.executable, "-c", _PREBUILT], cwd=str(proj), env=e, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["callable"] and out["compiles"] == 0 and out["how"] in ("so", "o"), out
    assert out["not_prebuilt"] is True
    assert out["rule"] == (
        "my_scale: block = 100 is not allowed with dtype='bfloat16', bias=False: "
        "block must be a multiple of 32 (whole warps)"
    )
