"""What `quack cache stats|clean` and `prewarm` make of a tampered or damaged cache:
FIFOs, sockets and device nodes planted at an entry's files or as the journal and the
remote stats file (named and removed like planted links, never opened: a FIFO open
blocks), a derived .so left without its .so.json (debris), and journal lines whose
fields have the wrong type (skipped like torn lines). Real CLI subprocesses, bounded."""

from __future__ import annotations

import hashlib
import json
import os
import select
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import toykernels  # noqa: F401
from reliability_support import QUACK, env

from quack import registry
from quack.cache import journal, keys


def _key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def _entry(d: Path, key: str, *, so: bool = True, age: float = 3 * 86400) -> None:
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = os.urandom(1000)
    (d / f"{key}.o").write_bytes(data)
    meta = {"format": 1, "key": key, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / f"{key}.json").write_text(json.dumps(meta))
    (d / f"{key}.lock").write_bytes(b"")
    if so:
        (d / f"{key}.so").write_bytes(b"x" * 500)
        (d / f"{key}.so.json").write_text("{}")
    t = time.time() - age
    for f in d.glob(f"{key}*"):
        os.utime(f, (t, t))


@pytest.fixture
def proj(tmp_path):
    d = tmp_path / "proj"
    d.mkdir()
    (d / "quack.toml").write_text('[runtime]\narch = "sm_90a"\n[build]\nkernel_packages = ["toykernels"]\n')
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    fp = registry.get("toy_scale").source_fingerprint()
    fpdir = root / "v1" / keys.toolchain_stamp("sm_90a") / "toy_scale" / fp
    for i in range(4):
        _entry(fpdir, _key(i))
    return {"dir": d, "root": root, "fpdir": fpdir}


