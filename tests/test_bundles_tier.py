"""Issue 13, unit tier: the bundle runtime tier with bundles written by the real wheel
writer and unpacked (as pip does) into a site directory on sys.path; the objects are
placeholder bytes (lookups checksum them, nothing here loads them)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import toykernels

from quack import settings
from quack.bundles import index as bindex
from quack.bundles import tier as bt
from quack.compile import builder
from quack.errors import BundleError, CacheWarning, KernelNotPrebuilt
from quack_build.bundle import inspect as bundle_inspect
from quack_build.bundle import wheel as bw

PARAMS = {"dtype": "float32", "block": 128, "bias": False}


def ref_for(params=PARAMS, arch="sm_90a"):
    spec = toykernels.toy_scale.spec
    return builder.entry_ref(spec, spec.bind((), params), arch)


def bfile(ref, obj=b"placeholder object bytes", so=b"placeholder shared object", stamp=None):
    import hashlib

    e = bindex.IndexEntry(
        ref.key,
        ref.kernel,
        ref.arch,
        stamp or ref.stamp,
        ref.srcfp,
        dict(PARAMS),
        hashlib.sha256(obj).hexdigest(),
        len(obj),
        hashlib.sha256(so).hexdigest() if so is not None else None,
        len(so) if so is not None else None,
    )
    # The store's metadata, as quack bundle ships it (checked against the index).
    meta = {"format": 1, "key": e.key, "kernel": e.kernel, "arch": e.arch, "stamp": e.stamp}
    meta.update(srcfp=e.srcfp, sha256=e.sha256, size=e.size, params=dict(PARAMS))
    return bw.BundleFile(e, obj, meta, so)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path where bundles get 'installed' (unzipped); discovery reset."""
    d = tmp_path / "site"
    d.mkdir()
    monkeypatch.syspath_prepend(str(d))
    bt.reset()
    yield d
    bt.reset()


def install(site: Path, files, name="demo", version="1.0", signing_key=None) -> Path:
    whl, _ = bw.write_wheel(
        files, name=name, version=version, out_dir=site.parent / "dist", signing_key=signing_key
    )
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
    return site / bindex.package_name(name)


@pytest.fixture
def s(quack_settings):
    return quack_settings


def test_hit_is_checksummed_and_comes_from_the_bundle(site, s):
    ref = ref_for()
    pkg = install(site, [bfile(ref)])
    hit = bt.tier().lookup(ref, s)
    assert hit is not None
    entry, b = hit
    assert b.name == "demo" and b.version == "1.0"
    assert (
        entry.obj_path
        == pkg
        / bindex.IndexEntry(ref.key, ref.kernel, ref.arch, ref.stamp, ref.srcfp, {}, "0" * 64, 0).rel_obj
    )
    assert entry.so_path is not None and entry.so_path.read_bytes() == b"placeholder shared object"
    assert bt.tier().lookup(ref_for(dict(PARAMS, block=64)), s) is None  # another key: a miss


def test_bundles_sit_in_the_lookup_chain_as_an_in_place_tier(site, s):
    from quack.cache.contract import InPlaceTier, ReadTier
    from quack.runtime import tiers

    order = [t.name for t in tiers.read_tiers(s)]
    assert order[:1] == ["bundles"]
    (v,) = [t for t in tiers.read_tiers(s) if t.name == "bundles"]
    assert isinstance(v, InPlaceTier) and isinstance(v, ReadTier)
    assert not bt.tier().discovered  # building the chain discovers nothing
    ref = ref_for()
    install(site, [bfile(ref)], name="demo")
    entry = v.open(ref)
    assert entry.meta["source"] == "bundle:demo" and bt.tier().discovered
    got = v.fetch(ref)
    assert got.data == b"placeholder object bytes" and got.ref == ref and got.source == "bundle:demo"
    assert v.searched() == ("demo 1.0 (1 of 1 entries for this toolchain and sm_90a)",)


