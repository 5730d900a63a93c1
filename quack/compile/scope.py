"""Per-attempt scopes of the compile pool, visible to the threads a test starts.

``pool_scope`` makes ``@jit_cache`` submit a miss and raise CompilePending at once;
``recording_pending`` / ``recording_not_prebuilt`` collect what an attempt raised or
missed. They are ContextVars, so nested scopes and asyncio tasks stay separate.

A ContextVar is unset in a thread the test did not set it in, and torch runs every
backward pass on its own device threads. So a miss in a backward (``loss.backward()``
calling a kernel's gradient op) saw no scope: instead of deferring, it waited for its
compile on the test's thread. Seen on the H200: a cold ``--async-compile=16`` run of
the training tests crawled one backward compile at a time and did not finish in
210 s. :func:`sharing_with_threads` (the pytest runner enters it around each
attempt) publishes the owner thread's values to every thread that has none of its
own; a pending compile raised there reaches the test through autograd's own error
relay, and is recorded for the runner in any case."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_UNSET: Any = object()


class _Sharing:
    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self.values: dict[SharedVar[Any], Any] = {}


_sharing: _Sharing | None = None
_sharing_lock = threading.Lock()


class SharedVar(Generic[T]):
    """A ContextVar whose value set in the thread owning the open
    :func:`sharing_with_threads` block is also seen by threads that never set it."""

    def __init__(self, name: str, default: T) -> None:
        self._var: contextvars.ContextVar[T] = contextvars.ContextVar(name)
        self._default = default

    def get(self) -> T:
        v = self._var.get(_UNSET)
        if v is not _UNSET:
            return v
        s = _sharing
        if s is not None:
            return s.values.get(self, self._default)
        return self._default

    @contextlib.contextmanager
    def bound(self, value: T) -> Iterator[T]:
        """Set for this block (in this context; and for other threads, when this
        thread owns the sharing block)."""
        token = self._var.set(value)
        s = _sharing
        mine = s is not None and s.owner == threading.get_ident()
        old = _UNSET
        if mine:
            assert s is not None
            old = s.values.get(self, _UNSET)
            s.values[self] = value
        try:
            yield value
        finally:
            if mine:
                assert s is not None
                if old is _UNSET:
                    s.values.pop(self, None)
                else:
                    s.values[self] = old
            self._var.reset(token)


@contextlib.contextmanager
def sharing_with_threads() -> Iterator[None]:
    """Around one test attempt: scopes this thread enters inside the block are seen
    by threads with no scope of their own (autograd's device threads). One owner at
    a time; a nested call (another thread, or re-entry) leaves the outer one in place."""
    global _sharing
    with _sharing_lock:  # two threads entering at once: one owns, the other nests
        mine = _sharing is None
        if mine:
            _sharing = _Sharing()
    try:
        yield
    finally:
        if mine:
            _sharing = None


# The scopes (compile/pool.py has the functions that enter them).
ACTIVE: SharedVar[Any] = SharedVar("quack_pool", None)  # the CompilePool misses submit to
SCOPE_ROOT: SharedVar[str | None] = SharedVar("quack_scope_root", None)
PENDING_LOG: SharedVar[list | None] = SharedVar("quack_pending_log", None)
MISS_LOG: SharedVar[list | None] = SharedVar("quack_miss_log", None)
