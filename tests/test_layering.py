"""The layering rule import-linter cannot see: nothing in quack outside
quack.compile imports cutlass (or torch) at module level, so `quack --help`,
`quack cache stats` and loading a prebuilt kernel never pay for the compiler."""

import json
import subprocess
import sys

_CODE = r"""
import importlib, json, pkgutil, sys
import quack
names = sorted(m.name for m in pkgutil.walk_packages(quack.__path__, "quack.")
               if not m.name.startswith("quack.compile"))
for n in names:
    importlib.import_module(n)
print(json.dumps({"modules": names, "heavy": sorted(m for m in sys.modules
                  if m.split(".")[0] in ("cutlass", "torch", "tvm_ffi"))}))
"""


def test_no_module_outside_compile_imports_cutlass_or_torch(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", _CODE], capture_output=True, text=True, timeout=120, cwd=str(tmp_path)
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "quack.runtime.tiers" in out["modules"] and "quack.testing.plugin" in out["modules"]
    assert len(out["modules"]) >= 20
    assert out["heavy"] == [], out["heavy"]
