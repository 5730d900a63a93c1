"""Per-kernel parameter rules (quack.params.Rule, issue 9 bug 10): declared at
registration, applied by manifest validation and at every call, before anything
compiles, with a message naming the parameter, the value and what is allowed."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import relkernels
from quack import registry
from quack.errors import ParamError
from quack.params import Int, Rule
from reliability_support import env, run_quack


def test_rule_refuses_at_call_time_before_compiling(quack_settings, tmp_path, monkeypatch):
    counter = tmp_path / "compiles"
    monkeypatch.setenv("QUACK_TEST_COUNTER", str(counter))
    with pytest.raises(ParamError) as ei:
        relkernels.rel_ruled(1001)
    e = ei.value
    assert (e.kernel, e.param) == ("rel_ruled", "i")
    assert str(e) == "rel_ruled: i = 1001 is not allowed: i must be even from 1000 on (a test rule)"
    assert not counter.exists()
    with pytest.raises(ParamError):  # the same through key() (no compile either)
        relkernels.rel_ruled.key(1001)
    assert registry.get("rel_ruled").bind((), {"i": 999}) == {"i": 999}


def test_rule_must_name_a_parameter():
    with pytest.raises(TypeError, match="rules must be quack.params.Rule"):
        registry.register("bad_rule", lambda i: i, {"i": Int()}, rules=[Rule("j", "x", bool)])
    with pytest.raises(TypeError, match="rules must be"):
        registry.register("bad_rule", lambda i: i, {"i": Int()}, rules=[lambda p: True])
    assert "bad_rule" not in registry.all_specs()


def test_manifest_refuses_cross_entropy_n_668_before_compiling(tmp_path):
    (tmp_path / "quack.toml").write_text('[build]\nkernel_packages = ["quack_kernels"]\n')
    m = tmp_path / "ce.toml"
    m.write_text('[[kernel]]\nname = "cross_entropy_fwd"\n'
                 'params = { dtype = ["float32", "bfloat16"], n = [668, 672] }\n')
    r = run_quack(["build", "--cache-dir", tmp_path / "cache", str(m)], cwd=tmp_path, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert (f"{m}:1: [[kernel]] #1 (cross_entropy_fwd): cross_entropy_fwd: n = 668 is not allowed with "
            f"dtype='bfloat16': n must be a multiple of 8 for float16/bfloat16") in out, out
    assert 'exclude = [{ dtype = "bfloat16", n = 668 }]' in out
    assert "1 problem in the manifests; nothing was built" in out
    assert not list((tmp_path / "cache").rglob("*.o")) and "Traceback" not in out


_COMPILES = r"""
import json, sys
from quack import registry
from quack.compile import builder
from quack.errors import CompileError
registry.load_packages(["quack_kernels"])
spec = registry.get("cross_entropy_fwd")
out = []
for dtype, n in json.loads(sys.argv[1]):
    allowed = all(r.check({"dtype": dtype, "n": n}) for r in spec.rules)
    try:
        builder.compile_to(spec, {"dtype": dtype, "n": n}, "sm_90a", sys.argv[2])
        compiled = True
    except CompileError:
        compiled = False
    out.append([dtype, n, allowed, compiled])
print(json.dumps(out))
"""


def test_cross_entropy_rule_is_what_the_compiler_accepts(tmp_path):
    """The rule was found by compiling; this keeps it honest: each configuration the rule
    refuses fails in the real compiler, each neighbour it allows compiles."""
    cases = [["bfloat16", 668], ["bfloat16", 666], ["bfloat16", 667], ["bfloat16", 672],
             ["float16", 668], ["float32", 666], ["float32", 667], ["float32", 668]]
    r = subprocess.run([sys.executable, "-c", _COMPILES, json.dumps(cases), str(tmp_path / "x.o")],
                       capture_output=True, text=True, timeout=400, env=env(), cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert [(d, n, a) for d, n, a, c in res if a != c] == [], res
    assert {(d, n) for d, n, a, _ in res if not a} == {("bfloat16", 668), ("bfloat16", 666), ("float16", 668),
                                                       ("float32", 666), ("float32", 667)}
