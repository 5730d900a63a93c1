"""`quack build --executor ray`: real builds on a real two-node Ray cluster (both nodes
on 127.0.0.1, one CPU each), started once for this module. The builds run as real
`quack build` subprocesses connecting by address (the coordinator starts its own Ray
driver, as a user's would); compiles are real CuTe DSL compiles for sm_90a on CPU.
Counts and contents are asserted; the one time bound is the issue's (unreachable
address: an error within 10 s)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from interrupt_support import busy_loops, scaled
from test_cli_build import quack_sub, sub_env, write_project
from typer.testing import CliRunner

from quack import settings
from quack.cache import keys
from quack.cache.store import DiskStore
from quack.compile import builder
from quack_build.build import interrupts

__all__ = ["busy_loops"]  # the fixture, used by name

# Ray rewrites a 127.0.0.1 address to the host's outward IP (where our loopback-only test
# cluster does not listen) unless multi-host clusters are off: off for this process (set
# before ray is imported) and for the `quack build` subprocesses (sub_env copies os.environ).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

TESTS = Path(__file__).parent
ROOT = TESTS.parent

# A kernel that marks when (and in which process) its compile starts, then takes a
# few seconds: time to kill or interrupt the actor compiling it.
SLOW_PKG = """
import os
import time

from quack import jit_cache
from quack.params import Int

MARKS = {marks!r}


@jit_cache("qrt_slow", params={{"n": Int(min=0, max=100)}})
def qrt_slow(n: int):
    open(os.path.join(MARKS, "%d-%d" % (n, os.getpid())), "w").close()
    time.sleep({sleep})
    import toykernels

    return toykernels.toy_scale.compile_uncached("float16", 32 * (n + 1), False)
"""

SLOW_MANIFEST = """
[[kernel]]
name = "qrt_slow"
archs = ["sm_90a"]
params = { n = [1, 2] }
"""


def build_json(r) -> dict:
    """The build's --json result; when there is none (it stopped before building: e.g. once
    under load, through Ray Client, with exit 1 and empty stdout), the failure shows why."""
    assert r.stdout.strip(), f"no JSON result (exit {r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(r.stdout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """Two nodes of one CPU each, loopback only; a Ray Client server on the head."""
    from ray.cluster_utils import Cluster

    client_port = _free_port()
    c = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "num_cpus": 1,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
            "ray_client_server_port": client_port,
        },
    )
    try:
        c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        yield {"gcs": c.address, "client": f"ray://127.0.0.1:{client_port}"}
    finally:
        c.shutdown()


@pytest.fixture
def cluster(ray_cluster) -> str:
    """The cluster's GCS address (HOST:PORT)."""
    return ray_cluster["gcs"]


def slow_project(tmp_path: Path, sleep: float):
    marks = tmp_path / "marks"
    marks.mkdir()
    pkg = tmp_path / "pkgs" / "qrt_slowpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "slow.py").write_text(SLOW_PKG.format(marks=str(marks), sleep=sleep))
    # A dotted kernel package: the actors get it only by shipping (the cluster's nodes do not
    # have tmp_path on their path), which must send its top-level package, qrt_slowpkg.
    proj = write_project(tmp_path / "proj", SLOW_MANIFEST, packages=("qrt_slowpkg.slow", "toykernels"))
    return proj, marks, sub_env(tmp_path / "cache", str(tmp_path / "pkgs"))


