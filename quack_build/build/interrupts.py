"""Ctrl-C, SIGTERM and SIGHUP for the ``quack`` command: any phase ends within a few
seconds, with exit 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP), and leaves no process behind.

``install()`` is the first thing ``quack_build.cli.main.main`` does, so there is no phase
without a handler (before it, a SIGTERM killed the process without any cleanup: compile
workers and a forkserver in the middle of its preload outlived it). The handler turns
any of them into KeyboardInterrupt, which every command already cleans up after
(quack_build.build.scheduler: kill the workers, sweep what they left; quack_build.cli.run: exit 130), and
remembers which signal came, so that

* the exit status is 128 + the signal whatever the command made of the interrupt
  (click turns a KeyboardInterrupt outside a command's body into "Aborted!", exit 1; a
  build interrupted while its last key landed exited 0; SIGTERM came out as 130);
* a second signal during that cleanup does not abort it half-way (leaving an orphan
  object without its sweep): the first one's deadline already bounds it;
* a wait the cleanup cannot interrupt (a thread blocked in ``open()`` of a FIFO that
  interpreter exit joins, a ``join`` of a process that does not die) cannot keep the
  process alive: a watchdog armed by the first signal kills the known child processes
  and ends the process ``GRACE_S`` seconds later.

Only the standard library is imported here: ``quack cache stats`` installs it too."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

GRACE_S = 8.0  # the orderly cleanup takes well under a second; this is its upper bound
# SIGHUP: a closed terminal, or a supervisor's stop; unhandled it killed the build with no
# cleanup and no summary, leaving its compile workers' temp files.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_received: int | None = None
_installed = False


def install() -> None:
    """Route SIGINT, SIGTERM and SIGHUP to :func:`_on_signal` (main thread only)."""
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)
    _installed = True


def reassert() -> None:
    """Re-install the handlers after a library replaced them: ``ray.init`` installs a
    SIGTERM handler of its own (``sys.exit(15)``), which skipped the build's cleanup."""
    if _installed:
        install()


def installed() -> bool:
    """Whether these handlers are in charge (the ``quack`` command; not quack used as a library)."""
    return _installed


def received() -> int | None:
    """The signal that interrupted this process, or None."""
    return _received


@contextmanager
def deferred() -> Iterator[None]:
    """Run the block with the signals deferred: one that comes is recorded and its
    watchdog armed (so the block, or the process, still ends within GRACE_S), and the
    KeyboardInterrupt is raised when the block ends. For a library call that an
    exception raised at an arbitrary point leaves half done: ``ray.init`` interrupted
    while its local instance starts (processes up but not yet recorded for ray.shutdown:
    they outlived the build) or while its core worker is built (the interpreter's exit
    then segfaulted). Deferred in Python, not blocked in the kernel: the processes the
    call starts would inherit a blocked mask and ignore SIGTERM. A no-op where these
    handlers are not installed, or off the main thread."""
    if not _installed or threading.current_thread() is not threading.main_thread():
        yield
        return
    before = _received
    for sig in SIGNALS:
        signal.signal(sig, _defer)
    try:
        yield
    except BaseException:
        install()
        if before is None and _received is not None:
            raise KeyboardInterrupt from None  # the signal, not what the block made of it
        raise
    install()
    if before is None and _received is not None:
        raise KeyboardInterrupt


def take(signum: int) -> bool:
    """A signal a library's own handler caught while it was installed (``ray.init`` puts
    in a SIGTERM handler that raises SystemExit(15): exit 15, no cleanup), handled as
    this module's handler would have: recorded and the watchdog armed (once); the caller
    raises KeyboardInterrupt. False when these handlers are not installed (quack used as
    a library: the signal is the caller's business)."""
    if not _installed:
        return False
    _arm(signum)
    return True


def exit_code(code) -> int:
    """The process's exit status: 128 + the signal once one came, else ``code``
    (SystemExit's code: None is 0, a message is 1)."""
    if _received is not None:
        return 128 + _received
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _on_signal(signum, frame) -> None:  # noqa: ARG001
    if _arm(signum):
        raise KeyboardInterrupt
    # else: the first signal's cleanup is running, bounded by its watchdog


def _defer(signum, frame) -> None:  # noqa: ARG001
    _arm(signum)


def _arm(signum: int) -> bool:
    """Record the first signal and start its watchdog; False for a later one."""
    global _received
    if _received is not None:
        return False
    _received = signum
    threading.Thread(
        target=_watchdog, args=(128 + signum,), name="quack-interrupt-watchdog", daemon=True
    ).start()
    return True


def _watchdog(code: int) -> None:
    time.sleep(GRACE_S)
    hard_exit(code, f"interrupted: the cleanup did not end within {GRACE_S:.0f} s; stopped")


def hard_exit(code: int, message: str) -> None:
    """Kill this process's compile workers and forkserver, stop the Ray instance it
    started, flush, and exit now. What ran no cleanup is no partial entry: objects are
    published by atomic rename, and an object left without its metadata is swept as an
    orphan (quack.cache.orphans)."""
    kill_children()
    stop_ray()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed pipe: nothing more to say
            pass
    try:
        os.write(2, (message + "\n").encode())
    except OSError:
        pass
    os._exit(code)


def kill_children() -> None:
    """SIGKILL the child processes multiprocessing started (compile workers) and the
    compile forkserver. Only modules already imported are used: nothing is loaded
    in a process that is being stopped."""
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        try:
            children = list(getattr(mp_process, "_children", ()))
        except RuntimeError:  # the main thread changed the set meanwhile
            children = []
        for p in children:
            try:
                if p.pid:
                    os.kill(p.pid, signal.SIGKILL)
            except (OSError, AttributeError):
                pass
    worker = sys.modules.get("quack.compile.worker")
    if worker is not None:
        worker.stop_forkserver()


#: The longest hard_exit waits for the Ray instance it stops (stop_ray).
RAY_STOP_S = 3.0


def stop_ray() -> None:
    """Stop the processes of the local Ray instance this process started (``--executor
    ray`` without an address: its GCS, raylet and, through the raylet, the agents and
    actors), if any: what ``ray.shutdown`` does, without its disconnect, which a main
    thread stuck in a Ray call could hold up. Each process gets a SIGTERM first, the
    raylet's chance to stop its children (SIGKILLed, they outlived the build for a
    minute); bounded by RAY_STOP_S. Nothing when Ray is not imported, or only connected
    to a cluster (none of its processes are ours)."""
    worker = sys.modules.get("ray._private.worker")
    node = getattr(worker, "_global_node", None)
    if node is None:
        return

    def kill() -> None:
        try:
            node.kill_all_processes(check_alive=False, allow_graceful=True)
        except Exception:  # noqa: BLE001 - already gone, or a Ray without this method
            pass

    t = threading.Thread(target=kill, name="quack-ray-stop", daemon=True)
    t.start()
    t.join(RAY_STOP_S)
