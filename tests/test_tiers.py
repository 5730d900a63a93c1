"""The Store contract and the runtime's lookup chain (quack.cache.contract,
quack.runtime.tiers): unit tests with an in-memory tier, and end to end with a
real compile served to a second cache through a DirectoryTier."""

from __future__ import annotations

import hashlib
import logging
import warnings

import pytest
import toykernels
from conftest import use_settings

from quack import settings
from quack.cache.contract import CORRUPT, MISSING, OK, Fetched, ReadTier, Store
from quack.cache.directory_tier import DirectoryTier
from quack.cache.entry import EntryRef
from quack.cache.store import DiskStore
from quack.errors import CacheWarning
from quack.runtime import tiers

SRCFP = "0123456789abcdef"


def _ref(i: int = 1) -> EntryRef:
    return EntryRef("toy_scale", f"{i:02x}" * 32, "sm_90a", SRCFP)


class MemoryTier:
    """A ReadTier serving bytes from a dict (what a remote or bundle tier returns)."""

    def __init__(self, name="memtier", objects=None, boom=False):
        self.name = name
        self.objects = dict(objects or {})
        self.boom = boom
        self.asked: list[str] = []

    def fetch(self, ref):
        self.asked.append(ref.key)
        if self.boom:
            raise RuntimeError("tier bug")
        data = self.objects.get(ref.key)
        if data is None:
            return None
        return Fetched(ref, data, {"params": {"dtype": "float32"}, "compile_s": 1.5}, self.name)


@pytest.fixture(autouse=True)
def _no_tiers_left():
    yield
    for name in ("memtier", "second", "broken", "shared"):
        tiers.unregister_tier(name)


def test_diskstore_satisfies_the_contract(tmp_path):
    store = DiskStore(tmp_path / "c")
    assert isinstance(store, Store)
    assert isinstance(MemoryTier(), ReadTier)
    assert isinstance(DirectoryTier(tmp_path / "c"), ReadTier)


def test_inspect_is_read_only(tmp_path):
    store = DiskStore(tmp_path / "c")
    ref = _ref()
    assert store.inspect(ref).status == MISSING
    with store.lock(ref):
        tmp = store.tmp_obj(ref)
        tmp.write_bytes(b"object-bytes" * 100)
        store.publish(ref, tmp, {"compile_s": 0.1})
    got = store.inspect(ref)
    assert got.status == OK and got.ok and got.meta["size"] == 1200 and got.so is None
    store.paths(ref)["obj"].write_bytes(b"tampered" * 150)
    got = store.inspect(ref)
    assert got.status == CORRUPT and "checksum" in got.problem
    assert store.paths(ref)["obj"].exists(), "inspect must not quarantine"
    assert not (store.root / "quarantine").exists()


def test_fetch_into_publishes_atomically_and_in_order(tmp_path):
    store = DiskStore(tmp_path / "c")
    ref = _ref(2)
    data = b"\x7fELF fake object" * 64
    first = MemoryTier("memtier", {})
    second = MemoryTier("second", {ref.key: data})
    entry, name = tiers.fetch_into(store, ref, (first, second))
    assert name == "second" and first.asked == [ref.key] and second.asked == [ref.key]
    assert entry is not None and entry.obj_path.read_bytes() == data
    meta = store.lookup(ref).meta
    assert meta["sha256"] == hashlib.sha256(data).hexdigest() and meta["size"] == len(data)
    assert meta["key"] == ref.key and meta["compile_s"] == 1.5 and meta["params"] == {"dtype": "float32"}
    assert not [p for p in store.root.rglob("*") if ".tmp-" in p.name]
    # A second fetch is not needed: the local store now has it.
    assert store.lookup(ref) is not None


def test_a_raising_tier_is_a_miss_with_one_warning(tmp_path):
    store = DiskStore(tmp_path / "c")
    bad = MemoryTier("broken", boom=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(3):
            assert tiers.fetch_into(store, _ref(3), (bad,)) == (None, "")
    assert len([x for x in w if issubclass(x.category, CacheWarning)]) == 1
    assert len(bad.asked) == 3


def test_wrong_ref_is_ignored(tmp_path):
    store = DiskStore(tmp_path / "c")

    class Liar(MemoryTier):
        def fetch(self, ref):
            return Fetched(_ref(9), b"x" * 10, {}, self.name)

    assert tiers.fetch_into(store, _ref(4), (Liar("memtier"),)) == (None, "")
    assert store.lookup(_ref(4)) is None and store.lookup(_ref(9)) is None


def test_registry_order_factories_and_broken_factory(quack_settings):
    tiers.register_tier("second", lambda s: MemoryTier("second"), order=tiers.REMOTE)
    tiers.register_tier("memtier", lambda s: MemoryTier("memtier"), order=tiers.BUNDLES)
    tiers.register_tier("shared", lambda s: None, order=50)  # not configured: left out

    def broken(s):
        raise ValueError("no such bucket")

    tiers.register_tier("broken", broken, order=10)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        order = [t.name for t in tiers.read_tiers(settings.get())]
    assert order == ["bundles", "memtier", "second"]  # bundles: built in
    assert any("no such bucket" in str(x.message) for x in w)


def test_tier_hit_end_to_end_loads_without_compiling(quack_settings, cache_dir, tmp_path, log_records):
    """A real object compiled into one cache is served to an empty cache by a
    DirectoryTier, published there, and loaded: no compile, even in prebuilt mode."""
    toykernels.toy_scale("float32", 64, False)  # compiled by a worker into cache_dir
    (src,) = [p for p in cache_dir.rglob("*.o") if p.parent.parent.name == "toy_scale"]
    other = tmp_path / "other"
    tiers.register_tier("shared", lambda s: DirectoryTier(cache_dir, name="shared"), order=tiers.BUNDLES)
    use_settings(cache_dir=str(other), mode="prebuilt")
    n0 = len(toykernels.COMPILES)
    with log_records("quack", logging.INFO) as records:
        fn = toykernels.toy_scale("float32", 64, False)
    assert callable(fn) and len(toykernels.COMPILES) == n0
    (dst,) = [p for p in other.rglob("*.o") if p.parent.parent.name == "toy_scale"]
    assert dst.read_bytes() == src.read_bytes()
    assert any("tier shared: hit toy_scale" in r.getMessage() for r in records)
    # Not in the tier either: prebuilt mode still says so.
    from quack.errors import KernelNotPrebuilt

    with pytest.raises(KernelNotPrebuilt):
        toykernels.toy_scale("float32", 96, False)


def test_directory_tier_refuses_a_corrupt_object(quack_settings, cache_dir, tmp_path):
    toykernels.toy_scale("float16", 64, False)
    (src,) = [
        p
        for p in cache_dir.rglob("*.o")
        if p.parent.parent.name == "toy_scale" and '"float16"' in p.with_suffix(".json").read_text()
    ]
    data = bytearray(src.read_bytes())
    data[len(data) // 2] ^= 0xFF
    src.write_bytes(bytes(data))
    tier = DirectoryTier(cache_dir, name="shared")
    ref = EntryRef("toy_scale", src.stem, "sm_90a", src.parent.name)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert tier.fetch(ref) is None
        assert tier.fetch(ref) is None
    assert len([x for x in w if "corrupt" in str(x.message)]) == 1
    assert src.exists(), "a read-only tier never moves anything"
