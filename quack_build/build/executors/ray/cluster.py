"""Reaching a Ray cluster for ``quack build``: importing ray (the optional ``[ray]`` extra),
the address check, the connection, and the code the actors need (shipped as
``runtime_env.py_modules``)."""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from quack.errors import ExecutorError
from quack_build.build import interrupts
from quack_build.build.executors.base import RAY_INSTALL_HINT

CONNECT_TIMEOUT_S = 5.0  # reaching a cluster's address; an unreachable one fails fast
# What every actor runs with: GPU-blind, no second (hidden) CuTe DSL cache, no forkserver preload.
# Ray Client's server side starts a process per client ("SpecificServer"); on a loaded head
# that start sometimes fails once and works the next time (seen on a 2-core CI host:
# "Starting Ray client server failed" for the first client of a fresh cluster). These two
# messages are that spawn failing, not the address or the job: worth one more try.
CLIENT_SPAWN_FAILURES = ("Starting Ray client server failed", "Proxy failed to Connect to backend")
CLIENT_ATTEMPTS = 2
log = logging.getLogger("quack")
ACTOR_ENV = {"CUDA_VISIBLE_DEVICES": "", "CUTE_DSL_DISABLE_FILE_CACHING": "1", "QUACK_NO_PRELOAD": "1"}


def import_ray(local_only: bool = False):
    """``ray``, or ExecutorError with the install line. ``local_only``: the build starts its
    own single-host instance; keep all of it on 127.0.0.1 (Ray otherwise binds the host's
    outward IP). Read by Ray when it is first imported, so set before."""
    if local_only and "ray" not in sys.modules:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise ExecutorError(RAY_INSTALL_HINT, executor="ray") from None
    return ray


def first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]


