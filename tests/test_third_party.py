"""Issue 27, third-party kernels first-class: parameter types (fp8 / integer dtypes,
Tuple), the target arch for compile functions and rules, [build] preload, the
compiler-free occupancy helper, and a shared cache root with another tool. The worked
example (examples/third_party) is tests/test_third_party_example.py."""

from __future__ import annotations

import json
import os

import pytest
from reliability_support import run_py

from quack import registry, settings
from quack.errors import ParamError, PreloadError, SettingsError
from quack.params import DTYPES, FP8_DTYPES, INT_DTYPES, Dtype, Int, Rule, Tuple


# -- 3. parameter types ------------------------------------------------------------------
def test_dtype_default_refuses_fp8_and_ints_and_keeps_existing_encodings():
    d = Dtype()
    for name in DTYPES:
        assert d.encode(d.check("dtype", name)) == ["dtype", name]  # the key's form, unchanged
    for other in FP8_DTYPES + INT_DTYPES:
        with pytest.raises(ParamError, match="one of the dtypes float32, float16, bfloat16"):
            d.check("dtype", other)


def test_fp8_and_int_dtypes_are_opt_in_and_canonical_across_spellings():
    torch = pytest.importorskip("torch")
    d = Dtype(choices=FP8_DTYPES + INT_DTYPES)

    class Float8E4M3FN:
        """A stand-in with cutlass's class name (cutlass itself is not imported here)."""

    for spelling in ("float8_e4m3fn", torch.float8_e4m3fn, Float8E4M3FN, "fp8_e4m3", "E4M3"):
        assert d.check("x", spelling) == "float8_e4m3fn"
    assert d.check("x", torch.float8_e5m2) == "float8_e5m2"
    assert d.check("x", torch.int8) == "int8" and d.check("x", torch.uint8) == "uint8"
    assert d.encode("float8_e5m2") == ["dtype", "float8_e5m2"]
    with pytest.raises(TypeError, match="canonical dtype names"):
        Dtype(choices=("float8",))


def test_tuple_param_checks_length_and_elements_and_encodes_tagged():
    t = Tuple(Int(min=1), Int(choices=(1, 2, 4)))
    assert t.check("tile", [128, 4]) == (128, 4) == t.check("tile", (128, 4))
    assert t.encode((128, 4)) == ["tuple", [["int", 128], ["int", 4]]]
    with pytest.raises(ParamError, match=r"tile.*has 3 elements"):
        t.check("tile", (1, 2, 4))
    with pytest.raises(ParamError, match=r"element 1"):
        t.check("tile", (128, 3))
    with pytest.raises(ParamError, match="a tuple of 2"):
        t.check("tile", "128,4")


def _tuple_kernel():
    def compile_tp_t(tile=(128, 4), arch="sm_90a"):
        return (tile, arch)

    compile_tp_t.__module__ = "tests_tp_fake"
    return registry.register(
        "tp_t_fake",
        compile_tp_t,
        {"tile": Tuple(Int(min=1), Int(min=1))},
        rules=[Rule("arch", "SM90 only", lambda p: p["arch"].startswith("sm_90"))],
    )


def test_manifest_tuple_values_are_arrays_in_the_list_of_values(tmp_path):
    from quack_build.manifest import read as manifest

    _tuple_kernel()
    m = tmp_path / "m.toml"
    m.write_text(
        '[[kernel]]\nname = "tp_t_fake"\narchs = ["sm_90a"]\nparams = { tile = [[128, 4], [256, 2]] }\n'
    )
    cfgs = manifest.expand([m]).configs
    assert sorted(c.params["tile"] for c in cfgs) == [(128, 4), (256, 2)]
    m.write_text('[[kernel]]\nname = "tp_t_fake"\narchs = ["sm_90a"]\nparams = { tile = [128, 4] }\n')
    with pytest.raises(Exception, match=r"tile is a tuple parameter.*tile = \[\[128, 256\]\] is one value"):
        manifest.expand([m])


# -- 2. the target arch --------------------------------------------------------------------
def test_compile_function_gets_the_arch_and_arch_rules_refuse():
    from quack.compile import builder

    spec = _tuple_kernel()
    assert spec.takes_arch and list(spec.params) == ["tile"]  # not a user parameter
    b = spec.bind((), {"tile": [64, 2]}, arch="sm_90a")
    assert builder.call_compile(spec, b, "sm_90a") == ((64, 2), "sm_90a")
    assert spec.bind((), {"tile": [64, 2]}) == b  # without an arch: arch rules wait
    with pytest.raises(ParamError, match=r"tp_t_fake: arch = 'sm_100a' is not allowed .*: SM90 only"):
        spec.bind((), {"tile": [64, 2]}, arch="sm_100a")
    with pytest.raises(TypeError, match="'arch' is reserved"):
        registry.register("tp_bad_arch", lambda arch: None, {"arch": Int()})