def test_altered_object_refused_with_one_warning_and_the_other_bundle_used(site, s):
    ref = ref_for()
    a = install(site, [bfile(ref)], name="a-first")
    install(site, [bfile(ref)], name="b-second")
    obj = next(a.rglob("*.o"))
    obj.write_bytes(b"placeholder object bytez")  # same size, other bytes
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        e1, b1 = bt.tier().lookup(ref, s)
        e2, b2 = bt.tier().lookup(ref, s)
    assert b1.name == b2.name == "b-second"
    msgs = [str(x.message) for x in w if issubclass(x.category, CacheWarning)]
    assert len(msgs) == 1 and "a-first" in msgs[0] and "checksum mismatch" in msgs[0], msgs


def test_two_bundles_same_key_first_by_name(site, s):
    ref = ref_for()
    install(site, [bfile(ref)], name="zz")
    install(site, [bfile(ref)], name="aa")
    assert bt.tier().lookup(ref, s)[1].name == "aa"
    assert [b.name for b in bt.tier().bundles(s)] == ["aa", "zz"]


def test_other_toolchain_stamp_is_never_used_and_reported(site, s):
    ref = ref_for()
    other = ref.stamp.replace("cutlass", "cutlass0.0.0-was")
    install(site, [bfile(ref, stamp=other)], name="old")
    assert bt.tier().lookup(ref, s) is None
    [row] = bt.summary(s)
    assert row["name"] == "old" and row["entries"] == 1 and row["current_entries"] == 0
    assert row["current"] is False and row["stamps"] == [other]


def test_other_arch_bundle_is_never_used_and_reported(site, s):
    install(site, [bfile(ref_for(arch="sm_100a"))], name="blackwell")
    assert bt.tier().lookup(ref_for(), s) is None
    [row] = bt.summary(s)  # this process targets sm_90a
    assert row["current"] is False and row["current_entries"] == 0 and row["stamps"][0].endswith("-sm_100a")
    assert bt.tier().searched(s) == ("blackwell 1.0 (0 of 1 entries for this toolchain and sm_90a)",)


def test_other_source_fingerprint_is_not_used(site, s):
    ref = ref_for()
    stale = dataclasses.replace(ref, srcfp="0123456789abcdef")
    install(site, [bfile(stale)])
    assert bt.tier().lookup(ref, s) is None


def test_prebuilt_miss_lists_the_bundles_searched(site, cache_dir):
    install(site, [bfile(ref_for(dict(PARAMS, block=256)))], name="shipped", version="2.0")
    saved = settings._current
    settings.set_current(
        settings.resolve({"cache_dir": str(cache_dir), "arch": "sm_90a", "mode": "prebuilt"})
    )
    try:
        n0 = len(toykernels.COMPILES)
        with pytest.raises(KernelNotPrebuilt) as ei:
            toykernels.toy_scale("float32", 96, False)
        assert len(toykernels.COMPILES) == n0
    finally:
        settings.set_current(saved)
    err = ei.value
    assert err.bundles == ("shipped 2.0 (1 of 1 entries for this toolchain and sm_90a)",)
    assert "bundles searched: shipped 2.0" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert again.bundles == err.bundles and str(again) == str(err)


