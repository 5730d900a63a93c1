"""Issue 30 end to end, in real `quack build` / `quack cache pull` processes: a FIFO
planted at an object's name of a shared directory (the build hung for ever; here it
runs under a hard time-out, so a regression fails instead of hanging CI), and
`quack cache pull` into a cache on a small tmpfs (a full disk was counted as remote
misses and exited 0). The remote objects are signed synthetic bytes: only the FIFO
test compiles (the two toy keys it must build)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import remote_services
from test_remote_build import TOY2, build_json, env_for, project, quack, warning_lines

from quack import settings, signing
from quack.remote import objects, tier
from quack.remote.backend import open_backend

remote_services.require_modules("redis", "boto3", "moto")

TOY18 = """
[defaults]
archs = ["sm_90a"]
[[kernel]]
name = "toy_scale"
params = { dtype = ["float32", "float16", "bfloat16"], block = [32, 64, 96, 128, 160, 192] }
"""
HARD_TIMEOUT = 300  # the old code never returned: the test must fail, not hang


@pytest.fixture(scope="module")
def keydir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    signing.write_keypair("ci-1", d)
    return d


def toy_refs(proj: Path, cache: Path) -> list:
    """The (config, EntryRef) of every key of ``proj``'s manifest, as its build computes them."""
    from quack.compile import builder
    from quack_build.manifest.read import expand

    settings.set_current(settings.resolve(env=env_for(cache), cwd=proj))
    try:
        import toykernels  # noqa: F401 - registers toy_scale

        configs = expand([proj / "m.toml"], archs=("sm_90a",)).configs
        return [(c, builder.entry_ref(c.spec, c.params, c.arch)) for c in configs]
    finally:
        settings.set_current(None)
        tier.reset_offline_for_tests()


def test_fifo_at_object_names_build_compiles_with_one_warning(tmp_path, keydir):
    proj = project(tmp_path / "proj", TOY2)
    shared = tmp_path / "shared"
    shared.mkdir()
    refs = toy_refs(proj, tmp_path / "c")
    fifos = []
    for _, ref in refs:
        p = shared.joinpath(*objects.object_name(ref).split("/"))
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(p)  # no writer ever opens it: a blocking open waits for ever
        fifos.append(str(p))
    res, err = build_json(
        proj, env_for(tmp_path / "c", f"file://{shared}", keydir=keydir), timeout=HARD_TIMEOUT
    )
    assert (res["ok"], res["compiled"], res["remote_hits"]) == (True, 2, 0)
    lines = warning_lines(err, "remote cache")
    assert len(lines) == 1, err[-3000:]
    assert "a FIFO, not a regular file; refused" in lines[0] and any(f in lines[0] for f in fifos)


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(mode=0o700)
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def test_cache_pull_on_a_full_disk_fails_with_the_cause(tmp_path, keydir):
    small = tmp_path / "small"
    if not _mount_tmpfs(small, "256k"):
        pytest.skip("mounting a tmpfs is not permitted here (needs root); the unit test injects ENOSPC")
    try:
        proj = project(tmp_path / "proj", TOY18)
        cache = small / "cache"
        shared = tmp_path / "shared"
        shared.mkdir()
        signer = signing.load_signing_key(keydir / "ci-1.key")
        remote = open_backend(f"file://{shared}")
        refs = toy_refs(proj, cache)
        for c, ref in refs:  # 18 x 40 KB of signed synthetic objects: more than 256 KB
            blob = objects.pack(ref, c.plain_params, os.urandom(40_000), signer)
            assert remote.put_if_absent(objects.object_name(ref), blob)
        env = env_for(cache, f"file://{shared}", keydir=keydir)
        r = quack(["cache", "pull", "--json"], proj, env, timeout=HARD_TIMEOUT)
        assert r.returncode == 1, r.stderr[-3000:]
        rep = json.loads(r.stdout)
        assert rep["total"] == len(refs) == 18
        assert rep["failed"] >= 1 and rep["pulled"] + rep["failed"] == 18 and rep["missing"] == 0
        # The terminal wraps the message where the path's length puts it (an xdist
        # worker's tmp path is longer): read it with its line breaks undone.
        err = " ".join(r.stderr.split())
        assert "No space left on device" in err and str(cache) in err
        # The human form says the same, and does not call the failures "not available".
        r = quack(["cache", "pull"], proj, env, timeout=HARD_TIMEOUT)
        assert r.returncode == 1 and "No space left on device" in " ".join(r.stderr.split())
        assert (
            f"pulled 0 of 18 from file://{shared} ({rep['pulled']} already local, 0 not available, "
            f"{rep['failed']} not stored locally;" in " ".join(r.stdout.split())
        )
    finally:
        subprocess.run(["umount", str(small)], capture_output=True, timeout=30)
