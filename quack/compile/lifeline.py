"""The compile pool's processes end with the process that started them.

A process using the pool that is killed (SIGKILL, a SIGTERM it does not handle: pytest
under ``timeout``, a cancelled CI job) runs no atexit hook, so nothing kills its
forkserver or its workers: the forkserver kept importing cutlass (or compiling its
warm-up) and a busy worker kept compiling, for as long as the compile took (for ever,
for a wedged one), re-parented to init, each holding the resource tracker's pipe open so
that it stayed too. Here:

* a worker asks the kernel for SIGTERM when the thread that forked it ends
  (``PR_SET_PDEATHSIG``): the forkserver's main thread, or the pool's dispatcher thread
  under the fork and spawn start methods; then checks that its parent had not already
  died between the fork and the request (the signal would never come). A SIGTERM that
  comes while its parent lives (one sent to the process group) is ignored: the pool's
  process ends its workers. The parent-death signal arms a kernel alarm (SIGALRM, default action: it ends the process even inside the
  compiler's C code) for what is left of the current compile's time-out: a compile
  that ends in time is still published whole for the next run, as the parent's pool
  would have allowed, and one that does not (wedged) ends with it, as the parent's pool
  would have killed it. An idle worker ends at once.
* the forkserver, spawned by the dispatcher thread (which ends at every pool shutdown,
  while the forkserver is meant to serve the next pool of the process), cannot use
  ``PR_SET_PDEATHSIG``: a thread of its own waits on multiprocessing's "alive" pipe,
  whose write end only client processes hold, and kills the forkserver when it reads
  EOF (every client gone), also during its preload, when its main loop, which watches
  that pipe too, is not running yet.
"""

from __future__ import annotations

import math
import os
import select
import signal
import sys
import threading
import time
from typing import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# When the current compile must end (time.monotonic()), None while idle: read by the
# SIGTERM handler on the parent's death.
_deadline: float | None = None


def compiling(timeout: float | None) -> None:
    """A task starts (its compile time-out, seconds) or ends (None)."""
    global _deadline
    _deadline = None if timeout is None else time.monotonic() + timeout


def die_with_parent(expected_ppid: int | None) -> None:
    """Linux: SIGTERM this process when the thread that forked it ends, then bounded as
    the module docstring says; exit now if its parent (``expected_ppid``, when known) is
    already gone. Elsewhere: nothing."""
    if not sys.platform.startswith("linux") or expected_ppid is None:
        return

    def on_term(signum, frame) -> None:
        if os.getppid() == expected_ppid:
            # A plain SIGTERM, while the parent lives: ignored. One sent to the whole
            # process group (systemd's stop, `timeout`, a CI job's kill) reaches the pool's
            # process too, which kills its workers itself and then sweeps their temp
            # files; a worker dying on its own meanwhile raced that sweep (quack.compile.worker).
            return
        left = None if _deadline is None else _deadline - time.monotonic()
        if left is None or left <= 0:
            os._exit(1)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(max(1, math.ceil(left)))

    signal.signal(signal.SIGTERM, on_term)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # no libc symbol: the old behaviour, no lifeline
        return
    if os.getppid() != expected_ppid:
        os._exit(1)  # re-parented before the request took effect: the parent is gone


def watch_alive_fd(fd: int) -> Callable[[], None]:
    """Kill this process (the forkserver) once ``fd``, the read end of a pipe whose write
    ends only its clients hold, reads EOF (every client process has ended) before the
    returned ``stop`` is called. Call ``stop`` when the preload is over: from then on the
    forkserver's own main loop watches that pipe and exits cleanly at EOF (a kill racing
    it ended the process with SIGKILL instead: tests/test_preload.py saw -9)."""
    stop_r, stop_w = os.pipe()

    def watch() -> None:
        try:
            while True:
                try:
                    ready, _, _ = select.select([fd, stop_r], [], [])
                except InterruptedError:
                    continue
                except OSError:
                    return  # closed by the forkserver itself: it is ending anyway
                if stop_r in ready:
                    return  # the preload is over: main's loop has the pipe now
                if fd in ready:
                    os.kill(os.getpid(), signal.SIGKILL)
                    return
        finally:
            os.close(stop_r)

    def stop() -> None:
        try:
            os.write(stop_w, b"x")
            os.close(stop_w)
        except OSError:
            pass

    threading.Thread(target=watch, name="quack-forkserver-lifeline", daemon=True).start()
    return stop
