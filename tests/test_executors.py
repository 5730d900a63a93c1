"""The executor contract as the scheduler drives it (a scripted executor: no compiles),
the executor setting, and `--executor ray` without Ray installed."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types

import pytest
import toykernels  # noqa: F401
from test_cli_build import sub_env, write_project
from typer.testing import CliRunner

from quack import registry, settings
from quack.cache.store import DiskStore
from quack.errors import CompileError, ExecutorError, SettingsError, ToolchainMismatch
from quack_build.build import executors, results, scheduler
from quack_build.build import plan as planning
from quack_build.build import trace as tracing
from quack_build.build.executors import base
from quack_build.build.executors.base import DONE, FAILED, NOTE, STARTED, Event
from quack_build.manifest.config import BuildConfig


def _cfg(block: int) -> BuildConfig:
    spec = registry.get("toy_scale")
    p = spec.bind((), {"dtype": "float16", "block": block})
    return BuildConfig("toy_scale", p, "sm_90a", spec.key(p, "sm_90a"), "test", spec)


class ScriptedExecutor:
    """Answers each poll with the next scripted batch of events (keys by block size)."""

    name = "scripted"
    start_s = 0.0

    def __init__(self, script, jobs=2):
        self.script = list(script)
        self.jobs = jobs
        self.submitted: list[str] = []
        self.calls: list[str] = []

    def start(self, max_jobs):
        self.calls.append(f"start {max_jobs}")
        self.jobs = min(self.jobs, max_jobs)

    def submit(self, item):
        self.submitted.append(item.key)

    def poll(self, timeout):
        assert self.script, "polled after the script ended: the scheduler should have stopped"
        return self.script.pop(0)

    def cancel(self):
        self.calls.append("cancel")

    def close(self):
        self.calls.append("close")

    def stats(self):
        return {"retries": 1}


class Recorder(results.NullReporter):
    def __init__(self):
        self.notes, self.started_lanes = [], []

    def note(self, text):
        self.notes.append(text)

    def started(self, task):
        self.started_lanes.append((task.lane, task.slot))


def test_scheduler_drives_an_executor_retry_note_lanes_failure_and_trace(tmp_path):
    a, b = _cfg(64), _cfg(128)
    k = {64: a.key, 128: b.key}
    err = CompileError(
        "toy_scale", {"block": 128}, "sm_90a", "Traceback ...\nValueError: the compiler says no"
    )
    script = [
        [
            Event(STARTED, k[64], lane="actor 1 (n1 pid 11)", pid=11, t_start=1000.0),
            Event(STARTED, k[128], lane="actor 2 (n2 pid 22)", pid=22, t_start=1000.0),
        ],
        [
            Event(NOTE, text="Ray actor 1 died while compiling; retrying on another actor (retry 1 of 2)"),
            Event(STARTED, k[64], lane="actor 2 (n2 pid 22)", pid=22, t_start=1001.0),
        ],
        [Event(FAILED, k[128], lane="actor 2 (n2 pid 22)", pid=22, error=err)],
        [Event(DONE, k[64], lane="actor 2 (n2 pid 22)", pid=22, compiled=True, compile_s=0.5)],
    ]
    ex = ScriptedExecutor(script)
    rep = Recorder()
    store = DiskStore(tmp_path / "cache", fsync=False)
    tasks = planning.plan([a, b], store)
    res = scheduler.BuildSession(
        tasks,
        store,
        scheduler.BuildOptions(jobs=8, reporter=rep, keep_going=True, executor=ex, log_dir=tmp_path / "logs"),
    ).run()
    assert ex.calls == ["start 2", "close"] and sorted(ex.submitted) == sorted(k.values())
    assert res.jobs == 2 and res.executor == "scripted" and res.executor_stats == {"retries": 1}
    assert res.count(results.COMPILED) == 1 and res.count(results.FAILED) == 1
    assert rep.notes == ["Ray actor 1 died while compiling; retrying on another actor (retry 1 of 2)"]
    # the retry moved the key to another lane and gave its slot back first
    assert [lane for lane, _ in rep.started_lanes] == [
        "actor 1 (n1 pid 11)",
        "actor 2 (n2 pid 22)",
        "actor 2 (n2 pid 22)",
    ]
    assert len({slot for _, slot in rep.started_lanes[1:]}) == 2
    failed = next(t for t in res.tasks if t.status == results.FAILED)
    assert failed.error == "ValueError: the compiler says no"
    assert "the compiler says no" in (tmp_path / "logs").glob("build-*.log").__next__().read_text()
    doc = res.to_json()
    assert doc["executor"] == "scripted" and {kk.get("lane") for kk in doc["keys"]} == {"actor 2 (n2 pid 22)"}
    trace = tmp_path / "t.json"
    tracing.write_trace(trace, res, res.t0)
    names = [
        e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["name"] == "thread_name"
    ]
    assert names == ["scheduler", "actor 2 (n2 pid 22)"]
    # nothing was really published: the build is not ok
    assert not res.ok and set(res.missing_after) == set(k.values())


def test_fail_fast_stops_submitting_and_ends_with_keys_still_queued(tmp_path):
    cfgs = [_cfg(b) for b in (32, 64, 128, 256, 512, 1024)]
    store = DiskStore(tmp_path / "cache", fsync=False)
    tasks = planning.plan(cfgs, store)
    first, second, third = (t.cfg.key for t in tasks[:3])  # no known times: manifest order
    err = CompileError("toy_scale", {}, "sm_90a", "boom")
    # jobs=1: a window of 3 submitted; the first fails, the two in flight finish, the
    # other three are never submitted, and the run ends (no spin on the unsent ones).
    ex = ScriptedExecutor(
        [
            [Event(STARTED, first, pid=1)],
            [Event(FAILED, first, error=err)],
            [Event(DONE, second, pid=1, compiled=True), Event(DONE, third, pid=1, compiled=True)],
        ],
        jobs=1,
    )
    res = scheduler.BuildSession(tasks, store, scheduler.BuildOptions(jobs=1, executor=ex)).run()
    assert ex.submitted == [first, second, third] and not ex.script
    assert res.count(results.FAILED) == 1 and res.count(results.COMPILED) == 2
    assert res.count(results.SKIPPED) == 3 and ex.calls[-1] == "close"


def test_executor_start_failure_propagates_and_nothing_is_planned(tmp_path):
    class Refusing(ScriptedExecutor):
        def start(self, max_jobs):
            raise ToolchainMismatch(
                "refusing Ray actor 1: its toolchain stamp is 'x' but this coordinator's is 'y'",
                worker_stamp="x",
                coordinator_stamp="y",
            )

    store = DiskStore(tmp_path / "cache", fsync=False)
    with pytest.raises(ExecutorError) as ei:
        scheduler.BuildSession(
            planning.plan([_cfg(32)], store), store, scheduler.BuildOptions(jobs=1, executor=Refusing([]))
        ).run()
    e = ei.value
    assert isinstance(e, RuntimeError) and (e.worker_stamp, e.coordinator_stamp) == ("x", "y")
    import pickle

    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is ToolchainMismatch and e2.worker_stamp == "x" and str(e2) == str(e)


# --- the setting ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["local", "ray", "auto", "ray://head.example:10001", "10.0.0.5:6379"])
def test_executor_setting_accepts_the_documented_forms(tmp_path, value):
    (tmp_path / "quack.toml").write_text(f'[build]\nexecutor = "{value}"\n')
    assert settings.resolve(cwd=tmp_path, env={}).executor == value
    assert settings.resolve(cwd=tmp_path, env={"QUACK_BUILD_EXECUTOR": "local"}).executor == "local"
    assert settings.resolve({"executor": "auto"}, cwd=tmp_path, env={}).executor == "auto"


def test_executor_setting_errors_name_the_source(tmp_path):
    assert settings.resolve(cwd=tmp_path, env={}).executor == "local"
    with pytest.raises(SettingsError) as ei:
        settings.resolve(cwd=tmp_path, env={"QUACK_BUILD_EXECUTOR": "slurm"})
    assert "QUACK_BUILD_EXECUTOR='slurm' is invalid" in str(ei.value) and "ray://HOST:PORT" in str(ei.value)
    (tmp_path / "quack.toml").write_text('[build]\nexecutor = "ray://"\n')
    with pytest.raises(SettingsError) as ei:
        settings.resolve(cwd=tmp_path, env={})
    assert "build.executor = 'ray://' is invalid" in str(ei.value)


def test_cli_executor_flag_usage_error_is_exit_2(tmp_path, monkeypatch):
    from quack_build.cli.app import app

    proj = write_project(tmp_path / "proj")
    monkeypatch.chdir(proj)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "cache"))
    saved = settings.installed()
    try:
        r = CliRunner().invoke(app, ["build", "--executor", "slurm://x"])
    finally:
        settings.set_current(saved)
    assert r.exit_code == 2 and "--executor" in r.output


def test_factory_local_is_the_default(tmp_path):
    s = settings.resolve({"cache_dir": str(tmp_path / "c"), "jobs": 3}, cwd=tmp_path, env={})
    ex = executors.create(s, jobs=None, store=DiskStore(tmp_path / "c"))
    assert ex.name == "local" and ex.jobs == 3


# --- without Ray ------------------------------------------------------------------------------

NO_RAY = (
    "import sys\nsys.modules['ray'] = None  # as if the [ray] extra were not installed\n"
    "from quack_build.cli.main import main\nmain(sys.argv[1:])\n"
)


def test_executor_ray_without_ray_is_one_line_with_the_install_command(tmp_path):
    proj = write_project(tmp_path / "proj")
    for flag in (["--executor", "ray"], []):
        env = sub_env(tmp_path / "cache")
        if not flag:
            env["QUACK_BUILD_EXECUTOR"] = "ray://127.0.0.1:1"
        r = subprocess.run(
            [sys.executable, "-c", NO_RAY, "build", *flag],
            cwd=proj,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 1, r.stderr
        assert r.stderr.strip() == "error: " + base.RAY_INSTALL_HINT
        assert "pip install 'quack-cache[ray]'" in r.stderr
    assert not list((tmp_path / "cache").glob("v1/*/*/*/*.o"))


# --- publishing a remote worker's result (the coordinator is the only writer) -----------------


def _remote_result(cfg: BuildConfig, data: bytes = b"\x7fELF not really an object" * 40, **over) -> dict:
    import hashlib

    from quack.cache import keys

    res = {
        "key": cfg.key,
        "srcfp": cfg.spec.source_fingerprint(),
        "stamp": keys.toolchain_stamp(cfg.arch),
        "obj": data,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "so": None,
        "compile_s": 0.25,
        "host": "node-7",
        "pid": 4242,
    }
    res.update(over)
    return res


def _item(cfg: BuildConfig, force: bool = False) -> base.WorkItem:
    return base.WorkItem(
        cfg.key,
        cfg.kernel,
        cfg.spec.module,
        cfg.plain_params,
        cfg.arch,
        force,
        spec=cfg.spec,
        bound=cfg.params,
    )


def test_publish_result_verifies_and_publishes_once_with_metadata_last(tmp_path):
    from quack.compile import builder
    from quack_build.build.executors.publish import publish_result

    cfg = _cfg(256)
    store = DiskStore(tmp_path / "cache", fsync=False)
    res = _remote_result(cfg)
    assert publish_result(store, _item(cfg), res, worker="Ray actor 1") is True
    e = store.lookup(builder.entry_ref(cfg.spec, cfg.params, cfg.arch))
    assert e is not None and e.obj_path.read_bytes() == res["obj"]
    assert e.meta["sha256"] == res["sha256"] and e.meta["executor"] == "ray" and e.meta["host"] == "node-7"
    assert not list(e.obj_path.parent.glob("*.tmp-*"))
    # already there: not published again (another process won); --force replaces it
    assert publish_result(store, _item(cfg), _remote_result(cfg, b"other" * 10), worker="w") is False
    assert store.lookup(e.ref).obj_path.read_bytes() == res["obj"]
    assert (
        publish_result(store, _item(cfg, force=True), _remote_result(cfg, b"other" * 10), worker="w") is True
    )
    assert store.lookup(e.ref).obj_path.read_bytes() == b"other" * 10


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("key", "0" * 64, "it computed key 0000000000000000, the coordinator"),
        (
            "srcfp",
            "feedfacefeedface",
            "it compiled sources with fingerprint feedfacefeedface, this checkout has",
        ),
        ("stamp", "py3.9-cutlass0.1-cu12-tvmffi0.1-sm_90a", "its toolchain stamp is 'py3.9-cutlass0.1"),
        ("size", 3, "bytes, it sent 3 (truncated in transit)"),
        ("sha256", "ab" * 32, "SHA-256 does not match what it sent (corrupted in transit)"),
    ],
)
def test_publish_result_refuses_a_mismatch_and_publishes_nothing(tmp_path, field, value, says):
    from quack_build.build.executors.publish import publish_result

    cfg = _cfg(512)
    store = DiskStore(tmp_path / "cache", fsync=False)
    with pytest.raises(ExecutorError) as ei:
        publish_result(
            store, _item(cfg), _remote_result(cfg, **{field: value}), worker="Ray actor 3 (n pid 9)"
        )
    assert says in str(ei.value) and "from Ray actor 3 (n pid 9)" in str(ei.value)
    assert "nothing was published" in str(ei.value)
    assert not list((tmp_path / "cache").glob("v1/*/*/*/*"))


def _wait_events(pub, n: int, timeout: float = 60.0) -> list[Event]:
    """The publisher's events until there are ``n`` (bounded: fails after ``timeout``)."""
    import time

    out: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += pub.done()
        time.sleep(0.01)
    assert len(out) == n, f"{len(out)} events of {n} within {timeout} s: {out}"
    return out


