"""Issue 6, cases 6-8: stopped and killed lock holders, `quack cache clean` under load,
many processes on one cold key and on 100 keys. Compiles are counted, never timed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import warnings
from pathlib import Path

import pytest
import relkernels  # noqa: F401 - registers rel_copy
from reliability_support import NO_TORCH, PY, QUACK, TESTS, env, session_objects

from quack import registry
from quack.cache.store import DiskStore
from quack.compile import builder


@pytest.fixture
def objs(tmp_path_factory):
    return session_objects(tmp_path_factory)


def rel_ref(i: int):
    spec = registry.get("rel_copy")
    return builder.entry_ref(spec, spec.bind((), {"i": i}), "sm_90a")


def spawn(code: str, *args, **envextra) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-c", code, *map(str, args)],
        env=env(**envextra),
        cwd=str(TESTS),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(p: subprocess.Popen, timeout: float = 300):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"rc={p.returncode}\n{out}\n{err}"
    return json.loads(out.strip().splitlines()[-1])


def counted(counter: Path) -> list[tuple[int, int]]:
    if not counter.exists():
        return []
    return [tuple(map(int, line.split())) for line in counter.read_text().splitlines()]


# --- 6. lock holders stopped and killed ------------------------------------------------------

_HOLDER = r"""
import json, os, sys, time
from pathlib import Path
import relkernels
from quack.compile import builder
from quack import registry
from quack.cache.store import DiskStore
root, obj, i, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
spec = registry.get("rel_copy")
ref = builder.entry_ref(spec, spec.bind((), {"i": i}), "sm_90a")
store = DiskStore(Path(root))
data = Path(obj).read_bytes()
with store.lock(ref):
    tmp = store.tmp_obj(ref)
    with open(tmp, "wb") as f:
        f.write(data[: len(data) // 2]); f.flush()
        print("locked", flush=True)
        time.sleep(hold)
        f.write(data[len(data) // 2:])
    store.publish(ref, tmp, {"compile_s": 0.0, "pid": os.getpid()})
print(json.dumps({"published": True, "pid": os.getpid()}), flush=True)
"""

_JIT_WAITER = r"""
import json, os, time, warnings
warnings.simplefilter("always")
import relkernels
t = time.time()
with warnings.catch_warnings(record=True) as w:
    fn = relkernels.rel_copy(7)
u = relkernels.rel_copy.usage()[0]
print(json.dumps({"how": u["how"], "tier": u["tier"], "callable": callable(fn), "s": time.time() - t,
                  "pid": os.getpid(), "warnings": [str(x.message) for x in w]}))
"""

_BUILD_WAITER = r"""
import json, sys, time
from pathlib import Path
import relkernels
from quack.compile import builder
from quack import registry
from quack.errors import LockTimeout
from quack.cache.store import DiskStore
root, i, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
spec = registry.get("rel_copy")
print("waiting", flush=True)
try:
    e, compiled = builder.build(spec, spec.bind((), {"i": i}), "sm_90a", DiskStore(Path(root)),
                                lock_timeout=timeout)
    print(json.dumps({"compiled": compiled, "t": time.time(), "pid_in_meta": e.meta.get("pid")}))
except LockTimeout as e:
    print(json.dumps({"timeout": str(e), "t": time.time()}))
"""


def test_stopped_lock_holder(objs, tmp_path):
    """A holder SIGSTOPped past the lock time-out: runtime waiters fall back (compile in
    a compile worker, unstored, and load that object: publish nothing), a build waiter
    gets LockTimeout, patient waiters wait; resumed, the holder publishes: exactly one
    complete publish, and the patient waiters then find it (no compile)."""
    root, counter = tmp_path / "cache", tmp_path / "compiles"
    ex = dict(QUACK_TEST_OBJ=objs["float32"]["path"], QUACK_TEST_COUNTER=counter)
    holder = spawn(_HOLDER, root, objs["float32"]["path"], 7, 1.0, **ex)
    assert holder.stdout.readline().strip() == "locked"
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        patient = [spawn(_BUILD_WAITER, root, 7, 120, **ex) for _ in range(2)]
        hasty = spawn(_BUILD_WAITER, root, 7, 1.0, **ex)
        jit = [
            spawn(
                _JIT_WAITER,
                QUACK_CACHE_DIR=root,
                QUACK_ARCH="sm_90a",
                QUACK_LOCK_TIMEOUT=1,
                QUACK_COMPILE_TIMEOUT=2,
                QUACK_COMPILE_JOBS=1,
                **ex,
            )
            for _ in range(2)
        ]
        h = finish(hasty)
        assert "timeout" in h and "still held" in h["timeout"], h
        waiter_pids = set()
        for p in jit:
            r = finish(p)
            assert r["tier"] == "compile" and r["how"] != "jit" and r["callable"], r  # loaded, unstored
            assert any("in a compile worker" in w and "loaded it unstored" in w for w in r["warnings"]), r
            waiter_pids.add(r["pid"])
        ref = rel_ref(7)
        assert not DiskStore(root).paths(ref)["meta"].exists(), "a waiter published under a held lock"
        assert all(p.poll() is None for p in patient)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    hr = finish(holder)
    for p in patient:
        r = finish(p)
        assert r["compiled"] is False and r["pid_in_meta"] == hr["pid"], r
    store = DiskStore(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        e = store.lookup(rel_ref(7))
    assert e is not None and e.meta["pid"] == hr["pid"]  # the holder's publish, the only one
    d = store.entry_dir(rel_ref(7))
    assert sorted(p.suffix for p in d.iterdir()) == [".json", ".lock", ".o"], list(d.iterdir())
    # Compiles: only the runtime waiters' private ones (never published), in their compile
    # workers, never in the waiters themselves; none by the holder (it published what it
    # had), none by the patient waiters.
    pids = [pid for pid, _ in counted(counter)]
    assert len(pids) == 2 and hr["pid"] not in pids and not waiter_pids & set(pids), (pids, waiter_pids)


_HELD_WAITER = r"""
import json, os, warnings
warnings.simplefilter("always")
import relkernels
from quack.compile import pool
from quack.errors import CacheWarning, CompileTimeout
out = {"pid": os.getpid()}
with warnings.catch_warnings(record=True) as w:
    try:
        fn = relkernels.rel_copy(5)
        u = relkernels.rel_copy.usage()[0]
        out.update(how=u["how"], tier=u["tier"], callable=callable(fn))
    except CompileTimeout as e:
        out.update(error=str(e), external=e.external, holder=e.holder)
st = pool.default_pool().stats()
out.update({k: st.get(k, 0) for k in ("awaited_external", "timeouts", "compiled", "submitted", "unstored")})
out["warnings"] = [str(x.message) for x in w if issubclass(x.category, CacheWarning)]
print(json.dumps(out))
"""


def _wait_on_held_lock(objs, tmp_path, finish_s: float = 120, **settings):
    """A runtime miss of rel_copy 5 in a fresh process while another process holds the
    key's lock and never publishes it (stopped mid-compile): (the waiter's report, the
    holder's pid, (pid, i) of every compile)."""
    root, counter = tmp_path / "cache", tmp_path / "compiles"
    ex = dict(QUACK_TEST_OBJ=objs["float32"]["path"], QUACK_TEST_COUNTER=counter)
    holder = spawn(_HOLDER, root, objs["float32"]["path"], 5, 3600, **ex)
    assert holder.stdout.readline().strip() == "locked"
    waiter = None
    try:
        waiter = spawn(
            _HELD_WAITER,
            QUACK_CACHE_DIR=root,
            QUACK_ARCH="sm_90a",
            QUACK_MODE="jit",
            QUACK_COMPILE_JOBS=1,
            **settings,
            **ex,
        )
        r = finish(waiter, timeout=finish_s)
    finally:
        for p in (holder, waiter):
            if p is not None:
                p.kill()
                p.wait(30)
    assert not DiskStore(root).paths(rel_ref(5))["meta"].exists(), "published under a held lock"
    return r, holder.pid, counted(counter)


def test_runtime_wait_on_a_held_lock_is_bounded_by_lock_timeout(objs, tmp_path):
    """A runtime miss whose key another process holds (stopped mid-compile, never
    publishing) waits lock_timeout (QUACK_LOCK_TIMEOUT), not compile_timeout, then has a
    compile worker compile it unstored (bounded by compile_timeout, as any compile) and
    loads that object, with one warning naming lock_timeout. It compiled it in its own
    process before, where no time-out bounds a compile: a wedged compile hung it."""
    r, holder, compiles = _wait_on_held_lock(
        objs,
        tmp_path,
        QUACK_LOCK_TIMEOUT=1,
        QUACK_COMPILE_TIMEOUT=900,  # the old bound: the waiter sat here 15 minutes
    )
    assert r["tier"] == "compile" and r["how"] != "jit" and r["callable"], r  # loaded, unstored
    assert (r["awaited_external"], r["timeouts"], r["unstored"], r["submitted"], r["compiled"]) == (
        1,
        0,
        1,
        1,
        1,
    ), r
    assert len(r["warnings"]) == 1, r["warnings"]
    w = r["warnings"][0]
    assert f"another process (pid {holder}) held the lock of rel_copy key" in w, w
    assert "past lock_timeout: QUACK_LOCK_TIMEOUT" in w and "in a compile worker" in w, w
    assert [i for _, i in compiles] == [5] and compiles[0][0] != r["pid"], compiles  # a worker's


def test_unstored_compile_after_lock_timeout_is_bounded_by_compile_timeout(objs, tmp_path):
    """The unstored compile that follows lock_timeout wedges (QUACK_TEST_COMPILE_SLEEP):
    its worker is killed at compile_timeout and the miss raises that CompileTimeout (its
    own, remembered like any). In this process the compile had no bound: the waiter slept
    with it for as long as it took."""
    r, holder, compiles = _wait_on_held_lock(
        objs,
        tmp_path,
        finish_s=90,
        QUACK_LOCK_TIMEOUT=1,
        QUACK_COMPILE_TIMEOUT=2,
        QUACK_TEST_COMPILE_SLEEP=3600,
    )
    assert "error" in r and not r["external"], r
    assert "still unfinished after 2 s" in r["error"] and "QUACK_COMPILE_TIMEOUT" in r["error"], r
    assert (r["awaited_external"], r["unstored"], r["submitted"], r["timeouts"], r["compiled"]) == (
        1,
        1,
        1,
        1,
        0,
    ), r
    assert [i for _, i in compiles] == [5] and compiles[0][0] != r["pid"], compiles  # a worker's


def test_runtime_wait_past_compile_timeout_raises_and_compiles_nothing(objs, tmp_path):
    """compile_timeout smaller than lock_timeout: the wait for the holder's lock ends at
    compile_timeout, and the miss raises CompileTimeout naming the holder and that
    setting; nothing compiles, here or in a worker (the holder's compile ran that long).
    Before, the waiter warned that lock_timeout had passed and compiled the key in its own
    process with no time limit: a wedged compile (under xdist, another worker's) then
    hung it for as long as the compile took."""
    r, holder, compiles = _wait_on_held_lock(objs, tmp_path, QUACK_LOCK_TIMEOUT=600, QUACK_COMPILE_TIMEOUT=1)
    assert "error" in r, r  # it compiled the key in its own process, unbounded
    assert r["external"] and r["holder"] == holder, r
    assert f"another process (pid {holder}) held the lock of rel_copy key" in r["error"], r
    assert "past compile_timeout: QUACK_COMPILE_TIMEOUT" in r["error"] and "lock_timeout" not in r["error"], r
    assert (r["awaited_external"], r["timeouts"], r["unstored"], r["submitted"], r["compiled"]) == (
        1,
        1,
        0,
        0,
        0,
    ), r
    assert r["warnings"] == [] and compiles == [], (r, compiles)


def test_killed_lock_holder_next_waiter_proceeds_at_once(objs, tmp_path):
    root, counter = tmp_path / "cache", tmp_path / "compiles"
    ex = dict(QUACK_TEST_OBJ=objs["float32"]["path"], QUACK_TEST_COUNTER=counter)
    holder = spawn(_HOLDER, root, objs["float32"]["path"], 9, 3600, **ex)
    assert holder.stdout.readline().strip() == "locked"
    waiter = spawn(_BUILD_WAITER, root, 9, 120, **ex)
    assert waiter.stdout.readline().strip() == "waiting"
    time.sleep(1.0)
    assert waiter.poll() is None, "the waiter did not wait for the lock"
    t_kill = time.time()
    holder.kill()
    holder.wait()
    r = finish(waiter)
    assert r["compiled"] is True and r["t"] - t_kill < 5.0, r
    assert len(counted(counter)) == 1
    store = DiskStore(root)
    assert store.lookup(rel_ref(9)) is not None
    store.sweep_debris(grace=0)  # the killed holder's half-written temp
    assert not [p for p in root.rglob("*") if ".tmp-" in p.name]


# --- 8. many processes, one cold key / 100 keys ---------------------------------------------------

_COLD = r"""
import json, os, sys, time
from pathlib import Path
import toykernels
from quack.compile import builder
from quack import registry
from quack.cache.store import DiskStore
root, go = sys.argv[1], Path(sys.argv[2])
spec = registry.get("toy_scale")
params = spec.bind((), {"dtype": "bfloat16", "block": 512, "bias": True})
while not go.exists():
    time.sleep(0.005)
e, compiled = builder.build(spec, params, "sm_90a", DiskStore(Path(root)))
print(json.dumps({"compiled": compiled, "compiles": len(toykernels.COMPILES), "so": bool(e.so_path)}))
"""


def test_eight_processes_one_cold_key_compile_once(tmp_path):
    """A real kernel, cold, requested by 8 processes released together: one compile."""
    root, go = tmp_path / "cache", tmp_path / "go"
    ps = [spawn(_COLD, root, go) for _ in range(8)]
    time.sleep(1.0)  # let them all import and spin on the start line
    go.touch()
    rs = [finish(p) for p in ps]
    assert sum(r["compiled"] for r in rs) == 1, rs
    assert sum(r["compiles"] for r in rs) == 1, rs


_MANY = r"""
import json, random, sys, time
from pathlib import Path
import relkernels
from quack.compile import builder
from quack import registry
from quack.cache.store import DiskStore
root, n, seed, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
spec = registry.get("rel_copy")
store = DiskStore(Path(root))
keys = list(range(n)); random.Random(seed).shuffle(keys)
while not go.exists():
    time.sleep(0.005)
compiled = 0
for i in keys:
    e, c = builder.build(spec, spec.bind((), {"i": i}), "sm_90a", store)
    compiled += c
print(json.dumps({"compiled": compiled}))
"""


def test_eight_processes_hundred_keys_compile_count_equals_keys(objs, tmp_path):
    root, counter, go = tmp_path / "cache", tmp_path / "compiles", tmp_path / "go"
    ex = dict(
        QUACK_TEST_OBJ=objs["float32"]["path"], QUACK_TEST_COUNTER=counter, QUACK_TEST_COMPILE_SLEEP=0.01
    )
    ps = [spawn(_MANY, root, 100, seed, go, **ex) for seed in range(8)]
    time.sleep(1.0)
    go.touch()
    rs = [finish(p, timeout=600) for p in ps]
    c = counted(counter)
    assert len(c) == 100 and sorted(i for _, i in c) == list(range(100)), len(c)
    assert sum(r["compiled"] for r in rs) == 100
    store = DiskStore(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(store.lookup(rel_ref(i)) is not None for i in range(100))


_JIT_MANY = (
    NO_TORCH
    + r"""
import json, random, sys, warnings
warnings.simplefilter("error")
import relkernels
keys = list(range(int(sys.argv[1]))); random.Random(int(sys.argv[2])).shuffle(keys)
vals = [relkernels.rel_copy(i) for i in keys]
u = relkernels.rel_copy.usage()
print(json.dumps({"n": len(vals), "how": sorted({x["how"] for x in u}),
                  "compiles": sum(x["compiles"] for x in u)}))
"""
)


def test_runtime_processes_share_compiles(objs, tmp_path):
    """The same through the runtime (@jit_cache -> compile pool -> store): 4 processes over
    12 keys, compile count equals key count, no time-outs, no warnings."""
    root, counter = tmp_path / "cache", tmp_path / "compiles"
    ex = dict(
        QUACK_TEST_OBJ=objs["float32"]["path"],
        QUACK_TEST_COUNTER=counter,
        QUACK_CACHE_DIR=root,
        QUACK_ARCH="sm_90a",
        QUACK_COMPILE_JOBS=1,
        QUACK_TEST_COMPILE_SLEEP=0.05,
    )
    ps = [spawn(_JIT_MANY, 12, seed, **ex) for seed in range(4)]
    rs = [finish(p, timeout=600) for p in ps]
    assert all(r["n"] == 12 for r in rs)
    c = counted(counter)
    assert sorted(i for _, i in c) == list(range(12)), c


# --- 7. clean while processes load and build ---------------------------------------------------

_LOADER = (
    NO_TORCH
    + r"""
import hashlib, json, os, random, sys, time, warnings
from pathlib import Path
warnings.simplefilter("error")  # any CacheWarning (a 'corrupt' entry) fails this process
import relkernels
from quack.compile import builder
from quack.runtime import loader
from quack import registry
from quack.cache.store import DiskStore
from quack.errors import EntryVanished
root, seed, go, stop = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
spec = registry.get("rel_copy")
store = DiskStore(Path(root))
rng = random.Random(seed)
loader._prepare_runtime()
print("ready", flush=True)
while not go.exists():
    time.sleep(0.005)
# Until the test says stop (after its cleans ran), and at least 50 rounds: a count, not a
# clock, so a slow machine gets the same overlap (a 6 s window once fit one clean, issue 24).
stats = {"hits": 0, "misses": 0, "builds": 0, "loads": 0, "vanished": 0}
deadline = time.time() + 600  # a guard against a test that never says stop
rounds = 0
while (rounds < 50 or not stop.exists()) and time.time() < deadline:
    rounds += 1
    # Paced: eight unpaced loops took every CPU of the 2-core machine for as long as the
    # cleans ran (125 CPU-s, the suite's costliest test), which made the cleans slower and
    # the loops longer still. At 50 rounds a second each, 400 lookups a second overlap
    # every clean; on 2 cores unpaced loops managed little more between them.
    time.sleep(0.02)
    i = rng.randrange(60)
    ref = builder.entry_ref(spec, spec.bind((), {"i": i}), "sm_90a")
    e = store.lookup(ref)
    if e is None:
        stats["misses"] += 1
        if rng.random() < 0.5:
            builder.build(spec, spec.bind((), {"i": i}), "sm_90a", store)
            stats["builds"] += 1
        continue
    stats["hits"] += 1
    try:
        data = e.obj_path.read_bytes()
    except FileNotFoundError:
        stats["vanished"] += 1  # evicted after the lookup: a plain miss next time
        continue
    # A reader never sees a partial file: what it reads is whole or absent.
    assert hashlib.sha256(data).hexdigest() == e.meta["sha256"], "partial or foreign object read"
    if rng.random() < 0.2:
        try:
            fn, mod, how = loader.load_entry(store, e)
            stats["loads"] += 1
        except EntryVanished:
            stats["vanished"] += 1
print(json.dumps(stats))
"""
)


def test_clean_while_eight_processes_load_and_build(objs, tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "quack.toml").write_text('[build]\nkernel_packages = ["relkernels"]\n')
    root = tmp_path / "cache"
    ex = dict(QUACK_TEST_OBJ=objs["float32"]["path"], QUACK_CACHE_DIR=root)
    store = DiskStore(root)
    spec = registry.get("rel_copy")
    os.environ["QUACK_TEST_OBJ"] = objs["float32"]["path"]
    for i in range(40):
        builder.build(spec, spec.bind((), {"i": i}), "sm_90a", store)
    # A lock this test holds all along: clean must neither unlink it nor evict its entry.
    held = rel_ref(0)
    lock_ino = os.stat(store.paths(held)["lock"]).st_ino
    go, stop = tmp_path / "go", tmp_path / "stop"
    ps = [spawn(_LOADER, root, seed, go, stop, **ex) for seed in range(8)]
    for p in ps:
        assert p.stdout.readline().strip() == "ready"
    cleans = []
    go.touch()
    with store.lock(held):
        # Every kind of clean, twice, while the eight loaders run (they stop when told, after).
        variants = [[], ["--max-size", "100KiB"], ["--max-size", "0"], ["--older-than", "0s"]]
        for args in variants * 2:
            r = subprocess.run(
                [*QUACK, "cache", "clean", "--cache-dir", str(root), *args],
                env=env(),
                capture_output=True,
                text=True,
                timeout=120,
                cwd=str(proj),
            )
            cleans.append((args, r.returncode))
            assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
        assert os.stat(store.paths(held)["lock"]).st_ino == lock_ino, "a held lock file was unlinked"
        assert store.paths(held)["meta"].exists(), "an entry under a held lock was evicted"
    running = sum(p.poll() is None for p in ps)  # the loaders outlived the cleans: they overlapped
    stop.touch()
    rs = [finish(p, timeout=300) for p in ps]
    print("clean under load:", len(cleans), "cleans;", json.dumps(rs))
    assert (
        running == 8
        and len(cleans) == 8
        and sum(r["hits"] for r in rs) > 0
        and sum(r["misses"] for r in rs) > 0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(60):
            store.lookup(rel_ref(i))  # whatever is left verifies (or is a plain miss)
