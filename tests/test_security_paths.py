"""Issue 6, cases 9-10: symlinks planted anywhere in the cache are refused (O_NOFOLLOW /
lstat) and their targets stay untouched; unsafe cache roots are refused with a fix;
hostile kernel names, parameters and manifest entries never leave the cache root."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import relkernels  # noqa: F401 - registers rel_copy
import toykernels  # noqa: F401 - registers toy_scale
from reliability_support import (
    NO_TORCH,
    QUACK,
    ROOT,
    copy_publish,
    env,
    run_py,
    session_objects,
    toy_ref,
    write_toy_project,
)

from quack import registry, settings
from quack.cache import fsutil
from quack.cache.entry import EntryRef
from quack.cache.store import DiskStore
from quack.compile import builder
from quack.errors import CacheError, CacheWarning, CacheWriteError, ParamError, SettingsError, UnknownKernel
from quack.runtime import loader


@pytest.fixture
def objs(tmp_path_factory):
    return session_objects(tmp_path_factory)


def snapshot(d: Path) -> dict:
    """Every file under d (not following links) with its bytes' digest and mode."""
    out = {}
    for p in sorted(Path(d).rglob("*")):
        st = os.lstat(p)
        out[str(p.relative_to(d))] = (
            stat.S_IFMT(st.st_mode),
            st.st_mode & 0o7777,
            hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None,
        )
    return out


@pytest.fixture
def outside(objs, tmp_path):
    """A directory outside the cache holding a complete, valid-looking entry: the bait."""
    bait = tmp_path / "outside"
    store = DiskStore(bait)
    copy_publish(store, toy_ref(objs["float32"]), Path(objs["float32"]["path"]))
    return bait


# --- 9. symlinks -------------------------------------------------------------------------


