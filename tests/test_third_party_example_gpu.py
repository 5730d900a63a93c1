"""examples/third_party on a GPU: every prebuilt configuration launched against torch
(the CPU checks are in test_third_party_example.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import third_party_support
from conftest import requires_gpu

built = third_party_support.built  # the module-scoped build, a fixture used by name

_LAUNCH = r"""
import json, sys, torch
from tp_kernels.dequant import tp_dequant
checked = 0
for p in json.loads(sys.argv[1]):  # every configuration the build compiled
    in_dt, out_dt = getattr(torch, p["in_dtype"]), getattr(torch, p["out_dtype"])
    x = (torch.randn(4096, 8, device="cuda") * 4).to(in_dt)
    y = tp_dequant(x, 0.5, out_dt, tuple(p["tile"]))
    ref = (x.float() * 0.5).to(out_dt)  # one multiply in fp32, one rounding: exact
    torch.testing.assert_close(y, ref, rtol=0, atol=0, msg=lambda m: f"{p}: {m}")
    checked += 1
print(json.dumps({"checked": checked}))
"""


@requires_gpu
def test_example_launches_every_prebuilt_configuration_against_torch(built):
    proj, e, res = built
    e = dict(e, QUACK_MODE="prebuilt", PYTHONPATH=f"{proj}:{e['PYTHONPATH']}")
    params = [k["params"] for k in res["keys"]]
    p = subprocess.run(
        [sys.executable, "-c", _LAUNCH, json.dumps(params)],
        cwd=proj,
        env=e,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"checked": 19}