def test_a_bundle_says_which_gpus_rows_chose_its_configurations(site, cache_dir, tmp_path):
    """A bundle made on a CPU build farm keys for each table's default GPU; on another model
    every tuned call misses. The index records the model (``quack bundle``: its build's
    choice), the misses and `quack bundle inspect` show it; older bundles without it still load."""
    install(site, [bfile(ref_for(dict(PARAMS, block=256)))], name="shipped", version="2.0")
    pkg = site / bindex.package_name("shipped")
    doc = json.loads((pkg / "index.json").read_text())
    assert "tune_gpu" not in doc  # written without one: an older bundle's index
    bt.reset()
    whl, idx = bw.write_wheel(
        [bfile(ref_for(dict(PARAMS, block=256)))], name="farm", version="1.0", out_dir=tmp_path / "d",
        tune_gpu=((), "no GPU here"),
    )  # fmt: skip
    assert bindex.parse(idx.to_bytes()).tune_gpu == ((), "no GPU here")
    assert bundle_inspect.inspect_wheel(whl, None)["tune_gpu"] == {"models": [], "source": "no GPU here"}
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
    saved = settings._current
    settings.set_current(
        settings.resolve({"cache_dir": str(cache_dir), "arch": "sm_90a", "mode": "prebuilt"})
    )
    try:
        with pytest.raises(KernelNotPrebuilt) as ei:
            toykernels.toy_scale("float32", 96, False)
    finally:
        settings.set_current(saved)
    assert ei.value.bundles == (
        "farm 1.0 (1 of 1 entries for this toolchain and sm_90a, tuned for each table default GPU)",
        "shipped 2.0 (1 of 1 entries for this toolchain and sm_90a)",
    )
    one = bindex.Index("x", "1", 0, "0", (), (("H100", "H200"), "--gpu")).to_bytes()
    assert json.loads(one)["tune_gpu"] == {"models": ["H100", "H200"], "source": "--gpu"}
    assert bindex.parse(one).tune_gpu == (("H100", "H200"), "--gpu")
    # an unknown shape (a later quack's) reads as absent: informative only, never a refusal
    for bad in (
        {"models": ["../x"], "source": "s"},
        {"models": ["H100"]},
        "H100",
        {"models": "H100", "source": "s"},
        {"model": "H100", "source": "s"},
    ):
        doc = json.loads(one)
        doc["tune_gpu"] = bad
        assert bindex.parse(json.dumps(doc).encode()).tune_gpu is None


def _tuned_file(gpu, fn="cross_entropy_fwd", args=("bfloat16", 4096, "none")):
    """A bundle file of a tuned kernel, its configuration chosen by ``gpu``'s rows (the
    cross-entropy forward at N = 4096: the H100's row keeps the heuristic, the H200's
    streams with 4 stages), placeholder bytes."""
    import hashlib

    from quack_kernels import cross_entropy, softmax

    spec = {
        "cross_entropy_fwd": cross_entropy.compile_cross_entropy_fwd,
        "softmax_fwd": softmax.compile_softmax_fwd,
    }[fn].spec
    with settings.override(tune_gpu=gpu):
        bound = spec.bind(args, {}, arch="sm_90a")
        ref = builder.entry_ref(spec, bound, "sm_90a")
    params = spec.plain(bound)
    obj = b"placeholder"
    e = bindex.IndexEntry(
        ref.key, ref.kernel, ref.arch, ref.stamp, ref.srcfp, params, hashlib.sha256(obj).hexdigest(), len(obj)
    )
    meta = {"format": 1, "key": e.key, "kernel": e.kernel, "arch": e.arch, "stamp": e.stamp}
    meta.update(srcfp=e.srcfp, sha256=e.sha256, size=e.size, params=params)
    return bw.BundleFile(e, obj, meta, None)


def test_verify_bundles_says_where_a_default_call_here_would_miss(site, s, tmp_path):
    """By key: the configuration this machine's model asks for, with each tuned entry's other
    parameters, among the bundle's entries. A bundle built without a GPU (the H200's rows,
    the table's default) is right for an H200 and wrong for an H100; one built for both is
    right for both and wrong for a B200 (no rows: the heuristic); a kernel both models
    configure alike (the softmax forward at 4096) is right anywhere, as are untuned ones."""
    from quack_build.verify.bundles import verify_bundles

    made = {
        "for-h200": ([_tuned_file("H200")], (("H200",), "this machine's GPU, through NVML")),
        "farm": ([_tuned_file("H200")], ((), "no NVIDIA driver here")),
        "untuned": ([bfile(ref_for(dict(PARAMS, block=256)))], (("H200",), "[tune] gpu / QUACK_TUNE_GPU")),
        "both": ([_tuned_file("H100"), _tuned_file("H200")], (("H100", "H200"), "--gpu")),
        "alike": ([_tuned_file("H200", "softmax_fwd", ("bfloat16", 4096))], (("H200",), "--gpu")),
    }
    for name, (files, tuned) in made.items():
        whl, _ = bw.write_wheel(files, name=name, version="1.0", out_dir=tmp_path / "d", tune_gpu=tuned)
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)

    def notes(gpu):
        bt.reset()
        with settings.override(tune_gpu=gpu):
            res = verify_bundles(settings.get(), load=False)
        # said, not a problem (the placeholder objects have their own: no GPU code)
        assert all(not b["problems"] for b in res["bundles"])
        return {b["name"]: b["gpu_note"] for b in res["bundles"]}

    on_h100 = notes("H100")
    assert (
        "a default call of cross_entropy_fwd here asks for configurations chosen by GPU H100's"
        in (on_h100["for-h200"])
    )
    assert "(tuned for GPU H200) does not hold" in on_h100["for-h200"] and "--gpu H100" in on_h100["for-h200"]
    assert "(tuned for each table default GPU)" in on_h100["farm"]
    assert on_h100["untuned"] == on_h100["both"] == on_h100["alike"] == ""
    assert set(notes("H200").values()) == {""}
    from quack_kernels import _tuning

    _tuning.reload()  # the warning is said once a process: this test's, whatever ran before
    with pytest.warns(UserWarning, match="no tuning-table rows for GPU 'B200'.*run `quack tune` on a B200"):
        on_b200 = notes("B200")  # the heuristic there, and the user is told so
    assert "(tuned for GPU H100, H200)" in on_b200["both"] and on_b200["alike"] == ""