def test_symlinked_cache_root_is_refused(outside, objs, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    store = DiskStore(link)
    with pytest.raises(CacheError, match="symbolic link.*QUACK_CACHE_DIR"):
        store.lookup(toy_ref(objs["float32"]))
    with pytest.raises(CacheError, match="symbolic link"):
        store.tmp_obj(toy_ref(objs["float32"]))
    assert snapshot(outside) == before


@pytest.mark.parametrize("level", ["v1", "stamp", "kernel", "srcfp", "quarantine"])
def test_symlinked_directory_in_the_cache_is_refused(level, outside, objs, tmp_path):
    root = tmp_path / "cache"
    store = DiskStore(root)
    ref = toy_ref(objs["float32"])
    copy_publish(store, ref, Path(objs["float32"]["path"]))
    entry_dir = store.entry_dir(ref)
    bait_dir = DiskStore(outside).entry_dir(ref)
    victim = {
        "v1": root / "v1",
        "stamp": entry_dir.parent.parent,
        "kernel": entry_dir.parent,
        "srcfp": entry_dir,
        "quarantine": root / "quarantine",
    }[level]
    target = {
        "v1": outside / "v1",
        "stamp": bait_dir.parent.parent,
        "kernel": bait_dir.parent,
        "srcfp": bait_dir,
        "quarantine": outside,
    }[level]
    if level == "quarantine":
        victim.mkdir(exist_ok=True)
        store.paths(ref)["obj"].write_bytes(b"corrupt")  # so that lookup wants to quarantine
    shutil.rmtree(victim)
    victim.symlink_to(target, target_is_directory=True)
    before = snapshot(outside)
    if level == "quarantine":
        with pytest.warns(CacheWarning, match="could not be moved aside"):
            assert store.lookup(ref) is None
    else:
        with pytest.raises(CacheError, match="symbolic link"):
            store.lookup(ref)
        with pytest.raises(CacheError, match="symbolic link|not a directory"):
            store.lock(ref).__enter__()
        spec = registry.get("toy_scale")
        with pytest.raises(CacheError):
            builder.build(spec, spec.bind((), objs["float32"]["params"]), "sm_90a", store)
    assert snapshot(outside) == before


@pytest.mark.parametrize("which", ["obj", "meta"])
def test_symlinked_entry_file_is_never_read_through(which, outside, objs, tmp_path, monkeypatch):
    """A .o or .json that is a symlink (even to a valid entry) is refused and moved aside;
    its target is untouched; nothing is loaded."""
    monkeypatch.setattr(loader, "load_so", lambda *a: pytest.fail("loaded through a symlink"))
    root = tmp_path / "cache"
    store = DiskStore(root)
    ref = toy_ref(objs["float32"])
    copy_publish(store, ref, Path(objs["float32"]["path"]))
    p = store.paths(ref)[which]
    p.unlink()
    p.symlink_to(DiskStore(outside).paths(ref)[which])
    before = snapshot(outside)
    with pytest.warns(CacheWarning, match="was corrupt"):
        assert store.lookup(ref) is None
    assert not os.path.lexists(p)
    assert snapshot(outside) == before


@pytest.mark.parametrize("which", ["so", "so_meta"])
def test_symlinked_derived_file_is_replaced_not_followed(which, outside, objs, tmp_path):
    if not loader.can_link():
        pytest.skip("no C compiler")
    root = tmp_path / "cache"
    store = DiskStore(root)
    ref = toy_ref(objs["float32"])
    e = copy_publish(store, ref, Path(objs["float32"]["path"]))
    loader.link_entry(store, e)
    bait = DiskStore(outside)
    loader.link_entry(bait, bait.lookup(ref))
    p = store.paths(ref)[which]
    p.unlink()
    p.symlink_to(bait.paths(ref)[which])
    before = snapshot(outside)
    with pytest.warns(CacheWarning, match=r"is damaged \(a symbolic link \(never followed\)"):
        e = store.lookup(ref)
    assert e.so_path is None  # a symlinked .so or sidecar is never trusted
    so = loader.link_entry(store, e)
    assert so is not None and not os.path.islink(so)
    assert snapshot(outside) == before


def test_symlinked_lock_file_is_refused(objs, tmp_path):
    root = tmp_path / "cache"
    store = DiskStore(root)
    ref = toy_ref(objs["float32"])
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    victim.chmod(0o644)
    store._ensure(ref)
    store.paths(ref)["lock"].symlink_to(victim)
    with pytest.raises(CacheError, match="lock file .*symbolic link"):
        with store.lock(ref):
            pass  # the lock must be refused before the block runs
    # neither written through nor chmod-ed through the link (an assertion that was `... or True`)
    assert victim.read_text() == "precious" and victim.stat().st_mode & 0o777 == 0o644
    assert victim.read_text() == "precious"


def test_planted_temp_path_is_never_written_through(objs, tmp_path, monkeypatch):
    """Temp names are random, but even a predicted one is refused: temps are created
    O_EXCL | O_NOFOLLOW, and publishing re-checks the temp is a private regular file."""
    root = tmp_path / "cache"
    store = DiskStore(root)
    ref = toy_ref(objs["float32"])
    store._ensure(ref)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")

    class FixedUUID:
        hex = "0123456789abcdef"

    monkeypatch.setattr(fsutil.uuid, "uuid4", lambda: FixedUUID)
    for target in ("obj", "meta"):
        planted = fsutil.tmp_beside(store.paths(ref)[target])
        planted.symlink_to(victim)
    with pytest.raises(CacheWriteError):
        store.tmp_obj(ref)
    with pytest.raises(FileExistsError):
        fsutil.write_atomic(store.paths(ref)["meta"], b"{}")
    link = tmp_path / "cache" / "tmplink"
    link.symlink_to(victim)
    with pytest.raises(OSError):
        fsutil.publish_file(link, store.paths(ref)["obj"])
    assert victim.read_text() == "precious"
    assert not store.paths(ref)["obj"].exists() and not store.paths(ref)["meta"].exists()


# --- 9. unsafe roots ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777, 0o720])
def test_root_writable_by_others_is_refused_with_fix(mode, tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(CacheError) as ei:
        DiskStore(root).lookup(EntryRef("toy_scale", "0" * 64, "sm_90a", "0" * 16))
    assert f"chmod 700 {root}" in str(ei.value)


def test_root_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(root, 4242, 4242)  # real: another owner
    else:
        monkeypatch.setattr(os, "getuid", lambda: os.stat(root).st_uid + 1)
    with pytest.raises(CacheError) as ei:
        DiskStore(root).lookup(EntryRef("toy_scale", "0" * 64, "sm_90a", "0" * 16))
    assert "owned by uid" in str(ei.value) and "QUACK_CACHE_DIR" in str(ei.value)


def test_root_inside_world_writable_dir_without_sticky_bit(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(CacheError, match=r"anyone can write.*chmod o-w"):
        DiskStore(open_dir / "cache").lookup(EntryRef("toy_scale", "0" * 64, "sm_90a", "0" * 16))
    open_dir.chmod(0o1777)  # like /tmp: fine
    assert DiskStore(open_dir / "cache").lookup(EntryRef("toy_scale", "0" * 64, "sm_90a", "0" * 16)) is None


def test_unsafe_root_runtime_still_runs_uncached(tmp_path, objs):
    """The runtime refuses the unsafe cache (a warning saying why) and still runs: the
    miss is compiled by a worker, unstored (rel_copy's "compile" exports a real toy .o),
    and loaded from a private copy; nothing lands in the refused cache."""
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o777)
    r = run_py(
        NO_TORCH + "import json, warnings\nwarnings.simplefilter('always')\nimport relkernels\n"
        "with warnings.catch_warnings(record=True) as w:\n    fn = relkernels.rel_copy(5)\n"
        "u = relkernels.rel_copy.usage()[0]\n"
        "print(json.dumps({'callable': callable(fn), 'tier': u['tier'],"
        " 'w': [str(x.message) for x in w]}))",
        QUACK_CACHE_DIR=root,
        QUACK_TEST_OBJ=objs["float32"]["path"],
    )
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["callable"] and out["tier"] == "compile", out
    assert any("chmod 700" in w for w in out["w"]), out
    assert list(root.iterdir()) == []


def test_filelock_has_the_symlink_cve_fixes():
    """CVE-2025-68146 and CVE-2026-22701 (lock-file symlink / TOCTOU) are fixed in 3.20.3."""
    v = tuple(int(x) for x in re.findall(r"\d+", md.version("filelock"))[:3])
    assert v >= (3, 20, 3), v
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"filelock>=3\.20\.3', text), "pyproject must keep the filelock floor"


# --- 10. hostile names and values -------------------------------------------------------------------

HOSTILE = [
    "../canary",
    "../../canary",
    "/tmp/quack-canary-abs",
    "a/b",
    "x\0y",
    "..",
    ".",
    "",
    "k" * 5000,
    "\udcff\udcfe",
    "ok\n",
    "ok/../../canary",
    "C:\\canary",
    "~/canary",
    "toy_scale/..",
]


@pytest.fixture
def canary(tmp_path):
    c = tmp_path / "canary"
    yield c
    assert not c.exists() and not (tmp_path.parent / "canary").exists()
    assert not Path("/tmp/quack-canary-abs").exists()


@pytest.mark.parametrize("bad", HOSTILE, ids=lambda s: repr(s)[:20])
def test_hostile_names_refused_and_stay_under_root(bad, canary, tmp_path, objs):
    root = tmp_path / "cache"
    DiskStore(root)
    good = toy_ref(objs["float32"])
    with pytest.raises(ValueError, match="must match"):
        registry.register(bad, lambda dtype: None, {})
    with pytest.raises(UnknownKernel):
        registry.get(bad)
    for field in ("kernel", "key", "arch", "srcfp"):
        kw = dict(kernel=good.kernel, key=good.key, arch=good.arch, srcfp=good.srcfp)
        kw[field] = bad
        with pytest.raises(ParamError, match="refusing"):
            EntryRef(**kw)
    spec = registry.get("toy_scale")
    for p in ("dtype", "block", "bias"):
        with pytest.raises(ParamError):
            spec.bind((), dict(objs["float32"]["params"], **{p: bad}))
    with pytest.raises(SettingsError):
        settings.resolve({}, env={"QUACK_ARCH": bad}, cwd=tmp_path) if bad else (_ for _ in ()).throw(
            SettingsError("empty means unset")
        )
    for p in root.rglob("*") if root.exists() else ():
        assert fsutil.under_root(p, root)


def test_path_helpers_refuse_escapes(tmp_path):
    root = tmp_path / "cache"
    for bad in ("../x", "a/../../x", "/etc/passwd", "a\0b"):
        with pytest.raises(CacheError):
            fsutil.under_root(root / bad if not bad.startswith("/") else Path(bad), root)
    with pytest.raises(CacheError):
        DiskStore(str(tmp_path / "a\0b"))


def test_hostile_manifest_entries_refused(canary, tmp_path):
    """Manifest entries with ../, /, NUL, absolute paths, long strings, non-UTF-8: the CLI
    refuses each clearly and nothing is written outside the cache root."""
    write_toy_project(tmp_path)
    entries = [
        b'[[kernel]]\nname = "../canary"\nparams = { dtype = ["float32"] }\n',
        b'[[kernel]]\nname = "/tmp/quack-canary-abs"\n',
        b'[[kernel]]\nname = "toy_scale"\narchs = ["../../canary"]\nparams = { dtype = ["float32"] }\n',
        b'[[kernel]]\nname = "toy_scale"\nparams = { dtype = ["../canary"] }\n',
        b'[[kernel]]\nname = "toy_\\u0000scale"\nparams = { dtype = ["float32"] }\n',
        b'[[kernel]]\nname = "toy_scale"\nparams = { dtype = ["float32\\u0000../canary"] }\n',
        b'[[kernel]]\nname = "' + b"k" * 100000 + b'"\n',
        b'[[kernel]]\nname = "toy\xff\xfescale"\n',
        b'[[kernel]]\nname = "toy_scale"\nparams = { dtype = ["float32"], block = [128], bias = [false], '
        b'extra = ["../../canary"] }\n',
    ]
    for i, data in enumerate(entries):
        m = tmp_path / f"hostile{i}.toml"
        m.write_bytes(data)
        r = subprocess.run(
            [*QUACK, "build", "--cache-dir", str(tmp_path / "cache"), str(m)],
            env=env(),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=120,
            cwd=str(tmp_path),
        )
        out = r.stdout + r.stderr
        assert r.returncode not in (0,) and "Traceback" not in out, (i, out)
        assert m.name in out, (i, out)
    for p in tmp_path.rglob("*"):
        assert p.is_relative_to(tmp_path)
    assert not any("canary" in p.name for p in tmp_path.rglob("*"))
