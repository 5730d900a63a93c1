"""The store as its readers see it: a FIFO planted at an entry's file is refused, never
waited on; a republish (`quack build --force`) never shows a reader a gap; an entry of
another source fingerprint or toolchain is foreign; a damaged .so is said, an absent one
is not; the corrupt-entry warning is true in prebuilt mode."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import toykernels  # noqa: F401 - registers toy_scale
from reliability_support import (
    NO_TORCH,
    can_mount,
    copy_publish,
    env,
    run_py,
    run_quack,
    session_objects,
    toy_ref,
    write_toy_project,
)

from quack.cache import fsutil
from quack.cache.store import DiskStore
from quack.compile import external
from quack.errors import CacheWarning
from quack.runtime import loader


@pytest.fixture
def objs(tmp_path_factory):
    return session_objects(tmp_path_factory)


@pytest.fixture
def linked(objs, tmp_path):
    """A store with one real entry (toy_scale float32/128) and its linked .so."""
    if not loader.can_link():
        pytest.skip("no C compiler: the .so path is not used")
    store = DiskStore(tmp_path / "cache")
    ref = toy_ref(objs["float32"])
    e = copy_publish(store, ref, Path(objs["float32"]["path"]))
    assert loader.link_entry(store, e) is not None
    return store, ref


def plant_fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def cache_warnings(w) -> list[str]:
    return [str(x.message) for x in w if issubclass(x.category, CacheWarning)]


# --- item 1: a FIFO planted at an entry's file -----------------------------------------------

# In a subprocess, bounded: without O_NONBLOCK the open of a FIFO waits for a writer forever.
_LOOKUP = r"""
import json, warnings
from pathlib import Path
from quack.cache.entry import EntryRef
from quack.cache.store import DiskStore
from quack.errors import CacheWarning
store = DiskStore(Path(ROOT))
ref = EntryRef(*REF)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    insp = store.inspect(ref)
    e = store.lookup(ref)
print(json.dumps({"hit": e is not None, "so": e is not None and e.so_path is not None,
                  "inspect": [insp.status, insp.problem],
                  "warnings": [str(x.message) for x in w if issubclass(x.category, CacheWarning)]}))
"""


def lookup_in_subprocess(store: DiskStore, ref) -> dict:
    head = f"ROOT = {str(store.root)!r}\nREF = {[ref.kernel, ref.key, ref.arch, ref.srcfp]!r}\n"
    r = run_py(head + _LOOKUP, timeout=60)
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["meta", "obj"])
def test_fifo_at_metadata_or_object_is_quarantined_as_a_miss(linked, name):
    store, ref = linked
    plant_fifo(store.paths(ref)[name])
    out = lookup_in_subprocess(store, ref)
    assert out["inspect"][0] == "corrupt" and "not a regular file" in out["inspect"][1], out
    assert not out["hit"], out
    assert len(out["warnings"]) == 1, out
    assert "was corrupt" in out["warnings"][0] and "not a regular file" in out["warnings"][0], out
    assert "treated as a miss" in out["warnings"][0], out
    assert not os.path.lexists(store.paths(ref)[name])  # moved aside
    assert len(list((store.root / "quarantine").glob("*.reason"))) == 1


@pytest.mark.parametrize("name", ["so", "so_meta"])
def test_fifo_at_the_so_or_its_sidecar_is_relinked_with_one_warning(linked, name):
    store, ref = linked
    plant_fifo(store.paths(ref)[name])
    out = lookup_in_subprocess(store, ref)
    assert out["hit"] and not out["so"], out  # the verified .o serves; the .so is relinked
    assert out["inspect"][0] == "ok", out
    assert len(out["warnings"]) == 1 and "not a regular file" in out["warnings"][0], out
    assert "is damaged" in out["warnings"][0], out
    assert not (store.root / "quarantine").exists()


def test_fifo_at_the_lock_is_not_waited_on(linked):
    store, ref = linked
    lock = store.paths(ref)["lock"]
    plant_fifo(lock)
    r = run_py(
        f"from quack.compile import external\nprint(external.lock_held({str(lock)!r}))",
        timeout=60,
    )
    assert r.stdout.split()[-1] == "False"
    assert external.lock_held(lock) is False


_PREBUILT = (
    NO_TORCH
    + r"""
