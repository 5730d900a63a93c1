"""Issue 6, cases 1-2: a damaged or swapped .o is detected by its checksum before
anything loads it, quarantined, rebuilt, and the next call hits. Real kernels."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import toykernels
from conftest import use_settings
from reliability_support import QUACK, copy_publish, env, session_objects, toy_ref, write_toy_project

from quack.cache.store import DiskStore
from quack.errors import CacheWarning
from quack.runtime import loader


@pytest.fixture
def toy_objects(tmp_path_factory):
    return session_objects(tmp_path_factory)


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        for i in (0, len(data) // 3, len(data) // 2, len(data) - 1):
            data[i] ^= 0xFF  # same size, flipped bytes (ELF header, code, tail)
    elif how == "zero":
        data = bytearray()
    elif how == "half":
        data = data[: len(data) // 2]
    elif how == "extend":
        data += b"\0" * 16
    path.write_bytes(bytes(data))


@pytest.fixture
def guarded_loader(monkeypatch):
    """Every load goes through here: assert the bytes being loaded match the
    metadata's digest at load time (i.e. nothing unverified reaches load_module)."""
    seen = []
    real = loader.load_entry

    def checked(store, entry):
        data = entry.obj_path.read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry.meta["sha256"], "unverified object loaded"
        seen.append(entry.obj_path)
        return real(store, entry)

    monkeypatch.setattr(loader, "load_entry", checked)
    return seen


def _usage(dtype):
    (u,) = [
        u
        for u in toykernels.toy_scale.usage()
        if u["params"]["dtype"] == dtype and u["params"]["block"] == 256
    ]
    return u


def test_damaged_object_quarantined_rebuilt_then_hit(quack_settings, cache_dir, guarded_loader):
    """flipped bytes (same size), truncated to zero, truncated to half, grown: each detected
    before loading, quarantined with a CacheWarning, rebuilt by a real compile; next call hits."""
    toykernels.toy_scale("float32", 256, False)
    for n, how in enumerate(("flip", "zero", "half", "extend"), 1):
        (obj,) = [p for p in cache_dir.rglob("*.o") if p.parent.parent.name == "toy_scale"]
        good = json.loads(obj.with_suffix(".json").read_text())["sha256"]
        damage(obj, how)
        use_settings()  # a new generation: forget this process's in-memory table
        reason = "checksum" if how == "flip" else "truncated"
        with pytest.warns(
            CacheWarning, match=rf"toy_scale key [0-9a-f]{{16}} was corrupt \(object file.*{reason}"
        ):
            fn = toykernels.toy_scale("float32", 256, False)
        assert callable(fn)
        u = _usage("float32")
        assert (u["misses"], u["compiles"]) == (1, 1), how
        q = sorted(p.name for p in (cache_dir / "quarantine").iterdir())
        assert sum(p.endswith(".reason") for p in q) == n and sum(p.endswith(".o") for p in q) == n
        rebuilt = json.loads(obj.with_suffix(".json").read_text())["sha256"]
        assert hashlib.sha256(obj.read_bytes()).hexdigest() == rebuilt
        assert rebuilt == good, "the rebuild reproduces the original object"
        use_settings()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            toykernels.toy_scale("float32", 256, False)
        u = _usage("float32")
        assert (u["hits"], u["compiles"]) == (1, 0), how
    assert len(guarded_loader) == 1 + 2 * 4


@pytest.mark.parametrize("how", ["flip", "zero", "half", "extend"])
def test_damaged_object_is_a_miss_at_the_store(how, toy_objects, tmp_path, monkeypatch):
    """The same damage at the store level (no compile): lookup is None, nothing loads."""
    monkeypatch.setattr(loader, "load_so", lambda *a: pytest.fail("loaded a damaged entry"))
    monkeypatch.setattr(loader, "load_object", lambda *a: pytest.fail("loaded a damaged entry"))
    store = DiskStore(tmp_path / "c")
    ref = toy_ref(toy_objects["float32"])
    copy_publish(store, ref, Path(toy_objects["float32"]["path"]))
    damage(store.paths(ref)["obj"], how)
    with pytest.warns(CacheWarning, match="was corrupt"):
        assert store.lookup(ref) is None
    assert not store.paths(ref)["obj"].exists() and not store.paths(ref)["meta"].exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.lookup(ref) is None  # now a plain miss


