"""The remote tier end to end: real `quack build` / `quack cache push|pull`
processes, real compiles of the toy kernels (and the default manifest's real
kernels for the round trip), a real redis-server, moto's S3 server and a shared
directory. Counts are asserted; the only times asserted are the time-out bounds.

One writer build of the toy manifest per module is reused by every test that
only needs objects on a remote."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import remote_services
from remote_services import moto_s3, redis_server, silent_socket

from quack import settings, signing
from quack.cache import keys
from quack.remote import objects, tier

remote_services.require_modules("redis", "boto3", "moto")

TESTS = Path(__file__).parent
ROOT = TESTS.parent
TOY6 = """
[defaults]
archs = ["sm_90a"]
[[kernel]]
name = "toy_scale"
params = { dtype = ["float16", "bfloat16"], block = [64, 128, 256] }
"""
TOY2 = """
[defaults]
archs = ["sm_90a"]
[[kernel]]
name = "toy_scale"
params = { dtype = "float32", block = [32, 96] }
"""
_REMOTE_VARS = (
    "QUACK_REMOTE",
    "QUACK_REMOTE_WRITE",
    "QUACK_SIGNING_KEY",
    "QUACK_TRUSTED_KEYS",
    "QUACK_REMOTE_TIMEOUT",
    "QUACK_MODE",
)


def project(d: Path, manifest: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "quack.toml").write_text(
        '[build]\nkernel_packages = ["toykernels"]\nmanifests = ["m.toml"]\n[runtime]\narch = "sm_90a"\n'
    )
    (d / "m.toml").write_text(manifest)
    return d


def env_for(
    cache: Path, remote: str | None = None, *, keydir: Path | None = None, write: bool = False, **extra
) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _REMOTE_VARS}
    env["QUACK_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("COLUMNS", None)
    if remote:
        env["QUACK_REMOTE"] = remote
    if keydir is not None:
        env["QUACK_TRUSTED_KEYS"] = str(keydir / "ci-1.pub")
        if write:
            env["QUACK_REMOTE_WRITE"] = "1"
            env["QUACK_SIGNING_KEY"] = str(keydir / "ci-1.key")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def quack(args, cwd, env, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "quack_build", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def build_json(cwd, env, *args, expect_rc=0, timeout=600) -> tuple[dict, str]:
    r = quack(["build", "-j", "2", "--json", *args], cwd, env, timeout=timeout)
    assert r.returncode == expect_rc, r.stderr[-3000:]
    return json.loads(r.stdout), r.stderr


def warning_lines(stderr: str, fragment: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("warning:") and fragment in ln]


@pytest.fixture(scope="module")
def keydir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    signing.write_keypair("ci-1", d)
    signing.write_keypair("evil", d)
    return d


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis")) as s:
        yield s


def db(srv, n: int) -> str:
    return f"redis://127.0.0.1:{srv.port}/{n}"


@pytest.fixture(scope="module")
def toy(tmp_path_factory, srv, keydir):
    """The module's one writer build: TOY6 compiled into a fresh cache and pushed
    to Redis db 0 by `quack build` (write = true)."""
    base = tmp_path_factory.mktemp("toy")
    proj = project(base / "proj", TOY6)
    cache = base / "writer-cache"
    res, err = build_json(proj, env_for(cache, db(srv, 0), keydir=keydir, write=True))
    return {"proj": proj, "cache": cache, "res": res, "stderr": err}


def commandstat(srv, cmd: str) -> int:
    return int(srv.client().info("commandstats").get(f"cmdstat_{cmd}", {}).get("calls", 0))


# --- round trips -------------------------------------------------------------------------


def test_build_pushes_and_a_fresh_reader_compiles_nothing(toy, srv, keydir, tmp_path):
    w = toy["res"]
    assert (w["ok"], w["compiled"], w["remote_pushed"], w["remote_hits"], w["remote_rejected"]) == (
        True,
        6,
        6,
        0,
        0,
    )
    assert all(k["remote_push"] == "pushed" for k in w["keys"])
    assert len(srv.client().keys("quack/v1/*")) == 6  # db 0
    sets_before = commandstat(srv, "set")
    # A reader (no signing key, write off): zero compiles, every key from the remote, and it never writes.
    res, err = build_json(toy["proj"], env_for(tmp_path / "reader", db(srv, 0), keydir=keydir))
    assert (res["ok"], res["compiled"], res["remote_hits"], res["remote_pushed"]) == (True, 0, 6, 0)
    assert all(k["status"] == "remote" for k in res["keys"])
    assert commandstat(srv, "set") == sets_before
    # The pulled entries are ordinary, verified local entries now: a second build finds them cached.
    res, _ = build_json(toy["proj"], env_for(tmp_path / "reader", db(srv, 0), keydir=keydir))
    assert (res["cached"], res["remote_hits"], res["compiled"]) == (6, 0, 0)
    r = quack(["cache", "stats", "--json"], toy["proj"], env_for(tmp_path / "reader"))
    st = json.loads(r.stdout)["remote"]["total"]
    assert (st["hits"], st["rejected"], st["errors"]) == (6, 0, 0) and st["bytes_down"] > 0
    r = quack(["cache", "stats"], toy["proj"], env_for(tmp_path / "reader"))
    assert "remote cache" in r.stdout and db(srv, 0) in r.stdout


def test_read_only_reader_that_compiles_never_writes(toy, srv, keydir, tmp_path):
    """A reader whose keys are not on the remote compiles them and pushes nothing,
    even with write = true when it holds no signing key."""
    proj = project(tmp_path / "proj", TOY2)
    n_keys = len(srv.client().keys("*"))
    sets_before = commandstat(srv, "set")
    env = env_for(tmp_path / "c", db(srv, 0), keydir=keydir, QUACK_REMOTE_WRITE="1")
    res, err = build_json(proj, env)
    assert (res["ok"], res["compiled"], res["remote_pushed"]) == (True, 2, 0)
    assert len(warning_lines(err, "no signing key")) == 1
    assert commandstat(srv, "set") == sets_before and len(srv.client().keys("*")) == n_keys


@pytest.fixture(scope="module")
def default_cache(tmp_path_factory):
    """A local cache holding the default manifest: a copy of the session's cache
    (CI built it with `quack build` before pytest), completed by a real build."""
    cache = tmp_path_factory.mktemp("default") / "cache"
    src = Path(os.environ.get("QUACK_CACHE_DIR") or settings.default_cache_dir())
    if (src / "v1").is_dir():
        shutil.copytree(src / "v1", cache / "v1", symlinks=True)
    cache.mkdir(exist_ok=True, mode=0o700)
    r = quack(["build", "manifests/default.toml", "--json"], ROOT, env_for(cache), timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    return {"cache": cache, "total": res["total"]}


@pytest.mark.parametrize("backend", ["redis", "s3", "file"])
def test_default_manifest_round_trip(backend, default_cache, srv, keydir, tmp_path, request):
    if backend == "redis":
        url = db(srv, 1)
        srv.client(db=1).flushdb()
        ctx = None
    elif backend == "s3":
        ctx = moto_s3()
        url = ctx.__enter__()
        request.addfinalizer(lambda: ctx.__exit__(None, None, None))
    else:
        (tmp_path / "shared").mkdir()
        url = f"file://{tmp_path / 'shared'}"
    total = default_cache["total"]
    r = quack(
        ["cache", "push", "manifests/default.toml", "--json"],
        ROOT,
        env_for(default_cache["cache"], url, keydir=keydir, write=True),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    pushed = json.loads(r.stdout)
    assert (pushed["pushed"], pushed["missing"], pushed["failed"]) == (total, 0, 0)
    # A fresh machine: an empty cache builds the default manifest with zero compiles.
    res, err = build_json(ROOT, env_for(tmp_path / "fresh", url, keydir=keydir), "manifests/default.toml")
    assert (res["ok"], res["total"], res["compiled"], res["remote_hits"], res["remote_rejected"]) == (
        True,
        total,
        0,
        total,
        0,
    )
    # And the explicit pull has nothing left to do.
    r = quack(
        ["cache", "pull", "manifests/default.toml", "--json"],
        ROOT,
        env_for(tmp_path / "fresh", url, keydir=keydir),
    )
    assert r.returncode == 0 and json.loads(r.stdout)["local"] == total


# --- refusals ------------------------------------------------------------------------------


def _resign(header: dict, key: signing.SigningKey, **changes) -> dict:
    import base64

    h = dict(header, **changes)
    h.pop("signature", None)
    h["signer"] = key.name
    signed = keys.canonical_json({k: h[k] for k in objects.SIGNED_FIELDS if k in h}).encode()
    h["signature"] = base64.b64encode(key.sign(signed)).decode()
    return h


def _blob(header: dict, body: bytes) -> bytes:
    return objects.MAGIC + keys.canonical_json(header).encode() + b"\n" + body


def test_each_tampered_object_is_refused_compiled_locally_and_counted(toy, srv, keydir, tmp_path):
    src = srv.client(db=0)
    dst = srv.client(db=2)
    dst.flushdb()
    names = sorted(n.decode() for n in src.keys("quack/v1/*"))
    assert len(names) == 6
    blobs = {n: src.get(n) for n in names}
    ci = signing.load_signing_key(keydir / "ci-1.key")
    evil = signing.load_signing_key(keydir / "evil.key")
    cases = {}
    for n, how in zip(names, ("bytes", "header", "copied", "untrusted", "truncated", "stamp")):
        header, body = objects.parse_header(blobs[n])
        body = bytes(body)
        if how == "bytes":
            b = bytearray(body)
            b[len(b) // 2] ^= 0x01
            blob = _blob(header, bytes(b))
        elif how == "header":
            blob = _blob(dict(header, params={"dtype": "float32", "block": 32}), body)
        elif how == "copied":
            blob = blobs[names[0] if n != names[0] else names[1]]
        elif how == "untrusted":
            blob = _blob(_resign(header, evil), body)
        elif how == "truncated":
            blob = blobs[n][:-500]
        else:  # signed by the trusted key, but for another toolchain
            blob = _blob(_resign(header, ci, stamp="py3.9-cutlass4.0.0-cu12-tvmffi0.1.0-sm_90a"), body)
        dst.set(n, blob)
        cases[how] = n
    res, err = build_json(toy["proj"], env_for(tmp_path / "reader", db(srv, 2), keydir=keydir))
    assert (res["ok"], res["compiled"], res["remote_hits"], res["remote_rejected"]) == (True, 6, 0, 6)
    assert res["remote"]["rejected_by_reason"] == {
        "checksum": 1,
        "bad-signature": 1,
        "wrong-key": 1,
        "untrusted": 1,
        "size": 1,
        "wrong-stamp": 1,
    }
    assert len(warning_lines(err, "refused")) == 1
    # Nothing refused reached the local store: every entry there was compiled here.
    metas = [
        json.loads(p.read_text())
        for p in (tmp_path / "reader").glob("v1/*/toy_scale/*/*.json")
        if not p.name.endswith(".so.json")
    ]
    assert len(metas) == 6 and not any("remote" in m for m in metas)
    r = quack(["cache", "stats", "--json"], toy["proj"], env_for(tmp_path / "reader"))
    assert json.loads(r.stdout)["remote"]["total"]["rejected"] == 6


# --- a remote that is down, hung, or full ----------------------------------------------------


def test_redis_stopped_mid_build(toy, keydir, tmp_path):
    """In process: the remote holds 3 of 6 keys; Redis is stopped right after the
    first pull. The build finishes (the rest compiled), one warning."""
    import warnings

    from quack.cache.store import DiskStore
    from quack_build.build import plan as planning
    from quack_build.build import results, scheduler
    from quack_build.manifest.read import expand

    with redis_server(tmp_path / "redis") as s:
        c = s.client()
        src_blobs = _toy_blobs(toy, keydir)
        for name in sorted(src_blobs)[:3]:
            c.set(name, src_blobs[name])
        tier.reset_offline_for_tests()
        s_settings = settings.resolve(env=env_for(tmp_path / "c", s.url, keydir=keydir), cwd=toy["proj"])
        settings.set_current(s_settings)
        try:
            import toykernels  # noqa: F401

            configs = expand([toy["proj"] / "m.toml"], archs=("sm_90a",)).configs
            store = DiskStore(s_settings.cache_dir, fsync=False)
            tasks = planning.plan(configs, store)
            remote = tier.from_settings(s_settings)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                res = scheduler.BuildSession(
                    tasks,
                    store,
                    scheduler.BuildOptions(
                        jobs=2, remote=remote, settings=s_settings, on_pulled=lambda t: s.stop()
                    ),
                ).run()
            assert res.ok
            # Pulls run on a few threads: those in flight when Redis stopped may
            # have finished; every key is there, pulled or compiled.
            hits, compiled = res.count(results.REMOTE), res.count(results.COMPILED)
            assert 1 <= hits <= 3 and hits + compiled == 6
            assert res.remote["errors"] >= 1 and res.remote_offline
            assert len([x for x in w if issubclass(x.category, tier.RemoteWarning)]) == 1
        finally:
            settings.set_current(None)
            tier.reset_offline_for_tests()


def _toy_blobs(toy, keydir) -> dict[str, bytes]:
    """The toy writer's objects, read back from its file-system cache and signed (no Redis needed)."""
    from quack.cache.entry import EntryRef
    from quack.cache.store import DiskStore

    out = {}
    store = DiskStore(toy["cache"], fsync=False)
    ci = signing.load_signing_key(keydir / "ci-1.key")
    for meta_path in sorted(Path(toy["cache"]).glob("v1/*/toy_scale/*/*.json")):
        if meta_path.name.endswith(".so.json"):
            continue
        meta = json.loads(meta_path.read_text())
        ref = EntryRef(meta["kernel"], meta["key"], meta["arch"], meta["srcfp"])
        e = store.lookup(ref)
        out[objects.object_name(ref)] = objects.pack(ref, meta["params"], e.obj_path.read_bytes(), ci)
    return out


