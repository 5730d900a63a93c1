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
    p["so"].write_bytes(b"not an ELF")  # there but damaged: said once, then relinked
    with pytest.warns(CacheWarning, match="is damaged"):
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


# --- EntryRef and Entry: written-out dataclass methods (issue 15) ---------------------------

# The path-component rules as they were written before (regular expressions): the str-based
# checks that replaced them must accept and refuse exactly the same strings.
OLD_RULES = {
    "kernel": r"^[a-z][a-z0-9_]{0,63}$",
    "key": r"^[0-9a-f]{64}$",
    "arch": r"^sm_[0-9]{2,3}[af]?$",
    "srcfp": r"^(?:[0-9a-f]{16}|main)$",
}
GOOD = {"kernel": "toy_scale", "key": "ab" * 32, "arch": "sm_90a", "srcfp": "0123456789abcdef"}
TRICKY = [
    "", "a", "z9_", "a" * 64, "a" * 65, "A", "1abc", "_a", "ab-c", "ab c", "abc\n", "\nabc", "é",
    "a\x00", "../x", "a/b", ".", "sm_90a", "sm_90", "sm_100a", "sm_103f", "sm_9", "sm_1000",
    "sm_90af", "sm_90b", "sm_", "sm_a", "SM_90", "sm_90a\n", "sm_\u0661\u0662", "sm_\u00b2\u00b3",
    "sm_90\u0661", "main", "Main", "main\n", "0123456789abcdef", "0123456789ABCDEF",
    "0123456789abcde", "0123456789abcdef0", "\u0660123456789abcdef", "ab" * 32, "AB" * 32,
    "ab" * 31 + "a", "ab" * 32 + "a", "ab" * 31 + "ag", "ab" * 31 + "a\u0661",
]  # fmt: skip


@pytest.mark.parametrize("field", sorted(OLD_RULES))
def test_entry_ref_fields_are_refused_as_the_old_patterns_refused_them(field):
    import re

    from quack.cache.entry import EntryRef
    from quack.errors import ParamError

    checked = 0
    for value in TRICKY:
        want = re.fullmatch(OLD_RULES[field], value) is not None
        try:
            EntryRef(**dict(GOOD, **{field: value}))
            got = True
        except ParamError:
            got = False
        assert got == want, (field, value)
        checked += 1
    for bad in (None, 5, b"sm_90a"):  # not text at all
        with pytest.raises(ParamError):
            EntryRef(**dict(GOOD, **{field: bad}))
    assert checked == len(TRICKY)


def test_entry_ref_and_entry_behave_as_generated_dataclasses(tmp_path):
    import copy
    import dataclasses
    import pickle
    from pathlib import Path

    from quack.cache.entry import Entry, EntryRef
    from quack.errors import ParamError

    @dataclasses.dataclass(frozen=True)
    class EntryRefGen:
        kernel: str
        key: str
        arch: str
        srcfp: str

    @dataclasses.dataclass
    class EntryGen:
        ref: object
        meta: dict
        obj_path: Path
        so_path: Path | None

    a, b = EntryRef(**GOOD), EntryRef(**GOOD)
    c = EntryRef(**dict(GOOD, arch="sm_100a"))
    ga, gc = EntryRefGen(**GOOD), EntryRefGen(**dict(GOOD, arch="sm_100a"))
    assert a == b and hash(a) == hash(b) and a != c and (a == c) == (ga == gc)
    assert a != ga and a != tuple(GOOD.values())  # another class is never equal
    assert repr(a).startswith("EntryRef(") and repr(a).partition("(")[2] == repr(ga).partition("(")[2]
    assert [f.name for f in dataclasses.fields(a)] == [f.name for f in dataclasses.fields(ga)]
    assert dataclasses.asdict(a) == dataclasses.asdict(ga) == GOOD
    for op in (lambda r: setattr(r, "arch", "sm_80"), lambda r: delattr(r, "key")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            op(a)
        with pytest.raises(dataclasses.FrozenInstanceError):
            op(ga)
    assert a.arch == "sm_90a" and a.key == GOOD["key"]
    r = dataclasses.replace(a, srcfp="fedcba9876543210")
    assert r.srcfp == "fedcba9876543210" and r.kernel == a.kernel and a.srcfp == GOOD["srcfp"]
    with pytest.raises(ParamError):  # replace builds through __init__: checked again
        dataclasses.replace(a, srcfp="../../etc")
    for dup in (pickle.loads(pickle.dumps(a)), copy.copy(a), copy.deepcopy(a)):
        assert dup == a and hash(dup) == hash(a) and type(dup) is EntryRef
    assert {a: 1}[b] == 1

    e = Entry(a, {"sha256": "x"}, tmp_path / "k.o", None)
    ge = EntryGen(a, {"sha256": "x"}, tmp_path / "k.o", None)
    assert e == Entry(b, {"sha256": "x"}, tmp_path / "k.o", None)
    assert e != Entry(a, {"sha256": "y"}, tmp_path / "k.o", None) and e != ge
    assert repr(e).startswith("Entry(") and repr(e).partition("(")[2] == repr(ge).partition("(")[2]
    with pytest.raises(TypeError):
        hash(e)  # mutable, unhashable, as @dataclass(eq=True) makes it
    e.so_path = tmp_path / "k.so"  # not frozen
    assert dataclasses.replace(e, so_path=None).so_path is None and e.so_path == tmp_path / "k.so"
    assert pickle.loads(pickle.dumps(e)) == e
