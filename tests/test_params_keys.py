"""Keys: canonical, stable across processes and hash seeds, and complete."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from quack.cache import keys
from quack.errors import ParamError
from quack.params import Bool, Choice, Config, Dtype, Float, Int
from quack.registry import register


@dataclasses.dataclass(frozen=True)
class Tile:
    m: int = 64
    swizzle: bool = False


def _k(dtype: str, n: int, flag: bool = False, tile: Tile = Tile(), mode: str = "a", eps: float = 0.5):
    raise AssertionError("never compiled here")


SPEC = register(
    "test_keys_kernel",
    _k,
    {
        "dtype": Dtype(),
        "n": Int(min=1, max=1 << 20),
        "flag": Bool(),
        "tile": Config(cls=Tile),
        "mode": Choice(choices=("a", "b")),
        "eps": Float(),
    },
)


def key_of(*a, arch="sm_90a", **kw):
    return SPEC.key(SPEC.bind(a, kw), arch)


def test_same_config_same_key_any_spelling():
    import torch

    k = key_of("bfloat16", 4096)
    assert k == key_of(dtype="bfloat16", n=4096)
    assert k == key_of(torch.bfloat16, 4096)
    assert k == key_of("bf16", 4096, flag=False, tile={"m": 64}, mode="a", eps=0.5)
    assert len(k) == 64 and int(k, 16) >= 0


@pytest.mark.parametrize(
    "change",
    [
        dict(dtype="float16"),
        dict(n=4097),
        dict(flag=True),
        dict(tile=Tile(m=128)),
        dict(tile=Tile(swizzle=True)),
        dict(mode="b"),
        dict(eps=0.25),
    ],
)
def test_every_parameter_changes_the_key(change):
    base = dict(dtype="bfloat16", n=4096)
    assert key_of(**base) != key_of(**{**base, **change})


def test_arch_and_version_change_the_key():
    p = SPEC.bind(("bfloat16", 4096), {})
    assert SPEC.key(p, "sm_90a") != SPEC.key(p, "sm_100a")
    v2 = dataclasses.replace(SPEC, version=1)
    assert v2.key(p, "sm_90a") != SPEC.key(p, "sm_90a")


def test_true_is_not_one():
    with pytest.raises(ParamError, match="flag"):
        key_of("bfloat16", 4096, flag=1)
    with pytest.raises(ParamError, match="'n'"):
        key_of("bfloat16", True)
    with pytest.raises(ParamError):
        key_of("bfloat16", 4096.0)
    # The encodings themselves differ too.
    assert Bool().encode(True) != Int().encode(1)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(dtype="int8", n=1), "dtype"),
        (dict(dtype="bfloat16", n=0), "'n'"),
        (dict(dtype="bfloat16", n=1, mode="c"), "mode"),
        (dict(dtype="bfloat16"), "missing parameter 'n'"),
        (dict(dtype="bfloat16", n=1, nope=3), "unknown parameter 'nope'"),
        (dict(dtype="bfloat16", n=1, tile={"q": 1}), "unknown fields"),
        (dict(dtype="bfloat16", n=1, eps=float("nan")), "eps"),
    ],
)
def test_bad_params_name_the_parameter(bad, match):
    with pytest.raises(ParamError, match=match):
        key_of(**bad)


def test_key_material_is_canonical_json():
    text = keys.key_material("k", {"b": ["int", 1], "a": ["bool", True]}, "sm_90a")
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    assert text.index('"a"') < text.index('"b"')


_SNIPPET = """
import sys, json
sys.path.insert(0, {tests!r})
from test_params_keys import key_of, Tile
print(json.dumps([key_of("bfloat16", 4096), key_of("float32", 7, True, Tile(32, True), "b", 1e-6)]))
"""


def test_keys_identical_across_processes_and_hash_seeds(tmp_path):
    tests = os.path.dirname(__file__)
    outs = set()
    for seed, cwd in (("0", tmp_path), ("12345", "/"), ("random", tests)):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run(
            [sys.executable, "-c", _SNIPPET.format(tests=tests)],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        )
        outs.add(r.stdout.strip().splitlines()[-1])
    assert len(outs) == 1
    # Pinned value: the key format is an interface (a change must bump the layout).
    assert json.loads(outs.pop())[0] == key_of("bfloat16", 4096)


def test_golden_key_is_stable():
    # Frozen on Python 3.11; the encoding uses nothing version-specific (no pickle, no
    # hash()), so 3.10 and 3.12 must give the same. A change here orphans every cache.
    enc = {"dtype": ["dtype", "bfloat16"], "n": ["int", 4096]}
    assert (
        keys.make_key("rmsnorm_fwd", enc, "sm_90a")
        == "e444a982fed3332c8bf5fd23f757aca0a5c784cb3a470133084e868ae06691ca"
    )


_XVER = """
import sys, json
sys.path.insert(0, {root!r})
from quack.registry import register
from quack.params import Dtype, Int, Bool
def f(dtype: str, n: int, flag: bool = False):
    pass