def _q(args, proj) -> subprocess.CompletedProcess:
    """``quack ARGS`` on the fixture's cache; a hang (a FIFO opened) fails, bounded."""
    r = subprocess.run(
        [*QUACK, *map(str, args)],
        cwd=str(proj["dir"]),
        env=env(QUACK_CACHE_DIR=proj["root"]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    return r


def test_planted_fifo_socket_and_device_are_named_by_stats_and_removed_by_clean(proj, monkeypatch):
    root, d = proj["root"], proj["fpdir"]
    planted = {}
    (d / f"{_key(0)}.json").unlink()
    os.mkfifo(d / f"{_key(0)}.json")  # key 0 looked complete: counted as an entry
    planted[d / f"{_key(0)}.json"] = "named pipe (FIFO)"
    (d / f"{_key(1)}.so").unlink()
    monkeypatch.chdir(d)  # a socket's path is limited to 108 bytes: bind it relative
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(f"{_key(1)}.so")
    planted[d / f"{_key(1)}.so"] = "socket"
    try:
        (d / f"{_key(2)}.lock").unlink()
        os.mknod(d / f"{_key(2)}.lock", stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's
        planted[d / f"{_key(2)}.lock"] = "device node"
    except PermissionError:
        pass  # no CAP_MKNOD: the FIFO and the socket stand for the rest
    for name in ("journal.jsonl", "remote-stats.jsonl"):  # plain open() blocked on these
        os.mkfifo(root / name)
        planted[root / name] = "named pipe (FIFO)"

    r = _q(["cache", "stats", "--json"], proj)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert {Path(x["path"]): x["what"] for x in info["planted"]} == planted
    assert info["totals"]["entries"] == 3  # key 0's FIFO metadata is no entry
    r = _q(["cache", "stats"], proj)
    assert r.returncode == 0 and f"planted in the cache ({len(planted)};" in r.stdout, r.stdout
    assert f"named pipe (FIFO): {root / 'journal.jsonl'}" in r.stdout
    r = _q(["prewarm", "-n"], proj)
    assert r.returncode == 0 and "0 journal records" in r.stdout, r.stdout + r.stderr
    assert r.stderr.count("warning:") == 1 and "journal.jsonl was not read in full" in r.stderr

    r = _q(["cache", "clean"], proj)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "planted named pipe (FIFO) (never opened)" in r.stdout and "planted socket" in r.stdout
    assert not any(os.path.lexists(p) for p in planted)
    sock.close()
    # Key 0, once its FIFO is gone, is an object without metadata: debris, removed too.
    assert "interrupted publish" in r.stdout and not (d / f"{_key(0)}.o").exists()
    r = _q(["cache", "stats", "--json"], proj)
    assert json.loads(r.stdout)["planted"] == [] and json.loads(r.stdout)["totals"]["entries"] == 3


def test_journal_append_never_blocks_on_a_planted_fifo(proj):
    """Appended at every process's exit: opening a FIFO for writing waited for a reader."""
    fifo = proj["root"] / "journal.jsonl"
    os.mkfifo(fifo)
    code = "import sys\nfrom quack.cache import journal\njournal.append(sys.argv[1], [{'t': 1.0}])\n"
    r = subprocess.run(
        [sys.executable, "-c", code, str(proj["root"])], env=env(), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_remote_stats_append_never_blocks_on_a_planted_fifo(proj):
    """Also appended at the exit of every process that used a remote: the same hang."""
    fifo = proj["root"] / "remote-stats.jsonl"
    os.mkfifo(fifo)
    code = (
        "import sys\nfrom quack.remote import stats\n"
        "try:\n    stats.append_line(sys.argv[1], '{}\\n')\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(proj["root"])], env=env(), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("refused"), r.stdout  # ENXIO: no reader, never a wait
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    # a regular file is appended to, line by line
    os.unlink(fifo)
    from quack.remote import stats

    stats.append_line(proj["root"], "a\n")
    stats.append_line(proj["root"], "b\n")
    assert (proj["root"] / "remote-stats.jsonl").read_text() == "a\nb\n"


def _holder(lock: Path) -> subprocess.Popen:
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import filelock, time\nl = filelock.FileLock({str(lock)!r})\nl.acquire()\n"
            "print('held', flush=True)\ntime.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([p.stdout], [], [], 60)
    assert ready and p.stdout.readline().strip() == "held"
    return p


def test_a_so_without_its_sidecar_is_debris_clean_removes(proj):
    """Left when the disk filled between the .so and its .so.json: never loadable (it
    can't be verified), and nothing removed it."""
    d = proj["fpdir"]
    for i in range(3):
        (d / f"{_key(i)}.so.json").unlink()
    now = time.time()
    os.utime(d / f"{_key(2)}.so", (now, now))  # young: a link may be writing its sidecar
    bundle = _key(9)  # an installed bundle's derived .so (.so + .so.json only): not debris
    (d / f"{bundle}.so").write_bytes(b"y" * 300)
    (d / f"{bundle}.so.json").write_text("{}")
    holder = _holder(d / f"{_key(1)}.lock")
    try:
        r = _q(["cache", "stats", "--json"], proj)
        deb = json.loads(r.stdout)["debris"]
        assert (deb["orphan_so_files"], deb["orphan_so_bytes"]) == (3, 1500), deb
        r = _q(["cache", "clean", "--all", "-n", "-v"], proj)
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.count(f"{_key(0)}.so ") == 1, r.stdout  # listed once, not per rule
        assert "interrupted link (.so without its .so.json)" in r.stdout
        r = _q(["cache", "clean", "--json"], proj)
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads(r.stdout)
        assert res["by_reason"]["interrupted link (.so without its .so.json)"] == {"files": 1, "bytes": 500}
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert not (d / f"{_key(0)}.so").exists()
    assert all((d / f"{_key(0)}{s}").exists() for s in (".o", ".json", ".lock"))  # the entry stays
    assert (d / f"{_key(1)}.so").exists()  # its lock was held
    assert (d / f"{_key(2)}.so").exists()  # within the grace
    assert (d / f"{bundle}.so").exists() and (d / f"{_key(3)}.so").exists()


def test_journal_records_with_malformed_fields_are_skipped(proj):
    root = proj["root"]
    good = {
        "kernel": "toy_scale",
        "key": _key(0),
        "arch": "sm_90a",
        "params": {"dtype": "float32", "block": 128, "bias": False},
        "hits": 2,
        "misses": 1,
        "compiles": 1,
        "compile_s": 0.5,
        "t": time.time(),
    }
    journal.append(root, [good])
    bad = [
        {"t": "x"},  # TypeError comparing it with --since
        {**good, "key": [1]},  # unhashable in stats' per-kernel key set
        {**good, "params": [1]},  # stats' table called .items() on it
        {**good, "hits": "3"},
        {**good, "t": True},
        {**good, "compile_s": None, "kernel": 7},
    ]
    with open(root / "journal.jsonl", "a") as f:
        f.write("".join(json.dumps(b) + "\n" for b in bad) + "not json\n[1, 2]\n")
    assert journal.read(root) == [good]
    r = _q(["cache", "stats", "--json"], proj)
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)["journal"]
    assert j["records"] == 1 and j["kernels"]["toy_scale"]["hits"] == 2
    r = _q(["cache", "stats"], proj)
    assert r.returncode == 0 and "slowest compiles" in r.stdout, r.stderr
    r = _q(["prewarm", "-n", "--since", "0"], proj)
    assert r.returncode == 0 and "prewarm: 1 journal records, 1 configurations used" in r.stdout, r.stderr


def test_a_directory_at_an_entry_file_is_quarantined_once_and_clean_removes_it(proj, tmp_path):
    """A directory at ``<key>.json``: the runtime quarantines the entry with one warning.
    It used to move the directory into quarantine/, and then every `quack cache clean`
    failed on it ("Is a directory", exit 1) and `stats` counted it for ever; planted()
    did not name a directory at a file's name, so clean never removed one either. No link
    inside such a directory is ever followed."""
    import warnings

    from quack.cache.entry import EntryRef
    from quack.cache.store import DiskStore
    from quack.errors import CacheWarning

    root, d = proj["root"], proj["fpdir"]
    outside = tmp_path / "outside.txt"
    outside.write_text("not the cache's")

    def plant(path: Path) -> None:
        path.unlink()
        path.mkdir()
        (path / "inner").write_bytes(b"y" * 10)
        (path / "link").symlink_to(outside)  # unlinked, its target never touched
        (path / "linked_dir").symlink_to(tmp_path, target_is_directory=True)

    plant(d / f"{_key(0)}.json")
    plant(d / f"{_key(1)}.lock")
    legacy = root / "quarantine" / f"{keys.toolchain_stamp('sm_90a')}-{_key(2)}-1.json"
    legacy.mkdir(parents=True)  # what an older quack moved into quarantine/
    (legacy / "inner").write_bytes(b"z")

    r = _q(["cache", "stats", "--json"], proj)
    assert r.returncode == 0, r.stderr
    got = {Path(x["path"]): x["what"] for x in json.loads(r.stdout)["planted"]}
    assert got == {
        d / f"{_key(0)}.json": "directory where a file belongs",
        d / f"{_key(1)}.lock": "directory where a file belongs",
    }

    ref = EntryRef("toy_scale", _key(0), "sm_90a", d.name)
    store = DiskStore(root)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert store.lookup(ref) is None
        assert store.lookup(ref) is None  # a plain miss now: nothing left to quarantine
    msgs = [str(x.message) for x in w if issubclass(x.category, CacheWarning)]
    assert len(msgs) == 1 and "was corrupt" in msgs[0], msgs
    assert not os.path.lexists(d / f"{_key(0)}.json")
    quarantined = sorted(p.name for p in (root / "quarantine").iterdir())
    assert not [n for n in quarantined if (root / "quarantine" / n).is_dir() and _key(0) in n], quarantined
    reason = next((root / "quarantine").glob(f"*{_key(0)}*.reason")).read_text()
    assert "a directory, removed rather than kept here" in reason, reason

    for _ in range(2):  # and not again on the next clean
        r = _q(["cache", "clean"], proj)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "Is a directory" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert not os.path.lexists(d / f"{_key(1)}.lock") and not os.path.lexists(legacy)
    assert outside.read_text() == "not the cache's" and tmp_path.is_dir()
    r = _q(["cache", "stats", "--json"], proj)
    info = json.loads(r.stdout)
    assert info["planted"] == [] and info["debris"]["quarantined_files"] == 0, info["debris"]