def test_publisher_threads_publish_once_report_failures_as_events_and_stop(tmp_path):
    from quack_build.build.executors.publish import Publisher

    a, b = _cfg(64), _cfg(128)
    pub = Publisher(DiskStore(tmp_path / "cache", fsync=False))
    pub.open("10.0.0.5:6379")
    try:
        pub.submit(_item(a), _remote_result(a), worker="Ray actor 1", lane="actor 1", pid=11)
        pub.submit(_item(b), _remote_result(b, size=3), worker="Ray actor 2", lane="actor 2", pid=22)
        got = {e.key: e for e in _wait_events(pub, 2)}
        assert not pub.pending and pub.done() == []
        assert got[a.key].kind == DONE and got[a.key].compiled and got[a.key].compile_s == 0.25
        assert (got[a.key].lane, got[a.key].pid) == ("actor 1", 11)
        bad = got[b.key]
        assert bad.kind == FAILED and (bad.lane, bad.pid) == ("actor 2", 22)
        assert isinstance(bad.error, ExecutorError) and "truncated in transit" in str(bad.error)
        assert "from Ray actor 2" in str(bad.error) and bad.error.address == "10.0.0.5:6379"
        # the same key again: another process (here: this one) published it first
        pub.submit(_item(a), _remote_result(a), worker="Ray actor 1", lane="actor 1", pid=11)
        (again,) = _wait_events(pub, 1)
        assert again.kind == DONE and not again.compiled and again.compile_s == 0.0
        assert pub.counts["published"] == 1
    finally:
        pub.shutdown()
    pub.shutdown()  # idempotent
    with pytest.raises(ExecutorError, match="shut down"):
        pub.submit(_item(a), _remote_result(a), worker="w", lane="w", pid=0)