def probe(address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """A TCP connect to the cluster's HOST:PORT, so an unreachable address fails in
    seconds with a clear message (Ray's own connect retries for a minute or more).
    Raises ExecutorError."""
    hostport = address[len("ray://") :] if address.startswith("ray://") else address
    host, _, port = hostport.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        why = "timed out" if isinstance(e, socket.timeout) else (getattr(e, "strerror", None) or str(e))
        raise ExecutorError(
            f"cannot reach the Ray cluster at {address}: {why} (within {timeout:.0f} s). Is it running "
            f"(`ray start --head` on that host; Ray Client listens on 10001, the GCS on 6379) and is "
            f"the port open from here? To build on this host instead: --executor local",
            executor="ray",
            address=address,
        ) from None


def stage_packages(names) -> tuple[str, list[str]]:
    """Copy each package (or one-file module) under its import name into a new temp
    directory; returns (the directory, the paths to ship). Ray names a shipped module
    after its directory, and an installed package may live in a folder of another name
    (kernels/ installs as quack_kernels). A dotted name (``pkg.sub``) ships its top-level
    package, once: an actor imports ``pkg.sub`` through ``pkg``, and a ``pkg.sub`` shipped
    alone was a module named "pkg.sub" that no import finds. Raises ExecutorError naming
    the package."""
    stage = tempfile.mkdtemp(prefix="quack-ray-ship-")
    out: list[str] = []
    copied: set[Path] = set()
    try:
        for name in names:
            try:
                dst = _stage_one(name, Path(stage), copied)
            except Exception as e:  # noqa: BLE001
                raise ExecutorError(
                    f"cannot ship the package {name!r} ([build] kernel_packages) to the "
                    f"Ray actors: {first_line(e)}",
                    executor="ray",
                ) from None
            if str(dst) not in out:
                out.append(str(dst))
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return stage, out


def _stage_one(name: str, stage: Path, copied: set[Path]) -> Path:
    """Copy the top-level package (or module) of ``name`` into ``stage`` unless ``copied``
    (the sources copied so far) has it; returns the copy."""
    top = name.partition(".")[0]
    mod = importlib.import_module(name)  # the entry itself must import here
    top_mod = importlib.import_module(top)
    paths = list(getattr(top_mod, "__path__", None) or [top_mod.__file__])
    if len(paths) > 1 and top != name:
        # A namespace package spread over several directories: the portion holding ``name``
        # (another entry's portion merges into the same copy).
        where = Path(getattr(mod, "__file__", None) or list(mod.__path__)[0]).resolve()
        paths = [p for p in paths if Path(p).resolve() in where.parents]
    if len(paths) != 1 or not paths[0]:
        raise ValueError(f"a namespace package spread over {len(paths)} directories")
    src = Path(paths[0])
    dst = stage / top if src.is_dir() else stage / f"{top}.py"
    if src in copied:
        return dst
    copied.add(src)
    if not src.is_dir():
        shutil.copyfile(src, dst)
        return dst
    shutil.copytree(
        src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o"), dirs_exist_ok=True
    )
    return dst


def retry_client_spawn(ray, address: str | None, e: BaseException, attempt: int) -> bool:
    """Whether ``ray.init`` failed because the Ray Client server could not start this
    client's server process, with an attempt left; if so, says so (quack logger) and
    drops what the failed attempt left connected. Bounded: CLIENT_ATTEMPTS in all."""
    if not (address or "").startswith("ray://") or attempt >= CLIENT_ATTEMPTS:
        return False
    if not any(m in str(e) for m in CLIENT_SPAWN_FAILURES):
        return False
    log.warning(
        "ray: %s: %s; trying once more (attempt %d of %d)",
        address,
        first_line(e),
        attempt + 1,
        CLIENT_ATTEMPTS,
    )
    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 - nothing may be connected after a failed init
        pass
    return True


def _init(ray, address: str | None, num_cpus: int | None, kw: dict) -> None:
    """``ray.init``, once more after a Ray Client spawn failure. Raises ExecutorError."""
    attempt = 1
    while True:
        try:
            if address is None:
                ray.init(
                    address="local",
                    num_cpus=num_cpus or os.cpu_count() or 1,
                    _node_ip_address="127.0.0.1",
                    include_dashboard=False,
                    **kw,
                )
            else:
                ray.init(address=address, **kw)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, ValueError...
            if retry_client_spawn(ray, address, e, attempt):
                attempt += 1
                continue
            where = address or "a new local instance"
            tries = f" (after {attempt} attempts)" if attempt > 1 else ""
            raise ExecutorError(
                f"cannot start Ray ({where}){tries}: {first_line(e)}", executor="ray", address=address or ""
            ) from None


@contextmanager
def _keep_sigterm(ray) -> Iterator[None]:
    """Keep ray.init from installing its SIGTERM handler (``sys.exit(15)``: exit 15, no
    cleanup, raised wherever ray.init was) while the build's handlers are in charge.
    Ray's hook for it is private (``ray._private.utils.set_sigterm_handler``): a Ray
    without it installs its handler, and connect() turns its SystemExit(15) back into
    the build's SIGTERM."""
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    real = getattr(utils, "set_sigterm_handler", None)
    if real is None or not interrupts.installed():
        yield
        return
    utils.set_sigterm_handler = lambda handler: None  # type: ignore[union-attr]
    try:
        yield
    finally:
        utils.set_sigterm_handler = real  # type: ignore[union-attr]


def stop_partial_init(ray, e: BaseException) -> None:
    """After ``ray.init`` raised ``e`` (a failure, Ctrl-C, SIGTERM): stop what it started.
    ``ray.shutdown`` stops a local instance once ray.init has recorded it; interrupted
    while that instance was still starting (its GCS, raylet and agents up, ray.init
    waiting for the node to register), the only handle on their processes is the node
    object being constructed, in the traceback: its own kill (each process a SIGTERM,
    then SIGKILL after a second) stops them. Without it the raylet's agents outlived
    the build for a minute."""
    try:
        ray.shutdown()
    except Exception:  # noqa: BLE001 - nothing may be connected
        pass
    seen: set[int] = set()
    exc: BaseException | None = e
    while exc is not None and id(exc) not in seen:  # e, and what it was raised from
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            node = tb.tb_frame.f_locals.get("self")
            kill = getattr(node, "kill_all_processes", None)
            if hasattr(node, "all_processes") and callable(kill):
                try:
                    kill(check_alive=False, allow_graceful=True)
                except Exception:  # noqa: BLE001 - gone already, or another Ray's node
                    pass
                return
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__


def connect(
    ray, target: str, *, num_cpus: int | None, runtime_env: dict, connect_timeout: float = CONNECT_TIMEOUT_S
) -> str:
    """``ray.init`` for ``target`` ("ray": a new local instance, or RAY_ADDRESS when set;
    "auto"; "ray://HOST:PORT"; "HOST:PORT") with the job's runtime_env; returns the
    address to show. Raises ExecutorError (unreachable, already connected, Ray's error)."""
    if ray.is_initialized():
        # Code ships with the job's runtime_env, which only ray.init sets: a process
        # already connected can't give its actors our packages.
        raise ExecutorError(
            "this process is already connected to Ray; quack build connects by "
            "itself (call ray.shutdown() first, or run `quack build` in its own "
            "process)",
            executor="ray",
        )
    # RAY_ADDRESS is Ray's own setting (not quack's): `--executor ray` honours it as ray.init() does.
    env_addr = os.environ.get("RAY_ADDRESS", "")
    address = (env_addr or None) if target == "ray" else target
    if address and address != "auto":
        probe(address, connect_timeout)
    kw = dict(log_to_driver=False, logging_level=logging.WARNING, runtime_env=runtime_env)
    try:
        # A signal during ray.init is taken when it returns (bounded by the interrupt's
        # watchdog): raised inside, it left a half-started instance or a half-built core
        # worker (interrupts.deferred).
        with interrupts.deferred(), _keep_sigterm(ray):
            _init(ray, address, num_cpus, kw)
    except BaseException as e:
        # ray.init failed or was interrupted: what it started (a local instance's GCS, raylet
        # and agents) is stopped here, or it outlives the build (the agents for a minute).
        # Ray's own SIGTERM handler, where it could not be kept out, raises SystemExit(15):
        # that signal is the build's (exit 143 after the cleanup, not 15 without it).
        signalled = isinstance(e, SystemExit) and e.code == signal.SIGTERM and interrupts.take(signal.SIGTERM)
        interrupts.reassert()
        stop_partial_init(ray, e)
        if signalled:
            raise KeyboardInterrupt from None
        raise
    # The core worker ray.init built installs a failure-signal handler (SIGTERM included:
    # a stack dump, then exit 1 or an abort): the build's handlers take over again now,
    # before the actors' start-up (minutes, on a cluster scaling up).
    interrupts.reassert()
    if address and address != "auto":
        return address
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001
        return address or "?"