def test_manifest_expansion_refuses_an_arch_a_rule_forbids(tmp_path):
    from quack_build.manifest import read as manifest

    _tuple_kernel()
    m = tmp_path / "m.toml"
    m.write_text('[[kernel]]\nname = "tp_t_fake"\narchs = ["sm_100a"]\nparams = { tile = [[128, 4]] }\n')
    with pytest.raises(Exception, match=r"arch = 'sm_100a' is not allowed.*SM90 only"):
        manifest.expand([m])


# -- 1. preload settings and the worker side -----------------------------------------------
def test_preload_setting_from_toml_and_env(tmp_path):
    (tmp_path / "quack.toml").write_text('[build]\npreload = ["pkg.heavy", "torch"]\n')
    s = settings.resolve(env={}, cwd=tmp_path)
    assert s.preload == ("pkg.heavy", "torch") and s.sources["preload"] == str(tmp_path / "quack.toml")
    s = settings.resolve(env={"QUACK_PRELOAD": "a.b, c"}, cwd=tmp_path)
    assert s.preload == ("a.b", "c") and s.sources["preload"] == "QUACK_PRELOAD"
    (tmp_path / "quack.toml").write_text('[build]\npreload = ["pkg heavy"]\n')
    with pytest.raises(SettingsError, match=r"quack.toml: build.preload .* not a module name"):
        settings.resolve(env={}, cwd=tmp_path)


def test_preload_failure_is_recorded_once_and_raised_per_task_naming_the_module():
    # A fresh process: quack.compile.preload keeps a per-process record.
    code = r"""
import json
from quack.compile import preload
from quack.errors import PreloadError
preload.run(["json", "tp_no_such_module_xyz", "os"], "/p/quack.toml")
out = {}
try:
    preload.ensure(["json"], "/p/quack.toml")
except PreloadError as e:
    out = {"module": e.module, "source": e.source, "line": str(e).splitlines()[0]}
print(json.dumps(out))
"""
    r = run_py(code)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["module"] == "tp_no_such_module_xyz" and out["source"] == "/p/quack.toml"
    assert out["line"].startswith("error: preload module 'tp_no_such_module_xyz' (set in /p/quack.toml)")
    assert issubclass(PreloadError, Exception)


def _pkg(root, name: str, init: str = "", **mods: str):
    d = root / name
    d.mkdir(parents=True)
    (d / "__init__.py").write_text(init)
    for m, text in mods.items():
        (d / f"{m}.py").write_text(text)


def test_preload_check_finds_modules_without_running_them_and_names_a_missing_one(tmp_path, monkeypatch):
    import sys

    from quack.compile import preload

    # __init__ raises: a package the check would run could not be found "cleanly".
    boom = 'raise RuntimeError("tpq_lib ran")\n'
    _pkg(tmp_path / "a", "tpq_lib", init=boom, heavy=boom)
    _pkg(tmp_path / "a", "tpq_plain")
    # A pkgutil-style namespace spread over two folders: `tpq_ns.far` is only found once
    # tpq_ns/__init__.py has run (extend_path), which the check confirms in a child.
    ext = "__path__ = __import__('pkgutil').extend_path(__path__, __name__)\n"
    _pkg(tmp_path / "a", "tpq_ns", init=ext)
    _pkg(tmp_path / "b", "tpq_ns", init=ext, far="")
    monkeypatch.syspath_prepend(str(tmp_path / "b"))
    monkeypatch.syspath_prepend(str(tmp_path / "a"))
    preload.check(["json", "tpq_lib", "tpq_lib.heavy", "tpq_ns.far"], "/p/quack.toml")
    assert not {"tpq_lib", "tpq_lib.heavy", "tpq_ns", "tpq_ns.far"} & set(sys.modules)
    for mod, missing in (
        ("tpq_nothing_here", "ModuleNotFoundError: No module named 'tpq_nothing_here'"),
        ("tpq_plain.missing", "ModuleNotFoundError: No module named 'tpq_plain.missing'"),
        # Not found statically: the child's real find_spec runs tpq_lib/__init__.py (the
        # worker would too), and its error is the one reported.
        ("tpq_lib.missing", "RuntimeError: tpq_lib ran"),
        ("tpq_ns.nowhere", "ModuleNotFoundError: No module named 'tpq_ns.nowhere'"),
    ):
        with pytest.raises(PreloadError) as ei:
            preload.check(["json", mod], "/p/quack.toml")
        e = ei.value
        assert (e.module, e.source, e.checked) == (mod, "/p/quack.toml", True)
        assert e.head == (
            f"error: preload module {mod!r} (set in /p/quack.toml) cannot be imported (checked before "
            f"compiling): {missing}"
        ), e.head
    # A parent that is a module, not a package: the import system's own message.
    with pytest.raises(PreloadError) as ei:
        preload.check(["os.path.nope"])
    assert ei.value.head.endswith(
        ": ModuleNotFoundError: __path__ attribute not found on 'os.path' while trying to find 'os.path.nope'"
    ), ei.value.head
    assert not {"tpq_lib", "tpq_plain", "tpq_ns"} & set(sys.modules)


