"""Planted links in the cache (issue 9, bug 7): the remedy a message gives must work.
`quack cache clean` removes planted symlinks (never following them), `verify` and
`stats` name them; a world-writable root is refused by stats and clean like build.
Real CLI subprocesses on a real cache (rel_copy publishes a real toy .o)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from reliability_support import env, run_quack, session_objects


@pytest.fixture(scope="module")
def obj(tmp_path_factory) -> str:
    return session_objects(tmp_path_factory)["float32"]["path"]


def _project(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "quack.toml").write_text('[build]\nkernel_packages = ["relkernels"]\nmanifests = ["m.toml"]\n')
    (d / "m.toml").write_text('[[kernel]]\nname = "rel_copy"\nparams = { i = [1, 2] }\n')
    return d


def _q(args, proj: Path, obj: str):
    r = run_quack(args, cwd=proj, timeout=180, env_=env(QUACK_CACHE_DIR=proj / "cache", QUACK_TEST_OBJ=obj))
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out
    return r.returncode, out


def _built(tmp_path: Path, obj: str) -> Path:
    proj = _project(tmp_path / "proj")
    rc, out = _q(["build", "-j", "1"], proj, obj)
    assert rc == 0, out
    return proj


def test_symlinked_kernel_dir_named_and_cleaned(tmp_path, obj):
    proj = _built(tmp_path, obj)
    kdir = next((proj / "cache" / "v1").glob("*/rel_copy"))
    target = tmp_path / "elsewhere"
    kdir.rename(target)
    kdir.symlink_to(target, target_is_directory=True)
    before = sorted(p.name for p in target.rglob("*"))

    rc, out = _q(["build", "-j", "1", "--keep-going"], proj, obj)
    assert rc == 1 and "a symbolic link in the cache" in out and "quack cache clean" in out, out
    rc, out = _q(["verify", "--no-load", "--json"], proj, obj)
    assert rc == 1
    res = json.loads(out[: out.rindex("}") + 1])
    assert all(e["problems"][0].startswith("planted in the cache") for e in res["entries"]), res
    rc, out = _q(["cache", "stats"], proj, obj)
    assert rc == 0 and f"symbolic link: {kdir}" in out, out
    rc, out = _q(["cache", "stats", "--json"], proj, obj)
    assert json.loads(out)["planted"] == [{"path": str(kdir), "what": "symbolic link"}]

    rc, out = _q(["cache", "clean"], proj, obj)  # the advice the messages give
    assert rc == 0 and "planted symbolic link" in out, out
    assert not os.path.lexists(kdir)
    assert sorted(p.name for p in target.rglob("*")) == before  # the target untouched
    rc, out = _q(["build", "-j", "1"], proj, obj)
    assert rc == 0, out


def test_symlinked_lock_file_named_and_cleaned(tmp_path, obj):
    proj = _built(tmp_path, obj)
    lock = sorted(next((proj / "cache" / "v1").glob("*/rel_copy/*")).glob("*.lock"))[0]
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    lock.unlink()
    lock.symlink_to(victim)

    rc, out = _q(["verify", "--no-load"], proj, obj)
    assert rc == 1 and "lock file" in out and "symbolic link" in out, out
    rc, out = _q(["cache", "stats"], proj, obj)
    assert rc == 0 and f"symbolic link: {lock}" in out, out
    rc, out = _q(["build", "-j", "1", "--force"], proj, obj)
    assert rc == 1 and "quack cache clean" in out, out
    rc, out = _q(["cache", "clean"], proj, obj)
    assert rc == 0 and not os.path.lexists(lock) and victim.read_text() == "keep\n", out
    rc, out = _q(["build", "-j", "1", "--force"], proj, obj)
    assert rc == 0, out


@pytest.mark.parametrize(
    "cmd", [["cache", "stats"], ["cache", "stats", "--json"], ["cache", "clean"], ["cache", "clean", "--all"]]
)
def test_world_writable_root_refused_by_stats_and_clean(tmp_path, obj, cmd):
    proj = _built(tmp_path, obj)
    (proj / "cache").chmod(0o777)
    n = len(list((proj / "cache").rglob("*.o")))
    rc, out = _q(cmd, proj, obj)
    assert rc == 1 and "writable by group or others" in out and "chmod 700" in out, out
    assert "0 entries" not in out
    assert len(list((proj / "cache").rglob("*.o"))) == n == 2


def test_linker_temp_files_go_to_the_cache_and_clean_sweeps_them(tmp_path, obj):
    """The linker runs with TMPDIR=<root>/tmp (a killed link leaves its cc* files in the
    cache, not in /tmp); `quack cache clean` removes scratch files older than a link
    could take, and leaves a fresh one (a link may be running)."""
    import shutil
    import subprocess
    import sys

    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no C compiler: the .so path is not used")
    rec = tmp_path / "tmpdirs"
    cc = tmp_path / "cc-wrapper"
    cc.write_text(f'#!/bin/sh\nprintf "%s\\n" "$TMPDIR" >> "{rec}"\nexec "{gcc}" "$@"\n')
    cc.chmod(0o755)
    proj = _project(tmp_path / "proj")
    root = proj / "cache"
    code = (
        "import relkernels, sys\nfrom quack import registry\nfrom quack.compile import builder\n"
        "from quack.cache.store import DiskStore\nspec = registry.get('rel_copy')\n"
        "e, c = builder.build(spec, spec.bind((), {'i': 3}), 'sm_90a', DiskStore(sys.argv[1]))\n"
        "print(bool(e.so_path))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(root)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env(QUACK_TEST_OBJ=obj, CC=str(cc)),
    )
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
    assert rec.read_text().split() == [str(root / "tmp")]
    assert (root / "tmp").is_dir() and ((root / "tmp").stat().st_mode & 0o777) == 0o700

    old, fresh = root / "tmp" / "ccAbCdEf.res", root / "tmp" / "ccGhIjKl.o"
    old.write_text("x")
    fresh.write_text("y")
    os.utime(old, (1, 1))
    rc, out = _q(["cache", "stats"], proj, obj)
    assert rc == 0 and "1 temp files of killed links" in out, out
    rc, out = _q(["cache", "clean"], proj, obj)
    assert rc == 0 and "temp file of a killed link" in out, out
    assert not old.exists() and fresh.exists()


def test_stats_counts_build_compiles_and_says_where(tmp_path, obj):
    """Right after `quack build`, stats counts its compiles (at build, not run time);
    prewarm does not mistake them for uses."""
    proj = _built(tmp_path, obj)
    rc, out = _q(["cache", "stats", "--json"], proj, obj)
    assert rc == 0, out
    k = json.loads(out)["journal"]["kernels"]["rel_copy"]
    assert (k["compiles"], k["build_compiles"], k["hits"], k["misses"]) == (2, 2, 0, 0), k
    assert all(s["where"] == "build" for s in json.loads(out)["journal"]["slowest"])
    rc, out = _q(["cache", "stats"], proj, obj)
    row = next(ln for ln in out.splitlines() if ln.lstrip("│ ").startswith("rel_copy"))
    assert " 2/0 " in row, out
    rc, out = _q(["prewarm", "--dry-run"], proj, obj)
    assert rc == 0 and "0 configurations used" in out, out
