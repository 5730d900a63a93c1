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


def received() -> int | None:
    """The signal that interrupted this process, or None."""
    return _received


def exit_code(code) -> int:
    """The process's exit status: 128 + the signal once one came, else ``code``
    (SystemExit's code: None is 0, a message is 1)."""
    if _received is not None:
        return 128 + _received
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _on_signal(signum, frame) -> None:  # noqa: ARG001
    global _received
    if _received is not None:
        return  # the first signal's cleanup is running, bounded by its watchdog
    _received = signum
    threading.Thread(
        target=_watchdog, args=(128 + signum,), name="quack-interrupt-watchdog", daemon=True
    ).start()
    raise KeyboardInterrupt


def _watchdog(code: int) -> None:
    time.sleep(GRACE_S)
    hard_exit(code, f"interrupted: the cleanup did not end within {GRACE_S:.0f} s; stopped")


def hard_exit(code: int, message: str) -> None:
    """Kill this process's compile workers and forkserver, flush, and exit now. What
    ran no cleanup is no partial entry: objects are published by atomic rename, and
    an object left without its metadata is swept as an orphan (quack.cache.orphans)."""
    kill_children()
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
