"""Issue 30, the bundle side: unbounded or unchecked bundle input.

Index caps and signature-before-parse (item 4), per-entry metadata against the index
(5), nothing read outside the installed package (6), ``quack bundle inspect`` on
hostile wheels (7), a full disk while writing (10). Bundles are written by the real
writer and unpacked into a site directory on sys.path, as in test_bundles_tier."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
import warnings
import zipfile
from pathlib import Path

import pytest
from test_bundles_tier import PARAMS, _trusting, bfile, install, ref_for

from quack.bundles import index as bindex
from quack.bundles import tier as bt
from quack.errors import BundleError, CacheWarning
from quack_build.bundle import inspect as bundle_inspect
from quack_build.bundle import wheel as bw

MIB = 1024 * 1024


@pytest.fixture
def s(quack_settings):
    return quack_settings


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on sys.path where bundles get 'installed' (unzipped); discovery reset."""
    d = tmp_path / "site"
    d.mkdir()
    monkeypatch.syspath_prepend(str(d))
    bt.reset()
    yield d
    bt.reset()


@pytest.fixture
def keys(tmp_path):
    from quack import signing

    d = tmp_path / "keys"
    signing.write_keypair("ci-1", d)
    return {"key": signing.load_signing_key(d / "ci-1.key"), "pub": d / "ci-1.pub"}


def cache_warnings(w) -> list[str]:
    return [str(x.message) for x in w if issubclass(x.category, CacheWarning)]