@pytest.mark.parametrize("bad", ["not json", "[]", "size", "sha256", "key", "kernel", "arch", "format"])
def test_tampered_metadata_is_rejected(bad, toy_objects, tmp_path):
    store = DiskStore(tmp_path / "c")
    ref = toy_ref(toy_objects["float32"])
    copy_publish(store, ref, Path(toy_objects["float32"]["path"]))
    mp = store.paths(ref)["meta"]
    meta = json.loads(mp.read_text())
    if bad == "not json":
        mp.write_bytes(b"\xff\xfe{garbage")
    elif bad == "[]":
        mp.write_text("[]")
    else:
        meta[bad] = {
            "size": meta["size"] + 1,
            "sha256": "0" * 64,
            "key": "f" * 64,
            "kernel": "rmsnorm_fwd",
            "arch": "sm_100a",
            "format": 99,
        }[bad]
        mp.write_text(json.dumps(meta))
    with pytest.warns(CacheWarning, match="was corrupt"):
        assert store.lookup(ref) is None


def test_swapped_objects_are_rejected(toy_objects, tmp_path, monkeypatch):
    """Two valid entries with their .o files swapped: the metadata ties each key to its
    content digest, so both are rejected (and never loaded)."""
    monkeypatch.setattr(loader, "load_so", lambda *a: pytest.fail("loaded a swapped entry"))
    store = DiskStore(tmp_path / "c")
    a, b = toy_ref(toy_objects["float32"]), toy_ref(toy_objects["float16"])
    copy_publish(store, a, Path(toy_objects["float32"]["path"]))
    copy_publish(store, b, Path(toy_objects["float16"]["path"]))
    assert store.lookup(a) and store.lookup(b)
    pa, pb = store.paths(a)["obj"], store.paths(b)["obj"]
    tmp = pa.with_name("swap")
    os.replace(pa, tmp), os.replace(pb, pa), os.replace(tmp, pb)
    with pytest.warns(CacheWarning, match="checksum mismatch"):
        assert store.lookup(a) is None
    with pytest.warns(CacheWarning, match="checksum mismatch"):
        assert store.lookup(b) is None


def test_swapped_whole_entries_are_foreign(toy_objects, tmp_path):
    """An entry's .o + metadata copied under another key's name: the metadata names the
    other key, so it is refused as foreign."""
    store = DiskStore(tmp_path / "c")
    a, b = toy_ref(toy_objects["float32"]), toy_ref(toy_objects["float16"])
    copy_publish(store, a, Path(toy_objects["float32"]["path"]))
    for name in ("obj", "meta"):
        shutil.copyfile(store.paths(a)[name], store.paths(b)[name])
    with pytest.warns(CacheWarning, match="foreign entry"):
        assert store.lookup(b) is None
    assert store.lookup(a) is not None


def test_damaged_derived_so_is_relinked_not_loaded(toy_objects, tmp_path):
    """The .so is derived; a damaged one fails its sidecar digest and is relinked from
    the verified .o, with one CacheWarning saying so (the artifact itself is fine)."""
    if not loader.can_link():
        pytest.skip("no C compiler: the .so path is not used")
    store = DiskStore(tmp_path / "c")
    ref = toy_ref(toy_objects["float32"])
    e = copy_publish(store, ref, Path(toy_objects["float32"]["path"]))
    so = loader.link_entry(store, e)
    good = so.read_bytes()
    damage(so, "flip")
    with pytest.warns(CacheWarning, match="is damaged"):
        e2 = store.lookup(ref)
    assert e2.so_path is None  # the damaged .so is not offered
    so2 = loader.link_entry(store, e2)
    assert so2.read_bytes() == good and store.lookup(ref).so_path == so2


@pytest.mark.parametrize("how", ["flip", "zero", "half"])
def test_verify_names_a_damaged_entry(how, toy_objects, tmp_path):
    """`quack verify` exits non-zero and names the damaged entry."""
    cache = tmp_path / "c"
    write_toy_project(tmp_path)
    store = DiskStore(cache)
    ref = toy_ref(toy_objects["float32"])
    copy_publish(store, ref, Path(toy_objects["float32"]["path"]))
    r = subprocess.run(
        [*QUACK, "verify", "--no-load"],
        env=env(QUACK_CACHE_DIR=cache),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    damage(store.paths(ref)["obj"], how)
    r = subprocess.run(
        [*QUACK, "verify", "--no-load"],
        env=env(QUACK_CACHE_DIR=cache),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "Traceback" not in out
    assert ref.key[:12] in out or "toy_scale" in out, out