def test_malformed_index_refuses_the_bundle_with_one_warning(site, s):
    ref = ref_for()
    pkg = install(site, [bfile(ref)], name="evil")
    doc = json.loads((pkg / "index.json").read_text())
    doc["entries"][0]["kernel"] = "../../etc"
    (pkg / "index.json").write_text(json.dumps(doc))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert bt.tier().lookup(ref, s) is None
        assert bt.tier().lookup(ref, s) is None
    msgs = [str(x.message) for x in w if issubclass(x.category, CacheWarning)]
    assert len(msgs) == 1 and "evil" in msgs[0] and "malformed" in msgs[0], msgs


def test_index_path_fields_must_match_the_layout():
    ref = ref_for()
    doc = json.loads(bindex.Index("x", "1", 0, "0", (bfile(ref).entry,)).to_bytes())
    doc["entries"][0]["file"] = "../../outside.o"
    with pytest.raises(BundleError, match="does not match the store layout"):
        bindex.parse(json.dumps(doc).encode())
    with pytest.raises(BundleError, match="format"):
        bindex.parse(b'{"format": 99}')
    with pytest.raises(ValueError, match="bundle name"):
        bindex.check_name("Bad Name")


@pytest.mark.parametrize(
    "name, why",
    [
        ("quack-cache", "runtime's own"),  # the wheel required itself; installed, it removed quack
        ("quack_cache", "runtime's own"),  # the same distribution as pip normalises names
        ("quack.cache", "runtime's own"),
        ("not.a_bundle", "not a quack bundle"),  # an installed distribution, normalised
        ("numpy", "not a quack bundle"),  # pip would replace the runtime's own dependency
    ],
)
def test_a_bundle_may_not_take_the_runtimes_or_an_installed_packages_name(site, name, why):
    install(site, [bfile(ref_for())], name="demo")
    info = site / "not_a_bundle-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: not-a-bundle\nVersion: 1.0\n")
    assert bw.check_new_name("demo") == "demo"  # an installed bundle's next version is fine
    with pytest.raises(ValueError, match=f"bundle name {name!r} .*{why}.*use a name of your own"):
        bw.check_new_name(name)
    with pytest.raises(ValueError, match=why):  # the writer itself refuses it too
        bw.write_wheel([bfile(ref_for())], name=name, version="1", out_dir=site.parent / "refused")
    assert not (site.parent / "refused").exists()


@pytest.fixture
def keys(tmp_path):
    from quack import signing

    d = tmp_path / "keys"
    signing.write_keypair("ci-1", d)
    signing.write_keypair("other", d)
    return {
        "key": signing.load_signing_key(d / "ci-1.key"),
        "pub": d / "ci-1.pub",
        "other_key": signing.load_signing_key(d / "other.key"),
    }


def _trusting(cache_dir, pub):
    return settings.resolve(
        {"cache_dir": str(cache_dir), "arch": "sm_90a", "mode": "jit", "trusted_keys": [str(pub)]}
    )