def test_publisher_shutdown_with_more_queued_than_threads_drops_the_queue_cleanly(tmp_path, monkeypatch):
    """Shutdown drops the queued results (never published) and lets the ones in progress
    finish: ``done`` returns just the finished ones' events, and then nothing is pending (a
    cancelled future left behind made ``done`` raise and ``pending`` true for ever)."""
    import threading
    import time

    from quack_build.build.executors import publish

    started = threading.Semaphore(0)
    published = []

    def slow(store, item, res, **kw):
        started.release()
        time.sleep(0.2)
        published.append(item.key)
        return True

    monkeypatch.setattr(publish, "publish_result", slow)
    cfgs = [_cfg(32 + 32 * i) for i in range(3 * publish.PUBLISH_THREADS)]
    pub = publish.Publisher(DiskStore(tmp_path / "cache", fsync=False))
    pub.open("h:1")
    for c in cfgs:
        pub.submit(_item(c), _remote_result(c), worker="w", lane="w", pid=0)
    assert started.acquire(timeout=30)  # the first publishes are under way
    pub.shutdown()
    events = pub.done()
    assert not pub.pending
    assert 1 <= len(events) <= publish.PUBLISH_THREADS < len(cfgs)
    assert sorted(e.key for e in events) == sorted(published) and all(e.kind == DONE for e in events)
    assert pub.counts["published"] == len(published) and pub.done() == []


