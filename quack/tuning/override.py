"""``use_config``: within a block, calls of one kernel derive THIS configuration instead of
the tuning table's (``quack tune`` runs a candidate through the kernel's own torch-facing op
and its reference check this way).

The configuration still goes through ``KernelSpec.bind``, so it is in the key and the
launch geometry that follows the bound configuration matches the object loaded: nothing
outside the key changes the compiled code. Context-local (a ``contextvars`` variable): a
thread or task of its own never sees another's override."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

_OVERRIDES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("quack_tune_overrides", default=None)
_TABLES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("quack_tune_tables", default=None)


@contextlib.contextmanager
def use_config(kernel: str, config: Any) -> Iterator[None]:
    token = _OVERRIDES.set({**(_OVERRIDES.get() or {}), kernel: config})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


@contextlib.contextmanager
def use_table(table: Any) -> Iterator[None]:
    """Within the block, configurations derived for ``table.arch`` come from ``table`` (a
    ``Table``) instead of the checked-in one: ``benchmarks/bench_tune.py`` times the winners
    of two tables side by side this way. Like ``use_config``, what it changes is the derived
    configuration, so the key, the object and the launch geometry stay consistent."""
    token = _TABLES.set({**(_TABLES.get() or {}), table.arch: table})
    try:
        yield
    finally:
        _TABLES.reset(token)


@contextlib.contextmanager
def without_tables(default_gpu: str) -> Iterator[None]:
    """Within the block, every arch's table is an empty one (``default_gpu`` its header's):
    configurations are the kernels' heuristics, and no table file is read. ``quack tune
    --from-empty`` derives its problems so, which therefore works where the checked-in
    table is broken (the table it is told to replace)."""
    token = _TABLES.set({**(_TABLES.get() or {}), _EMPTY: default_gpu})
    try:
        yield
    finally:
        _TABLES.reset(token)


_EMPTY = "*"  # the key of without_tables' mark in _TABLES (no arch is named so)
_empty_tables: dict = {}  # (arch, gpu) -> one empty Table: the derivation memos key on it


def table_override(arch: str) -> Any:
    """The table ``use_table`` (or ``without_tables``) set for ``arch`` here, or None."""
    tables = _TABLES.get() or {}
    t = tables.get(arch)
    if t is None and _EMPTY in tables:
        from quack.tuning.table import Table

        key = (arch, tables[_EMPTY])
        t = _empty_tables.get(key)
        if t is None:
            t = _empty_tables[key] = Table(arch, tables[_EMPTY])
    return t


def override(kernel: str) -> Any:
    """The configuration ``use_config`` set for ``kernel`` here, or None."""
    return (_OVERRIDES.get() or {}).get(kernel)


def as_bound(spec: Any, params: dict) -> contextlib.AbstractContextManager:
    """Within the block, calls of ``spec``'s kernel derive the configuration bound in
    ``params`` (a manifest entry's, explicit or derived) instead of today's table default:
    ``quack verify --run`` runs a configuration's reference hook through the kernel's own
    op, which derives its configuration, so without this an entry with an explicit
    candidate would be checked by running another kernel. A no-op for a kernel without a
    derived parameter."""
    for name, p in spec.params.items():
        if getattr(p, "derive", None) is not None and params.get(name) is not None:
            return use_config(spec.name, params[name])
    return contextlib.nullcontext()
