"""Per-kernel parameter rules (quack.params.Rule, issue 9 bug 10): declared at
registration, applied by manifest validation and at every call, before anything
compiles, with a message naming the parameter, the value and what is allowed."""

from __future__ import annotations

import json

import pytest
import relkernels
from reliability_support import env, run_quack

from quack import registry
from quack.errors import ParamError
from quack.params import Int, Rule


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


def test_manifest_refuses_by_rule_before_compiling(tmp_path, monkeypatch):
    """A manifest combination the kernel's rule refuses: file:line, parameter, value, what
    is allowed and how to exclude it; one problem for many refused values; nothing built."""
    (tmp_path / "quack.toml").write_text('[build]\nkernel_packages = ["relkernels"]\n')
    m = tmp_path / "r.toml"
    m.write_text(
        '[[kernel]]\nname = "rel_ruled"\nparams = { i = [998, 999, 1000, 1001, 1003, 1005, 1007] }\n'
    )
    counter = tmp_path / "compiles"
    r = run_quack(
        ["build", "--cache-dir", tmp_path / "cache", str(m)],
        cwd=tmp_path,
        timeout=120,
        env_=env(QUACK_TEST_COUNTER=counter, QUACK_TEST_OBJ="/nonexistent"),
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert (
        f"{m}:1: [[kernel]] #1 (rel_ruled): rel_ruled: i = 1001 is not allowed: i must be even from "
        f"1000 on (a test rule); drop it from the lists or exclude it: exclude = [{{ i = 1001 }}]"
    ) in out
    assert "1 more of its 7 combinations are refused by the kernel's rules (not listed)" in out
    assert "4 problems in the manifests; nothing was built" in out
    assert not counter.exists() and "Traceback" not in out


def test_cross_entropy_n_668_now_builds(tmp_path):
    """Issue 9's N=668 case (bfloat16/float16 cross-entropy): the kernels handle any N now
    (issue 14), so it builds instead of failing inside the compiler, and needs no rule."""
    from quack import registry as reg

    (tmp_path / "quack.toml").write_text('[build]\nkernel_packages = ["quack_kernels"]\n')
    m = tmp_path / "ce.toml"
    m.write_text(
        '[[kernel]]\nname = "cross_entropy_fwd"\nparams = { dtype = ["bfloat16", "float16"], n = 668 }\n'
    )
    r = run_quack(
        ["build", "--jobs", "2", "--json", "--cache-dir", tmp_path / "cache", str(m)],
        cwd=tmp_path,
        timeout=400,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["compiled"] == 2
    reg.load_packages(["quack_kernels"])
    assert reg.get("cross_entropy_fwd").rules == ()