def wait_for(pred, timeout: float, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    return None


def all_dead(pids) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def objects(cache: Path, kernel: str = "*") -> list[Path]:
    return sorted(cache.glob(f"v1/*/{kernel}/*/*.o"))


def entries(cache: Path, kernel: str = "*") -> list[Path]:
    return [m for m in cache.glob(f"v1/*/{kernel}/*/*.json") if not m.name.endswith(".so.json")]


# --- the default manifest, bit for bit ---------------------------------------------------------


def _default_manifest_sample(tmp_path, per_kernel: int = 2):
    """The first ``per_kernel`` configurations of each kernel of the default manifest, as a
    manifest file, and their configs. Bit identity is a property of the executor's path;
    two configurations of each kernel cover every kernel's code generation on both actors.
    All 51 were the suite's longest test (184-325 s of the 2-core suite's critical path,
    issue 25: the CPU suite in 6 minutes)."""
    import tomli_w

    from quack.manifest_line import manifest_entries
    from quack_build.cli.context import load_kernels
    from quack_build.manifest.read import expand

    settings.set_current(None)
    s = settings.resolve(cwd=ROOT)
    load_kernels(s)
    picked: dict[str, list] = {}
    for c in expand(s.manifest_paths(), archs=s.build_archs()).configs:
        if len(picked.setdefault(c.kernel, [])) < per_kernel:
            picked[c.kernel].append(c)
    configs = [c for cs in picked.values() for c in cs]
    path = tmp_path / "default-sample.toml"
    path.write_text(tomli_w.dumps(manifest_entries((c.kernel, c.plain_params, c.arch) for c in configs)))
    return path, configs, s


# A hang guard, not a speed check: its compiles run on two one-CPU actors under the rest of
# the suite's load, and beside four busy loops the default manifest's 51 ran past
# pytest-timeout's 600 s (issue 24 item 4: the suite must pass oversubscribed).
#
# Both actors compile: the build dispatches as soon as its first actor is ready (as it
# should), so under load the second node's actor once said hello after the first had
# compiled all 14 keys, and the spread checks below failed on one node. A preload module
# (imported by each actor as it starts, before its hello) holds each actor until both
# have started, bounded: past the bound the build goes on and the node count fails.
GATE = """
import os, time

MARKS = {marks!r}
open(os.path.join(MARKS, str(os.getpid())), "w").close()
deadline = time.monotonic() + 300
while len(os.listdir(MARKS)) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def gated_project(tmp_path: Path, manifest: Path) -> tuple[Path, dict]:
    """A project building ``manifest`` with the shipped kernels, whose actors start
    together (GATE): the gate ships as a kernel package; its module is private (``_``),
    so the kernel scan of the coordinator never imports it, only the actors' preload."""
    marks = tmp_path / "gate-marks"
    marks.mkdir()
    pkg = tmp_path / "gatepkgs" / "qrt_gate"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_both.py").write_text(GATE.format(marks=str(marks)))
    proj = write_project(tmp_path / "proj", manifest.read_text(), packages=("quack_kernels", "qrt_gate"))
    toml = proj / "quack.toml"
    toml.write_text(toml.read_text().replace("[build]\n", '[build]\npreload = ["qrt_gate._both"]\n'))
    return proj, sub_env(tmp_path / "cache", str(tmp_path / "gatepkgs"))


@pytest.mark.timeout(1800)
def test_default_manifest_through_ray_is_bit_identical_to_local(cluster, tmp_path):
    sample, configs, s = _default_manifest_sample(tmp_path)
    assert len(configs) == 14 and len({c.kernel for c in configs}) == 7
    cache = tmp_path / "cache"
    proj, env = gated_project(tmp_path, sample)
    trace = tmp_path / "trace.json"
    r = quack_sub(
        ["build", "--executor", cluster, "--json", "--trace", str(trace)],
        proj,
        env,
        timeout=1500,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "IMPORTED torch=False cutlass=False" in r.stderr  # the coordinator stays light
    res = build_json(r)
    assert res["executor"] == "ray" and res["ok"] and res["failed"] == 0
    assert res["compiled"] == res["total"] > 0
    st = res["executor_stats"]
    assert res["preload"] == ["qrt_gate._both"] and len(list((tmp_path / "gate-marks").iterdir())) == 2
    assert len(st["nodes"]) == 2 and st["actors_refused"] == 0 and st["published"] == res["compiled"]
    # Per-actor lanes in the trace: one per actor that compiled, named by node and pid.
    doc = json.loads(trace.read_text())
    lanes = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name" and e["tid"]]
    assert len(lanes) == 2 and all(n.startswith("actor ") and " pid " in n for n in lanes)
    assert {k["lane"] for k in res["keys"]} == set(lanes)

    # The reference: the local executor's objects for the same keys (the session's cache
    # when it holds them all, e.g. after CI's `quack build`; else built here).
    ray_store = DiskStore(cache, fsync=False)
    ref_store = DiskStore(Path(os.environ.get("QUACK_CACHE_DIR") or s.cache_dir), fsync=False)
    refs = [builder.entry_ref(c.spec, c.params, c.arch) for c in configs]
    if any(ref_store.lookup(ref) is None for ref in refs):
        local = tmp_path / "local"
        r2 = quack_sub(
            ["build", str(sample), "--executor", "local", "--json"], ROOT, sub_env(local), timeout=900
        )
        assert r2.returncode == 0, r2.stderr[-3000:]
        ref_store = DiskStore(local, fsync=False)
    for ref in refs:
        mine, theirs = ray_store.lookup(ref), ref_store.lookup(ref)
        assert mine is not None and theirs is not None, ref
        assert (
            hashlib.sha256(mine.obj_path.read_bytes()).digest()
            == hashlib.sha256(theirs.obj_path.read_bytes()).digest()
        ), ref
        assert mine.meta["executor"] == "ray" and mine.so_path is not None
    assert len(refs) == res["total"]


# --- failures -----------------------------------------------------------------------------------


def test_actor_killed_mid_compile_is_retried_on_another_actor(cluster, tmp_path):
    proj, marks, env = slow_project(tmp_path, sleep=3)
    p = subprocess.Popen(
        [sys.executable, "-m", "quack_build.cli.main", "build", "--executor", cluster, "--json"],
        cwd=proj,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = wait_for(lambda: sorted(marks.iterdir()), timeout=240)
        assert first, "no compile started"
        n, pid = (int(x) for x in first[0].name.split("-"))
        os.kill(pid, signal.SIGKILL)  # the actor's process, mid-compile
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err[-3000:]
    res = json.loads(out)
    assert res["compiled"] == 2 and res["failed"] == 0 and res["ok"]
    assert res["executor_stats"]["actor_deaths"] == 1 and res["executor_stats"]["retries"] == 1
    assert "died while compiling qrt_slow" in err and "retrying on another actor (retry 1 of 2)" in err
    again = [m for m in marks.iterdir() if m.name.startswith(f"{n}-")]
    assert len(again) == 2 and f"{n}-{pid}" in {m.name for m in again}  # ran again, elsewhere
    assert len(entries(tmp_path / "cache", "qrt_slow")) == 2


def test_failing_config_exit_1_with_compiler_message_keep_going_builds_the_rest(ray_cluster, tmp_path):
    """Through Ray Client (ray://HOST:PORT) this time."""
    proj = write_project(
        tmp_path / "proj",
        """
[[kernel]]
name = "toy_fail"
params = { boom = true }
[[kernel]]
name = "toy_scale"
archs = ["sm_90a"]
params = { dtype = "float32", block = [32, 64] }
""",
    )
    cache = tmp_path / "cache"
    r = quack_sub(
        ["build", "--executor", ray_cluster["client"], "--keep-going", "--json"],
        proj,
        sub_env(cache),
        timeout=600,
    )
    assert r.returncode == 1, r.stderr[-3000:]
    res = build_json(r)
    assert res["failed"] == 1 and res["compiled"] == 2 and res["not_built"] == 0 and not res["ok"]
    assert "FAILED    toy_fail(boom=true) sm_90a" in r.stderr
    assert "ValueError: toy_fail: boom requested" in r.stderr
    assert "ValueError: toy_fail: boom requested" in Path(res["log"]).read_text()
    assert len(entries(cache, "toy_scale")) == 2 and not entries(cache, "toy_fail")


def test_ctrl_c_kills_the_actors_and_leaves_no_partial_entry(cluster, tmp_path, busy_loops):
    proj, marks, env = slow_project(tmp_path, sleep=60)
    p = subprocess.Popen(
        [sys.executable, "-m", "quack_build.cli.main", "build", "--executor", cluster, "-v"],
        cwd=proj,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        started = wait_for(lambda: sorted(marks.iterdir()), timeout=scaled(240))
        assert started, "no compile started"
        # The signal and the shutdown run on an oversubscribed machine (issue 24: on a busy
        # one the build outlived the time-out after SIGINT). The start-up before it is only
        # waited for: under the loops it took a minute of the suite's time.
        busy_loops.start()
        p.send_signal(signal.SIGINT)
        # Within the interrupt's grace (quack_build.build.interrupts): past it the build stops itself.
        out, _ = p.communicate(timeout=scaled(60) + interrupts.GRACE_S)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 130, out[-3000:]
    assert "interrupted" in out
    cache = tmp_path / "cache"
    assert not entries(cache, "qrt_slow") and not objects(cache, "qrt_slow")
    assert not list(cache.glob("v1/*/qrt_slow/*/*.tmp-*"))
    pids = [int(m.name.split("-")[1]) for m in marks.iterdir()]

    assert wait_for(lambda: all_dead(pids), timeout=30), f"actors {pids} still compiling after Ctrl-C"


def test_a_cluster_build_fills_the_signed_remote_cache(cluster, tmp_path):
    """The coordinator publishes what the actors compiled, then signs and pushes it to the
    remote (file:// here); another machine's build then pulls every key, compiling none."""
    from quack import signing

    keydir = tmp_path / "keys"
    signing.write_keypair("ci-1", keydir)
    (tmp_path / "team-cache").mkdir()
    remote = f"file://{tmp_path / 'team-cache'}"
    proj = write_project(
        tmp_path / "proj",
        """
[[kernel]]
name = "toy_scale"
archs = ["sm_90a"]
params = { dtype = "float32", block = [96, 160] }
""",
    )

    def env(cache: Path, write: bool) -> dict:
        e = sub_env(cache)
        e.update(QUACK_REMOTE=remote, QUACK_TRUSTED_KEYS=str(keydir / "ci-1.pub"))
        if write:
            e.update(QUACK_REMOTE_WRITE="1", QUACK_SIGNING_KEY=str(keydir / "ci-1.key"))
        return e

    r = quack_sub(["build", "--executor", cluster, "--json"], proj, env(tmp_path / "c1", True), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = build_json(r)
    assert res["executor"] == "ray" and res["compiled"] == 2 and res["remote_pushed"] == 2
    assert {k["remote_push"] for k in res["keys"]} == {"pushed"}
    r = quack_sub(["build", "--json"], proj, env(tmp_path / "c2", False), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = build_json(r)
    assert res["remote_hits"] == 2 and res["compiled"] == 0
    assert sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in objects(tmp_path / "c1")) == sorted(
        hashlib.sha256(p.read_bytes()).hexdigest() for p in objects(tmp_path / "c2")
    )


def test_compile_past_the_time_out_kills_its_actor_and_fails_the_key(cluster, tmp_path):
    proj, marks, env = slow_project(tmp_path, sleep=120)
    env["QUACK_COMPILE_TIMEOUT"] = "3"
    r = quack_sub(["build", "--executor", cluster, "--keep-going", "--json"], proj, env, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    res = build_json(r)
    assert res["failed"] == 2 and res["compiled"] == 0 and res["executor_stats"]["timeouts"] == 2
    assert all(
        "CompileTimeout: compile of qrt_slow key" in k["error"] and "still unfinished after 3 s" in k["error"]
        for k in res["keys"]
    ), res["keys"]
    pids = [int(m.name.split("-")[1]) for m in marks.iterdir()]
    assert len(pids) == 2

    assert wait_for(lambda: all_dead(pids), timeout=30), f"wedged actors {pids} still running"
    assert not objects(tmp_path / "cache", "qrt_slow")


def test_toolchain_stamp_mismatch_is_refused_naming_both(cluster, tmp_path, monkeypatch):
    from quack_build.build.executors.ray import executor as ray_executor
    from quack_build.cli.app import app

    proj = write_project(tmp_path / "proj")
    monkeypatch.chdir(proj)
    cache = tmp_path / "cache"
    monkeypatch.setenv("QUACK_CACHE_DIR", str(cache))
    fake = "py3.11-cutlass0.0.1-cu12-tvmffi0.0.1-sm_90a"
    monkeypatch.setattr(ray_executor, "TEST_ACTOR_STAMP", fake)
    saved = settings.installed()
    try:
        r = CliRunner().invoke(app, ["build", "--executor", cluster, "-j", "2"])
    finally:
        settings.set_current(saved)
        if ray.is_initialized():
            ray.shutdown()
    assert r.exit_code == 1, r.output
    mine = keys.toolchain_stamp("sm_90a")
    assert f"its toolchain stamp is {fake!r} but this coordinator's is {mine!r}" in r.output
    assert "every actor refused: nothing built" in r.output
    assert not objects(cache)


# `quack build`, stopped inside ray.init where its local instance's processes (GCS, raylet,
# and the raylet's agents) are up but not yet recorded for ray.shutdown (the node waits to
# register): a marker, then a wait for the test's "release" (bounded: a test that forgets it
# cannot hang).
GATE_RAY_INIT = """
import os, sys, time
import ray._private.services as services

marks, real = sys.argv.pop(1), services.get_node


def gated(*a, **k):
    open(os.path.join(marks, "in-ray-init"), "w").close()
    end = time.monotonic() + 120
    while time.monotonic() < end and not os.path.exists(os.path.join(marks, "release")):
        time.sleep(0.05)
    return real(*a, **k)


services.get_node = gated
from quack_build.cli.main import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_during_ray_init_ends_the_build_with_its_exit_code_and_no_ray_process_left(tmp_path, sig):
    """Ctrl-C (SIGINT to the process group) or SIGTERM (to the build) while ray.init starts
    the build's local instance. Ctrl-C left the raylet's agents running for a minute;
    SIGTERM met Ray's own handler (exit 15, no cleanup). Now: 130 / 143, "interrupted",
    nothing of the instance left in the build's session."""
    from interrupt_support import session_processes

    signum = getattr(signal, sig)
    marks = tmp_path / "marks"
    marks.mkdir()
    proj = write_project(tmp_path / "proj")
    env = sub_env(tmp_path / "cache")
    env.pop("RAY_ADDRESS", None)
    p = subprocess.Popen(
        [sys.executable, "-c", GATE_RAY_INIT, str(marks), "build", "--executor", "ray", "-j", "1"],
        cwd=proj,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own session: what is left of it can be listed
    )
    try:
        assert wait_for(lambda: (marks / "in-ray-init").exists(), timeout=scaled(120)), "ray.init not reached"
        if signum == signal.SIGINT:
            os.killpg(p.pid, signum)  # as a terminal's Ctrl-C
        else:
            os.kill(p.pid, signum)
        (marks / "release").touch()
        out, _ = p.communicate(timeout=scaled(60) + interrupts.GRACE_S)
    finally:
        (marks / "release").touch()
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 128 + signum, out[-3000:]
    assert "interrupted" in out and "Traceback" not in out and "SIGTERM received" not in out, out[-3000:]
    left = wait_for(lambda: not session_processes(p.pid), timeout=scaled(15))
    assert left, f"left after {sig}: {session_processes(p.pid)}"


@pytest.mark.parametrize("form", ["ray://127.0.0.1:{port}", "127.0.0.1:{port}"])
def test_unreachable_address_is_a_clear_error_within_10s(tmp_path, form):
    proj = write_project(tmp_path / "proj")
    address = form.format(port=_free_port())
    t0 = time.monotonic()
    r = quack_sub(["build", "--executor", address], proj, sub_env(tmp_path / "cache"), timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    assert f"error: cannot reach the Ray cluster at {address}: Connection refused" in r.stderr
    assert "--executor local" in r.stderr
    assert took < scaled(10), took
    assert not objects(tmp_path / "cache")


def test_executor_ray_from_the_setting_starts_a_local_instance_with_preload_and_stops_it(tmp_path):
    """The `[build] executor` setting (not the flag) with no cluster address starts a local
    Ray instance (2 CPUs here) and stops it: none of its processes outlive the build. Its
    actors import the `[build] preload` modules once each, at their start, and the build
    reports the time (issue 27). One test: each local instance costs ~40 s of the 2-core
    suite (issue 25), and the two checks were two such starts."""
    pkgs = tmp_path / "pkgs"
    pkgs.mkdir()
    marks = tmp_path / "marks"
    marks.mkdir()
    # The "heavy library": marks which process imported it (a file per import).
    (pkgs / "tpq_heavy.py").write_text(
        "import os, tempfile, time\n"
        f"tempfile.NamedTemporaryFile(dir={str(marks)!r}, prefix='%d-' % os.getpid(), delete=False)\n"
        "time.sleep(0.2)\n"
    )
    proj = write_project(
        tmp_path / "proj",
        """
[[kernel]]
name = "toy_scale"
archs = ["sm_90a"]
params = { dtype = "bfloat16", block = [64, 128, 256, 512] }
""",
    )
    toml = proj / "quack.toml"
    toml.write_text(toml.read_text().replace("[build]\n", '[build]\npreload = ["tpq_heavy"]\n'))
    env = sub_env(tmp_path / "cache", str(pkgs))
    env["QUACK_BUILD_EXECUTOR"] = "ray"  # the setting, not the flag
    env.pop("RAY_ADDRESS", None)
    p = subprocess.Popen(
        [sys.executable, "-m", "quack_build.cli.main", "build", "-j", "2", "--json"],
        cwd=proj,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err[-3000:]
    res = json.loads(out)
    assert (res["executor"], res["compiled"], res["jobs"], res["preload"]) == ("ray", 4, 2, ["tpq_heavy"]), (
        res
    )
    assert len(entries(tmp_path / "cache", "toy_scale")) == 4
    assert res["preload_s"] >= 0.2, res  # the module's own sleep, at least
    imports = [int(m.name.split("-")[0]) for m in marks.iterdir()]
    compiled_by = {int(k["worker"]) for k in res["keys"]}
    # Once per actor (at most the 2 started), every actor that compiled among them.
    assert len(imports) == len(set(imports)) <= 2, imports
    assert compiled_by <= set(imports), (compiled_by, imports)

    # Ray names the session it started after the driver's pid: none of its processes
    # (GCS, raylet, workers) outlive the build.
    def leftovers():
        r = subprocess.run(["pgrep", "-f", f"session_[0-9_-]*_{p.pid}/"], capture_output=True, text=True)
        return r.stdout.split()

    assert wait_for(lambda: not leftovers(), timeout=30), leftovers()
