"""For the Ctrl-C / SIGTERM / time-out tests: a kernel package that stops in a chosen
phase of `quack build` and says so with a marker file (tests wait on that event, never
on a sleep), the processes left in a build's session, deadlines that scale with the
machine's load, and a fixture that oversubscribes the CPUs on purpose (a user's laptop
or a CI runner is busy: a Ctrl-C test that passed only on a quiet machine proved
nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent

# Stops where QGATE_BLOCK (comma-separated) says, writing "<phase>-<pid>" in QGATE_MARKS
# first, until "release" appears there (bounded: a test that forgets it cannot hang):
#   import  - the build process importing the kernel packages (settings, planning ahead);
#   preload - the compile forkserver's preload (worker start-up);
#   compile - a worker compiling qgate(n) (which then compiles a real toy_scale).
# QGATE_STUCK_THREAD=1: the build process also starts a non-daemon thread blocked for ever
# in a read, as a library's stuck thread would be: interpreter exit joins it.
GATE_PKG = """
import os
import sys
import threading
import time

from quack import jit_cache
from quack.params import Int

MARKS = os.environ.get("QGATE_MARKS", "")
BLOCK = set(filter(None, os.environ.get("QGATE_BLOCK", "").split(",")))


def _gate(phase):
    if phase not in BLOCK or not MARKS:
        return
    open(os.path.join(MARKS, "%s-%d" % (phase, os.getpid())), "w").close()
    end = time.monotonic() + 300
    while time.monotonic() < end and not os.path.exists(os.path.join(MARKS, "release")):
        time.sleep(0.05)


if "quack.compile._preload" in sys.modules:
    _gate("preload")
else:
    _gate("import")
    if os.environ.get("QGATE_STUCK_THREAD") == "1":
        _r, _w = os.pipe()
        threading.Thread(target=os.read, args=(_r, 1), name="stuck-library-thread").start()


@jit_cache("qgate", params={"n": Int(min=0, max=100)})
def qgate(n: int):
    _gate("compile")
    import toykernels

    return toykernels.toy_scale.compile_uncached("float16", 32 * (n + 1), False)
"""


def write_gate_project(d: Path, n=(1, 2), extra_manifest: str = "") -> tuple[Path, Path, Path]:
    """(project dir, package dir for PYTHONPATH, marks dir) of a project building qgate."""
    pkgs = d / "pkgs"
    (pkgs / "qgate").mkdir(parents=True)
    (pkgs / "qgate" / "__init__.py").write_text(GATE_PKG)
    proj = d / "proj"
    proj.mkdir()
    (proj / "quack.toml").write_text(
        '[build]\nkernel_packages = ["toykernels", "qgate"]\nmanifests = ["m.toml"]\n'
        '[runtime]\narch = "sm_90a"\n'
    )
    ns = ", ".join(str(i) for i in n)
    (proj / "m.toml").write_text(
        f'[[kernel]]\nname = "qgate"\narchs = ["sm_90a"]\nparams = {{ n = [{ns}] }}\n{extra_manifest}'
    )
    marks = d / "marks"
    marks.mkdir()
    return proj, pkgs, marks


def gate_env(cache: Path, pkgs: Path, marks: Path, block: str, **extra: str) -> dict:
    env = dict(os.environ)
    env.pop("COLUMNS", None)
    env.update(
        QUACK_CACHE_DIR=str(cache),
        PYTHONPATH=os.pathsep.join(
            p for p in (str(pkgs), str(TESTS), str(ROOT), env.get("PYTHONPATH", "")) if p
        ),
        QGATE_MARKS=str(marks),
        QGATE_BLOCK=block,
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def load_factor() -> float:
    """How much slower than a quiet machine this one runs now (1 when quiet)."""
    try:
        return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    except OSError:
        return 1.0


def scaled(seconds: float) -> float:
    """A deadline for something that takes ``seconds`` at most on a quiet machine."""
    return seconds * load_factor()


def wait_for(pred: Callable, timeout: float, what: str = ""):
    """Poll ``pred`` until it returns something truthy (returned) or ``timeout`` passes."""
    end = time.monotonic() + timeout
    while True:
        got = pred()
        if got or time.monotonic() > end:
            return got
        time.sleep(0.05)


def session_processes(sid: int) -> list[str]:
    """The live (not zombie) processes of session ``sid``, as "pid command" lines."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(f"{d.name} {cmd[:120]}")
    return out


BUSY_LOOP = "import time\nend = time.monotonic() + 900\nwhile time.monotonic() < end:\n    pass\n"


class BusyLoops:
    """Two busy loops per CPU, at most eight (each one bounded at 900 s in case its owner's
    teardown never runs), started by ``start()`` and killed by ``stop()``."""

    def __init__(self) -> None:
        self.n = min(8, 2 * (os.cpu_count() or 1))
        self.procs: list[subprocess.Popen] = []

    def start(self) -> int:
        if not self.procs:
            self.procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(self.n)]
        return self.n

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(timeout=30)
        self.procs = []


@pytest.fixture
def busy_machine():
    """Oversubscribe the CPUs for the test's whole duration."""
    loops = BusyLoops()
    try:
        yield loops.start()
    finally:
        loops.stop()


@pytest.fixture
def busy_loops():
    """Busy loops the test starts (and may stop) itself around the phase whose timing it
    checks: a set-up or a final rebuild under four busy loops on 2 cores took a minute
    of the suite's time and proved nothing more (issue 25). Killed at teardown."""
    loops = BusyLoops()
    try:
        yield loops
    finally:
        loops.stop()
