"""`quack cache stats|clean` on synthetic caches (no compiles)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import toykernels  # noqa: F401
from typer.testing import CliRunner

from quack import registry, settings
from quack.cache import journal, keys
from quack_build.cli.app import app

TESTS = Path(__file__).parent
ROOT = TESTS.parent
runner = CliRunner()
STALE_STAMP = "py3.9-cutlass4.0.0-cu12-tvmffi0.1.0-sm_90a"


def fake_entry(d: Path, key: str, size: int = 1000, age: float = 0.0, so: bool = False) -> None:
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = os.urandom(size)
    (d / f"{key}.o").write_bytes(data)
    meta = {
        "format": 1,
        "key": key,
        "size": size,
        "sha256": hashlib.sha256(data).hexdigest(),
        "compile_s": 0.3,
    }
    (d / f"{key}.json").write_text(json.dumps(meta))
    (d / f"{key}.lock").write_bytes(b"")
    if so:
        (d / f"{key}.so").write_bytes(b"x" * 500)
        (d / f"{key}.so.json").write_text("{}")
    if age:
        t = time.time() - age
        for f in d.glob(f"{key}*"):
            os.utime(f, (t, t))


def _key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "quack.toml").write_text('[build]\nkernel_packages = ["toykernels"]\n')
    monkeypatch.chdir(proj)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(root))
    saved = settings.installed()
    cur_fp = registry.get("toy_scale").source_fingerprint()
    cur = root / "v1" / keys.toolchain_stamp("sm_90a") / "toy_scale" / cur_fp
    stale_fp = root / "v1" / keys.toolchain_stamp("sm_90a") / "toy_scale" / "0000000000000000"
    stale_tc = root / "v1" / STALE_STAMP / "toy_scale" / cur_fp
    unknown = root / "v1" / keys.toolchain_stamp("sm_90a") / "someone_elses" / "1111111111111111"
    for i in range(5):
        fake_entry(cur, _key(i), age=86400 * (10 * i), so=(i == 0))
    for i in range(5, 8):
        fake_entry(stale_fp, _key(i))
    for i in range(8, 10):
        fake_entry(stale_tc, _key(i))
    fake_entry(unknown, _key(10))
    yield {"root": root, "cur": cur, "stale_fp": stale_fp, "stale_tc": stale_tc, "unknown": unknown}
    settings.set_current(saved)


def test_stats_json(cache):
    journal.append(
        cache["root"],
        [
            {
                "kernel": "toy_scale",
                "key": _key(0),
                "arch": "sm_90a",
                "params": {"dtype": "float16"},
                "hits": 7,
                "misses": 1,
                "compiles": 1,
                "compile_s": 2.5,
                "t": time.time(),
            },
            {
                "kernel": "toy_scale",
                "key": _key(1),
                "arch": "sm_90a",
                "params": {"dtype": "float32"},
                "hits": 3,
                "misses": 0,
                "compiles": 0,
                "compile_s": 0.0,
                "t": time.time(),
            },
        ],
    )
    r = runner.invoke(app, ["cache", "stats", "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    t = info["totals"]
    assert (t["entries"], t["current_entries"], t["stale_entries"], t["unknown_entries"]) == (11, 5, 5, 1)
    by = {(f["stamp"], f["srcfp"]): f for f in info["fingerprints"]}
    assert by[(STALE_STAMP, cache["stale_tc"].name)]["why"] == "toolchain changed"
    assert by[(keys.toolchain_stamp("sm_90a"), "0000000000000000")]["why"] == "kernel source changed"
    assert info["kernels"]["toy_scale"] == {
        "current": 5,
        "stale": 5,
        "unknown": 0,
        "bytes": info["kernels"]["toy_scale"]["bytes"],
    }
    j = info["journal"]["kernels"]["toy_scale"]
    assert (j["hits"], j["misses"], j["compiles"], j["compile_s"]) == (10, 1, 1, 2.5)
    assert info["journal"]["slowest"][0]["compile_s"] == 2.5
    r = runner.invoke(app, ["cache", "stats"])
    assert r.exit_code == 0
    assert "11 entries" in r.output and "kernel source changed" in r.output and "slowest compiles" in r.output


def test_stats_shows_square_brackets_in_the_journal_as_text(cache):
    """A journal line with "params": {"s": "[/]"} made `quack cache stats` die in a rich
    MarkupError traceback: the journal's kernels and params are escaped in the tables."""
    row = {"key": _key(0), "arch": "sm_90a", "hits": 1, "misses": 1, "compiles": 1, "compile_s": 9.5}
    journal.append(cache["root"], [dict(row, kernel="k[/]", params={"s": "[/]"}, t=time.time())])
    r = subprocess.run(
        [sys.executable, "-m", "quack_build", "cache", "stats"],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]), COLUMNS="200"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "k[/]" in r.stdout and "s=[/]" in r.stdout, r.stdout


