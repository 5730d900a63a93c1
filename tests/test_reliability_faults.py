"""Issue 6, cases 4-5 and durability: disk full, read-only cache, publish order, fsync switch."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
import relkernels  # noqa: F401 - registers rel_copy
import toykernels  # noqa: F401 - registers toy_scale
from reliability_support import (
    NO_TORCH,
    QUACK,
    can_mount,
    copy_publish,
    env,
    made_read_only,
    run_py,
    session_objects,
    toy_ref,
    write_toy_project,
)

from quack import registry, settings, signing
from quack.cache import fsutil
from quack.cache.store import DiskStore
from quack.compile import builder
from quack.errors import CacheWriteError
from quack.remote import objects
from quack.remote.backend import open_backend
from quack.runtime import loader


@pytest.fixture
def objs(tmp_path_factory):
    return session_objects(tmp_path_factory)


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def entry_files(root: Path) -> list[str]:
    """Everything but lock files (which are meant to stay)."""
    return [f for f in files(root) if not f.endswith(".lock")]


# --- 4. disk full ---------------------------------------------------------------------


def test_enospc_during_export_names_cache_and_leaves_nothing(objs, tmp_path, monkeypatch):
    monkeypatch.setenv("QUACK_TEST_OBJ", objs["float32"]["path"])
    monkeypatch.setenv("QUACK_TEST_EXPORT_ERRNO", str(errno.ENOSPC))
    root = tmp_path / "cache"
    store = DiskStore(root)
    spec = registry.get("rel_copy")
    params = spec.bind((), {"i": 1})
    with pytest.raises(CacheWriteError) as ei:
        builder.build(spec, params, "sm_90a", store)
    msg = str(ei.value)
    assert str(root) in msg and "disk full" in msg and "nothing was published" in msg, msg
    assert entry_files(root) == [], "a temp file or partial entry was left behind"
    monkeypatch.delenv("QUACK_TEST_EXPORT_ERRNO")  # space freed
    entry, compiled = builder.build(spec, params, "sm_90a", store)
    assert compiled and store.lookup(entry.ref) is not None


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])
def test_enospc_at_each_fsync_of_publish(fail_at, objs, tmp_path, monkeypatch):
    """Some file systems report a full disk only at fsync. Fail the n-th fsync of a
    publish (object, directory, metadata, directory): a clear error naming the cache,
    no temp file left, and what remains is either nothing or a whole, verified entry."""
    root = tmp_path / "cache"
    store = DiskStore(root, fsync=True)
    ref = toy_ref(objs["float32"])
    real = os.fsync
    n = [0]

    def fsync(fd):
        n[0] += 1
        if n[0] == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CacheWriteError) as ei:
        copy_publish(store, ref, Path(objs["float32"]["path"]))
    monkeypatch.setattr(os, "fsync", real)
    assert str(root) in str(ei.value) and "disk full" in str(ei.value)
    left = entry_files(root)
    assert not any(".tmp-" in f for f in left), left
    e = store.lookup(ref)
    assert e is not None or not any(f.endswith((".o", ".json")) for f in left), left
    copy_publish(store, ref, Path(objs["float32"]["path"]))
    assert store.lookup(ref) is not None


_TMPFS_BUILD = (
    NO_TORCH
    + r"""
import json, sys, subprocess
from pathlib import Path
from quack.compile import builder
from quack import registry
from quack.errors import CacheWriteError
from quack.cache.store import DiskStore
import toykernels
spec = registry.get("toy_scale")
params = spec.bind((), {"dtype": "float32", "block": 256, "bias": True})
out = []
for mnt in sys.argv[1:]:
    root = Path(mnt) / "cache"
    try:
        builder.build(spec, params, "sm_90a", DiskStore(root))
        out.append({"ok": True})
    except CacheWriteError as e:
        out.append({"ok": False, "msg": str(e),
                    "left": sorted(str(p) for p in root.rglob("*") if p.is_file() and not p.name.endswith(".lock"))})
    if mnt == sys.argv[-1]:
        subprocess.run(["mount", "-o", "remount,size=4m", mnt], check=True)  # free space
        e, compiled = builder.build(spec, params, "sm_90a", DiskStore(root))
        out.append({"ok": True, "compiled": compiled, "verified": DiskStore(root).lookup(e.ref) is not None})