def test_hung_redis_costs_one_time_out(keydir, tmp_path):
    """A listening socket that never answers: the build compiles everything,
    one warning, one time-out (QUACK_REMOTE_TIMEOUT=1) for the whole build."""
    proj = project(tmp_path / "proj", TOY2)
    with silent_socket() as port:
        env = env_for(
            tmp_path / "c", f"redis://127.0.0.1:{port}/0", keydir=keydir, write=True, QUACK_REMOTE_TIMEOUT=1
        )
        t0 = time.monotonic()
        res, err = build_json(proj, env)
        wall = time.monotonic() - t0
    assert (res["ok"], res["compiled"], res["remote_hits"], res["remote_pushed"]) == (True, 2, 0, 0)
    assert res["remote"]["errors"] == 1 and res["remote"]["offline"]
    assert len(warning_lines(err, "timed out")) == 1 and len(warning_lines(err, "remote")) == 1
    assert wall < 120  # bounded: one 1 s time-out, then the remote is off (the rest is compiling)


def test_refused_redis_build_succeeds_one_warning(keydir, tmp_path):
    from remote_services import free_port

    proj = project(tmp_path / "proj", TOY2)
    res, err = build_json(
        proj, env_for(tmp_path / "c", f"redis://127.0.0.1:{free_port()}/0", keydir=keydir, write=True)
    )
    assert (res["ok"], res["compiled"], res["remote"]["errors"]) == (True, 2, 1)
    assert len(warning_lines(err, "unreachable")) == 1


