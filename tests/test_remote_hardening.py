"""Issue 30, the remote side, without compiling: what a shared directory can plant
(FIFOs, directories and symlinks at object names, symlinked directories, a root
anyone can write, a root that is not a store), values over the size cap on each
backend (a real redis-server, moto's S3 server, a directory), malformed URLs, and
the pull: a wait Ctrl-C ends, a local write failure counted as a failure."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import threading
import warnings

import pytest
import remote_services

from quack import settings, signing
from quack.cache.entry import EntryRef
from quack.cache.store import DiskStore
from quack.errors import RemoteError, RemoteWarning, SettingsError
from quack.remote import file_backend, objects, tier
from quack.remote.backend import open_backend
from quack.runtime import tiers
from quack_build.build import remote as remote_sync

remote_services.require_modules("redis", "boto3", "moto")

NAME = "quack/v1/stamp/kern/0123456789abcdef/" + "a" * 64
DEADLINE = 60.0  # a guard against a hang of the old code, never reached when it works


def bounded(fn, *args):
    """Run ``fn`` on a daemon thread: its result, or a test failure if it does not
    return by DEADLINE (the old file backend blocked for ever on a FIFO)."""
    box: dict = {}

    def run():
        try:
            box["v"] = fn(*args)
        except BaseException as e:  # noqa: BLE001
            box["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE)
    assert not t.is_alive(), f"{fn} blocked"
    if "e" in box:
        raise box["e"]
    return box["v"]


@pytest.fixture(autouse=True)
def _fresh_remote_state(fresh_remote_state):
    """tests/conftest.py's, for every test here."""


@pytest.fixture
def shared(tmp_path):
    d = tmp_path / "shared"
    d.mkdir(mode=0o755)
    return d


def _plant_dir(root, name=NAME):
    p = root.joinpath(*name.split("/"))
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


# --- 1. what is planted at an object's name ----------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dir", "symlink"])
def test_file_backend_refuses_what_is_not_a_regular_file(shared, kind):
    b = open_backend(f"file://{shared}")
    p = _plant_dir(shared)
    if kind == "fifo":
        os.mkfifo(p)  # open(2) without O_NONBLOCK waits for a writer for ever
    elif kind == "dir":
        p.mkdir()
    else:
        (shared.parent / "real").write_bytes(b"x" * 10)
        os.symlink(shared.parent / "real", p)
    with pytest.raises(RemoteError) as e:
        bounded(b.get, NAME)
    assert e.value.reason == "protocol" and str(p) in str(e.value)
    assert {"fifo": "a FIFO", "dir": "a directory", "symlink": "a symbolic link"}[kind] in str(e.value)
    assert b.put_if_absent(NAME, b"new") is False  # the name is taken: nothing replaced


def test_file_backend_operation_bounded_by_the_time_out(shared, monkeypatch):
    """A hung file system (open never returns): the call gives up after op_timeout
    as a redis or S3 time-out does, reason ``timeout`` (the tier switches it off)."""
    release = threading.Event()
    entered = threading.Event()

    class HungOs:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def open(*a, **kw):
            entered.set()
            release.wait(DEADLINE)
            return os.open(*a, **kw)

    b = open_backend(f"file://{shared}", op_timeout=0.3)
    monkeypatch.setattr(file_backend, "os", HungOs())
    try:
        for op in (lambda: b.get(NAME), lambda: b.put_if_absent(NAME, b"x"), lambda: b.exists(NAME)):
            with pytest.raises(RemoteError) as e:
                bounded(op)
            assert e.value.reason == "timeout" and e.value.offline
        assert entered.is_set() and not release.is_set()  # it gave up while the call still hung
    finally:
        release.set()


@pytest.fixture
def lock_waiters(monkeypatch) -> set[threading.Thread]:
    """The threads that asked file_backend for an flock, recorded as they ask. Enumerating
    ``quack-remote-op`` threads after a time-out raced with those threads ending (one can
    be gone by then: CI once saw an empty set where the test needed the waiter)."""
    import fcntl

    waiters: set[threading.Thread] = set()

    class RecordingFcntl:
        def __getattr__(self, attr):
            return getattr(fcntl, attr)

        def flock(self, fd, op):
            waiters.add(threading.current_thread())
            return fcntl.flock(fd, op)

    monkeypatch.setattr(file_backend, "fcntl", RecordingFcntl())
    return waiters


