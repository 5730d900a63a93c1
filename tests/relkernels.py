"""Stand-in kernels for the reliability suite: compiles that cost nothing and can be counted.

``rel_copy`` "compiles" by copying a real toy_scale .o (path in QUACK_TEST_OBJ) and
appends one line per compile to QUACK_TEST_COUNTER (O_APPEND: safe across processes),
so tests can count compiles across many processes without paying for real ones.
QUACK_TEST_COMPILE_SLEEP makes each compile take that long (to widen race windows);
QUACK_TEST_EXPORT_ERRNO makes the export write half the file and fail with that errno."""

import multiprocessing
import os
import signal
import time

from quack import jit_cache
from quack.params import Int, Rule


class _Exported:
    def __init__(self, i):
        self.i = i

    def export_to_c(self, object_file_path, function_name):
        with open(os.environ["QUACK_TEST_OBJ"], "rb") as f:
            data = f.read()
        fail = int(os.environ.get("QUACK_TEST_EXPORT_ERRNO", "0"))
        with open(object_file_path, "wb") as f:
            if fail:  # half written, then the disk is full (what a real write reports)
                f.write(data[: len(data) // 2])
                raise OSError(fail, os.strerror(fail))
            f.write(data)

    def __call__(self, *a):  # what an in-process (uncached) compile hands back
        return self.i


@jit_cache("rel_copy", params={"i": Int(min=0, max=100000)})
def rel_copy(i: int = 0):
    counter = os.environ.get("QUACK_TEST_COUNTER")
    if counter:
        fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{os.getpid()} {i}\n".encode())
        finally:
            os.close(fd)
    time.sleep(float(os.environ.get("QUACK_TEST_COMPILE_SLEEP", "0")))
    return _Exported(i)


@jit_cache("rel_fail", params={"i": Int(min=0, max=100000)})
def rel_fail(i: int = 0):
    """rel_copy, except that the configurations listed in QUACK_TEST_FAIL (comma-separated
    ``i`` values) raise inside the compile function, like a kernel the compiler rejects, and
    those in QUACK_TEST_SELFKILL kill their compile worker (SIGKILL) on their first
    QUACK_TEST_SELFKILL_TIMES attempts (default 1)."""
    counter = os.environ.get("QUACK_TEST_FAIL_COUNTER")
    if counter:  # one line per compile attempt, failed or not
        with open(counter, "a") as f:
            f.write(f"{os.getpid()} {i}\n")
    if str(i) in os.environ.get("QUACK_TEST_SELFKILL", "").split(",") and multiprocessing.parent_process():
        # A compile worker killed by a signal (what the OOM killer does), on the first
        # QUACK_TEST_SELFKILL_TIMES attempts of this i (counted in QUACK_TEST_FAIL_COUNTER).
        with open(os.environ["QUACK_TEST_FAIL_COUNTER"]) as f:
            attempts = sum(1 for line in f if line.split()[1] == str(i))
        if attempts <= int(os.environ.get("QUACK_TEST_SELFKILL_TIMES", "1")):
            os.kill(os.getpid(), signal.SIGKILL)
    gate = os.environ.get("QUACK_TEST_FAIL_GATE")
    if str(i) in os.environ.get("QUACK_TEST_FAIL", "").split(","):
        if gate:
            open(gate, "a").close()
        raise ValueError(f"rel_fail: configuration i={i} does not compile")
    if gate:
        # The other keys finish only after a failing one has raised: which of two workers
        # ends first is then no longer the machine's load's choice (bounded: 120 s).
        deadline = time.monotonic() + 120
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
    return rel_copy.compile_uncached(i)


def _even_when_big(p: dict) -> bool:
    return p["i"] < 1000 or p["i"] % 2 == 0


@jit_cache(
    "rel_ruled",
    params={"i": Int(min=0, max=100000)},
    rules=[Rule("i", "i must be even from 1000 on (a test rule)", _even_when_big)],
)
def rel_ruled(i: int = 0):
    """rel_copy behind a cross-parameter rule: refused configurations never compile."""
    return rel_copy.compile_uncached(i)