print(json.dumps(out))
"""
)

_TMPFS_JIT = (
    NO_TORCH
    + r"""
import json, warnings
warnings.simplefilter("always")
import toykernels
with warnings.catch_warnings(record=True) as w:
    fn = toykernels.toy_scale("float16", 128, True)
u = toykernels.toy_scale.usage()[0]
print(json.dumps({"callable": callable(fn), "how": u["how"], "warnings": [str(x.message) for x in w]}))
"""
)


@pytest.mark.skipif(
    not can_mount(),
    reason="needs root with mount (a real tmpfs); the injected ENOSPC tests above cover the logic",
)
def test_real_full_tmpfs(tmp_path):
    """A real full file system (tmpfs): too small for the .o (12k), big enough for the .o but
    not its metadata (16k). Clear error naming the cache, nothing left; after growing it the
    build completes; and the runtime in jit mode still runs the kernel on a full disk (a
    compile worker compiles it again unstored, into its own temp directory)."""
    mnts = []
    try:
        for size in ("12k", "16k", "12k"):
            m = tmp_path / f"mnt{len(mnts)}_{size}"
            m.mkdir()
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(m)], check=True
            )
            mnts.append(m)
        r = (
            run_py(_TMPFS_BUILD + "", timeout=300)
            if False
            else subprocess.run(
                [os.sys.executable, "-c", _TMPFS_BUILD, str(mnts[0]), str(mnts[1])],
                env=env(),
                capture_output=True,
                text=True,
                timeout=300,
            )
        )
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout.strip().splitlines()[-1])
        for mnt, rr in zip(mnts[:2], res[:2]):
            assert rr["ok"] is False, rr
            assert str(mnt / "cache") in rr["msg"] and "disk full" in rr["msg"], rr["msg"]
            assert rr["left"] == [], rr["left"]
        assert res[2] == {"ok": True, "compiled": True, "verified": True}
        j = run_py(_TMPFS_JIT, QUACK_CACHE_DIR=mnts[2] / "cache", QUACK_ARCH="sm_90a", QUACK_MODE="jit")
        out = json.loads(j.stdout.strip().splitlines()[-1])
        # compiled again by a compile worker, unstored, and loaded: never in this process
        assert out["callable"] and out["how"] == ("so" if loader.can_link() else "o"), out
        assert any("disk full" in w and "in a compile worker, unstored" in w for w in out["warnings"]), out
        assert len(out["warnings"]) == 1, out["warnings"]
        assert not any(".tmp-" in p.name for p in (mnts[2] / "cache").rglob("*"))
    finally:
        for m in mnts:
            subprocess.run(["umount", str(m)], capture_output=True)


# --- 4b. a full temp directory while loading an entry without its .so -----------------------
# Such an entry (pulled from a remote, built without a C compiler, its .so removed) is linked
# or loaded from a private copy of its verified .o. The copy was a file in the temp directory:
# on a full one ENOSPC escaped the kernel call. It is a sealed memory file now (no disk).


def _full_tmp(root: Path):
    """fsutil.reserve_tmp as on a full temp directory: every temp file outside ``root``
    (the cache, which still has room) fails with ENOSPC."""
    real = fsutil.reserve_tmp

    def reserve(target):
        if Path(root) not in Path(target).parents:
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        return real(target)

    return reserve


def test_full_temp_dir_still_loads_an_entry_without_its_so(objs, tmp_path, monkeypatch):
    root = tmp_path / "cache"
    store = DiskStore(root)
    ref = toy_ref(objs["float32"])
    copy_publish(store, ref, Path(objs["float32"]["path"]))
    entry = store.lookup(ref)
    assert entry is not None and entry.so_path is None
    monkeypatch.setattr(fsutil, "reserve_tmp", _full_tmp(root))
    fn, _module, how = loader.load_entry(store, entry)  # raised OSError ENOSPC
    assert callable(fn)
    assert how == ("so" if loader.can_link() else "o")  # the .so linked into the cache
    assert not any(".tmp-" in f for f in files(root))


_NO_MEMFD = (
    NO_TORCH
    + r"""
import errno, json, os, sys, warnings
from pathlib import Path
from quack.cache import fsutil
from quack.errors import CacheWarning, KernelNotPrebuilt
import toykernels

def no_memfd(*a, **k):
    raise OSError(errno.ENOSYS, "Function not implemented")

