"""The store: atomic publish, per-key lock, verification on lookup."""

import json
import os
import subprocess
import sys

import pytest
import toykernels

from quack.cache.store import DiskStore
from quack.compile import builder
from quack.errors import CacheWarning

SPEC = toykernels.toy_scale.spec


def ref_for(dtype="float32", block=32):
    return builder.entry_ref(SPEC, SPEC.bind((dtype, block, False), {}), "sm_90a")


@pytest.fixture
def built(cache_dir):
    """One real compiled entry."""
    store = DiskStore(cache_dir)
    entry, compiled = builder.build(SPEC, SPEC.bind(("float32", 32, False), {}), "sm_90a", store)
    assert compiled
    return store, entry


def test_lookup_verifies_and_returns_so(built):
    store, entry = built
    e = store.lookup(entry.ref)
    assert e is not None and e.so_path is not None and e.meta["sha256"] == entry.meta["sha256"]
    assert oct(os.stat(store.entry_dir(entry.ref)).st_mode & 0o777) == "0o700"
    assert oct(os.stat(e.obj_path).st_mode & 0o777) == "0o600"


def test_object_without_metadata_is_a_miss_not_corruption(built):
    store, entry = built
    os.unlink(store.paths(entry.ref)["meta"])  # a publish interrupted before its last step
    assert store.lookup(entry.ref) is None
    assert not (store.root / "quarantine").exists()


def test_temp_files_are_invisible(built, cache_dir):
    store, entry = built
    tmp = store.tmp_obj(ref_for("float16"))
    tmp.write_bytes(b"half-written")
    assert store.lookup(ref_for("float16")) is None


@pytest.mark.parametrize("damage", ["truncate", "zero", "foreign", "bad_json"])
def test_damaged_entries_are_quarantined(built, damage):
    store, entry = built
    p = store.paths(entry.ref)
    if damage == "truncate":
        p["obj"].write_bytes(p["obj"].read_bytes()[: entry.meta["size"] // 2])
    elif damage == "zero":
        p["obj"].write_bytes(b"")
    elif damage == "foreign":
        meta = json.loads(p["meta"].read_text())
        meta["key"] = "0" * 64
        p["meta"].write_text(json.dumps(meta))
    else:
        p["meta"].write_text("{not json")
    with pytest.warns(CacheWarning, match="was corrupt"):
        assert store.lookup(entry.ref) is None
    assert not p["obj"].exists() and not p["meta"].exists()
    assert len(list((store.root / "quarantine").glob("*.reason"))) == 1


def test_stale_so_is_not_used(built):
    store, entry = built
    p = store.paths(entry.ref)
    p["so"].write_bytes(b"not an ELF")
    e = store.lookup(entry.ref)
    assert e is not None and e.so_path is None  # relinked from the verified .o on load


_RACE = """
import sys, json
sys.path.insert(0, {tests!r})
import toykernels
from quack.compile import builder
from quack.cache.store import DiskStore
spec = toykernels.toy_scale.spec
entry, compiled = builder.build(spec, spec.bind(("bfloat16", 64, True), {{}}), "sm_90a", DiskStore({root!r}))
print(json.dumps({{"compiled": compiled, "sha": entry.meta["sha256"]}}))
"""


def test_concurrent_builders_compile_a_key_once(cache_dir):
    tests = os.path.dirname(__file__)
    code = _RACE.format(tests=tests, root=str(cache_dir))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, CUTE_DSL_ARCH="sm_90a"),
        )
        for _ in range(4)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(o["compiled"] for o in outs) == 1
    assert len({o["sha"] for o in outs}) == 1
