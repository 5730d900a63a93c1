"""`quack build`: real compiles of the toy kernels for sm_90a on CPU, through typer's
test runner and as real subprocesses. Counts are asserted, never durations."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from interrupt_support import busy_machine, scaled, wait_for
from typer.testing import CliRunner

from quack import settings
from quack_build.build import interrupts
from quack_build.cli.app import app

__all__ = ["busy_machine"]  # the fixture, used by name

TESTS = Path(__file__).parent
ROOT = TESTS.parent
runner = CliRunner()

TOY3 = """
[defaults]
archs = ["sm_90a"]
[[kernel]]
name = "toy_scale"
params = { dtype = "float16", block = [64, 128, 256] }
"""

SLOW_PKG = """
from quack import jit_cache
from quack.params import Int

@jit_cache("qbt_slow", params={"n": Int(min=0, max=100)})
def qbt_slow(n: int):
    import os
    import time

    if os.environ.get("QBT_MARKS"):  # the event a Ctrl-C test waits for: this compile runs
        open(os.path.join(os.environ["QBT_MARKS"], "%d-%d" % (n, os.getpid())), "w").close()
    time.sleep(120)
"""


def write_project(d: Path, manifest: str = TOY3, packages=("toykernels",), manifests=("m.toml",)) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    pk = ", ".join(f'"{p}"' for p in packages)
    ms = ", ".join(f'"{m}"' for m in manifests)
    (d / "quack.toml").write_text(
        f'[build]\nkernel_packages = [{pk}]\nmanifests = [{ms}]\n[runtime]\narch = "sm_90a"\n'
    )
    (d / "m.toml").write_text(manifest)
    return d


@pytest.fixture
def project(tmp_path, monkeypatch):
    d = write_project(tmp_path / "proj")
    monkeypatch.chdir(d)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "cache"))
    saved = settings.installed()
    yield d
    settings.set_current(saved)


def sub_env(cache: Path, extra_path: str = "") -> dict:
    env = dict(os.environ)
    env["QUACK_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (extra_path, str(TESTS), str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    env.pop("COLUMNS", None)
    return env


# Runs the CLI and reports whether torch / cutlass got imported into the build process.
WRAP = (
    "import sys\nfrom quack_build.cli.app import app\ntry:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n"
    "    code = e.code\nprint('IMPORTED torch=%s cutlass=%s' % ('torch' in sys.modules, "
    "'cutlass' in sys.modules), file=sys.stderr)\nsys.exit(code)\n"
)


def quack_sub(args, cwd, env, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WRAP, *args], cwd=cwd, env=env, capture_output=True, text=True, **kw
    )


def test_build_cached_rebuild_corrupt(project, tmp_path):
    r = runner.invoke(app, ["build", "-j", "2", "--trace", str(tmp_path / "trace.json")])
    assert r.exit_code == 0, r.output
    out = r.output
    assert "3 configurations, 0 cached, 3 to compile with 2 workers" in out
    assert out.count(" compiled  toy_scale(") == 3  # plain one-line-per-key output (not a TTY)
    assert "quack build summary" in out
    trace = json.loads((tmp_path / "trace.json").read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") == "compiled"]
    assert len(xs) == 3 and len({e["tid"] for e in xs}) <= 2
    assert all(e["args"]["arch"] == "sm_90a" for e in xs)

    r = runner.invoke(app, ["build", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert (res["total"], res["cached"], res["compiled"], res["failed"], res["ok"]) == (3, 3, 0, 0, True)

    # A truncated object counts as missing: quarantined and rebuilt.
    objs = sorted((tmp_path / "cache").glob("v1/*/toy_scale/*/*.o"))
    assert len(objs) == 3
    objs[0].write_bytes(objs[0].read_bytes()[:100])
    r = runner.invoke(app, ["build", "--dry-run", "--json"])
    assert r.exit_code == 0
    dry = json.loads(r.stdout)
    assert (dry["cached"], dry["to_compile"]) == (2, 1)
    r = runner.invoke(app, ["build", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert (res["cached"], res["compiled"]) == (2, 1)
    assert any((tmp_path / "cache" / "quarantine").iterdir())


def test_usage_and_validation_errors(project, tmp_path):
    assert runner.invoke(app, ["build", "--bogus"]).exit_code == 2
    assert runner.invoke(app, ["build", "--jobs", "-3"]).exit_code == 2
    assert runner.invoke(app, ["cache", "clean", "--max-size", "lots"]).exit_code == 2
    bad = tmp_path / "bad.toml"
    bad.write_text('[[kernel]]\nname = "toy_scale"\nparams = { dtype = "int8" }\n')
    r = runner.invoke(app, ["build", str(bad)])
    assert r.exit_code == 1
    assert f'{bad}:1: [[kernel]] #1 (toy_scale): params.dtype = "int8"' in r.output
    assert "nothing was built" in r.output
    syn = tmp_path / "syn.toml"
    syn.write_text('[[kernel]]\nname = "toy_scale\n')
    r = runner.invoke(app, ["verify", str(syn)])
    assert r.exit_code == 1 and f"{syn}:2:" in r.output and "TOML syntax error" in r.output
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("v1/*/*/*/*.o"))
    # No manifest argument and none in quack.toml: a usage error.
    (project / "quack.toml").write_text('[build]\nkernel_packages = ["toykernels"]\n')
    r = runner.invoke(app, ["build"])
    assert r.exit_code == 2 and "no manifest given" in r.output
    r = runner.invoke(app, ["build", str(tmp_path / "missing.toml")])
    assert r.exit_code == 1 and "no such manifest file" in r.output


def test_failure_fail_fast_keep_going_and_log(tmp_path):
    proj = write_project(
        tmp_path / "proj",
        """