import json, warnings
import toykernels
from quack.errors import CacheWarning
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    try:
        toykernels.toy_scale("float32", 128, False)
        got = "loaded"
    except Exception as e:
        got = type(e).__name__
u = toykernels.toy_scale.usage()
print(json.dumps({"got": got, "how": [x["how"] for x in u],
                  "warnings": [str(x.message) for x in w if issubclass(x.category, CacheWarning)]}))
"""
)


def load_prebuilt(root: Path) -> dict:
    r = run_py(_PREBUILT, timeout=120, QUACK_CACHE_DIR=root, QUACK_ARCH="sm_90a", QUACK_MODE="prebuilt")
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["meta", "obj", "so", "so_meta"])
def test_fifo_in_the_runtime_prebuilt(linked, name):
    store, ref = linked
    plant_fifo(store.paths(ref)[name])
    out = load_prebuilt(store.root)
    assert len(out["warnings"]) == 1 and "not a regular file" in out["warnings"][0], out
    if name in ("meta", "obj"):
        assert out["got"] == "KernelNotPrebuilt", out
        # prebuilt mode never compiles: the warning must not promise a recompile
        assert "recompiled" not in out["warnings"][0] and "treated as a miss" in out["warnings"][0]
    else:
        assert out["got"] == "loaded" and out["how"] == ["so"], out
        assert fsutil.read_nofollow(store.paths(ref)["so"])  # relinked: a regular file again


def verify_problems(proj: Path, root: Path) -> tuple[int, list[str]]:
    r = run_quack(["verify", "--no-load", "--json"], cwd=proj, env_=env(QUACK_CACHE_DIR=root), timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    return r.returncode, [p for row in json.loads(r.stdout)["entries"] for p in row["problems"]]


@pytest.mark.parametrize("name", ["meta", "obj", "so", "lock"])
def test_fifo_in_quack_verify_and_build(linked, tmp_path, name):
    store, ref = linked
    proj = write_toy_project(tmp_path / "proj").parent
    plant_fifo(store.paths(ref)[name])
    rc, problems = verify_problems(proj, store.root)
    assert rc == 1 and len(problems) == 1 and "not a regular file" in problems[0], problems
    if name == "so":  # derived: named, with its remedy (the runtime warns about it on every load)
        assert str(store.paths(ref)["so"]) in problems[0] and "links a new one" in problems[0], problems
    force = ["--force"] if name == "lock" else []
    r = run_quack(["build", *force], cwd=proj, env_=env(QUACK_CACHE_DIR=store.root), timeout=180)
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out
    if name == "lock":  # a planted lock is refused with its remedy, never waited on
        assert r.returncode == 1 and "not a regular file" in out and "quack cache clean" in out, out
        return
    assert r.returncode == 0, out
    assert out.count("not a regular file") == 1, out  # one warning, not one per lookup
    assert ("compiled  toy_scale" in out) == (name != "so"), out  # rebuilt unless derived
    if name == "so":  # build did not relink it (it never loads): this process's lookup says so, once
        with pytest.warns(CacheWarning, match="is damaged .not a regular file") as got:
            assert DiskStore(store.root).lookup(ref) is not None
        assert len([w for w in got if issubclass(w.category, CacheWarning)]) == 1
    else:
        assert DiskStore(store.root).lookup(ref) is not None


# --- item 2: a republish never shows a reader a gap -------------------------------------------


def test_republish_never_shows_a_reader_a_gap(objs, tmp_path, monkeypatch):
    """Each republish stops inside its gap (the old metadata removed, the new .o not yet
    renamed in) until a reader has looked the key up there: the reader must wait for the
    key's lock and get the new entry, never a miss (it got KernelNotPrebuilt)."""
    root = tmp_path / "cache"
    writer, reader = DiskStore(root, fsync=False), DiskStore(root, fsync=False)
    ref = toy_ref(objs["float32"])
    sources = [Path(objs["float32"]["path"]), Path(objs["float16"]["path"])]
    copy_publish(writer, ref, sources[0])
    in_gap, looked, answered = threading.Event(), threading.Semaphore(0), threading.Semaphore(0)
    real_publish_file, real_lock = fsutil.publish_file, reader.lock
    released = [False]  # this round's reader has released `looked`

    def publish_file(tmp, target, *, fsync=True):
        if target.suffix == ".o":  # the old metadata is gone: the gap is open
            assert not os.path.lexists(writer.paths(ref)["meta"])
            in_gap.set()
            # the reader's verdict (a miss, without the fix) or its wait on our lock (the
            # fix); bounded, so a reader stuck anywhere else fails the test
            assert looked.acquire(timeout=60), "the reader neither returned nor waited for the lock"
        real_publish_file(tmp, target, fsync=fsync)

    def reader_lock(r, timeout=None):
        if not released[0]:
            released[0] = True
            looked.release()
        return real_lock(r, timeout=timeout)

    monkeypatch.setattr(fsutil, "publish_file", publish_file)
    monkeypatch.setattr(reader, "lock", reader_lock)
    rounds, result, errors = 6, [], []

    def read_in_gaps():
        try:
            for _ in range(rounds):
                assert in_gap.wait(60), "no republish reached its gap"
                in_gap.clear()
                released[0] = False
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    e = reader.lookup(ref)
                if not released[0]:
                    released[0] = True
                    looked.release()
                result.append((e.meta["sha256"] if e else None, cache_warnings(w)))
                answered.release()
        except BaseException as ex:  # noqa: BLE001 - reported by the main thread
            errors.append(ex)
            looked.release()
            answered.release()

    t = threading.Thread(target=read_in_gaps, daemon=True)
    t.start()
    digests = []
    for i in range(rounds):
        digests.append(copy_publish(writer, ref, sources[(i + 1) % 2]).meta["sha256"])
        # the next round starts once this reader has its answer: a republish taking the
        # lock again at once would only starve the reader's polling wait for it
        assert answered.acquire(timeout=60), "the reader did not answer"
    t.join(60)
    assert not t.is_alive() and not errors, errors
    assert [d for d, _ in result] == digests, result  # each reader got the entry just published
    assert all(not w for _, w in result), result
    assert not (root / "quarantine").exists()