def test_a_replace_waiting_on_a_held_lock_gives_up_and_its_thread_ends(shared, lock_waiters):
    """Another writer holds the directory's replace lock and never lets go (a stopped
    process): the replace times out as any operation does, and then its thread ends and
    removes its temporary object. It used to block in flock(2) for the life of the
    process, holding the temp file and the lock file open."""
    import fcntl

    b = open_backend(f"file://{shared}", op_timeout=0.3)
    assert b.put_if_absent(NAME, b"refused")
    tag = b.get_current(NAME).tag
    obj_dir = shared / NAME.rsplit("/", 1)[0]
    holder = os.open(obj_dir / file_backend.REPLACE_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(RemoteError) as e:
            bounded(b.replace, NAME, b"new", tag)
        assert e.value.reason == "timeout"
        (op,) = lock_waiters  # one thread asked for the lock, again and again
        assert op.name == "quack-remote-op"
        op.join(DEADLINE)
        assert not op.is_alive()  # ended while the lock is still held
        assert sorted(p.name for p in obj_dir.iterdir()) == sorted(
            [NAME.rsplit("/", 1)[1], file_backend.REPLACE_LOCK]
        )
        assert b.get(NAME) == b"refused"  # nothing replaced after the time-out
    finally:
        os.close(holder)
    assert b.replace(NAME, b"new", tag) is True  # the lock free: it replaces
    assert b.get(NAME) == b"new"


def test_several_replaces_queued_on_a_held_lock_all_give_up_and_end(shared, lock_waiters):
    """Six writers (more than one, as a build's pushes are) queue on the held replace lock:
    each times out, each thread ends while the lock is still held, no temp file is left,
    and once it is freed the next replace takes."""
    import fcntl

    first = open_backend(f"file://{shared}", op_timeout=0.3)
    assert first.put_if_absent(NAME, b"refused")
    tag = first.get_current(NAME).tag
    obj_dir = shared / NAME.rsplit("/", 1)[0]
    holder = os.open(obj_dir / file_backend.REPLACE_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
    errors: list = []
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)

        def replace(i):
            b = open_backend(f"file://{shared}", op_timeout=0.3)
            try:
                b.replace(NAME, b"new %d" % i, tag)
            except RemoteError as e:
                errors.append(e.reason)

        callers = [threading.Thread(target=replace, args=(i,)) for i in range(6)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(DEADLINE)
        assert errors == ["timeout"] * 6
        ops = set(lock_waiters)  # the six operations' threads, each asked for the lock
        assert len(ops) == 6 and all(t.name == "quack-remote-op" for t in ops)
        for t in ops:
            t.join(DEADLINE)
        assert not any(t.is_alive() for t in ops)
        assert sorted(p.name for p in obj_dir.iterdir()) == sorted(
            [NAME.rsplit("/", 1)[1], file_backend.REPLACE_LOCK]
        )
        assert first.get(NAME) == b"refused"
    finally:
        os.close(holder)
    assert first.replace(NAME, b"new", tag) is True


# --- 8. the shared root and the directories under it ----------------------------------------


def test_symlinked_directory_under_the_root_is_neither_read_nor_written(shared, tmp_path):
    outside = tmp_path / "outside"
    (outside / "kern" / "0123456789abcdef").mkdir(parents=True)
    (outside / "kern" / "0123456789abcdef" / ("a" * 64)).write_bytes(b"planted")
    (shared / "quack" / "v1").mkdir(parents=True)
    os.symlink(outside, shared / "quack" / "v1" / "stamp")
    b = open_backend(f"file://{shared}")
    for op in (lambda: b.get(NAME), lambda: b.put_if_absent(NAME[:-1] + "b", b"x"), lambda: b.exists(NAME)):
        with pytest.raises(RemoteError) as e:
            op()
        assert e.value.reason == "protocol" and "symbolic link" in str(e.value)
    assert sorted(p.name for p in (outside / "kern" / "0123456789abcdef").iterdir()) == ["a" * 64]


def test_world_writable_root_is_refused(shared):
    os.chmod(shared, 0o777)
    b = open_backend(f"file://{shared}")
    for op in (lambda: b.get(NAME), lambda: b.put_if_absent(NAME, b"x")):
        with pytest.raises(RemoteError) as e:
            op()
        assert e.value.reason == "denied" and "writable by anyone" in str(e.value)
        assert f"chmod o-w {shared}" in str(e.value)
    assert list(shared.iterdir()) == []  # nothing written
    os.chmod(shared, 0o775)  # group-writable: how a team shares a directory
    assert b.put_if_absent(NAME, b"x") is True


def test_a_root_that_is_not_a_store_is_refused(shared):
    (shared / "notes.txt").write_text("someone's files")
    b = open_backend(f"file://{shared}")
    for op in (lambda: b.get(NAME), lambda: b.put_if_absent(NAME, b"x")):
        with pytest.raises(RemoteError) as e:
            op()
        assert e.value.reason == "denied" and "not a quack remote cache" in str(e.value)
        assert "notes.txt" in str(e.value) and ".quack-remote" in str(e.value)
    assert not (shared / "quack").exists()
    (shared / ".quack-remote").touch()  # marked by hand: accepted
    b = open_backend(f"file://{shared}")
    assert b.put_if_absent(NAME, b"x") is True and b.get(NAME) == b"x"
    with pytest.raises(RemoteError, match="not a quack remote cache"):
        open_backend("file:///etc").get(NAME)


def test_an_empty_root_is_a_new_store_marked_by_its_first_writer(shared):
    b = open_backend(f"file://{shared}")
    assert b.get(NAME) is None and not (shared / ".quack-remote").exists()  # a reader writes nothing
    assert b.put_if_absent(NAME, b"x") is True
    assert (shared / ".quack-remote").is_file()


_PUSH_WITH_UMASK = r"""
import os, sys
os.umask(int(sys.argv[2], 8))
from quack.remote.backend import open_backend
print(open_backend("file://" + sys.argv[1]).put_if_absent(sys.argv[3], b"object"))
"""


def _push_with_umask(root, umask: str, name: str = NAME) -> None:
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", _PUSH_WITH_UMASK, str(root), umask, name],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]


@pytest.mark.parametrize("umask", ["022", "077"])
def test_a_group_shared_store_stays_writable_by_the_group(tmp_path, umask):
    """docs/remote-cache.md: share the directory through a group (chmod 2775). The first
    writer's umask made its directories drwxr-sr-x (or drwx--S---): every other member
    of the group was denied and stopped pushing. Its objects must be group-readable."""
    import stat

    root = tmp_path / "team"
    root.mkdir()
    os.chmod(root, 0o2775)
    _push_with_umask(root, umask)
    made = [root.joinpath(*NAME.split("/")[: i + 1]) for i in range(len(NAME.split("/")) - 1)]
    for d in made:
        mode = d.stat().st_mode
        assert mode & stat.S_IRWXG == stat.S_IRWXG, f"{d}: {stat.filemode(mode)}"
        assert mode & stat.S_ISGID, f"{d}: {stat.filemode(mode)}"  # mkdir inherits it
    assert root.joinpath(*NAME.split("/")).stat().st_mode & stat.S_IRGRP
    # A second writer (another member's process) can write in the directories made.
    _push_with_umask(root, umask, NAME[:-1] + "b")


def test_a_private_store_is_not_widened(tmp_path):
    import stat

    root = tmp_path / "mine"
    root.mkdir(mode=0o700)
    os.chmod(root, 0o700)
    _push_with_umask(root, "077")
    for d in root.joinpath("quack").rglob("*"):
        assert stat.S_IMODE(d.stat().st_mode) & (stat.S_IRWXG | stat.S_IRWXO) == 0, d


# --- 3. the size cap, on every backend ---------------------------------------------------------

CAP = 4096


def _plant_value(kind, where, name, value: bytes):
    """Store ``value`` under ``name`` behind the backend's back (as a hostile writer would)."""
    if kind == "redis":
        where.client().set(name, value)
    elif kind == "s3":
        import boto3

        bucket, _, prefix = where[len("s3://") :].partition("/")
        boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=value)
    else:
        _plant_dir(where, name).write_bytes(value)


@pytest.mark.parametrize("kind", ["redis", "s3", "file"])
def test_values_over_the_cap_are_refused_as_size(kind, request, tmp_path):
    if kind == "redis":
        where = request.getfixturevalue("redis_srv")
        where.client().flushall()
        url = where.url
    elif kind == "s3":
        where = url = f"{request.getfixturevalue('s3_url')}/size"
    else:
        where = tmp_path / "shared"
        where.mkdir()
        url = f"file://{where}"
    b = open_backend(url, max_bytes=CAP)
    big, at_cap = NAME[:-1] + "b", NAME[:-1] + "c"
    _plant_value(kind, where, big, b"\0" * (50 * CAP))
    _plant_value(kind, where, at_cap, b"\1" * CAP)
    if kind == "redis":
        gets_before = _redis_reads(where)
    with pytest.raises(RemoteError) as e:
        b.get(big)
    assert e.value.reason == "size" and not e.value.offline
    assert f"{50 * CAP} bytes" in str(e.value) and "refused unread" in str(e.value)
    if kind == "redis":
        assert _redis_reads(where) == gets_before  # STRLEN only: the value was never sent
    assert b.get(at_cap) == b"\1" * CAP
    b.close()


def _redis_reads(srv) -> int:
    stats = srv.client().info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("get", "getrange"))