def lookup_twice(ref, s) -> tuple[object, list[str]]:
    """The first lookup's answer and the warnings of two lookups (one warning, not two)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        hit = bt.tier().lookup(ref, s)
        bt.tier().lookup(ref, s)
    return hit, cache_warnings(w)


@pytest.fixture
def big_loads(monkeypatch):
    """json.loads calls on more than 1 MiB: counts the parses of a large index."""
    calls = []
    real = json.loads

    def counting(data, *a, **k):
        if len(data) > MIB:
            calls.append(len(data))
        return real(data, *a, **k)

    monkeypatch.setattr(json, "loads", counting)
    return calls


# --- item 4: the index's size first, its signature over the raw bytes, then parse ---


def test_a_200_mb_index_is_refused_by_its_size_unread(site, s, big_loads):
    ref = ref_for()
    pkg = install(site, [bfile(ref)], name="huge")
    with open(pkg / "index.json", "r+b") as f:
        f.truncate(200 * MIB)  # sparse: 200 MB as fstat sees it, nothing on disk
    tracemalloc.start()
    try:
        hit, msgs = lookup_twice(ref, s)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert hit is None and big_loads == []
    assert peak < 4 * MIB, peak  # the old reader held all 200 MB (and then parsed it)
    assert len(msgs) == 1 and "huge" in msgs[0] and str(bindex.MAX_INDEX_BYTES) in msgs[0], msgs


def test_badly_signed_index_is_not_parsed(site, keys, cache_dir, big_loads):
    ref = ref_for()
    pkg = install(site, [bfile(ref)], name="padded", signing_key=keys["key"])
    doc = json.loads((pkg / "index.json").read_text())
    doc["pad"] = "x" * (3 * MIB)  # valid JSON, under the cap, not what was signed
    (pkg / "index.json").write_text(json.dumps(doc))
    hit, msgs = lookup_twice(ref, _trusting(cache_dir, keys["pub"]))
    assert hit is None and big_loads == []  # refused on the signature, never parsed
    assert len(msgs) == 1 and "padded" in msgs[0] and "bad signature" in msgs[0], msgs


def test_entries_are_capped_before_any_is_validated():
    doc = {"format": 1, "name": "x", "version": "1", "entries": [{}] * (bindex.MAX_ENTRIES + 1)}
    with pytest.raises(
        BundleError, match=f"{bindex.MAX_ENTRIES + 1} items, more than the {bindex.MAX_ENTRIES}"
    ):
        bindex.parse(json.dumps(doc).encode())
    with pytest.raises(BundleError, match="more than the"):
        bindex.parse(b" " * (bindex.MAX_INDEX_BYTES + 1))


# --- item 5: an entry's own metadata against the index ----------------------------


def _point_a_at_b(pkg: Path, a, b) -> None:
    """Rewrite the index so that entry ``a`` uses ``b``'s object (copied under a's name,
    with its metadata), sizes and digest updated: consistent unless metadata is read."""
    doc = json.loads((pkg / "index.json").read_text())
    ea, eb = (next(e for e in doc["entries"] if e["key"] == r.key) for r in (a, b))
    for suffix in (".o", ".json"):
        shutil.copy(pkg / eb["file"].replace(".o", suffix), pkg / ea["file"].replace(".o", suffix))
    ea["sha256"], ea["size"], ea["so"] = eb["sha256"], eb["size"], None
    (pkg / "index.json").write_text(json.dumps(doc))


def test_entry_pointed_at_another_kernels_files_is_refused(site, s):
    a, b = ref_for(), ref_for(dict(PARAMS, block=64))
    pkg = install(site, [bfile(a, obj=b"object of A"), bfile(b, obj=b"object of B")], name="mixed")
    _point_a_at_b(pkg, a, b)
    hit, msgs = lookup_twice(a, s)  # no trusted keys: only the metadata can tell
    assert hit is None
    assert len(msgs) == 1 and "mixed" in msgs[0] and f"key={b.key!r}" in msgs[0], msgs
    assert bt.tier().lookup(b, s) is not None  # B itself is fine


def test_inspect_refuses_an_entry_pointed_at_another_kernels_files(tmp_path):
    a, b = ref_for(), ref_for(dict(PARAMS, block=64))
    whl, _ = bw.write_wheel(
        [bfile(a, obj=b"object of A"), bfile(b, obj=b"object of B")],
        name="mixed",
        version="1",
        out_dir=tmp_path,
    )
    tree = tmp_path / "tree"
    with zipfile.ZipFile(whl) as z:
        z.extractall(tree)
    _point_a_at_b(tree / bindex.package_name("mixed"), a, b)
    info = bundle_inspect.inspect_wheel(rezip(tree, whl, tmp_path / "out"))
    assert not info["ok"]
    (row,) = [r for r in info["entries"] if r["key"] == a.key]
    assert len(row["problems"]) == 1 and "metadata" in row["problems"][0], row


# --- deeply nested JSON (RecursionError, which no reader's except ValueError caught) ---
# The per-entry metadata is not covered by the index's signature, so a signed bundle from a
# trusted key still has to survive a tampered one; the index and its signature are parsed
# (the index only when no keys are configured: else a changed index fails its signature).

DEEP = b"[" * 60_000  # under the 64 KiB caps of the metadata files and the signature


@pytest.mark.parametrize("where", ["meta", "so_meta", "sig", "index"])
def test_deeply_nested_json_in_a_bundle_is_refused_with_one_warning(site, keys, s, cache_dir, where):
    ref = ref_for()
    name = f"deep-{where.replace('_', '-')}"
    pkg = install(site, [bfile(ref)], name=name, signing_key=keys["key"])
    (e,) = bindex.parse((pkg / bindex.INDEX_NAME).read_bytes()).entries
    target = {
        "meta": e.rel_meta,
        "so_meta": e.rel_so_meta,
        "sig": bindex.SIG_NAME,
        "index": bindex.INDEX_NAME,
    }
    (pkg / target[where]).write_bytes(DEEP)
    hit, msgs = lookup_twice(ref, s if where == "index" else _trusting(cache_dir, keys["pub"]))
    assert hit is None
    assert len(msgs) == 1 and name in msgs[0] and "nested more than" in msgs[0], msgs


# --- item 6: nothing read outside the installed package --------------------------
# (Each test its own bundle name: a refused bundle warns once per process and name.)


def _set_entry_point(site: Path, name: str, value: str) -> None:
    (ep,) = site.glob("*.dist-info/entry_points.txt")
    ep.write_text(f"[quack.bundles]\n{name} = {value}\n")


def test_entry_point_value_dotdot_is_refused(site, s):
    ref = ref_for()
    pkg = install(site, [bfile(ref)], name="dotdot")
    for f in pkg.iterdir():  # a planted tree at site/.. (what the value '..' reached)
        (shutil.copytree if f.is_dir() else shutil.copy)(f, site.parent / f.name)
    shutil.rmtree(pkg / "v1")  # the real package no longer holds the object
    _set_entry_point(site, "dotdot", "..")
    hit, msgs = lookup_twice(ref, s)
    assert hit is None
    assert len(msgs) == 1 and "entry point value '..'" in msgs[0], msgs


def test_package_not_in_the_distributions_record_is_refused(site, s):
    ref = ref_for()
    install(site, [bfile(ref)], name="no-record")
    (record,) = site.glob("*.dist-info/RECORD")
    lines = record.read_text().splitlines()
    record.write_text("".join(ln + "\n" for ln in lines if "/index.json," not in ln))
    hit, msgs = lookup_twice(ref, s)
    assert hit is None and len(msgs) == 1 and "RECORD does not list" in msgs[0], msgs


def test_bundle_refused_before_its_index_is_named_with_its_version(site, s):
    """A bundle refused before its index was read was named "bundle NAME ? refused", in
    the warning and in KernelNotPrebuilt's list: the distribution's version names it."""
    ref = ref_for()
    install(site, [bfile(ref)], name="no-record-v", version="2.7.1")
    (record,) = site.glob("*.dist-info/RECORD")
    lines = record.read_text().splitlines()
    record.write_text("".join(ln + "\n" for ln in lines if "/index.json," not in ln))
    hit, msgs = lookup_twice(ref, s)
    assert hit is None and len(msgs) == 1, msgs
    assert "bundle no-record-v 2.7.1 refused: " in msgs[0] and " ? " not in msgs[0], msgs
    (b,) = [b for b in bt.discover(s) if b.name == "no-record-v"]
    assert (b.version, b.usable) == ("2.7.1", False)


def test_symlinked_layout_directory_is_not_followed(site, s, tmp_path):
    ref = ref_for()
    pkg = install(site, [bfile(ref)], name="linked-v1")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(pkg / "v1", outside / "v1")
    (pkg / "v1").symlink_to(outside / "v1")  # the files are intact, but outside the package
    hit, msgs = lookup_twice(ref, s)
    assert hit is None
    assert len(msgs) == 1 and "symbolic link" in msgs[0] and str(pkg / "v1") in msgs[0], msgs


def test_symlinked_package_directory_is_refused(site, s, tmp_path):
    ref = ref_for()
    pkg = install(site, [bfile(ref)], name="linked-pkg")
    shutil.move(pkg, tmp_path / "elsewhere")
    pkg.symlink_to(tmp_path / "elsewhere")
    hit, msgs = lookup_twice(ref, s)
    assert hit is None and len(msgs) == 1 and "symbolic link" in msgs[0], msgs


def test_fifo_in_place_of_an_object_is_a_miss_not_a_hang(site, s):
    import threading

    ref = ref_for()
    pkg = install(site, [bfile(ref)], name="fifo")
    (obj,) = pkg.rglob("*.o")
    obj.unlink()
    os.mkfifo(obj)  # open() without O_NONBLOCK waits for a writer for ever
    done, out = threading.Event(), {}

    def look():
        out["hit"], out["msgs"] = lookup_twice(ref, s)
        done.set()

    threading.Thread(target=look, daemon=True).start()
    assert done.wait(timeout=60), "the lookup blocked on a FIFO"
    assert out["hit"] is None and len(out["msgs"]) == 1 and "not a regular file" in out["msgs"][0], out


# --- item 7: quack bundle inspect on hostile wheels ------------------------------


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def rezip(tree: Path, like: Path, out_dir: Path, extra: dict[str, bytes] | None = None) -> Path:
    """A wheel named like ``like`` of ``tree``'s files plus ``extra`` members, with a
    RECORD that hashes every one (so only inspect's own checks can refuse it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / like.name
    members = {p.relative_to(tree).as_posix(): p.read_bytes() for p in sorted(tree.rglob("*")) if p.is_file()}
    (record,) = [n for n in members if n.endswith(".dist-info/RECORD")]
    del members[record]
    members.update(extra or {})
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as z:
        for n, data in members.items():
            z.writestr(zipfile.ZipInfo(n), data, zipfile.ZIP_DEFLATED)
        z.writestr(record, "".join(_record_line(n, d) for n, d in members.items()) + f"{record},,\n")
    return dst


@pytest.fixture
def wheel_tree(tmp_path):
    whl, _ = bw.write_wheel([bfile(ref_for())], name="demo", version="1.0", out_dir=tmp_path / "dist")
    tree = tmp_path / "tree"
    with zipfile.ZipFile(whl) as z:
        z.extractall(tree)
    return whl, tree


def test_rezipped_wheel_is_ok(wheel_tree, tmp_path):
    whl, tree = wheel_tree
    assert bundle_inspect.inspect_wheel(rezip(tree, whl, tmp_path / "same"))[
        "ok"
    ]  # the helper alone refuses nothing


@pytest.mark.parametrize(
    "member",
    ["../../../../tmp/x", "/etc/x", "quack_bundle_demo\\..\\..\\x", "C:/x", "quack_bundle_demo/./x"],
)
def test_inspect_refuses_unsafe_member_names(wheel_tree, tmp_path, member):
    whl, tree = wheel_tree
    info = bundle_inspect.inspect_wheel(rezip(tree, whl, tmp_path / "bad", {member: b"planted"}))
    assert not info["ok"]
    assert [p for p in info["problems"] if repr(member) in p], info["problems"]


def test_inspect_refuses_a_member_outside_the_package(wheel_tree, tmp_path):
    whl, tree = wheel_tree
    info = bundle_inspect.inspect_wheel(rezip(tree, whl, tmp_path / "pth", {"evil.pth": b"import os"}))
    assert not info["ok"] and any("evil.pth" in p and "outside" in p for p in info["problems"])


def test_inspect_refuses_an_oversized_member_unread(wheel_tree, tmp_path):
    whl, tree = wheel_tree
    zeros = bytes(bindex.MAX_FILE_BYTES + 1)  # deflated: ~65 KB in the wheel
    bad = rezip(tree, whl, tmp_path / "big", {"quack_bundle_demo/zeros.bin": zeros})
    del zeros
    tracemalloc.start()
    try:
        info = bundle_inspect.inspect_wheel(bad)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not info["ok"] and peak < 8 * MIB, peak  # the old inspect read it whole
    assert [p for p in info["problems"] if "zeros.bin" in p and str(bindex.MAX_FILE_BYTES) in p]


def test_inspect_streams_object_hashes(tmp_path):
    obj = bytes(24 * MIB)  # under the cap: read, in chunks
    whl, _ = bw.write_wheel([bfile(ref_for(), obj=obj)], name="large", version="1", out_dir=tmp_path)
    del obj
    tracemalloc.start()
    try:
        info = bundle_inspect.inspect_wheel(whl)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info["ok"], info["problems"]
    assert peak < 8 * MIB, peak


def test_inspect_refuses_an_oversized_index_unread(wheel_tree, tmp_path):
    whl, tree = wheel_tree
    idx = tree / "quack_bundle_demo" / "index.json"
    idx.write_bytes(idx.read_bytes() + b" " * bindex.MAX_INDEX_BYTES)
    bad = rezip(tree, whl, tmp_path / "bigidx")
    idx.unlink()
    tracemalloc.start()
    try:
        with pytest.raises(BundleError, match=f"more than the {bindex.MAX_INDEX_BYTES}"):
            bundle_inspect.inspect_wheel(bad)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * MIB, peak


def test_inspect_with_trusted_keys_does_not_parse_a_badly_signed_index(tmp_path, keys, big_loads):
    from quack import signing

    whl, _ = bw.write_wheel(
        [bfile(ref_for())], name="demo", version="1", out_dir=tmp_path / "d", signing_key=keys["key"]
    )
    tree = tmp_path / "tree"
    with zipfile.ZipFile(whl) as z:
        z.extractall(tree)
    idx = tree / "quack_bundle_demo" / "index.json"
    doc = json.loads(idx.read_text())
    doc["pad"] = "x" * (2 * MIB)
    idx.write_text(json.dumps(doc))
    trusted = signing.trusted_keys_from_settings(_trusting(tmp_path / "c", keys["pub"]))
    info = bundle_inspect.inspect_wheel(rezip(tree, whl, tmp_path / "bad"), trusted)
    assert not info["ok"] and info["entries"] == [] and big_loads == []
    assert any("bad signature" in p for p in info["problems"]), info["problems"]


# --- item 10: a full disk while writing the wheel ---------------------------------

_ENOSPC = r"""
import errno, gc, io, json, os, sys, zipfile
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_bundles_tier import bfile, ref_for
from quack_build.bundle import inspect as bundle_inspect
from quack_build.bundle import wheel as bw

class Full(io.FileIO):
    # ENOSPC once 64 KiB are written, like a full disk.
    written, full = 0, False
    def write(self, b):
        if Full.full or Full.written + len(b) > 65536:
            Full.full = True  # and it stays full
            raise OSError(errno.ENOSPC, "No space left on device")
        Full.written += len(b)
        return super().write(b)

class FakeIO:
    def __getattr__(self, name):
        return getattr(io, name)
    def open(self, file, mode="r", *a, **k):
        return io.BufferedRandom(Full(file, mode.replace("b", "")))

zipfile.io = FakeIO()  # only the zip writer's file sees the full disk
files = [bfile(ref_for(), obj=os.urandom(512 * 1024))]  # incompressible: past the limit
try:
    bw.write_wheel(files, name="full", version="1", out_dir=Path(sys.argv[1]))
    print(json.dumps({"errno": None}))
except OSError as e:
    print(json.dumps({"errno": e.errno}))
gc.collect()
"""


def test_full_disk_leaves_no_wheel_and_no_traceback(tmp_path):
    out = tmp_path / "dist"
    here = str(Path(__file__).parent)
    r = subprocess.run(
        [sys.executable, "-c", _ENOSPC, str(out), here], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"errno": 28}, r.stdout
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert list(out.iterdir()) == []  # no wheel, no temp directory


# --- a bundle's text shown by the CLI: data, never Rich markup ---------------------


def test_square_brackets_in_a_bundle_are_shown_not_parsed_as_markup(tmp_path):
    """A params value "[/]" in index.json crashed `quack bundle inspect` (and the verify
    --bundles and cache stats tables) with a rich MarkupError traceback: every table
    cell holding the bundle's data is escaped now. The real CLI, in subprocesses."""
    from reliability_support import env, run_quack

    f = bfile(ref_for())
    f.entry = dataclasses.replace(f.entry, params={"dtype": "[/]", "tag": "[bold]x[/bold]"})
    whl, _ = bw.write_wheel([f], name="brackets", version="1", out_dir=tmp_path / "dist")
    site = tmp_path / "site"
    with zipfile.ZipFile(whl) as z:
        z.extractall(site)
    (tmp_path / "cache").mkdir(mode=0o700)
    e = env(QUACK_CACHE_DIR=tmp_path / "cache", COLUMNS="200")
    e["PYTHONPATH"] = os.pathsep.join((e["PYTHONPATH"], str(site)))
    for args, rc in (
        (["bundle", "inspect", whl], 0),
        (["verify", "--bundles", "--no-load"], 1),  # placeholder objects: a problem row
        (["cache", "stats"], 0),
    ):
        r = run_quack(args, cwd=tmp_path, env_=e, timeout=120)
        out = r.stdout + r.stderr
        assert r.returncode == rc and "Traceback" not in out and "MarkupError" not in out, out
        if args[0] != "cache":  # stats lists the bundle, not its entries' params
            assert "dtype=[/]" in out and "tag=[bold]x[/bold]" in out, out
        else:
            assert "brackets" in out, out