def test_publisher_shutdown_gives_up_a_publish_waiting_for_a_lock_another_process_holds(tmp_path):
    """Ctrl-C while a result waits for its key's lock (another build compiling the key holds
    it): shutdown waited for the lock, up to lock_timeout (600 s), so the build only ended
    at the interrupt's 8 s watchdog, with no summary. Now that publish gives up at once,
    nothing written, and the lock's holder is left alone."""
    import threading
    import time

    from quack.compile import builder
    from quack_build.build.executors.publish import Publisher

    cfg = _cfg(64)
    store = DiskStore(tmp_path / "cache", fsync=False)  # lock_timeout: 600 s
    ref = builder.entry_ref(cfg.spec, cfg.params, cfg.arch)
    held = store.claim(ref)  # the other build's hold on the key (a lock of its own)
    assert held is not None
    waiting = threading.Event()
    real_lock = store.lock

    def lock(r, timeout=None):
        waiting.set()
        return real_lock(r, timeout)

    store.lock = lock  # type: ignore[method-assign]
    pub = Publisher(store)
    pub.open("h:1")
    stopper = threading.Thread(target=pub.shutdown)
    try:
        pub.submit(_item(cfg), _remote_result(cfg), worker="Ray actor 1", lane="actor 1", pid=11)
        assert waiting.wait(30), "the publish never asked for the lock"
        t0 = time.monotonic()
        stopper.start()
        stopper.join(10)
        assert not stopper.is_alive(), "shutdown waits for the lock another process holds"
        took = time.monotonic() - t0
    finally:
        os.close(held)  # before the fix: the publish gets the lock now, and shutdown ends
        stopper.join(60)
    (ev,) = pub.done()
    assert ev.kind == FAILED and type(ev.error).__name__ == "PublishCancelled", ev
    assert "given up: the build stopped while another process held the key's lock" in str(ev.error)
    assert store.lookup(ref) is None and not pub.pending and pub.counts["published"] == 0
    assert took < 5, took


def test_ray_executor_cancel_shuts_ray_down_before_waiting_for_publishes(tmp_path, monkeypatch):
    """The instance the build started goes first: ray.shutdown came after the publisher's
    wait, and a wait that never ended left its agents running."""
    fake, ex, _ = _dying_ray_executor(tmp_path, monkeypatch)
    ex.start(1)
    order = []
    real_shutdown = ex._publisher.shutdown
    monkeypatch.setattr(
        ex._publisher, "cancel", lambda: order.append(("cancel", fake.shutdowns)), raising=False
    )
    monkeypatch.setattr(
        ex._publisher, "shutdown", lambda: (order.append(("wait", fake.shutdowns)), real_shutdown())
    )
    ex.cancel()
    ex.close()
    assert ("wait", 1) in order and ("wait", 0) not in order, order  # Ray shut down before the wait
    assert order[0] == ("cancel", 0) and fake.shutdowns == 1 and fake.killed == 1