def test_tier_counts_an_oversized_value_as_a_size_refusal(shared, tmp_path):
    d = tmp_path / "keys"
    signing.write_keypair("ci-1", d)
    trusted = signing.load_trusted_keys(str(d / "ci-1.pub"))
    ref = EntryRef("toy_scale", hashlib.sha256(b"0").hexdigest(), "sm_90a", "0123456789abcdef")
    _plant_dir(shared, objects.object_name(ref)).write_bytes(b"\0" * (2 * CAP))
    t = tier.RemoteTier(open_backend(f"file://{shared}", max_bytes=CAP), trusted=trusted)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert t.fetch(ref) is None
    assert t.counters.rejected == 1 and dict(t.counters.rejected_by_reason) == {"size": 1}
    assert t.counters.errors == 0 and not t.offline
    msgs = [str(x.message) for x in w if issubclass(x.category, RemoteWarning)]
    assert len(msgs) == 1 and "refused (size)" in msgs[0]


def test_a_writer_never_signs_an_object_over_the_cap(tmp_path, monkeypatch):
    d = tmp_path / "keys"
    signing.write_keypair("ci-1", d)
    ref = EntryRef("toy_scale", hashlib.sha256(b"0").hexdigest(), "sm_90a", "0123456789abcdef")
    monkeypatch.setattr(objects, "MAX_BODY", 100)
    with pytest.raises(ValueError, match="over the 100-byte cap"):
        objects.pack(ref, {}, b"x" * 101, signing.load_signing_key(d / "ci-1.key"))