os.memfd_create = no_memfd  # a system without memory files ...
root = Path(sys.argv[1])
real = fsutil.reserve_tmp

def reserve(target):  # ... and with a full temp directory (the cache has room)
    if root not in Path(target).parents:
        raise OSError(errno.ENOSPC, "No space left on device", str(target))
    return real(target)

fsutil.reserve_tmp = reserve
calls = []
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    for _ in range(2):
        try:
            toykernels.toy_scale("float32", 128, False)
            calls.append("ok")
        except KernelNotPrebuilt:
            calls.append("not prebuilt")
print(json.dumps({"calls": calls, "warnings": [str(x.message) for x in w if issubclass(x.category, CacheWarning)],
                  "other": [str(x.message) for x in w if not issubclass(x.category, CacheWarning)]}))
"""
)


def test_without_memory_files_a_full_temp_dir_is_a_miss_with_one_warning(objs, tmp_path):
    """Where there are no memory files the copy is still a temp file: a temp directory
    that can't take it makes the entry a miss with one warning naming the cause, never a
    crash, and never a load of the cache's file itself (it could change after the check)."""
    root = tmp_path / "cache"
    copy_publish(DiskStore(root), toy_ref(objs["float32"]), Path(objs["float32"]["path"]))
    r = subprocess.run(
        [os.sys.executable, "-c", _NO_MEMFD, str(root)],
        env=env(QUACK_CACHE_DIR=root, QUACK_ARCH="sm_90a", QUACK_MODE="prebuilt"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["calls"] == ["not prebuilt", "not prebuilt"], out
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "ENOSPC" in out["warnings"][0] and "private copy" in out["warnings"][0], out["warnings"]
    assert not any(".tmp-" in f for f in files(root))


_FULL_TMP_CALL = (
    NO_TORCH
    + r"""
import json, tempfile, warnings
import toykernels
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    fn = toykernels.toy_scale("float32", 128, False)
u = toykernels.toy_scale.usage()[0]
print(json.dumps({"callable": callable(fn), "how": u["how"], "tier": u["tier"],
                  "tmp": tempfile.gettempdir(), "warnings": [str(x.message) for x in w]}))
"""
)


@pytest.mark.skipif(
    not can_mount(), reason="needs root with mount (a real tmpfs); the test above injects ENOSPC"
)
@pytest.mark.parametrize("mode", ["prebuilt", "jit"])
def test_real_full_tmpfs_as_temp_dir_loads_an_entry_without_its_so(objs, tmp_path, mode):
    """The reviewer's case: the cache and TMPDIR on one file system (~/.cache and /tmp on
    one root file system) with a page left. The entry loads, through cutlass (no room to
    link a .so), in both modes; the one warning says why every process now pays that (the
    disk is full) and how to free it (tests/test_failpaths_cache.py's link warning)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)], check=True)
    try:
        root = mnt / "cache"
        copy_publish(DiskStore(root), toy_ref(objs["float32"]), Path(objs["float32"]["path"]))
        (mnt / "tmp").mkdir(mode=0o700)
        st = os.statvfs(mnt)
        (mnt / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 4096))
        r = run_py(
            _FULL_TMP_CALL, QUACK_CACHE_DIR=root, QUACK_ARCH="sm_90a", QUACK_MODE=mode, TMPDIR=mnt / "tmp"
        )
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["tmp"] == str(mnt / "tmp"), out
        assert out["callable"] and out["how"] == "o" and out["tier"] == "cache", out
        (warning,) = out["warnings"]
        assert "cannot be linked into .so files" in warning and "disk full" in warning, warning
        assert not any(".tmp-" in f for f in files(root))
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


# --- 5. read-only cache -------------------------------------------------------------------

_RO_RUNTIME = (
    NO_TORCH
    + r"""
import json, warnings
warnings.simplefilter("always")
import toykernels
from quack.errors import CacheWarning
with warnings.catch_warnings(record=True) as w:
    a = toykernels.toy_scale("float32", 128, False)   # prebuilt, with its .so
    b = toykernels.toy_scale("float16", 64, False)    # prebuilt .o only: linked privately
    c = toykernels.toy_scale("bfloat16", 128, False)  # miss: compiled in a worker, not stored
    d = toykernels.toy_scale("bfloat16", 64, True)    # another miss: no second warning
u = {(x["params"]["dtype"], x["params"]["block"]): x for x in toykernels.toy_scale.usage()}
print(json.dumps({"how": [u[k]["how"] for k in (("float32", 128), ("float16", 64), ("bfloat16", 128),
                                                ("bfloat16", 64))],
                  "callable": all(map(callable, (a, b, c, d))),
                  "warnings": [str(x.message) for x in w if issubclass(x.category, CacheWarning)],
                  "other": [str(x.message) for x in w if not issubclass(x.category, CacheWarning)]}))
"""
)


@pytest.fixture
def read_only_cache(objs, tmp_path):
    """A cache with two prebuilt entries (one with its .so), made read-only for real:
    a read-only bind mount as root, or chmod a-w as an ordinary user."""
    src = tmp_path / "cache"
    store = DiskStore(src)
    e = copy_publish(store, toy_ref(objs["float32"]), Path(objs["float32"]["path"]))
    loader.link_entry(store, e)
    copy_publish(store, toy_ref(objs["float16"]), Path(objs["float16"]["path"]))
    before = files(src)
    with made_read_only(src, tmp_path / "ro") as ro:
        yield ro, before


def test_read_only_cache_runtime_works_with_one_warning(read_only_cache):
    root, before = read_only_cache
    r = run_py(_RO_RUNTIME, QUACK_CACHE_DIR=root, QUACK_ARCH="sm_90a", QUACK_MODE="jit")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["callable"]
    assert out["how"][:2] == ["so", "so"], out  # hits load fast, even without a stored .so
    # misses: compiled by a compile worker unstored, loaded from a private copy of the bytes
    assert out["how"][2:] == (["so", "so"] if loader.can_link() else ["o", "o"]), out
    assert len(out["warnings"]) == 1 and "not writable" in out["warnings"][0], out["warnings"]
    assert "compiled in a compile worker" in out["warnings"][0], out["warnings"]
    assert files(root) == before, "a read-only cache was modified"


def test_read_only_cache_build_fails_clearly(read_only_cache):
    root, _ = read_only_cache
    os.environ["QUACK_TEST_OBJ"] = "/nonexistent"  # never reached: the lock/temp fails first
    spec = registry.get("rel_copy")
    with pytest.raises(CacheWriteError) as ei:
        builder.build(spec, spec.bind((), {"i": 3}), "sm_90a", DiskStore(root))
    msg = str(ei.value)
    assert str(root) in msg and ("read-only" in msg or "permission denied" in msg), msg
    assert DiskStore(root).writable() is False


def test_read_only_cache_quack_build_fails_clearly(read_only_cache, tmp_path):
    root, before = read_only_cache
    write_toy_project(
        tmp_path / "proj",
        """
[[kernel]]
name = "toy_scale"
params = { dtype = ["bfloat16"], block = [32] }
""",
    )
    r = subprocess.run(
        [*QUACK, "build", "--cache-dir", str(root)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path / "proj"),
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0 and r.returncode != 2, out
    assert "Traceback" not in out, out
    assert str(root) in out and ("read-only" in out or "not writable" in out or "permission" in out), out
    assert files(root) == before


# --- 5b. a verified remote hit the local cache can't store -------------------------------
# It was downloaded, verified, then dropped: KernelNotPrebuilt with no reason in prebuilt
# mode, an in-process compile in jit mode. It is loaded from a private copy of its bytes.

_CALL_TOY = (
    NO_TORCH
    + r"""
import json, sys, warnings
if sys.argv[1:] == ["full"]:  # a cache on a full disk: the first file of a publish fails
    from quack.cache.store import DiskStore

    def tmp_obj(self, ref):
        raise OSError(28, "No space left on device", str(self.root))

    DiskStore.tmp_obj = tmp_obj
import toykernels
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    fn = toykernels.toy_scale("float32", 128, False)
u = toykernels.toy_scale.usage()[0]
print(json.dumps({"callable": callable(fn), "how": u["how"], "tier": u["tier"], "compiles": u["compiles"],
                  "warnings": [str(x.message) for x in w]}))
"""
)


@pytest.fixture
def signed_remote(objs, tmp_path):
    """A file:// remote holding the toy float32/128 object, signed by a trusted key:
    (its URL, the public key for QUACK_TRUSTED_KEYS)."""
    keys = tmp_path / "keys"
    signing.write_keypair("ci-1", keys)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    ref = toy_ref(objs["float32"])
    data = Path(objs["float32"]["path"]).read_bytes()
    blob = objects.pack(ref, objs["float32"]["params"], data, signing.load_signing_key(keys / "ci-1.key"))
    assert open_backend(f"file://{shared}").put_if_absent(objects.object_name(ref), blob)
    return f"file://{shared}", keys / "ci-1.pub"


@pytest.mark.parametrize("mode", ["prebuilt", "jit"])
@pytest.mark.parametrize("cache", ["read-only", "full"])
def test_a_verified_remote_hit_the_cache_cant_store_is_loaded(signed_remote, tmp_path, mode, cache):
    url, pub = signed_remote
    src = tmp_path / "cache"
    (src / "v1").mkdir(mode=0o700, parents=True)
    src.chmod(0o700)
    with contextlib.ExitStack() as stack:
        root = stack.enter_context(made_read_only(src, tmp_path / "ro")) if cache == "read-only" else src
        before = files(root)
        r = subprocess.run(
            [os.sys.executable, "-c", _CALL_TOY, *(["full"] if cache == "full" else [])],
            env=env(
                QUACK_CACHE_DIR=root,
                QUACK_ARCH="sm_90a",
                QUACK_MODE=mode,
                QUACK_REMOTE=url,
                QUACK_TRUSTED_KEYS=pub,
            ),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]  # prebuilt: KernelNotPrebuilt
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["callable"] and out["tier"] == "remote" and out["compiles"] == 0, out  # jit: compiled
        assert out["how"] == ("so" if loader.can_link() else "o"), out
        assert out["warnings"] == [], out["warnings"]
        assert not any(f.endswith((".o", ".so")) for f in files(root)), "stored, though it can't be"
        if cache == "read-only":
            assert files(root) == before


# --- durability -------------------------------------------------------------------------------


def _record(monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b, **kw):
        calls.append(("rename", os.fspath(a), os.fspath(b)))
        return real_replace(a, b, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return calls


def test_publish_durability_order(objs, tmp_path, monkeypatch):
    """write temp, fsync it, rename, fsync the directory; metadata the same way, last."""
    store = DiskStore(tmp_path / "cache", fsync=True)
    ref = toy_ref(objs["float32"])
    p = store.paths(ref)
    calls = _record(monkeypatch)
    copy_publish(store, ref, Path(objs["float32"]["path"]))
    d = str(p["obj"].parent)
    shape = []
    for c in calls:
        if c[0] == "fsync":
            path = c[1]
            shape.append(
                (
                    "fsync",
                    "dir"
                    if path == d
                    else "obj.tmp"
                    if ".o.tmp-" in path
                    else "meta.tmp"
                    if ".json.tmp-" in path
                    else path,
                )
            )
        else:
            shape.append(
                (
                    "rename",
                    "obj.tmp" if ".o.tmp-" in c[1] else "meta.tmp" if ".json.tmp-" in c[1] else c[1],
                    Path(c[2]).suffix,
                )
            )
    assert shape == [
        ("fsync", "obj.tmp"),
        ("rename", "obj.tmp", ".o"),
        ("fsync", "dir"),
        ("fsync", "meta.tmp"),
        ("rename", "meta.tmp", ".json"),
        ("fsync", "dir"),
    ], shape


def test_fsync_can_be_turned_off(objs, tmp_path, monkeypatch):
    store = DiskStore(tmp_path / "cache", fsync=False)
    ref = toy_ref(objs["float32"])
    calls = _record(monkeypatch)
    copy_publish(store, ref, Path(objs["float32"]["path"]))
    assert [c[0] for c in calls] == ["rename", "rename"]  # same order, no fsync
    assert store.lookup(ref) is not None


def test_fsync_setting_precedence(tmp_path):
    assert settings.resolve(env={}, cwd=tmp_path).fsync is True
    assert settings.resolve(env={"QUACK_FSYNC": "0"}, cwd=tmp_path).fsync is False
    (tmp_path / "quack.toml").write_text("[cache]\nfsync = false\n")
    assert settings.resolve(env={}, cwd=tmp_path).fsync is False
    assert settings.resolve(env={"QUACK_FSYNC": "1"}, cwd=tmp_path).fsync is True
