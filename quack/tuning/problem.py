"""The problem sizes of the call in flight, for a kernel whose tuned configuration depends on
sizes its compile parameters do not carry (the GEMM's m, n, k: ``jit_cache(problem=...)``).

The kernel's torch-facing wrapper enters ``at_problem(m=..., n=..., k=...)`` around its compile
function's call; a miss in prebuilt mode then suggests the manifest entry that lists the size
(``problems = [[m, n, k]]``) and leaves the configuration to the tuning table, which keeps a
build in step with the table as it is re-tuned. Without it the suggestion pinned today's
winner (an inline ``config``), which a re-tune silently left behind."""

from __future__ import annotations

import contextvars

_PROBLEM: contextvars.ContextVar[dict | None] = contextvars.ContextVar("quack_problem", default=None)


class at_problem:
    """``with at_problem(m=8192, n=4096, k=4096): fn = compile_gemm(...)``. A class, not a
    generator context manager: it is entered on every GEMM call (~0.3 us, against ~2 us for
    ``contextlib.contextmanager``)."""

    __slots__ = ("_sizes", "_token")

    def __init__(self, **sizes: int):
        self._sizes = sizes
        self._token: contextvars.Token | None = None

    def __enter__(self) -> None:
        self._token = _PROBLEM.set(self._sizes)

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _PROBLEM.reset(self._token)
            self._token = None


def current_problem() -> dict | None:
    """The sizes ``at_problem`` set for the call in flight, or None."""
    return _PROBLEM.get()
