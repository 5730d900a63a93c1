"""Deeply nested JSON (100,000 '[': 100 KB, under every size cap) in the files quack parses
from its cache: malformed like any other JSON, so a corrupt entry (quarantined, one
warning), a relinked .so or a skipped line, never RecursionError, which escaped every
reader's ``except ValueError`` (the kernel call, ``quack cache stats``, ``quack build``).
A bundle's files and a remote object's header: tests/test_bundles_hardening.py and
tests/test_remote_tier.py."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
from reliability_support import copy_publish, env, run_quack, session_objects, toy_ref

from quack.cache import journal
from quack.cache.store import DiskStore
from quack.errors import CacheWarning
from quack.remote import stats
from quack.runtime import loader
from quack.safejson import MAX_DEPTH, safe_loads
from quack_build.build.plan import PastTimes

DEEP = b"[" * 100_000


@pytest.fixture
def objs(tmp_path_factory):
    return session_objects(tmp_path_factory)


def cache_warnings(w) -> list[str]:
    return [str(x.message) for x in w if issubclass(x.category, CacheWarning)]


@pytest.mark.parametrize("data", [DEEP, DEEP.decode(), DEEP.decode().encode("utf-16"), b'{"a":' * 50_000])
def test_deep_nesting_is_a_value_error(data):
    with pytest.raises(ValueError, match=f"nested more than {MAX_DEPTH} levels deep"):
        safe_loads(data)


def test_brackets_in_strings_and_ordinary_json_parse_as_json_does():
    doc = b'{"a": [1, {"b": "' + b"[" * 100_000 + b'"}]}'
    assert safe_loads(doc) == json.loads(doc)
    nested = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert safe_loads(nested) == json.loads(nested)
    with pytest.raises(ValueError):
        safe_loads(b'{"a": 1')  # malformed as before


def test_a_caller_out_of_stack_is_not_blamed_on_the_input():
    """Input nested 30 deep fails to parse only because the caller's stack is nearly
    used up: that RecursionError is the caller's, and a metadata file that is fine must
    not be called malformed (and quarantined) for it."""
    depth = 0
    f = sys._getframe()
    while f is not None and depth < 100_000:
        depth, f = depth + 1, f.f_back
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 15)
    doc = b"[" * 30 + b"]" * 30
    try:
        if sys.version_info < (3, 12):
            with pytest.raises(RecursionError):
                safe_loads(doc)
        else:
            # 3.12 counts C recursion (json's C scanner) apart from the Python frames' limit:
            # the parse no longer runs out of the caller's stack, and must not be refused
            result = safe_loads(doc)
    finally:
        sys.setrecursionlimit(limit)
    if sys.version_info >= (3, 12):
        assert result == json.loads(doc)


def test_deep_metadata_is_a_corrupt_entry_quarantined_with_one_warning(objs, tmp_path):
    store = DiskStore(tmp_path / "cache")
    ref = toy_ref(objs["float32"])
    copy_publish(store, ref, Path(objs["float32"]["path"]))
    store.paths(ref)["meta"].write_bytes(DEEP)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert store.lookup(ref) is None  # raised RecursionError
    msgs = cache_warnings(w)
    assert len(msgs) == 1 and "corrupt" in msgs[0] and "nested more than" in msgs[0], msgs
    assert not store.paths(ref)["meta"].exists()  # moved to quarantine/
    copy_publish(store, ref, Path(objs["float32"]["path"]))  # rebuilt: a hit again
    assert store.lookup(ref) is not None


def test_deep_so_sidecar_is_relinked_with_one_warning(objs, tmp_path):
    if not loader.can_link():
        pytest.skip("no C compiler: the .so path is not used")
    store = DiskStore(tmp_path / "cache")
    ref = toy_ref(objs["float32"])
    e = copy_publish(store, ref, Path(objs["float32"]["path"]))
    assert loader.link_entry(store, e) is not None
    store.paths(ref)["so_meta"].write_bytes(DEEP)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        e = store.lookup(ref)  # raised RecursionError
    assert e is not None and e.so_path is None  # the loader links it again
    msgs = cache_warnings(w)
    assert len(msgs) == 1 and "nested more than" in msgs[0], msgs


def test_deep_journal_and_remote_stats_lines_are_skipped(tmp_path):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    rec = {"t": 1.0, "kernel": "toy_scale", "key": "a" * 64, "arch": "sm_90a", "hits": 2, "compiles": 1}
    journal.append(root, [rec])
    with open(root / journal.JOURNAL, "ab") as f:
        f.write(DEEP + b"\n")
    journal.append(root, [dict(rec, t=2.0)])
    assert [r["t"] for r in journal.read(root)] == [1.0, 2.0]  # raised RecursionError
    line = json.dumps({"url": "file:///x", "hits": 3}) + "\n"
    stats.append_line(root, line)
    stats.append_line(root, DEEP.decode() + "\n")
    stats.append_line(root, line)
    assert stats.read_stats(root)["total"]["hits"] == 6
    r = run_quack(["cache", "stats", "--json"], env_=env(QUACK_CACHE_DIR=root), timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["journal"]["records"] == 2 and out["journal"]["kernels"]["toy_scale"]["hits"] == 4, out
    assert out["remote"]["total"]["hits"] == 6, out["remote"]


def test_deep_metadata_of_an_older_fingerprint_is_skipped_by_the_build_plan(tmp_path):
    """quack build orders keys by their past compile times, read from every fingerprint's
    metadata of the key: a deep one crashed the build before any compile."""
    kdir = tmp_path / "cache" / "v1" / "stamp" / "toy_scale"
    key = "b" * 64
    for fp, data in (("0" * 16, DEEP), ("1" * 16, json.dumps({"compile_s": 2.5}).encode())):
        (kdir / fp).mkdir(parents=True)
        (kdir / fp / f"{key}.json").write_bytes(data)
    assert PastTimes(tmp_path / "cache").get("toy_scale", key) == 2.5  # raised RecursionError
