"""Imported once in the compile forkserver: every worker forks from here with
cutlass imported, the ``[build] preload`` modules imported (quack.compile.preload), the
kernel packages registered and one compile done.

torch is hidden while cutlass and tvm_ffi import (tvm_ffi imports torch when
it can: ~3 s that a compile never needs; the .o is bit-identical), then
unhidden so a compile function that does import torch still can."""

import os
import signal
import sys
import types


def _preload() -> None:
    # This runs in the forkserver, which shares the terminal's process group: a Ctrl-C
    # must not kill it mid-import with a KeyboardInterrupt traceback on the user's
    # terminal. The parent decides what happens to compiles (it exits, and the
    # forkserver follows when its pipe closes); workers ignore SIGINT likewise, and
    # both ignore a SIGTERM or SIGHUP sent to the group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _ignore_group_stops()
    # End with the parent even while the preload below runs (seconds, minutes on a loaded
    # machine): a killed parent runs no shutdown (quack.compile.lifeline). Only while it
    # runs: afterwards the forkserver's main loop watches the same pipe and exits cleanly.
    alive_r = _forkserver_alive_fd()
    if alive_r is None:
        _load()
        return
    from quack.compile import lifeline

    stop = lifeline.watch_alive_fd(alive_r)
    try:
        _load()
    finally:
        stop()


def _ignore_group_stops() -> None:
    """Ignore SIGTERM and SIGHUP sent to the whole process group (systemd's stop,
    `timeout`, a CI job's kill, a closed terminal): the pool's process ends the
    forkserver (quack.compile.worker.stop_forkserver), after its workers. A forkserver
    that died first closed the pipes its clients' join() reads, which then returned (exit
    255) before the worker had died, and the build's sweep of its temp files came too
    early. The processes it forks for other users of multiprocessing's forkserver get the
    default actions back (their ``terminate()`` still works); where multiprocessing's
    internals differ from what is wrapped here, nothing is ignored."""
    from multiprocessing import forkserver

    serve_one = getattr(forkserver, "_serve_one", None)
    if not callable(serve_one):
        return
    signals = (signal.SIGTERM, signal.SIGHUP)

    def _serve_one(*args, **kwargs):  # in the forked child, before it runs its target
        for sig in signals:
            signal.signal(sig, signal.SIG_DFL)
        return serve_one(*args, **kwargs)

    forkserver._serve_one = _serve_one  # type: ignore[attr-defined]
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def _load() -> None:
    """Import the compiler, the preload modules and the kernel packages; one warm-up compile."""
    os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
    try:
        from quack import settings

        s = settings.get()
        if s.no_preload:  # QUACK_NO_PRELOAD: workers import lazily (tests of the cold path)
            return
        os.environ.setdefault("CUTE_DSL_ARCH", s.arch)
        packages = s.kernel_packages
        modules, source = s.preload, s.sources.get("preload", "")
    except Exception:  # noqa: BLE001 - a bad quack.toml is reported by the caller, not here
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        packages = ()
        modules, source = (), ""
    from quack.runtime.ffi import torch_hidden

    try:
        with torch_hidden():
            import cutlass.cute  # noqa: F401
            import tvm_ffi  # noqa: F401
    except Exception:  # noqa: BLE001 - workers then import lazily and report real errors
        return
    # [build] preload: after cutlass (and with torch importable again), before the kernel
    # packages, whose modules may import them at the top. A failure is recorded: each
    # task a worker gets then fails with it (quack.compile.preload).
    from quack.compile import preload

    preload.run(modules, source)
    try:
        from quack import registry
        from quack.compile.warmup import warm_up

        registry.load_packages(packages)
        warm_up()
    except Exception:  # noqa: BLE001
        pass


def _forkserver_main_frame() -> types.FrameType | None:
    """The frame of multiprocessing's forkserver ``main`` importing this module, if any."""
    fs = sys.modules.get("multiprocessing.forkserver")
    main = getattr(fs, "main", None)
    if main is None:
        return None
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is main.__code__:
            return frame
        frame = frame.f_back
    return None


def _forkserver_alive_fd() -> int | None:
    """The read end of the forkserver's "alive" pipe (``main``'s ``alive_r``), or None."""
    frame = _forkserver_main_frame()
    fd = None if frame is None else frame.f_locals.get("alive_r")
    return fd if isinstance(fd, int) else None


def _imported_by_forkserver() -> bool:
    """True when multiprocessing's forkserver ``main`` is importing this module (its
    preload step). Any other import (a test, a tool walking the package) must not run
    ``_preload``: it set SIGINT to SIG_IGN in the importing process, and a test process
    that had imported it passed SIG_IGN on to the drivers it started, whose Ctrl-C
    tests then never ended (issue 24 item 4)."""
    return _forkserver_main_frame() is not None


if _imported_by_forkserver():
    _preload()
