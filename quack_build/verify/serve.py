"""The child side of the JSON-lines protocol that ``ChildProcess``
(quack_build.verify.loaders) drives: ``quack verify``'s loader (quack_build.verify.child)
and ``quack tune``'s measuring process (quack_build.tune.child) both serve through it.

One JSON request per stdin line, one JSON answer per line of the process's ORIGINAL
stdout: the answers get a private duplicate of fd 1, and fd 1 itself (with ``sys.stdout``)
goes to stderr. A kernel runtime printed "Error: kernel ..." lines to stdout after a failed
launch, the parent read them as answers, and every later answer of that process was blamed
on the entry after its own (on the H200: two good GEMM entries reported with a LayerNorm
error). An answer that says ``restart`` ends the process: a CUDA error is sticky (every
later launch in the process fails), so the next request gets a fresh process."""

from __future__ import annotations

import json
import os
import sys
from typing import Callable, TextIO


def serve(
    prog: str,
    handle: Callable[[dict], dict],
    argv: list[str] | None = None,
    warm: Callable[[], None] | None = None,
) -> None:
    """Answer ``handle(request)`` for each request line until stdin closes or an answer
    says ``restart``. ``--sys-path``: the parent's sys.path, put first. ``warm()``: run
    before the first request is read (the imports every request needs, done while the
    parent is still preparing its requests); its failure is left for that request to meet
    and report. ``--no-torch``: ``warm()`` runs with torch hidden (quack.runtime.ffi)."""
    import argparse

    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--sys-path", default="", help="the parent's sys.path, os.pathsep-joined")
    ap.add_argument(
        "--no-torch",
        action="store_true",
        help="no request hands a torch tensor to a kernel: warm() imports with torch hidden",
    )
    args = ap.parse_args(argv)
    extra = args.sys_path
    if extra:
        for p in reversed(extra.split(os.pathsep)):
            if p and p not in sys.path:
                sys.path.insert(0, p)
    proto: TextIO = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # native and Python prints go to stderr, never into the answers
    sys.stdout = sys.stderr
    if warm is not None:
        from contextlib import nullcontext

        from quack.runtime.ffi import torch_hidden

        try:
            # A static load's child (quack verify without --run): tvm_ffi's import of torch
            # was ~3 of its ~4 CPU-s of start-up, paid by every loader of every verify.
            with torch_hidden() if args.no_torch else nullcontext():
                warm()
        except Exception:  # noqa: BLE001 - the first request imports it again and says why
            pass
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        a = handle(json.loads(line))
        proto.write(json.dumps(a) + "\n")
        proto.flush()
        if a.get("restart"):
            return