def test_full_redis_push_fails_build_succeeds(keydir, tmp_path):
    proj = project(tmp_path / "proj", TOY2)
    with redis_server(tmp_path / "redis", maxmemory="1mb") as s:
        c = s.client()
        # Tiny: a few KB above what an empty server uses, less than one object (~15 KB).
        c.config_set("maxmemory", int(c.info("memory")["used_memory"]) + 4096)
        env = env_for(tmp_path / "c", s.url, keydir=keydir, write=True)
        res, err = build_json(proj, env)
        assert (res["ok"], res["compiled"], res["remote_pushed"]) == (True, 2, 0)
        assert res["remote"]["push_failed"] == 1  # then pushing stops for the process
        # ...and the pushes not tried are counted, not silent (the summary said "failed 1"
        # however many keys went unpushed).
        assert res["remote"]["push_skipped"] == 1 and res["remote_push_skipped"] == 1
        assert res["remote_push_failed"] == 1
        assert sorted(k["remote_push"] for k in res["keys"]) == ["failed", "skipped"]
        assert len(warning_lines(err, "full")) == 1
        assert s.client().dbsize() == 0
        # The summary table says both.
        r = quack(["build", "-j", "2", "--force"], proj, env)
        assert r.returncode == 0, r.stderr[-3000:]
        out = " ".join(r.stdout.split())
        assert "remote push failed 1" in out and "remote push skipped 1 (not tried" in out, out
        # `quack cache push` counts the same way: 1 failed, 1 not tried, not 2 failed.
        r = quack(["cache", "push", "--json"], proj, env)
        assert r.returncode == 1, r.stderr[-3000:]
        rep = json.loads(r.stdout)
        assert (rep["local"], rep["pushed"], rep["failed"], rep["skipped"]) == (2, 0, 1, 1), rep
        r = quack(["cache", "push"], proj, env)
        assert "1 failed, 1 not tried after a failure" in " ".join(r.stdout.split()), r.stdout
    out = subprocess.run(
        [sys.executable, "-m", "quack_build", "build", "-j", "2"],
        cwd=proj,
        env=env_for(tmp_path / "c2", "redis://127.0.0.1:9/0", keydir=keydir),
        text=True,
        capture_output=True,
        timeout=600,
    )
    assert out.returncode == 0 and "remote push failed" not in out.stdout