# --- 9. malformed URLs ----------------------------------------------------------------------------

MALFORMED = [
    ("redis://:@@/", "more than one '@'"),
    ("redis://", "no host name"),
    ("redis://:pw@/0", "no host name"),
    ("redis://h:99999/0", "Port out of range"),
    ("redis://h:x/0", "Port could not be cast"),
    ("rediss://h/db1", "not a number"),
    ("redis://[::1/0", "Invalid IPv6"),
    ("redis://h/0#x", "fragment"),
    ("s3://", "not a valid bucket name"),
    ("s3://Upper_Case/p", "not a valid bucket name"),
    ("s3://user@bucket/p", "not a valid bucket name"),
    ("s3://bucket/a/../b", "'..'"),
    ("s3://bucket/a//b", "empty"),
    ("file://host/x", "three slashes"),
    ("file://", "three slashes"),
    ("file:///a/../etc", "'..'"),
    ("file:///shared path", "space"),
]


@pytest.mark.parametrize("url,why", MALFORMED)
def test_malformed_urls_are_settings_errors(url, why, tmp_path):
    with pytest.raises(SettingsError) as e:
        settings.resolve(env={"QUACK_REMOTE": url}, cwd=tmp_path)
    assert "QUACK_REMOTE" in str(e.value) and why in str(e.value)
    with pytest.raises(ValueError, match="remote URL"):
        open_backend(url)
    # The same error type and wording as an unsupported scheme.
    with pytest.raises(SettingsError, match="QUACK_REMOTE='ftp://x' is invalid"):
        settings.resolve(env={"QUACK_REMOTE": "ftp://x"}, cwd=tmp_path)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "redis://user:p%40ss@cache.internal:6380/3",
        "rediss://cache/",
        "redis://h",
        "s3://quack-cache",
        "s3://quack-cache/team/ci",
        "file:///srv/quack",
        "file://localhost/srv/quack/",
    ],
)
def test_well_formed_urls_are_accepted(url, tmp_path):
    assert settings.resolve(env={"QUACK_REMOTE": url}, cwd=tmp_path).remote_url == url


