"""Manifest tables: validate each [[kernel]] table (and a file's [defaults] and
top-level keys) and count its configurations against the build's budget
(quack_build.manifest.budget) before anything is expanded; quack_build.manifest.expand
expands a valid table. quack_build.manifest.read drives them over every file given."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, Iterable

from quack import registry
from quack import settings as _settings
from quack.errors import UnknownKernel
from quack.tomlfile import escape
from quack_build.manifest.budget import Budget, charge
from quack_build.manifest.values import (
    FileCheck,
    check_archs,
    check_matcher,
    check_values,
    report_unknown_param,
    show_value,
)

TOP_KEYS = ("defaults", "kernel")
DEFAULTS_KEYS = ("archs", "params")
KERNEL_KEYS = ("name", "archs", "params", "exclude", "include", "problems")


@dataclasses.dataclass
class KernelTable:
    """One [[kernel]] table that passed validation: what ``expand.generate`` expands."""

    where: str
    origin: str
    name: str
    spec: Any
    names: list[str]
    axes: list[list]
    archs: list[str]
    excludes: list[dict]
    includes: list[dict]
    problems: tuple = ()  # the tuning problems' sizes (``problems``), dicts by the kernel's names


def prepare_kernel(
    ctx: FileCheck,
    idx: int,
    table: Any,
    defaults: dict,
    default_archs: list[str],
    arch_override: list[str] | None,
    budget: Budget,
    used_defaults: set,
) -> KernelTable | None:
    """Validate one table and count it against the budget; expands nothing. Each step
    reports what it finds; a step after which nothing more can be said stops here, the
    others go on so that one run lists every problem of the table."""
    label = f"[[kernel]] #{idx + 1}"
    name = _table_name(ctx, idx, label, table)
    if name is None:
        return None
    where = ctx.where(f"{label} ({escape(name)[:80]})", idx)
    spec = _lookup(ctx, where, name)
    if spec is None:
        return None
    used_defaults.add("\0resolved")
    ok = _check_keys(ctx, where, table, spec)
    archs: list[str] | None = default_archs
    if "archs" in table:
        archs = check_archs(ctx, where, table["archs"])
        ok = ok and archs is not None
    if arch_override:
        archs = arch_override
    split = _split_params(ctx, where, table, spec)
    if split is None:
        return None
    table, params = split
    given, values_ok = _given_values(ctx, where, f"{label} {name}", spec, params, defaults, used_defaults)
    excludes, includes, matchers_ok = _matchers(ctx, where, spec, table)
    probs = _problems(ctx, where, spec, table.get("problems"))
    if not (ok and values_ok and matchers_ok) or archs is None or probs is None:
        return None
    names = list(spec.params)
    axes = [given[n] if n in given else [spec.defaults[n]] for n in names]
    resolved = _resolve_includes(ctx, where, names, axes, includes)
    # an entry that leaves a derived configuration to the tuning table and lists problem sizes
    # builds one configuration per size (quack_build.manifest.expand): count each
    per_size = len(probs) if probs and any(n not in given for n in spec.derived_params) else 1
    if resolved is None or not charge(ctx, where, budget, names, axes, resolved, archs, per_size):
        return None
    return KernelTable(
        where, f"{ctx.path}:{label}", name, spec, names, axes, archs, excludes, resolved, probs
    )


def _problems(ctx: FileCheck, where: str, spec, raw: Any) -> tuple | None:
    """``problems``: the sizes ``quack tune`` times the entry's configurations at, each a
    list in the order of the kernel's ``problem`` names (``[m, n, k]`` for the GEMM) or a
    table of them; every size a positive integer. None (reported) when malformed or the
    kernel names no problem sizes (a row kernel's are its ``n`` and ``--rows``)."""
    if raw is None:
        return ()
    dims = tuple(spec.problem)
    if not dims:
        ctx.err(
            where,
            f"problems: kernel {spec.name!r} declares no problem sizes (jit_cache(problem=...)); "
            f"its tuning problems are its parameters (and quack tune --rows)",
        )
        return None
    shape = "[" + ", ".join(dims) + "]"
    if not isinstance(raw, list) or not raw:
        ctx.err(where, f"problems = {show_value(raw)} must be a non-empty list of {shape}")
        return None
    out: list[dict] = []
    for j, p in enumerate(raw):
        if isinstance(p, dict):
            vals = [p.get(d) for d in dims] if set(p) == set(dims) else None
        else:
            vals = list(p) if isinstance(p, list) and len(p) == len(dims) else None
        if vals is None or not all(type(v) is int and v > 0 for v in vals):
            ctx.err(
                f"{where}: problems[{j}]",
                f"{show_value(p)} must be {shape} (or {{ {', '.join(f'{d} = ...' for d in dims)} }}), "
                f"positive integers",
            )
            return None
        out.append(dict(zip(dims, vals)))
    return tuple(dict.fromkeys(tuple(d.items()) for d in out))  # a size listed twice: tuned once


def _table_name(ctx: FileCheck, idx: int, label: str, table: Any) -> str | None:
    """The table's kernel name, or None (reported) when the table or its name is malformed."""
    if not isinstance(table, dict):
        ctx.err(ctx.where(label, idx), f"must be a table, got {show_value(table)}")
        return None
    name = table.get("name")
    if name is None:
        ctx.err(ctx.where(label, idx), "missing key 'name' (the registered kernel name)")
        return None
    if not isinstance(name, str):
        ctx.err(ctx.where(label, idx), f"name = {show_value(name)} must be a string")
        return None
    return name


def _lookup(ctx: FileCheck, where: str, name: str):
    """The registered spec of ``name``, or None (reported: the closest name, what is
    registered, and where the registered packages came from)."""
    try:
        return registry.get(name)
    except UnknownKernel as e:
        known = list(e.known)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        cur = _settings.get()
        pk = ", ".join(cur.kernel_packages) or "none"
        src = (
            f"[build] kernel_packages in {cur.config_file}"
            if cur.config_file
            else "the default (no quack.toml found)"
        )
        ctx.err(
            where,
            f"name = {show_value(name)}: no kernel is registered under this name{hint}; "
            f"registered kernels: {', '.join(known) or '(none)'}. Kernels are registered from "
            f"{src}: {pk}; scanned: {registry.SCANNED}",
        )
        return None


def _check_keys(ctx: FileCheck, where: str, table: dict, spec) -> bool:
    """Every key of the table is a [[kernel]] key (a parameter given at the top level is
    pointed to params); False after reporting each one that is not."""
    ok = True
    for k in table:
        if k not in KERNEL_KEYS:
            ok = False
            if k in spec.params:
                ctx.err(
                    where,
                    f"unknown key {k!r}: parameters go under params, e.g. "
                    f"params = {{ {k} = {show_value(table[k])} }}",
                )
            else:
                ctx.err(where, f"unknown key {k!r}; allowed keys: {', '.join(KERNEL_KEYS)}")
    return ok


def _split_params(ctx: FileCheck, where: str, table: dict, spec) -> tuple[dict, dict] | None:
    """(table, params), copies, with an ``exclude`` / ``include`` found under params moved
    to the table; None (reported) when params is not a table or one is given twice."""
    params = table.get("params", {})
    if not isinstance(params, dict):
        ctx.err(where, f"params = {show_value(params)} must be a table of parameter = value or list")
        return None
    # `exclude = [...]` written after a [kernel.params] header lands inside params in
    # TOML; take it as the kernel's (no kernel parameter has these names).
    table = dict(table)
    params = dict(params)
    for k in ("exclude", "include"):
        if k in params and k not in spec.params:
            if k in table:
                ctx.err(where, f"{k} given twice (in the table and under params)")
                return None
            table[k] = params.pop(k)
    return table, params


def _given_values(
    ctx: FileCheck, where: str, label: str, spec, params: dict, defaults: dict, used_defaults: set
) -> tuple[dict[str, list], bool]:
    """The checked value lists of every parameter the table or [defaults] gives, and
    whether all were valid and every parameter without a default was given."""
    ok = True
    given: dict[str, list] = {}
    invalid: set[str] = set()  # given, but with a bad value: reported once, not also "missing"
    for k, v in params.items():
        if k not in spec.params:
            report_unknown_param(ctx, where, spec, k)
            ok = False
            continue
        vals = check_values(ctx, where, spec, k, v)
        if vals is None:
            ok = False
            invalid.add(k)
        else:
            given[k] = vals
    for k, v in defaults.items():
        if k in spec.params and k not in params:
            used_defaults.add(k)
            vals = check_values(ctx, f"{ctx.where('[defaults]')} (for {label})", spec, k, v)
            if vals is None:
                ok = False
                invalid.add(k)
            else:
                given[k] = vals
        elif k in spec.params:
            used_defaults.add(k)
    for n, p in spec.params.items():
        if n not in given and n not in invalid and n not in spec.defaults:
            ok = False
            ctx.err(
                where, f"missing parameter {n!r} (no default in {spec.qualname}); expected {p.describe()}"
            )
    return given, ok


def _matchers(ctx: FileCheck, where: str, spec, table: dict) -> tuple[list, list, bool]:
    """The table's checked ``exclude`` and ``include`` entries, and whether all were valid."""
    ok = True
    excludes: list = []
    includes: list = []
    for what, dest in (("exclude", excludes), ("include", includes)):
        raw = table.get(what, [])
        if not isinstance(raw, list):
            raw = [raw]
        for j, t in enumerate(raw):
            m = check_matcher(ctx, f"{where}: {what}[{j}]", spec, t, what)
            if m is None:
                ok = False
            else:
                dest.append(m)
    return excludes, includes, ok


def _resolve_includes(
    ctx: FileCheck, where: str, names: list[str], axes: list[list], includes: list[dict]
) -> list[dict] | None:
    """Each ``include`` entry as one full configuration (a parameter it leaves out takes
    the table's single value); None (reported) when an entry is ambiguous."""
    resolved: list[dict] = []
    for j, m in enumerate(includes):
        combo = {}
        for n in names:
            if n in m:
                if len(m[n]) != 1:
                    ctx.err(f"{where}: include[{j}]", f"{n} must be a single value, got {len(m[n])}")
                    return None
                combo[n] = m[n][0]
            elif len(axes[names.index(n)]) == 1:
                combo[n] = axes[names.index(n)][0]
            else:
                ctx.err(
                    f"{where}: include[{j}]",
                    f"must give {n!r}: the kernel table lists several "
                    f"values for it ({', '.join(map(show_value, axes[names.index(n)]))})",
                )
                return None
        resolved.append(combo)
    return resolved


def prepare_document(
    path: Path, doc: dict, *, archs: Iterable[str], arch_override, budget: Budget
) -> tuple[FileCheck, list[KernelTable]]:
    """Validate one parsed manifest: its problems land in the returned context."""
    kernels = doc.get("kernel", [])
    ctx = FileCheck(path, len(kernels) if isinstance(kernels, list) else 0)
    for k in doc:
        if k not in TOP_KEYS:
            hint = ""
            if k in ("kernels", "defaults_", "default"):
                hint = " (did you mean [[kernel]] or [defaults]?)"
            ctx.err(
                str(path), f"unknown top-level key {k!r}{hint}; allowed: [defaults] and [[kernel]] tables"
            )
    defaults = doc.get("defaults", {})
    default_archs = list(archs)
    dparams: dict = {}
    if not isinstance(defaults, dict):
        ctx.err(ctx.where("[defaults]"), "must be a table")
    else:
        for k in defaults:
            if k not in DEFAULTS_KEYS:
                ctx.err(
                    ctx.where("[defaults]"), f"unknown key {k!r}; allowed keys: {', '.join(DEFAULTS_KEYS)}"
                )
        if "archs" in defaults:
            a = check_archs(ctx, ctx.where("[defaults]"), defaults["archs"])
            if a is not None:
                default_archs = a
        dparams = defaults.get("params", {})
        if not isinstance(dparams, dict):
            ctx.err(ctx.where("[defaults]"), "params must be a table of parameter = value or list")
            dparams = {}
    if not isinstance(kernels, list):
        ctx.err(str(path), "'kernel' must be an array of tables: write [[kernel]], not [kernel]")
        kernels = []
    elif not kernels and not ctx.problems:
        ctx.err(str(path), "no [[kernel]] tables: the manifest builds nothing")
    tables: list[KernelTable] = []
    used: set = set()
    for i, t in enumerate(kernels):
        tb = prepare_kernel(ctx, i, t, dparams, default_archs, arch_override, budget, used)
        if tb is not None:
            tables.append(tb)
    for k in dparams:
        if k not in used and "\0resolved" in used:
            ctx.err(ctx.where("[defaults]"), f"params.{k}: no kernel in this manifest has a parameter {k!r}")
    return ctx, tables