def test_vet_hello_admits_a_matching_actor_and_refuses_naming_both_values():
    from quack.cache import keys
    from quack_build.build.executors.ray.actors import vet_hello

    want = keys.toolchain_stamp("sm_90a")
    fp = registry.get("toy_scale").source_fingerprint()
    assert vet_hello({"stamp": want, "srcfps": {"toy_scale": fp}}, want, "actor 1", "h:1") is None
    other = "py3.9-cutlass0.1-cu12-tvmffi0.1-sm_90a"
    err = vet_hello({"stamp": other}, want, "actor 2 (n pid 9)", "h:1")
    assert isinstance(err, ToolchainMismatch) and (err.worker_stamp, err.coordinator_stamp) == (other, want)
    assert f"refusing Ray actor 2 (n pid 9): its toolchain stamp is {other!r}" in str(err)
    err = vet_hello({"stamp": want, "srcfps": {"toy_scale": "feedface"}}, want, "actor 3", "h:1")
    assert isinstance(err, ToolchainMismatch) and (err.worker_stamp, err.coordinator_stamp) == (
        "feedface",
        fp,
    )
    assert "it sees kernel toy_scale with source fingerprint feedface but this checkout has" in str(err)


def test_ray_executor_stats_list_every_counter_in_order_before_start(tmp_path):
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    from quack_build.build.executors.publish import PUBLISH_THREADS
    from quack_build.build.executors.ray.executor import RayExecutor

    s = settings.resolve({"cache_dir": str(tmp_path / "c")}, cwd=tmp_path, env={})
    ex = RayExecutor("ray", jobs=2, settings=s, store=DiskStore(tmp_path / "c"))
    st = ex.stats()
    assert list(st) == [
        "actors_started",
        "actors_refused",
        "actor_deaths",
        "retries",
        "dispatched",
        "published",
        "timeouts",
        "actor_compile_wall_s",
        "roundtrip_s",
        "publish_s",
        "warm_s",
        "nodes",
        "jobs",
        "publish_threads",
        "start_s",
        "address",
    ]
    assert st["nodes"] == [] and st["published"] == 0 and st["publish_threads"] == PUBLISH_THREADS == 8
    ex.counts["a_new_counter"] = 3  # one _STATS_ORDER does not list: reported, not dropped
    assert ex.stats()["a_new_counter"] == 3
    ex.close()  # never started: nothing to stop


# --- Ray Client: a server-side spawn failure gets one more try, and only that -----------------


class _FakeRay:
    """``ray.init`` raising each given error in turn, then connecting."""

    def __init__(self, *errors: Exception):
        self.errors = list(errors)
        self.inits = 0
        self.shutdowns = 0

    def is_initialized(self) -> bool:
        return False

    def init(self, address=None, **kw):
        self.inits += 1
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self):
        self.shutdowns += 1


SPAWN = (
    "ConnectionAbortedError: RuntimeError: Starting Ray client server failed. See ray_client_server_23000.err"
)