[[kernel]]
name = "toy_fail"
params = { boom = true }
[[kernel]]
name = "toy_scale"
archs = ["sm_90a"]
params = { dtype = "float32", block = 32 }
""",
    )
    cache = tmp_path / "cache"
    env = sub_env(cache)
    r = quack_sub(["build", "-j", "1", "--json"], proj, env)
    assert r.returncode == 1, r.stderr
    res = json.loads(r.stdout)
    assert res["failed"] == 1 and not res["ok"]
    assert "IMPORTED torch=False cutlass=False" in r.stderr  # the build process stays light
    assert "FAILED    toy_fail(boom=true) sm_90a" in r.stderr
    assert "toy_fail: boom requested" in r.stderr
    log = Path(res["log"])
    assert log.is_file() and "ValueError: toy_fail: boom requested" in log.read_text()
    assert res["keys"][0]["kernel"] == "toy_fail" and res["keys"][0]["error"]
    r = quack_sub(["build", "-j", "1", "--keep-going", "--json"], proj, env)
    assert r.returncode == 1
    res = json.loads(r.stdout)
    assert res["failed"] == 1 and res["compiled"] + res["cached"] == 1 and res["not_built"] == 0


def test_two_builds_at_once_compile_each_key_once(tmp_path):
    proj = write_project(
        tmp_path / "proj",
        """
[[kernel]]
name = "toy_scale"
archs = ["sm_90a"]
params = { dtype = ["float16", "bfloat16"], block = [64, 128] }
""",
    )
    env = sub_env(tmp_path / "cache")
    cmd = [sys.executable, "-m", "quack_build.cli.main", "build", "-j", "1", "--json"]
    procs = [
        subprocess.Popen(cmd, cwd=proj, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_o, e) in zip(procs, outs):
        assert p.returncode == 0, e
    res = [json.loads(o) for o, _ in outs]
    assert sum(r["compiled"] for r in res) == 4
    for r in res:
        assert r["compiled"] + r["cached"] + r["cached_by_other"] == 4
    metas = [
        m for m in (tmp_path / "cache").glob("v1/*/toy_scale/*/*.json") if not m.name.endswith(".so.json")
    ]
    assert len(metas) == 4


def test_ctrl_c_stops_workers_and_leaves_no_partial_entry(tmp_path, busy_machine):
    pkg = tmp_path / "pkgs" / "qbt_slowpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "slow.py").write_text(SLOW_PKG)
    proj = write_project(
        tmp_path / "proj",
        """
[[kernel]]
name = "qbt_slow"
archs = ["sm_90a"]
params = { n = [1, 2] }
""",
        packages=("qbt_slowpkg",),
    )
    cache = tmp_path / "cache"
    env = sub_env(cache, str(tmp_path / "pkgs"))
    marks = tmp_path / "marks"
    marks.mkdir()
    env["QBT_MARKS"] = str(marks)
    p = subprocess.Popen(
        [sys.executable, "-m", "quack_build.cli.main", "build", "-j", "2", "-v"],
        cwd=proj,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    deadline = time.monotonic() + scaled(120)
    while time.monotonic() < deadline:
        ln = p.stdout.readline()
        if not ln:
            break
        lines.append(ln)
        if "start     qbt_slow" in ln:
            break
    assert any("start     qbt_slow" in ln for ln in lines), "".join(lines)
    # The event, not a sleep: a worker is inside the compile.
    assert wait_for(lambda: list(marks.iterdir()), scaled(60)), "".join(lines)
    p.send_signal(signal.SIGINT)
    try:
        out, _ = p.communicate(timeout=scaled(30) + interrupts.GRACE_S)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=60)
    text = "".join(lines) + out
    assert p.returncode == 130, text
    assert "interrupted" in text
    assert not [m for m in cache.glob("v1/*/qbt_slow/*/*.json") if not m.name.endswith(".so.json")]
    assert not list(cache.glob("v1/*/qbt_slow/*/*.o"))
    assert not list(cache.glob("v1/*/qbt_slow/*/*.tmp-*"))


def test_commands_register_in_the_order_help_lists_them():
    import typer

    from quack_build.cli import app

    group = typer.main.get_command(app.app)
    assert list(group.commands) == [
        "build",
        "verify",
        "keygen",
        "prewarm",
        "bundle",
        "bundle-inspect",
        "tune",
        "cache",
    ]
    assert [n for n, c in group.commands.items() if c.hidden] == ["bundle-inspect"]
    assert list(group.commands["cache"].commands) == ["stats", "clean", "pull", "push"]