def test_a_malformed_url_in_an_error_hides_the_password(tmp_path):
    with pytest.raises(ValueError) as e:
        open_backend("redis://u:hunter2@h:x/0")
    assert "hunter2" not in str(e.value)
    # The settings error names the variable and the URL, never the password: it is what a
    # CI log shows for a mistyped QUACK_REMOTE.
    for bad in ("redis://u:hunter2@h:x/0", "redis://u:hunter2@h:6379/db", "redis://u:hunter2@@h/0"):
        with pytest.raises(SettingsError) as e:
            settings.resolve(env={"QUACK_REMOTE": bad}, cwd=tmp_path)
        assert "QUACK_REMOTE=" in str(e.value) and "hunter2" not in str(e.value), str(e.value)
    (tmp_path / "quack.toml").write_text('[remote]\nurl = "redis://u:hunter2@h:6379/db"\n')
    with pytest.raises(SettingsError) as e:
        settings.resolve(env={}, cwd=tmp_path)
    assert "remote.url" in str(e.value) and "hunter2" not in str(e.value), str(e.value)


# --- 1. the pull's wait, and 2. a local write failure ---------------------------------------------


class _Task:
    def __init__(self, i):
        self.status = "todo"
        self.cfg = type("Cfg", (), {"spec": None, "params": i, "arch": "sm_90a", "kernel": "toy", "key": "k"})
        self.ref = EntryRef("toy_scale", hashlib.sha256(str(i).encode()).hexdigest(), "sm_90a", "0" * 16)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt during the test, whatever handler the process had
    (a library or an earlier test may have installed its own): the tests that interrupt
    the pull send themselves one and must see Python's default behaviour."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.fixture
def fake_refs(monkeypatch):
    monkeypatch.setattr(remote_sync.builder, "entry_ref", lambda spec, params, arch: _Task(params).ref)


@pytest.mark.parametrize("taker", ["main", "other"])
def test_pull_wait_ends_on_interrupt_while_a_fetch_hangs(fake_refs, sigint_raises, taker):
    """Fetches that never return (the FIFO of issue 30, or a hung server): SIGINT ends the
    pull's wait with KeyboardInterrupt while they still hang (the old pool's shutdown joined
    them first, and its exit hook joined them again at exit). ``taker``: the thread the
    signal is sent to, the waiting main thread or another one (whose C handler then only
    flags it for the main thread)."""
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    calls = []

    class HungRemote:
        offline = False

        def fetch(self, ref):
            calls.append(ref)
            if len(calls) == 1:
                return None  # the first fetch, alone: a miss; the rest run on the threads
            entered.set()
            release.wait(20)
            returned.set()
            return None

    main = threading.main_thread().ident
    assert threading.get_ident() == main

    def interrupt():
        if entered.wait(DEADLINE):
            signal.pthread_kill(main if taker == "main" else threading.get_ident(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            remote_sync.pull([_Task(i) for i in range(4)], None, HungRemote(), threads=2)
        assert entered.is_set() and not returned.is_set()
    finally:
        release.set()


def test_build_interrupted_during_the_pull_compiles_nothing(fake_refs):
    from quack_build.build import scheduler

    class InterruptingRemote:
        offline = False
        url = "file:///x"
        counters = tier.Counters()

        def fetch(self, ref):
            raise KeyboardInterrupt

    class NoExecutor:
        name = "none"

        def start(self, n):
            raise AssertionError("the build compiled after Ctrl-C in the pull")

    tasks = [_Task(i) for i in range(2)]
    res = scheduler.BuildSession(
        tasks, None, scheduler.BuildOptions(jobs=1, remote=InterruptingRemote(), executor=NoExecutor())
    ).run()
    assert res.interrupted and [t.status for t in tasks] == ["interrupted", "interrupted"]


def test_pull_counts_a_local_write_failure_as_a_failure(fake_refs, tmp_path, monkeypatch):
    """ENOSPC while the store writes a verified object: a failure with its cause, not a miss."""
    from quack.cache.contract import Fetched

    class Remote:
        offline = False

        def fetch(self, ref):
            return Fetched(ref, b"\x7fELF" + b"\0" * 1000, {"params": {}}, "remote:test")

    class FullFile:
        def __init__(self, *a, **kw):
            """Takes the temp file's arguments; opens nothing: every write fails as a full disk."""

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device", "tmpfile")

    store = DiskStore(tmp_path / "cache", fsync=False)
    monkeypatch.setattr(tiers, "open", FullFile, raising=False)
    failures: list = []
    tasks = [_Task(i) for i in range(4)]
    assert remote_sync.pull(tasks, store, Remote(), failures=failures) == 0
    assert len(failures) == 4 and all(t.status == "todo" for t in tasks)
    assert all(remote_sync.why(e).startswith("[Errno 28] No space left on device") for _, e in failures)
    # Without a list (the build): one warning naming the cause, the keys left to compile.
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert remote_sync.pull(tasks, store, Remote()) == 0
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 1 and "could not be stored locally" in msgs[0] and "No space left" in msgs[0]