@pytest.fixture
def listening():
    """A port that accepts TCP connects, so ``probe`` passes without a cluster."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s.getsockname()[1]
    s.close()


def test_ray_client_spawn_failure_is_tried_once_more(listening, log_records):
    from quack_build.build.executors.ray import cluster

    fake = _FakeRay(ConnectionAbortedError(SPAWN))
    with log_records("quack", logging.WARNING) as records:
        got = cluster.connect(fake, f"ray://127.0.0.1:{listening}", num_cpus=None, runtime_env={})
    assert got == f"ray://127.0.0.1:{listening}"
    assert (fake.inits, fake.shutdowns) == (2, 1)
    assert [r.getMessage() for r in records if "trying once more" in r.getMessage()]


def test_ray_client_spawn_failure_every_time_stops_after_two_attempts(listening):
    from quack_build.build.executors.ray import cluster

    fake = _FakeRay(*[ConnectionAbortedError(SPAWN)] * 5)
    with pytest.raises(ExecutorError) as ei:
        cluster.connect(fake, f"ray://127.0.0.1:{listening}", num_cpus=None, runtime_env={})
    assert fake.inits == cluster.CLIENT_ATTEMPTS == 2
    assert "(after 2 attempts)" in str(ei.value) and "Starting Ray client server failed" in str(ei.value)


@pytest.mark.parametrize(
    "form, error",
    [
        ("ray://127.0.0.1:{port}", ValueError("runtime_env: bad py_modules")),  # the job, not the spawn
        ("127.0.0.1:{port}", ConnectionAbortedError(SPAWN)),  # not Ray Client: no such server
    ],
)
def test_other_ray_init_failures_are_not_retried(listening, form, error):
    from quack_build.build.executors.ray import cluster

    fake = _FakeRay(error, error)
    with pytest.raises(ExecutorError) as ei:
        cluster.connect(fake, form.format(port=listening), num_cpus=None, runtime_env={})
    assert fake.inits == 1 and fake.shutdowns == 1  # no retry; what the failed init left is stopped
    assert "attempts" not in str(ei.value)


# --- a signal during ray.init: taken when it returns, then Ray is shut down ---------------------


@pytest.fixture
def build_handlers(monkeypatch):
    """The `quack` command's signal handlers, for this test only; the interrupt's watchdog
    only records its exit code (it would end the test process)."""
    import signal

    from quack_build.build import interrupts

    saved = {s: signal.getsignal(s) for s in interrupts.SIGNALS}
    monkeypatch.setattr(interrupts, "_received", None)
    monkeypatch.setattr(interrupts, "_installed", False)
    armed: list[int] = []
    monkeypatch.setattr(interrupts, "_watchdog", armed.append)
    interrupts.install()
    try:
        yield armed
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


class _SignalledRay(_FakeRay):
    """``ray.init`` that installs its own SIGTERM handler (as Ray's does: ``sys.exit(15)``),
    gets ``sig`` half-way, and would then go on to record its node and build its core
    worker (``completed``); or, with ``node``, fails inside the node's start-up after
    starting its processes."""

    def __init__(self, sig=None, node=None):
        import signal

        super().__init__()
        self.sig, self.node, self.completed = sig, node, False
        self._private = types.SimpleNamespace(
            utils=types.SimpleNamespace(set_sigterm_handler=lambda h: signal.signal(signal.SIGTERM, h))
        )

    def init(self, address=None, **kw):
        import signal

        self.inits += 1
        self._private.utils.set_sigterm_handler(lambda signum, frame: sys.exit(signum))
        if self.sig is not None:
            signal.raise_signal(self.sig)
        if self.node is not None:
            self.node()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the core worker's failure-signal handler
        self.completed = True


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_during_ray_init_is_taken_when_it_returns_and_ray_is_shut_down(
    listening, build_handlers, sig
):
    """Raised inside ray.init, Ctrl-C left a local instance half started (its agents
    outlived the build for a minute) or a core worker half built (a segfault at exit);
    SIGTERM met Ray's own handler: exit 15, no cleanup. Now the signal is taken when
    ray.init returns, Ray is shut down, and the build's handlers are back in charge."""
    import signal

    from quack_build.build import interrupts
    from quack_build.build.executors.ray import cluster

    signum = getattr(signal, sig)
    fake = _SignalledRay(signum)
    with pytest.raises(KeyboardInterrupt):
        cluster.connect(fake, f"127.0.0.1:{listening}", num_cpus=None, runtime_env={})
    assert fake.completed and (fake.inits, fake.shutdowns) == (1, 1)
    assert interrupts.received() == signum and build_handlers == [128 + signum]  # the watchdog armed
    assert all(signal.getsignal(s) == interrupts._on_signal for s in interrupts.SIGNALS)


def test_after_ray_init_the_build_handlers_are_back_and_a_node_it_left_starting_is_stopped(
    listening, build_handlers
):
    """A connect that works leaves the build's handlers in charge (ray.init's core worker
    installs its own: a SIGTERM during the actors' start-up dumped a stack and exited 1).
    A ray.init that fails while its node starts has the node's processes stopped: Ray
    had not recorded them for ray.shutdown."""
    import signal

    from quack_build.build import interrupts
    from quack_build.build.executors.ray import cluster

    on_signal = interrupts._on_signal
    fake = _SignalledRay()
    assert cluster.connect(fake, f"127.0.0.1:{listening}", num_cpus=None, runtime_env={})
    assert all(signal.getsignal(s) == on_signal for s in interrupts.SIGNALS)
    assert fake.shutdowns == 0 and build_handlers == []

    killed = []

    class Node:
        def __init__(self):
            self.all_processes = {"gcs_server": 1, "raylet": 2}
            raise ConnectionError("the raylet did not register")

        def kill_all_processes(self, **kw):
            killed.append(sorted(self.all_processes))

    fake = _SignalledRay(node=Node)
    with pytest.raises(ExecutorError, match="the raylet did not register"):
        cluster.connect(fake, f"127.0.0.1:{listening}", num_cpus=None, runtime_env={})
    assert killed == [["gcs_server", "raylet"]] and fake.shutdowns == 1
    assert all(signal.getsignal(s) == on_signal for s in interrupts.SIGNALS)


def test_awaited_keys_take_no_worker_slot_nor_a_place_in_the_window(tmp_path):
    """Keys another process holds the lock of are awaited: no worker slot (the display's
    rows), not in the submit window (jobs + 2), not in the workers' busy time."""
    cfgs = [_cfg(b) for b in (32, 64, 128, 256, 512)]
    store = DiskStore(tmp_path / "cache", fsync=False)
    tasks = planning.plan(cfgs, store)
    keys = [t.cfg.key for t in tasks]  # no known times: manifest order
    ex = ScriptedExecutor(
        [
            [Event(STARTED, keys[i], t_start=1000.0, awaited=True) for i in range(3)],
            [Event(STARTED, keys[3], pid=7, t_start=1000.0)],
            [Event(DONE, k, t_start=1000.0) for k in keys[:3]]
            + [Event(DONE, keys[3], pid=7, compiled=True, wall_s=1.0)],
            [Event(STARTED, keys[4], pid=7), Event(DONE, keys[4], pid=7, compiled=True, wall_s=1.0)],
        ],
        jobs=1,
    )
    rep = Recorder()
    res = scheduler.BuildSession(
        tasks, store, scheduler.BuildOptions(jobs=1, reporter=rep, executor=ex, order="given")
    ).run()
    # the window (3) was full of awaited keys after the first poll: the next two went out anyway
    assert ex.submitted == keys and not ex.script
    assert [slot for _, slot in rep.started_lanes] == [-1, -1, -1, 0, 0]
    assert res.count(results.SHARED) == 3 and res.count(results.COMPILED) == 2
    assert [t.awaited for t in res.tasks] == [True, True, True, False, False]
    assert res.busy_s == 2.0  # the two compiles; not the three waits
    assert [k.get("awaited") for k in res.to_json()["keys"]] == [True, True, True, None, None]


def test_live_display_shows_a_key_awaited_on_another_process_lock():
    import io
    import time

    from rich.console import Console

    from quack_build.build import progress

    con = Console(file=io.StringIO(), force_terminal=True, width=240)
    rep = progress.LiveReporter(con)
    a, b = results.Task(_cfg(64)), results.Task(_cfg(128))
    rep.planned([a, b], [a, b], 1)
    try:
        a.awaited, a.start, a.slot = True, time.time(), -1
        b.start, b.slot = time.time(), 0
        rep.started(a)
        rep.started(b)
        assert rep.live is not None
        out = Console(file=io.StringIO(), width=400)
        out.print(rep.live.get_renderable())
        text = out.file.getvalue()
    finally:
        rep.close()
    rows = text.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["worker", "waiting"], text  # not a worker's row
    assert f"{a.cfg.label()}: another process holds its lock" in text, text


# --- what ships to the actors: a dotted kernel package ships its top-level package ----------


def test_a_dotted_kernel_package_ships_its_top_level_package_once(tmp_path, monkeypatch):
    """``kernel_packages = ["pkg.sub"]``: the actors import ``pkg.sub`` through ``pkg``, so
    ``pkg`` is what ships (a directory named "pkg.sub" was shipped, and every actor failed
    "No module named 'pkg'"); ``pkg`` listed again, or another of its submodules, ships
    nothing more. A namespace package's portions merge into the one copy shipped."""
    import shutil
    from pathlib import Path

    from quack_build.build.executors.ray.cluster import stage_packages

    root = tmp_path / "pkgs"
    (root / "tsp_pkg" / "inner").mkdir(parents=True)
    (root / "tsp_pkg" / "__init__.py").write_text("")
    (root / "tsp_pkg" / "sub.py").write_text("X = 1\n")
    (root / "tsp_pkg" / "inner" / "__init__.py").write_text("")
    for portion, mod in (("a", "left"), ("b", "right")):  # tsp_ns: a namespace package in two places
        (tmp_path / portion / "tsp_ns").mkdir(parents=True)
        (tmp_path / portion / "tsp_ns" / f"{mod}.py").write_text("")
        monkeypatch.syspath_prepend(str(tmp_path / portion))
    monkeypatch.syspath_prepend(str(root))
    stage, mods = stage_packages(("tsp_pkg.sub", "tsp_pkg.inner", "tsp_pkg", "tsp_ns.left", "tsp_ns.right"))
    try:
        assert mods == [str(Path(stage) / "tsp_pkg"), str(Path(stage) / "tsp_ns")]
        assert sorted(p.name for p in Path(stage).iterdir()) == ["tsp_ns", "tsp_pkg"]
        shipped = Path(stage) / "tsp_pkg"
        assert (shipped / "__init__.py").is_file() and (shipped / "sub.py").read_text() == "X = 1\n"
        assert (shipped / "inner" / "__init__.py").is_file()
        assert sorted(p.name for p in (Path(stage) / "tsp_ns").iterdir()) == ["left.py", "right.py"]
    finally:
        shutil.rmtree(stage)
    with pytest.raises(ExecutorError, match="cannot ship the package 'tsp_pkg.nope'"):
        stage_packages(("tsp_pkg.nope",))


# --- the Ray executor's bookkeeping, on a fake Ray: actors that keep dying ----------------------


class _Ref:
    def __init__(self, value=None, error: BaseException | None = None):
        self.value, self.error = value, error


class _DyingRay:
    """Just enough of ``ray`` for RayExecutor: an actor is warm at once, and every compile
    kills the actor running it (a kernel that SIGKILLs its compile process)."""

    class exceptions:
        """ray.exceptions' four actor-loss errors, which RayExecutor catches by name."""

        class RayActorError(Exception):
            """An actor died (the one raised here: its compile killed it)."""

        class WorkerCrashedError(Exception):
            """Ray's worker process crashed."""

        class ObjectLostError(Exception):
            """A result's object was lost with its node."""

        class NodeDiedError(Exception):
            """The actor's node died."""

    def __init__(self, stamp: str):
        self.stamp = stamp
        self.pids = iter(range(101, 1000))
        self.killed = 0
        self.shutdowns = 0

    def remote(self, cls):
        ray = self

        class Handle:
            def __init__(self):
                pid = next(ray.pids)
                self.hello = types.SimpleNamespace(
                    remote=lambda: _Ref({"stamp": ray.stamp, "pid": pid, "node": "n", "warm_s": 0.1})
                )
                self.build = types.SimpleNamespace(
                    remote=lambda payload: _Ref(error=ray.exceptions.RayActorError(f"actor pid {pid} died"))
                )

        return types.SimpleNamespace(options=lambda **kw: types.SimpleNamespace(remote=lambda *a: Handle()))

    def wait(self, refs, num_returns=1, timeout=None):
        return list(refs), []

    def get(self, ref):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def kill(self, handle, no_restart=True):
        self.killed += 1

    def cluster_resources(self):
        return {"CPU": 1}

    def shutdown(self):
        self.shutdowns += 1


def _dying_ray_executor(tmp_path, monkeypatch):
    """A one-job RayExecutor over ``_DyingRay`` (no Ray started, nothing staged) and its
    store: (the fake ray, the executor, the store)."""
    pytest.importorskip("ray", reason="the [ray] extra is not installed")
    from quack.cache import keys as qkeys
    from quack_build.build.executors.ray import executor as rex

    fake = _DyingRay(qkeys.toolchain_stamp("sm_90a"))
    monkeypatch.setattr(rex, "import_ray", lambda local_only=False: fake)
    monkeypatch.setattr(rex, "stage_packages", lambda names: ("", []))
    monkeypatch.setattr(rex, "connect", lambda ray, target, **kw: "fake:1")
    s = settings.resolve({"cache_dir": str(tmp_path / "c")}, cwd=tmp_path, env={})
    store = DiskStore(tmp_path / "c", fsync=False)
    return fake, rex.RayExecutor("ray", jobs=1, settings=s, store=store), store


@pytest.mark.parametrize("keep_going", [True, False])
def test_ray_actors_dying_past_the_replacement_budget_fail_the_queued_keys_with_a_summary(
    tmp_path, monkeypatch, keep_going
):
    """Every compile kills its actor: once the replacement budget is spent and no actor is
    left, the keys still queued fail, not built, naming the budget and the last death; the
    build ends with its result (--keep-going: every key reported; without: it stops at the
    first failure, the rest not built). It raised "no Ray actor became ready ... within
    600 s; does the cluster have free CPUs?": no summary, the good keys never tried."""
    fake, ex, store = _dying_ray_executor(tmp_path, monkeypatch)  # MAX_RETRIES: 2
    cfgs = [_cfg(b) for b in (32, 64, 128, 256, 512)]
    tasks = planning.plan(cfgs, store)
    res = scheduler.BuildSession(
        tasks,
        store,
        scheduler.BuildOptions(
            jobs=1, reporter=Recorder(), keep_going=keep_going, executor=ex, order="given"
        ),
    ).run()
    st = res.executor_stats
    # the budget: 2 * jobs + 2 * MAX_RETRIES + 2 = 8 actors in all, each killed by its compile
    assert st["actors_started"] == st["actor_deaths"] == 8 and fake.killed == 8 and fake.shutdowns == 1
    by_key = {t.cfg.key: (t.status, t.error, t.failure) for t in res.tasks}
    got = [by_key[c.key] for c in cfgs]
    # two keys tried on 3 actors each; the third died on the last 2 and its retry found none left
    for status, error, failure in got[:2]:
        assert (status, failure) == (results.FAILED, "compile")
        assert error.startswith("the Ray actors compiling it died 3 times")
    spent = (
        "WorkersLost: no Ray actor left: the replacement budget is exhausted after 8 actor "
        "deaths (last: actor 8 (n pid 108): RayActorError: actor pid 108 died)"
    )
    lost = [g for g in got[2:] if g[0] == results.FAILED]
    assert lost and all(error.startswith(spent) and failure == "no_worker" for _, error, failure in lost)
    # --keep-going: the rest reported (failed, not built); without: it stopped at the first
    # failure, and the keys never submitted are not built
    assert [g[0] for g in got[3:]] == [results.FAILED if keep_going else results.SKIPPED] * 2
    assert len(lost) == (3 if keep_going else 1)
    # the summary lists them apart from the compile failures
    import io

    from rich.console import Console

    from quack_build.build import progress

    con = Console(file=io.StringIO(), width=400)
    progress.print_summary(con, res)
    text = con.file.getvalue()
    assert "2 configurations failed to compile:" in text
    n = len(lost)
    assert f"{n} configuration{'s' if n > 1 else ''} not built: no worker left (the executor lost" in text
    assert not res.ok and len(res.missing_after) == 5