def test_republishing_process_and_a_reader_loop(objs, tmp_path):
    """A publisher process republishes the key 150 times (alternating two objects, fsync
    on), as `quack build --force` does; this process looks the key up until the publisher
    is done: every lookup a hit, no warning (a reader that read the old metadata and then
    met the new .o waits for the lock too, and never quarantines a good entry)."""
    root = tmp_path / "cache"
    store = DiskStore(root)
    ref = toy_ref(objs["float32"])
    a, b = Path(objs["float32"]["path"]), Path(objs["float16"]["path"])
    copy_publish(store, ref, a)
    code = f"""
import shutil
from pathlib import Path
from quack.cache.entry import EntryRef
from quack.cache.store import DiskStore
store = DiskStore(Path({str(root)!r}))
ref = EntryRef(*{[ref.kernel, ref.key, ref.arch, ref.srcfp]!r})
objs = [Path({str(a)!r}), Path({str(b)!r})]
print("ready", flush=True)
for i in range(150):
    with store.lock(ref):
        tmp = store.tmp_obj(ref)
        shutil.copyfile(objs[(i + 1) % 2], tmp)
        store.publish(ref, tmp, {{"compile_s": 0.0}})
"""
    p = subprocess.Popen([sys.executable, "-c", code], env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        hits = misses = 0
        deadline = time.monotonic() + 300
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            while p.poll() is None:
                assert time.monotonic() < deadline, "the publisher did not finish"
                if store.lookup(ref) is None:
                    misses += 1
                else:
                    hits += 1
        assert p.wait(60) == 0
        assert misses == 0 and hits > 0, (hits, misses)
        assert cache_warnings(w) == []
    finally:
        p.kill()
        p.wait(30)


def test_object_without_metadata_on_a_read_only_cache_is_a_plain_miss(objs, tmp_path):
    """The lock a lookup would wait for can't be taken at all (a read-only mount): a plain
    miss, no crash, no warning; a corrupt entry there is one warning and a miss."""
    if not can_mount():
        pytest.skip("needs root with mount for a real read-only cache")
    src, ro = tmp_path / "cache", tmp_path / "ro"
    store = DiskStore(src)
    a, b = toy_ref(objs["float32"]), toy_ref(objs["float16"])
    copy_publish(store, a, Path(objs["float32"]["path"]))
    copy_publish(store, b, Path(objs["float16"]["path"]))
    os.unlink(store.paths(a)["meta"])  # debris of an interrupted publish
    mp = store.paths(b)["meta"]
    mp.write_text(json.dumps(dict(json.loads(mp.read_text()), srcfp="0" * 16)))
    ro.mkdir(mode=0o700)
    subprocess.run(["mount", "--bind", str(src), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True)
        rstore = DiskStore(ro)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert rstore.lookup(a) is None
        with pytest.warns(CacheWarning, match="could not be moved aside.*treated as a miss"):
            assert rstore.lookup(b) is None
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


# --- item 3: another source fingerprint or toolchain ------------------------------------------


@pytest.mark.parametrize("field", ["srcfp", "stamp"])
def test_metadata_of_another_fingerprint_or_toolchain_is_foreign(objs, tmp_path, field):
    store = DiskStore(tmp_path / "cache")
    ref = toy_ref(objs["float32"])
    copy_publish(store, ref, Path(objs["float32"]["path"]))
    mp = store.paths(ref)["meta"]
    meta = json.loads(mp.read_text())
    assert meta[field] == getattr(ref, field)  # every publish records both
    meta[field] = {"srcfp": "0" * 16, "stamp": "py3.9-cutlass9.9.9-cu11-other"}[field]
    mp.write_text(json.dumps(meta))
    assert store.inspect(ref).status == "corrupt" and field in store.inspect(ref).problem
    with pytest.warns(CacheWarning, match=rf"metadata {field}=.*foreign entry"):
        assert store.lookup(ref) is None


def test_verify_refuses_a_stale_fingerprint_copied_over_the_current(objs, tmp_path):
    store = DiskStore(tmp_path / "cache")
    ref = toy_ref(objs["float32"])
    copy_publish(store, ref, Path(objs["float32"]["path"]))
    proj = write_toy_project(tmp_path / "proj").parent
    e = env(QUACK_CACHE_DIR=store.root)
    assert run_quack(["verify", "--no-load"], cwd=proj, env_=e).returncode == 0
    mp = store.paths(ref)["meta"]
    mp.write_text(json.dumps(dict(json.loads(mp.read_text()), srcfp="0" * 16)))
    r = run_quack(["verify", "--no-load"], cwd=proj, env_=e)
    assert r.returncode == 1 and "srcfp" in r.stdout + r.stderr, r.stdout + r.stderr


# --- item 4: a damaged .so is said; an absent one is not --------------------------------------


@pytest.mark.parametrize("how", ["truncate", "tamper", "absent", "stale"])
def test_damaged_so_warns_once_absent_or_stale_is_silent(linked, how):
    store, ref = linked
    p = store.paths(ref)
    if how == "truncate":
        os.truncate(p["so"], 0)
    elif how == "tamper":
        p["so"].write_bytes(p["so"].read_bytes() + b"\0")
    elif how == "absent":
        p["so"].unlink()
    else:  # linked from an earlier .o: the sidecar names another digest
        side = json.loads(p["so_meta"].read_text())
        p["so_meta"].write_text(json.dumps(dict(side, o_sha256="0" * 64)))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        e = store.lookup(ref)
        again = store.lookup(ref)  # quack build looks a key up twice: still one warning
    assert e is not None and e.so_path is None and again is not None
    got = cache_warnings(w)
    if how in ("absent", "stale"):
        assert got == []
    else:
        assert len(got) == 1 and "is damaged" in got[0] and "truncated or tampered" in got[0], got
        assert str(p["so"]) in got[0]
    so = loader.link_entry(store, e)
    assert so is not None and store.lookup(ref).so_path == so  # relinked, verified again


def test_prebuilt_runtime_says_a_truncated_so_is_relinked(linked):
    store, ref = linked
    os.truncate(store.paths(ref)["so"], 0)
    out = load_prebuilt(store.root)
    assert out["got"] == "loaded" and out["how"] == ["so"], out
    assert len(out["warnings"]) == 1 and "truncated or tampered" in out["warnings"][0], out
    shutil.rmtree(store.root / "tmp", ignore_errors=True)
