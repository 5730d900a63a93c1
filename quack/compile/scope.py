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
relay, and is recorded for the runner in any case.

The functions that enter the scopes (``pool_scope``, ``suppress_pool``, the
``recording_*`` blocks, ``note_*``, ``active_pool``) live here too."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from quack.compile.pool import CompilePool

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


# The scopes (the functions below enter them).
ACTIVE: SharedVar[Any] = SharedVar("quack_pool", None)  # the CompilePool misses submit to
SCOPE_ROOT: SharedVar[str | None] = SharedVar("quack_scope_root", None)
PENDING_LOG: SharedVar[list | None] = SharedVar("quack_pending_log", None)
MISS_LOG: SharedVar[list | None] = SharedVar("quack_miss_log", None)


# Per-attempt logs the pytest plugin sets: CompilePending raised (even if the test
# swallowed it with ``except BaseException``), and prebuilt-mode misses.


@contextlib.contextmanager
def recording_pending():
    """Collect, in the yielded list, every CompilePending raised in this block
    (even one a test swallowed). Enter it inside ``pool_scope``, which starts
    each scope with no recording."""
    with PENDING_LOG.bound([]) as log:
        yield log


@contextlib.contextmanager
def recording_not_prebuilt():
    """Collect (KernelNotPrebuilt, settings) for every prebuilt-mode miss in this block."""
    with MISS_LOG.bound([]) as log:
        yield log


def note_pending(exc) -> None:
    log = PENDING_LOG.get()
    if log is not None:
        log.append(exc)


def note_not_prebuilt(exc, settings) -> None:
    log = MISS_LOG.get()
    if log is not None:
        log.append((exc, settings))


def active_pool(root=None) -> CompilePool | None:
    """The pool of the enclosing pool_scope, or None. A scope limited to one cache
    root (the pytest plugin's: the session's default cache) is not active for a
    miss in another root (a test's private cache): that miss waits instead."""
    pool = ACTIVE.get()
    if pool is not None and root is not None:
        only = SCOPE_ROOT.get()
        if only is not None and only != str(root):
            return None
    return pool


@contextlib.contextmanager
def pool_scope(pool: CompilePool | None = None, *, root=None):
    """In this block a miss submits to ``pool`` and raises CompilePending at once
    (only for misses in cache ``root``, if given)."""
    if pool is None:
        # Here, not at the top: a prebuilt hit never needs the pool module.
        from quack.compile.pool import default_pool

        pool = default_pool()
    with (
        ACTIVE.bound(pool) as active,
        SCOPE_ROOT.bound(None if root is None else str(root)),
        PENDING_LOG.bound(None),  # a nested scope's pendings are its owner's business
    ):
        yield active


@contextlib.contextmanager
def suppress_pool():
    """In this block misses wait for their compile, even inside a pool_scope."""
    with ACTIVE.bound(None):
        yield