def test_trusted_keys_accept_signed_refuse_unsigned_untrusted_and_altered(site, keys, cache_dir):
    ref = ref_for()
    install(site, [bfile(ref)], name="signed", signing_key=keys["key"])
    install(site, [bfile(ref)], name="unsigned")
    install(site, [bfile(ref)], name="wrong-key", signing_key=keys["other_key"])
    altered = install(site, [bfile(ref)], name="altered", signing_key=keys["key"])
    doc = json.loads((altered / "index.json").read_text())
    doc["version"] = "9.9"
    (altered / "index.json").write_text(json.dumps(doc))
    s = _trusting(cache_dir, keys["pub"])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        entry, b = bt.tier().lookup(ref, s)
        bt.tier().lookup(ref, s)
    assert b.name == "signed" and b.signer == "ci-1"
    msgs = sorted(str(x.message) for x in w if issubclass(x.category, CacheWarning))
    assert len(msgs) == 3, msgs
    assert "altered" in msgs[0] and "bad signature" in msgs[0]
    assert "unsigned" in msgs[1] and "not signed" in msgs[1]
    assert "wrong-key" in msgs[2] and "not a trusted key" in msgs[2]
    # Without trusted keys, every bundle is usable (first by name: "altered").
    bt.reset()
    s2 = settings.resolve({"cache_dir": str(cache_dir), "arch": "sm_90a"})
    assert bt.tier().lookup(ref, s2)[1].name == "altered"


def test_unloadable_trusted_keys_refuse_every_bundle(site, keys, cache_dir):
    ref = ref_for()
    install(site, [bfile(ref)], name="signed", signing_key=keys["key"])
    s = _trusting(cache_dir, keys["pub"].with_name("missing.pub"))
    with pytest.warns(CacheWarning, match="trusted keys can't be loaded"):
        assert bt.tier().lookup(ref, s) is None


_LAZY = r"""
import importlib.metadata as md, json, sys
calls = []
real = md.entry_points
def counting(*a, **k):
    if k.get("group") == "quack.bundles":
        calls.append(1)
    return real(*a, **k)
md.entry_points = counting
import quack, quack.runtime.jit, toykernels
from quack import settings
settings.get()
before = len(calls)
out = {"before": before}
try:
    toykernels.toy_scale("float32", 96, False)
except quack.KernelNotPrebuilt:
    out["miss1"] = len(calls)
try:
    toykernels.toy_scale("float32", 160, False)
except quack.KernelNotPrebuilt:
    out["miss2"] = len(calls)
out["cutlass"] = "cutlass" in sys.modules
print(json.dumps(out))
"""


def test_discovery_is_lazy_and_once_per_process(tmp_path):
    """Nothing is discovered by importing quack or kernels; the first lookup that reaches
    the tier reads the entry points, once."""
    import os

    env = dict(os.environ, QUACK_CACHE_DIR=str(tmp_path / "c"), QUACK_MODE="prebuilt", QUACK_ARCH="sm_90a")
    r = subprocess.run([sys.executable, "-c", _LAZY], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"before": 0, "miss1": 1, "miss2": 1, "cutlass": False}, out


def test_wheel_is_reproducible_with_source_date_epoch(tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764547200")
    files = [bfile(ref_for()), bfile(ref_for(dict(PARAMS, block=64)), so=None)]
    a, idx = bw.write_wheel(files, name="repro", version="1.0", out_dir=tmp_path / "a")
    b, _ = bw.write_wheel(files, name="repro", version="1.0", out_dir=tmp_path / "b")
    assert a.name == b.name == f"repro-1.0-py3-none-{bw.platform_tag()}.whl"
    assert a.read_bytes() == b.read_bytes() and idx.created == 1764547200.0
    info = bundle_inspect.inspect_wheel(a)
    assert info["ok"] and len(info["entries"]) == 2 and not info["signed"]
    with zipfile.ZipFile(a) as z:
        names = set(z.namelist())
        record = z.read("repro-1.0.dist-info/RECORD").decode()
    assert "repro-1.0.dist-info/entry_points.txt" in names and "quack_bundle_repro/index.json" in names
    assert all(n in record for n in names if not n.endswith("RECORD"))  # every file hashed by WheelFile