# -- 4. the compiler-free occupancy helper -------------------------------------------------
def test_max_active_clusters_needs_no_compiler():
    code = r"""
import json, sys
import quack.runtime
from quack.errors import OccupancyError
out = {}
try:
    out["n"] = quack.runtime.max_active_clusters(2, 128, 1024)
except OccupancyError as e:
    out["error"] = str(e)
out["fallback"] = quack.runtime.max_active_clusters(2, 128, 1024, fallback=7) if "error" in out else None
try:
    quack.runtime.max_active_clusters(0, 128)
except ValueError as e:
    out["bad"] = str(e)
out["cutlass"] = any(m == "cutlass" or m.startswith("cutlass.") for m in sys.modules)
print(json.dumps(out))
"""
    out = json.loads(run_py(code).stdout.strip().splitlines()[-1])
    assert out["cutlass"] is False, out
    assert "cluster_size = 0 must be an integer [1, 16]" in out["bad"]
    if "error" in out:  # no GPU here: the documented failure, or the fallback
        assert out["error"].startswith("occupancy query failed on CUDA device") and out["fallback"] == 7
    else:
        assert out["n"] >= 1


# -- 6. a cache root shared with another tool -----------------------------------------------
def _plant_foreign(root):
    foreign = {
        root / "jit_cache" / "abc123.o": b"x" * 100,  # beside v1/
        root / "kernels.db": b"y" * 50,
        root / "v1" / "quack_cache_v2" / "k" / "0123456789abcdef" / "deadbeef.o": b"z" * 70,
        root / "v1" / "README": b"someone's notes",
        root / "logs" / "other-tool.log": b"w" * 10,
        root / "tmp" / "their-scratch.bin": b"v" * 10,
    }
    for p, data in foreign.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        os.utime(p, (1, 1))  # old: nothing is kept for being recent
    return foreign


def test_stats_clean_verify_never_touch_a_foreign_tree(tmp_path):
    from quack_build.cachedir import walk as inventory
    from quack_build.cachedir.clean import clean
    from quack_build.cachedir.stats import summarize

    root = tmp_path / "cache"
    foreign = _plant_foreign(root)
    info = summarize(root, {})
    assert info["totals"]["entries"] == 0 and info["totals"]["bytes"] == 0, info["totals"]
    assert info["fingerprints"] == [] and info["planted"] == [], info
    assert info["debris"]["scratch_files"] == 0
    assert list(inventory.walk(root, {})) == []
    for kw in ({}, {"remove_all": True}, {"older_than": 0.0}, {"max_size": 0}):
        rep = clean(root, {}, **kw)
        assert rep.freed == 0, (kw, rep)
    for p, data in foreign.items():
        assert p.read_bytes() == data, p


def test_cli_clean_all_and_stats_leave_a_foreign_tree(tmp_path):
    from reliability_support import env, run_quack

    root = tmp_path / "cache"
    foreign = _plant_foreign(root)
    e = env(QUACK_CACHE_DIR=root)
    r = run_quack(["cache", "stats", "--json"], cwd=tmp_path, env_=e, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["totals"]["entries"] == 0
    r = run_quack(["cache", "clean", "--all"], cwd=tmp_path, env_=e, timeout=120)
    assert r.returncode == 0, r.stderr
    assert all(p.read_bytes() == d for p, d in foreign.items())
    assert isinstance(PreloadError("m", "", "x"), Exception)