@pytest.mark.parametrize("entry", ["main", "typer"])
def test_stats_imports_neither_cutlass_nor_torch(cache, entry):
    call = (
        "from quack_build.cli.main import main\nmain(['cache', 'stats', '--json'])"
        if entry == "main"
        else "from quack_build.cli.app import app\napp(['cache', 'stats', '--json'])"
    )
    heavy = (
        "('torch', 'cutlass', 'tvm_ffi', 'typer')" if entry == "main" else "('torch', 'cutlass', 'tvm_ffi')"
    )
    code = (
        "import sys\ntry:\n    " + call.replace("\n", "\n    ") + "\nexcept SystemExit as e:\n"
        f"    assert not e.code, e.code\nbad = [m for m in {heavy} if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
    r = subprocess.run([sys.executable, "-c", code], cwd=os.getcwd(), env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["totals"]["entries"] == 11


def test_clean_default_removes_stale_debris_quarantine(cache):
    root, cur = cache["root"], cache["cur"]
    q = root / "quarantine"
    q.mkdir()
    (q / "x-1.o").write_bytes(b"junk" * 10)
    (q / "x-1.reason").write_text("corrupt")
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    old = time.time() - 600
    dead_tmp = cur / f"{_key(0)}.o.tmp-{p.pid}-deadbeef"
    dead_tmp.write_bytes(b"x" * 10)
    os.utime(dead_tmp, (old, old))
    live_tmp = cur / f"{_key(1)}.o.tmp-{os.getpid()}-cafebabe"
    live_tmp.write_bytes(b"y" * 10)
    orphan = cur / f"{_key(20)}.o"  # interrupted publish: object without metadata
    orphan.write_bytes(b"z" * 10)
    os.utime(orphan, (old, old))
    young_orphan = cur / f"{_key(21)}.o"  # maybe being published right now
    young_orphan.write_bytes(b"z" * 10)

    r = runner.invoke(app, ["cache", "clean", "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["removed"] > 0
    assert cache["stale_fp"].exists() and dead_tmp.exists()  # dry run: nothing removed

    r = runner.invoke(app, ["cache", "clean", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert not cache["stale_fp"].exists() and not cache["stale_tc"].exists()
    assert not (root / "v1" / STALE_STAMP).exists()
    assert not q.exists()
    assert not dead_tmp.exists() and not orphan.exists()
    assert live_tmp.exists() and young_orphan.exists()
    assert len(list(cur.glob("*.json"))) == 5 + 1  # entries (+ one .so.json) kept
    assert all((cur / f"{_key(i)}.lock").exists() for i in range(5))  # current locks never unlinked
    assert cache["unknown"].exists()  # other projects' kernels: kept
    assert res["freed_bytes"] >= 5 * 1000
    r = runner.invoke(app, ["cache", "stats", "--json"])
    t = json.loads(r.stdout)["totals"]
    assert (t["current_entries"], t["stale_entries"]) == (5, 0)


def test_clean_skips_entries_locked_by_another_process(cache):
    lock = cache["stale_fp"] / f"{_key(5)}.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import filelock, sys, time\nl = filelock.FileLock({str(lock)!r})\nl.acquire()\n"
            "print('held', flush=True)\ntime.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        r = runner.invoke(app, ["cache", "clean", "--json"])
        assert r.exit_code == 0, r.output
        res = json.loads(r.stdout)
        assert len(res["busy"]) == 1
        assert (cache["stale_fp"] / f"{_key(5)}.o").exists() and lock.exists()
        assert not (cache["stale_fp"] / f"{_key(6)}.o").exists()
    finally:
        holder.kill()
        holder.wait()
    r = runner.invoke(app, ["cache", "clean", "--json"])
    assert not cache["stale_fp"].exists()


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--max-size", "1G"], "--max-size"),
        (["--older-than", "30d", "--json"], "--older-than"),
        (["--max-size", "1G", "--older-than", "30d"], "--max-size / --older-than"),
    ],
)
def test_clean_all_with_max_size_or_older_than_is_a_usage_error(cache, extra, named):
    """`--all --max-size 1G` meant "shrink to 1G" and deleted every entry: --all silently won."""
    before = sorted(cache["root"].rglob("*.o"))
    r = runner.invoke(app, ["cache", "clean", "--all", *extra])
    assert r.exit_code == 2, r.output
    assert f"error: --all cannot be combined with {named}: --all removes every entry" in r.stderr
    assert r.stdout == "" and sorted(cache["root"].rglob("*.o")) == before


def test_clean_older_than_max_size_all(cache):
    cur = cache["cur"]
    # entries 0..4 were last used 0, 10, 20, 30, 40 days ago
    r = runner.invoke(app, ["cache", "clean", "--older-than", "25d", "--json"])
    assert r.exit_code == 0, r.output
    left = sorted(p.stem for p in cur.glob("*.o"))
    assert left == sorted(_key(i) for i in range(3))
    # entries ~1200 B (entry 0 ~1700 with its .so), plus the other project's entry (used now)
    r = runner.invoke(app, ["cache", "clean", "--max-size", "3200", "--json"])
    assert r.exit_code == 0, r.output
    left = {p.stem for p in cur.glob("*.o")}
    assert left == {_key(0)}  # least recently used went first
    assert cache["unknown"].joinpath(f"{_key(10)}.o").exists()
    r = runner.invoke(app, ["cache", "clean", "--all"])
    assert r.exit_code == 0, r.output
    assert not list(cur.glob("*.o")) and not list(cur.glob("*.json"))
    assert list(cur.glob("*.lock"))  # lock files of a current fingerprint stay
    assert "freed" in r.output


def test_clean_missing_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "nope"))
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["cache", "clean"])
    assert r.exit_code == 0 and "nothing to clean" in r.output
    # --json: the schema of any clean ("busy" was 0, not a list; by_reason, errors absent)
    r = runner.invoke(app, ["cache", "clean", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout) == {
        "dry_run": False,
        "removed": 0,
        "freed_bytes": 0,
        "by_reason": {},
        "busy": [],
        "errors": [],
    }
    r = runner.invoke(app, ["cache", "stats", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["totals"]["entries"] == 0
