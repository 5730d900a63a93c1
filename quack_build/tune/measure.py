"""The parent side of ``quack tune``'s measuring process (quack_build.tune.child): one
child at a time measures (candidates timed side by side on one GPU must not share it),
restarted whenever a candidate's launch faults, its process dies or it hangs, so that
the next candidate gets a fresh CUDA context and the failed one is reported with its
configuration and the error. The process machinery is ``quack verify``'s
(``quack_build.verify.loaders.ChildProcess``).

Every wait has an exit: the start-up (imports, the CUDA context) takes at most
``start_timeout``, a request at most ``timeout`` (then the child is killed and the
candidate blamed: a pipeline that deadlocks never returns), a child that cannot start
twice in a row is not started again (``broken``: the caller ends the tune), and
``close`` (also on Ctrl-C) kills what is left."""

from __future__ import annotations

import itertools
from typing import Any

from quack.errors import MeasureError
from quack_build.verify.loaders import ChildProcess

MEASURE_TIMEOUT = 300.0  # a check, or a candidate's ~12 timed calls; a hang is killed after this
START_TIMEOUT = 180.0  # torch + cutlass imports and the CUDA context, on a host busy compiling
MODULE = "quack_build.tune.child"


def _last_line(text: str) -> str:
    head, _, tail = text.partition(": ")
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    return f"{head}: {lines[-1][:300]}" if lines else head


class Measurer:
    """Checks and times candidates in a child process. ``device``: the device string the
    child measures on ("cuda:0"); ``env``: the child's extra environment (the cache
    directory the candidates were compiled into); ``timer``: "module:function" timing a
    call (default ``quack.tuning.bench:gpu_time``); ``gpu``: whether the child sees the GPU
    (a CPU test's fakes do not)."""

    def __init__(
        self,
        *,
        device: str,
        env: dict | None = None,
        timer: str | None = None,
        timeout: float = MEASURE_TIMEOUT,
        start_timeout: float = START_TIMEOUT,
        gpu: bool = True,
    ):
        self.device, self.env, self.timer, self.gpu = device, dict(env or {}), timer, gpu
        self.timeout, self.start_timeout = timeout, start_timeout
        self.child: ChildProcess | None = None
        self.started = 0  # processes started: 1 + the restarts
        self.broken = ""  # why no measuring process could start: every later request fails at once
        self._ids = itertools.count()

    # ------------------------------------------------------------------ the process
    def _live(self) -> ChildProcess:
        if self.child is not None:
            return self.child
        if self.broken:
            raise MeasureError("", "", self.broken)
        why = ""
        for _ in range(2):  # a start that fails twice in a row is not one candidate's fault
            c = ChildProcess(self.gpu, module=MODULE, env=self.env, role="measuring")
            self.started += 1
            a = c.ask({"op": "hello", "device": self.device}, timeout=self.start_timeout)
            if a is not None and a.get("ready"):
                self.child = c
                return c
            why = (a or {}).get("error") or _last_line(c.death())
            c.kill()
            c.close()
        self.broken = f"the measuring process did not start (twice): {why}"
        raise MeasureError("", "", self.broken)

    def kill(self) -> None:
        """Kill the child now (an interrupt: no request will follow)."""
        self._retire()

    def _retire(self) -> None:
        c, self.child = self.child, None
        if c is not None:
            c.kill()
            c.close()

    def close(self) -> None:
        c, self.child = self.child, None
        if c is not None:
            c.close()  # stdin closed: the child ends; killed when it does not in 10 s

    def __enter__(self) -> "Measurer":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # an interrupt or a failure: nothing waits on the child any more
            self._retire()

    # ------------------------------------------------------------------ requests
    def _ask(self, op: str, problem: dict, config: Any) -> dict:
        """One request; on a fault, death or hang: the child replaced, MeasureError raised."""
        c = self._live()
        params = dict(problem["params"], config=config.knobs() if hasattr(config, "knobs") else config)
        req = dict(problem, op=op, id=next(self._ids), params=params, device=self.device, timer=self.timer)
        a = c.ask(req, timeout=self.timeout)
        label = config.label() if hasattr(config, "label") else str(config)
        if a is None:  # the process died: segfault, abort, out of memory
            reason = _last_line(c.death())
        elif a.get("timed_out"):
            reason = f"{op}: {a['error']}: a hung launch (the measuring process was killed)"
        elif a.get("id") != req["id"]:
            reason = f"the measuring process answered another request ({str(a)[:120]})"
        elif a.get("restart"):
            reason = f"{op}: {a.get('error')}"
        elif c.p.poll() is not None:
            reason = f"{op}: the measuring process ended after answering"
        else:
            return a
        self._retire()
        raise MeasureError(problem["kernel"], label, reason, restarted=True)

    def check(self, problem: dict, config: Any) -> None:
        """Run the reference check: AssertionError when wrong, MeasureError when it failed."""
        a = self._ask("check", problem, config)
        if a.get("wrong"):
            raise AssertionError(a["wrong"])
        if not a.get("ok"):
            raise MeasureError(problem["kernel"], config.label(), f"check: {a.get('error')}")

    def time(self, problem: dict, config: Any) -> float:
        """Seconds of one call of the candidate (MeasureError when it failed)."""
        a = self._ask("time", problem, config)
        if not a.get("ok") or a.get("time") is None:
            raise MeasureError(problem["kernel"], config.label(), f"time: {a.get('error')}")
        return float(a["time"])


def problem_request(spec: Any, base_plain: dict, sizes: dict) -> dict:
    """The part of a request that names one problem: the kernel, its plain parameters
    (without the config), the sizes and the hooks the child resolves."""
    return dict(
        kernel=spec.name,
        module=spec.module,
        params=base_plain,
        sizes=dict(sizes),
        bench=spec.bench,
        reference=spec.reference,
    )
