"""Issue 6, case 11: key completeness. Everything that changes the binary changes where
its entry lives; keys are identical across processes, hash seeds, start methods and
working directories; a cache filled for sm_90a is a miss for sm_100a, never a wrong load."""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import pytest
import toykernels  # noqa: F401 - registers toy_scale
from reliability_support import PY, TESTS, copy_publish, env, session_objects, toy_ref

from quack import registry
from quack.cache import keys
from quack.cache.store import DiskStore
from quack.compile import builder
from quack.errors import CacheWarning, ParamError


@pytest.fixture
def objs(tmp_path_factory):
    return session_objects(tmp_path_factory)


@pytest.fixture
def filled(objs, tmp_path):
    store = DiskStore(tmp_path / "cache")
    ref = toy_ref(objs["float32"])
    copy_publish(store, ref, Path(objs["float32"]["path"]))
    return store, ref, objs["float32"]


@pytest.mark.parametrize("field", ["cutlass_dsl", "tvm_ffi", "libs", "python"])
def test_toolchain_change_is_a_miss(field, filled, monkeypatch):
    store, ref, _ = filled
    assert store.lookup(ref) is not None
    real = keys.toolchain()
    # Another value than this machine's (a fixed "3.12" or "cu13" was no change on the
    # H200 machine, which runs exactly those).
    value = f"{real[field]}9"
    monkeypatch.setattr(keys, "toolchain", lambda: dict(real, **{field: value}))
    assert value in ref.stamp
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.lookup(ref) is None  # another stamp directory: a plain miss


@pytest.mark.parametrize(
    "change", [{"dtype": "float16"}, {"dtype": "bfloat16"}, {"block": 64}, {"block": 129}, {"bias": True}]
)
def test_each_compile_option_changes_the_key(change, filled):
    store, ref, info = filled
    spec = registry.get("toy_scale")
    params = spec.bind((), dict(info["params"], **change))
    other = builder.entry_ref(spec, params, "sm_90a")
    assert other.key != ref.key and store.lookup(other) is None


def test_true_is_not_one_and_int_is_not_float():
    spec = registry.get("toy_scale")
    with pytest.raises(ParamError):
        spec.bind((), {"dtype": "float32", "bias": 1})
    with pytest.raises(ParamError):
        spec.bind((), {"dtype": "float32", "block": True})
    with pytest.raises(ParamError):
        spec.bind((), {"dtype": "float32", "block": 128.0})
    enc = keys.key_material("k", {"a": ["bool", True]}, "sm_90a")
    assert enc != keys.key_material("k", {"a": ["int", 1]}, "sm_90a")


_KEYS = r"""
import json, multiprocessing as mp, os, sys
import toykernels
from quack import registry

def key():
    import toykernels
    from quack import registry
    spec = registry.get("toy_scale")
    return [spec.key(spec.bind((), {"dtype": d, "block": 256, "bias": b}), a) + ":" + spec.source_fingerprint()
            for d in ("float32", "bfloat16") for b in (False, True) for a in ("sm_90a", "sm_100a")]

if __name__ == "__main__":
    out = {"main": key()}
    for method in ("spawn", "forkserver", "fork"):
        with mp.get_context(method).Pool(1) as pool:
            out[method] = pool.apply(key)
    print(json.dumps(out))
"""


def test_keys_identical_across_seeds_start_methods_and_cwds(tmp_path):
    script = tmp_path / "keys_script.py"
    script.write_text(_KEYS)
    results = []
    for seed, cwd in (("0", TESTS), ("12345", tmp_path), ("random", Path("/"))):
        r = subprocess.run(
            [PY, str(script)],
            env=env(PYTHONHASHSEED=seed),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=str(cwd),
        )
        assert r.returncode == 0, r.stderr
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    flat = [tuple(v) for res in results for v in res.values()]
    assert len(set(flat)) == 1, "keys differ across processes / seeds / start methods / cwds"
    assert len(set(flat[0])) == len(flat[0])  # and the 8 configurations all differ


def test_sm90a_cache_is_a_miss_for_sm100a(filled):
    store, ref, info = filled
    spec = registry.get("toy_scale")
    params = spec.bind((), info["params"])
    other = builder.entry_ref(spec, params, "sm_100a")
    assert other.key != ref.key and other.stamp != ref.stamp
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.lookup(other) is None


def test_sm90a_entry_planted_under_sm100a_is_never_loaded(filled):
    """An sm_90a entry copied to where sm_100a's would live: its metadata names another
    key and arch, so it is refused as foreign (quarantined), never loaded."""
    store, ref, info = filled
    spec = registry.get("toy_scale")
    other = builder.entry_ref(spec, spec.bind((), info["params"]), "sm_100a")
    store._ensure(other)
    for name in ("obj", "meta"):
        store.paths(other)[name].write_bytes(store.paths(ref)[name].read_bytes())
    with pytest.warns(CacheWarning, match="foreign entry"):
        assert store.lookup(other) is None


def test_runtime_for_sm100a_on_sm90a_cache_is_a_prebuilt_miss(filled):
    store, ref, info = filled
    code = (
        "import toykernels\nfrom quack.errors import KernelNotPrebuilt\n"
        "try:\n    toykernels.toy_scale('float32', 128, False)\n    print('LOADED')\n"
        "except KernelNotPrebuilt as e:\n    print('MISS', e.arch)\n"
    )
    r90 = subprocess.run(
        [PY, "-c", code],
        env=env(QUACK_CACHE_DIR=store.root, QUACK_ARCH="sm_90a", QUACK_MODE="prebuilt"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(TESTS),
    )
    r100 = subprocess.run(
        [PY, "-c", code],
        env=env(
            QUACK_CACHE_DIR=store.root, QUACK_ARCH="sm_100a", CUTE_DSL_ARCH="sm_100a", QUACK_MODE="prebuilt"
        ),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(TESTS),
    )
    assert r90.stdout.strip() == "LOADED", r90.stderr
    assert r100.stdout.strip() == "MISS sm_100a", r100.stderr