spec = register("xver", f, {{"dtype": Dtype(), "n": Int(min=1), "flag": Bool()}})
print(spec.key(spec.bind(("bfloat16", 4096), {{"flag": True}}), "sm_90a"))
"""


def _interpreters():
    import glob

    found = [sys.executable]
    for v in ("3.10", "3.12"):
        # pyenv's real interpreters (its shims refuse versions not selected).
        for exe in sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{v}.*/bin/python{v}")))[:1]:
            r = subprocess.run(
                [exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
            )
            if r.returncode == 0:
                found.append(exe)
    return found


def test_keys_identical_across_python_versions():
    exes = _interpreters()
    if len(exes) < 2:
        pytest.skip("fewer than two Python versions installed")
    root = os.path.dirname(os.path.dirname(__file__))
    out = {}
    for exe in exes:
        # -I: isolated from the venv, so only the standard library and quack's pure modules load.
        r = subprocess.run([exe, "-I", "-c", _XVER.format(root=root)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        out[exe] = r.stdout.strip()
    assert len(set(out.values())) == 1, out


def test_specs_are_frozen_values_as_dataclasses_were():
    """The specs are written out (no dataclass exec at import, issue 15) and keep the frozen
    dataclass behaviour: equality and hash by class and settings, a dataclass-style repr,
    positional or keyword settings, no assignment."""
    from quack.params import Rule

    assert Int(1, 64) == Int(min=1, max=64) and hash(Int(1, 64)) == hash(Int(min=1, max=64))
    assert Int(1, 64) != Int(1, 65) and Int() != Float() and Dtype() != Choice(("float32",))
    assert len({Int(1, 2), Int(1, 2), Bool(), Bool(), Choice(("a",)), Choice(("a",))}) == 3
    assert repr(Int(1)) == "Int(min=1, max=None, choices=None)"
    assert repr(Bool()) == "Bool()" and repr(Choice(("a", "b"))) == "Choice(choices=('a', 'b'))"
    assert Dtype().choices == ("float32", "float16", "bfloat16") and Float(0.0).max is None
    for spec, field in ((Int(1), "min"), (Bool(), "kind"), (Dtype(), "choices")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(spec, field, 2)
        with pytest.raises(AttributeError):
            delattr(spec, field)

    @dataclasses.dataclass(frozen=True)
    class Tile2:
        m: int = 1

    @dataclasses.dataclass
    class Loose:
        m: int = 1

    assert Config(Tile2) == Config(Tile2) and Config(Tile2).cls is Tile2
    with pytest.raises(TypeError, match="frozen dataclass"):
        Config(Loose)

    def rule_check(p):
        return p["n"] > 0

    r = Rule("n", "positive", rule_check)
    assert r == Rule("n", "positive", rule_check) and r.check({"n": 1}) is True
    assert repr(r).startswith("Rule(param='n', allowed='positive', check=<function")