def test_two_writers_racing_one_object_per_key(srv, keydir, tmp_path):
    proj = project(tmp_path / "proj", TOY2)
    srv.client(db=3).flushdb()
    cmd = [sys.executable, "-m", "quack_build", "build", "-j", "1", "--json"]
    procs = [
        subprocess.Popen(
            cmd,
            cwd=proj,
            env=env_for(tmp_path / f"c{i}", db(srv, 3), keydir=keydir, write=True),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=600))
        finally:
            if p.poll() is None:
                p.kill()
    res = []
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-3000:]
        res.append(json.loads(o))
    # Each key was pushed exactly once (by whichever writer got there first); the
    # other writer either pulled it or found it already there.
    pushed = sum(r["remote_pushed"] for r in res)
    exists = sum(r["remote"]["push_exists"] for r in res)
    hits = sum(r["remote_hits"] for r in res)
    assert pushed == 2 and pushed + exists + hits == 4
    assert len(srv.client(db=3).keys("quack/v1/*")) == 2
    # Both objects verify for a third machine.
    res3, _ = build_json(proj, env_for(tmp_path / "c3", db(srv, 3), keydir=keydir))
    assert (res3["remote_hits"], res3["compiled"]) == (2, 0)


# --- the runtime, and the explicit commands ------------------------------------------------------

