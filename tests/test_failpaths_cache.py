"""Planted links in the cache (issue 9, bug 7): the remedy a message gives must work.
`quack cache clean` removes planted symlinks (never following them), `verify` and
`stats` name them; a world-writable root is refused by stats and clean like build.
Real CLI subprocesses on a real cache (rel_copy publishes a real toy .o)."""

from __future__ import annotations

import json
import os
import shutil
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


# -- a link the cache refuses: one warning, not a silent second-long load -------------------
_LOAD_TWO = """
import json, warnings
import relkernels
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    relkernels.rel_copy(1)
    relkernels.rel_copy(2)
print(json.dumps({
    "warnings": [str(x.message) for x in w if x.category.__name__ == "CacheWarning"],
    "how": sorted(u["how"] for u in relkernels.rel_copy.usage()),
}))
"""


def _load_two(proj: Path, obj: str, **extra) -> dict:
    """Load both built entries in a fresh process: its CacheWarnings and how each loaded."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _LOAD_TWO],
        capture_output=True,
        text=True,
        timeout=180,
        env=env(QUACK_CACHE_DIR=proj / "cache", QUACK_TEST_OBJ=obj, **extra),
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _built_without_so(tmp_path: Path, obj: str) -> Path:
    """Two built entries whose .so is gone (pulled from a remote, or cleaned): the next
    load links it."""
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler: the .so path is not used")
    proj = _built(tmp_path, obj)
    for p in (proj / "cache" / "v1").glob("*/rel_copy/*/*.so*"):
        p.unlink()
    return proj


def test_a_planted_scratch_file_fails_every_link_warns_once_and_clean_removes_it(tmp_path, obj):
    """A regular file at ``<cache>/tmp`` (the linker's scratch directory): every link failed
    silently, so every process loaded its kernels through CuTe DSL's runtime (~1.3 s, the
    compiler imported) with no word of why; `stats` did not name the file, `clean` left
    it. Also ``quarantine`` and ``logs`` as files: named and removed."""
    proj = _built_without_so(tmp_path, obj)
    root = proj / "cache"
    shutil.rmtree(root / "tmp")
    (root / "tmp").write_text("x")
    (root / "quarantine").write_text("x")
    if (root / "logs").is_dir():
        shutil.rmtree(root / "logs")
    (root / "logs").write_text("x")

    got = _load_two(proj, obj)
    assert got["how"] == ["o", "o"], got
    assert len(got["warnings"]) == 1, got  # once per cache, not per kernel
    msg = got["warnings"][0]
    assert str(root / "tmp") in msg and "cannot be linked into .so files" in msg, msg
    assert "imports the compiler in every process" in msg and "quack cache clean" in msg, msg
    assert not list(root.glob("v1/*/rel_copy/*/*.so")), "a link went through after all"

    rc, out = _q(["cache", "stats", "--json"], proj, obj)
    assert rc == 0, out
    assert {(x["path"], x["what"]) for x in json.loads(out)["planted"]} == {
        (str(root / name), "not a directory") for name in ("tmp", "quarantine", "logs")
    }
    rc, out = _q(["cache", "clean"], proj, obj)  # the advice the warning gives
    assert rc == 0 and "planted not a directory" in out, out
    assert not any(os.path.lexists(root / name) for name in ("tmp", "quarantine", "logs"))

    got = _load_two(proj, obj)
    assert got == {"warnings": [], "how": ["so", "so"]}, got
    assert len(list(root.glob("v1/*/rel_copy/*/*.so"))) == 2


def _fake_cc(tmp_path: Path, stderr: str) -> Path:
    """A C compiler that fails as the real one does (its message on stderr, exit 1), and
    records the locale it ran under."""
    cc = tmp_path / "failing-cc"
    cc.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "${{LC_ALL:-unset}}" >> "{tmp_path / "cc-locale"}"\n'
        f"echo '{stderr}' >&2\nexit 1\n"
    )
    cc.chmod(0o755)
    return cc


def test_a_link_a_full_disk_refused_warns_once_and_another_failure_does_not(tmp_path, obj):
    """ld's only sign of a full disk is its message: the link ran untranslated (LC_ALL=C)
    and the warning names the cause and the fix. A link failing for a reason of the
    toolchain's (not the cache's) is logged, not warned about."""
    proj = _built_without_so(tmp_path, obj)
    full = _fake_cc(tmp_path, "/usr/bin/ld: final link failed: No space left on device")
    got = _load_two(proj, obj, CC=full)
    assert got["how"] == ["o", "o"] and len(got["warnings"]) == 1, got
    msg = got["warnings"][0]
    assert "disk full" in msg and "quack cache clean --max-size" in msg, msg
    assert str(proj / "cache") in msg, msg
    assert set((tmp_path / "cc-locale").read_text().split()) == {"C"}

    other = _fake_cc(tmp_path, "/usr/bin/ld: cannot find -lcute_dsl_runtime")
    got = _load_two(proj, obj, CC=other)
    assert got == {"warnings": [], "how": ["o", "o"]}, got
