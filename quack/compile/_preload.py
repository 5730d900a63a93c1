"""Imported once in the compile forkserver: every worker forks from here with
cutlass imported, the kernel packages registered and one compile done.

torch is hidden while cutlass and tvm_ffi import (tvm_ffi imports torch when
it can: ~3 s that a compile never needs; the .o is bit-identical), then
unhidden so a compile function that does import torch still can."""
import os
import sys


def _preload() -> None:
    # The forkserver ignores Ctrl-C ("protect the process from ^C"), but only once its
    # preload is done; a Ctrl-C to the terminal's process group during these imports
    # would print a KeyboardInterrupt traceback from it. The owner of the pool stops
    # the server. So SIGINT is ignored during the preload and put back after it, so the
    # workers forked later get the handler they had before.
    import signal

    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: not the forkserver either
        _preload_body()
        return
    try:
        _preload_body()
    finally:
        signal.signal(signal.SIGINT, previous)


def _preload_body() -> None:
    os.environ.setdefault("CUTE_DSL_DISABLE_FILE_CACHING", "1")
    try:
        from quack import settings

        s = settings.get()
        os.environ.setdefault("CUTE_DSL_ARCH", s.arch)
        packages = s.kernel_packages
    except Exception:  # noqa: BLE001 - a bad quack.toml is reported by the caller, not here
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        packages = ()
    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import cutlass.cute  # noqa: F401
        import tvm_ffi  # noqa: F401
    except Exception:  # noqa: BLE001 - workers then import lazily and report real errors
        return
    finally:
        if hidden and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    try:
        from quack import registry
        from quack.compile._warmup import warm_up

        registry.load_packages(packages)
        warm_up()
    except Exception:  # noqa: BLE001
        pass


if os.environ.get("QUACK_NO_PRELOAD") != "1":
    _preload()