RUNTIME = """
import json, sys, warnings
warnings.simplefilter("always")
import toykernels
from quack.runtime import jit
fn = toykernels.toy_scale("float16", 128, False)
print(json.dumps({"compiles": len(toykernels.COMPILES), "stats": jit.cache_stats()}))
"""


def test_runtime_loads_what_ci_built_without_compiling(toy, srv, keydir, tmp_path):
    env = env_for(tmp_path / "c", db(srv, 0), keydir=keydir, QUACK_MODE="prebuilt")
    r = subprocess.run(
        [sys.executable, "-c", RUNTIME], cwd=toy["proj"], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["compiles"] == 0 and out["stats"]["compiles"] == 0 and out["stats"]["misses"] == 1
    st = json.loads(quack(["cache", "stats", "--json"], toy["proj"], env_for(tmp_path / "c")).stdout)
    assert st["remote"]["total"]["hits"] == 1
    # `quack prewarm` (what the journal says was used, missing now) pulls instead of compiling.
    shutil.rmtree(tmp_path / "c" / "v1")
    r = quack(["prewarm", "--json"], toy["proj"], env_for(tmp_path / "c", db(srv, 0), keydir=keydir))
    assert r.returncode == 0, r.stderr[-3000:]
    pw = json.loads(r.stdout)
    assert (pw["remote_hits"], pw["compiled"]) == (1, 0)
    # Remote down, prebuilt mode: the ordinary "not prebuilt" error, no crash from the remote.
    env = env_for(tmp_path / "c2", "redis://127.0.0.1:9/0", keydir=keydir, QUACK_MODE="prebuilt")
    r = subprocess.run(
        [sys.executable, "-c", RUNTIME], cwd=toy["proj"], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode != 0 and "KernelNotPrebuilt" in r.stderr and "unreachable" in r.stderr


def test_cache_push_pull_commands(toy, keydir, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    url = f"file://{shared}"
    r = quack(["cache", "push", "--json"], toy["proj"], env_for(toy["cache"], url, keydir=keydir))
    assert r.returncode == 1 and "QUACK_SIGNING_KEY" in r.stderr  # a reader can't push
    r = quack(["cache", "push", "--json"], toy["proj"], env_for(toy["cache"], url, keydir=keydir, write=True))
    assert r.returncode == 0, r.stderr
    assert (json.loads(r.stdout)["pushed"], json.loads(r.stdout)["exists"]) == (6, 0)
    r = quack(["cache", "push", "--json"], toy["proj"], env_for(toy["cache"], url, keydir=keydir, write=True))
    assert (json.loads(r.stdout)["pushed"], json.loads(r.stdout)["exists"]) == (0, 6)
    r = quack(["cache", "pull", "--json"], toy["proj"], env_for(tmp_path / "c", url, keydir=keydir))
    assert r.returncode == 0 and (json.loads(r.stdout)["pulled"], json.loads(r.stdout)["missing"]) == (6, 0)
    r = quack(["cache", "pull"], toy["proj"], env_for(tmp_path / "c", None))
    assert r.returncode == 1 and "no remote cache configured" in r.stderr
    r = quack(
        ["cache", "pull"], toy["proj"], env_for(tmp_path / "c3", "redis://127.0.0.1:9/0", keydir=keydir)
    )
    assert r.returncode == 1 and "unreachable" in r.stdout + r.stderr


# --- key rotation: a writer replaces what it refuses ---------------------------------------


def _rotated(env: dict, keys2: Path, *, trust: str = "ci-2") -> dict:
    """A writer's environment after the rotation of docs/remote-cache.md: it signs with
    ci-2 and trusts ``trust`` (ci-2 only once the old .pub is dropped)."""
    trusted = ":".join(str(keys2 / f"{n}.pub") for n in trust.split(","))
    return dict(env, QUACK_SIGNING_KEY=str(keys2 / "ci-2.key"), QUACK_TRUSTED_KEYS=trusted)


def test_rotation_heals_a_remote_through_a_build(srv, keydir, tmp_path):
    """The review's repro: ci-1's objects on Redis, then a writer signing with ci-2 and
    trusting ci-2 only. Its build refuses them, compiles, and replaces them (counted apart,
    one warning naming ci-1); a reader trusting ci-2 then compiles nothing."""
    signing.write_keypair("ci-2", tmp_path / "k2")
    shutil.copy(keydir / "ci-1.pub", tmp_path / "k2" / "ci-1.pub")
    proj = project(tmp_path / "proj", TOY2)
    srv.client(db=4).flushdb()
    old, _ = build_json(proj, env_for(tmp_path / "w1", db(srv, 4), keydir=keydir, write=True))
    assert (old["remote_pushed"], old["remote_replaced"]) == (2, 0)
    env2 = _rotated(env_for(tmp_path / "w2", db(srv, 4), keydir=keydir, write=True), tmp_path / "k2")
    res, err = build_json(proj, env2)
    assert (res["compiled"], res["remote_rejected"], res["remote_pushed"], res["remote_replaced"]) == (
        2,
        2,
        0,
        2,
    )
    assert res["remote"]["push_exists"] == 0 and res["remote"]["replaced_by_reason"] == {"untrusted": 2}
    assert all(k["remote_push"] == "replaced" for k in res["keys"])
    lines = warning_lines(err, "replaced")
    assert (
        len(lines) == 1
        and "2 objects at their names were signed by ci-1, which this writer does not trust" in lines[0]
    )
    table = quack(["build", "-j", "2", "--force"], proj, env2)
    assert table.returncode == 0 and "remote pushed" in table.stdout and "remote replaced" not in table.stdout
    reader = dict(env_for(tmp_path / "r", db(srv, 4)), QUACK_TRUSTED_KEYS=str(tmp_path / "k2" / "ci-2.pub"))
    res, _ = build_json(proj, reader)
    assert (res["remote_hits"], res["compiled"], res["remote_rejected"]) == (2, 0, 0)
    st = json.loads(quack(["cache", "stats", "--json"], proj, env_for(tmp_path / "w2")).stdout)
    assert st["remote"]["total"]["replaced"] == 2


def test_rotation_heals_a_remote_through_cache_push(toy, keydir, tmp_path):
    """`quack cache push` of a rotated writer re-signs what the remote holds under a dropped
    key (no compile), says so, exits 0; a second push finds valid objects; a writer still
    trusting ci-2 keeps them."""
    signing.write_keypair("ci-2", tmp_path / "k2")
    shutil.copy(keydir / "ci-1.pub", tmp_path / "k2" / "ci-1.pub")
    shared = tmp_path / "shared"
    shared.mkdir()
    url = f"file://{shared}"
    env1 = env_for(toy["cache"], url, keydir=keydir, write=True)
    r = quack(["cache", "push", "--json"], toy["proj"], env1)
    assert r.returncode == 0 and json.loads(r.stdout)["pushed"] == 6, r.stderr
    env2 = _rotated(env1, tmp_path / "k2")
    r = quack(["cache", "push"], toy["proj"], env2)
    assert r.returncode == 0, r.stderr
    assert "pushed 0 of 6" in r.stdout and "(replaced 6 refused objects, 0 already there" in r.stdout, (
        r.stdout
    )
    lines = warning_lines(r.stderr, "replaced")
    assert len(lines) == 1 and "6 objects at their names were signed by ci-1" in lines[0], r.stderr
    r = quack(["cache", "push", "--json"], toy["proj"], env2)
    rep = json.loads(r.stdout)
    assert r.returncode == 0 and (rep["pushed"], rep["replaced"], rep["exists"]) == (0, 0, 6)
    assert not warning_lines(r.stderr, "replaced")
    # ci-1's writer, not rotated yet but trusting both keys: ci-2's objects stay.
    r = quack(
        ["cache", "push", "--json"],
        toy["proj"],
        _rotated(env1, tmp_path / "k2", trust="ci-1,ci-2") | {"QUACK_SIGNING_KEY": str(keydir / "ci-1.key")},
    )
    assert (json.loads(r.stdout)["replaced"], json.loads(r.stdout)["exists"]) == (0, 6)
    pull_env = dict(env_for(tmp_path / "r", url), QUACK_TRUSTED_KEYS=str(tmp_path / "k2" / "ci-2.pub"))
    r = quack(["cache", "pull", "--json"], toy["proj"], pull_env)
    assert r.returncode == 0 and (
        json.loads(r.stdout)["pulled"],
        json.loads(r.stdout)["counters"]["rejected"],
    ) == (
        6,
        0,
    )
