"""Build manifests: parse, validate and expand TOML files into build configurations.

A manifest::

    [defaults]                          # optional, shared by every [[kernel]] table
    archs = ["sm_90a"]
    params = { dtype = ["bfloat16"] }   # applied to kernels that have such a parameter

    [[kernel]]
    name = "rmsnorm_fwd"
    archs = ["sm_90a"]                  # optional
    params = { dtype = ["float32", "bfloat16"], n = [256, 4096], has_weight = [true, false] }
    exclude = [{ dtype = "float32", n = 256 }]                      # drop matching combinations
    include = [{ dtype = "float16", n = 333, has_weight = true }]    # extra single combinations

Every value is a scalar or a list (the cross product is built); a Config
parameter takes an inline table. Everything is validated before anything
compiles, and all problems are reported together, each naming the file (and
line where it can be found), the table, the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

from quack import registry
from quack import settings as _settings
from quack.errors import ManifestError, ParamError, TomlFileError, UnknownKernel
from quack.params import Config as ConfigParam
from quack.tomlfile import escape

DEFAULT_MAX_CONFIGS = 10_000
TOP_KEYS = ("defaults", "kernel")
DEFAULTS_KEYS = ("archs", "params")
KERNEL_KEYS = ("name", "archs", "params", "exclude", "include")
_SCALARS = (str, int, float, bool)


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """One (kernel, canonical parameters, arch) to build, with its cache key."""

    kernel: str
    params: dict
    arch: str
    key: str
    origin: str
    spec: Any = dataclasses.field(compare=False, repr=False, hash=False)

    @property
    def plain_params(self) -> dict:
        return self.spec.plain(self.params)

    def label(self) -> str:
        return f"{self.kernel}({format_params(self.plain_params)}) {self.arch}"


def format_params(params: dict) -> str:
    out = []
    for k, v in params.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, dict):
            v = "{" + ",".join(f"{a}={b}" for a, b in v.items()) + "}"
        out.append(f"{k}={v}")
    return " ".join(out)


def _show(v: Any) -> str:
    if isinstance(v, bool):
        s = "true" if v else "false"
    elif isinstance(v, str):
        s = '"' + escape(v) + '"'  # a NUL or ESC in a value is shown, never printed raw
    else:
        s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _tname(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, dict):
        return "table"
    if isinstance(v, list):
        return "array"
    return {str: "string", int: "integer", float: "float"}.get(type(v), type(v).__name__)


def read_document(path: Path) -> dict:
    """Parse one manifest (quack.tomlfile: a regular file of at most 16 MiB, nesting
    bounded); any problem is a ManifestError naming file, line and column."""
    from quack.tomlfile import load

    try:
        return load(path, "manifest file")
    except TomlFileError as e:
        raise ManifestError([str(e)]) from None


def _kernel_header_lines(path: Path) -> list[int]:
    from quack.tomlfile import read_bytes

    try:
        lines = read_bytes(path, "manifest file").decode("utf-8").splitlines()
    except (TomlFileError, UnicodeDecodeError):
        return []
    return [i + 1 for i, ln in enumerate(lines) if re.match(r"^\s*\[\[\s*kernel\s*\]\]", ln)]


class _Ctx:
    """Collects problems for one file."""

    def __init__(self, path: Path, n_kernels: int):
        self.path = path
        self.problems: list[str] = []
        self.warnings: list[str] = []
        hl = _kernel_header_lines(path)
        self.header_lines = hl if len(hl) == n_kernels else []

    def where(self, table: str, idx: int | None = None) -> str:
        if idx is not None and self.header_lines:
            return f"{self.path}:{self.header_lines[idx]}: {table}"
        return f"{self.path}: {table}"

    def err(self, where: str, msg: str) -> None:
        self.problems.append(f"{where}: {msg}")


def _as_list(v: Any) -> list:
    return v if isinstance(v, list) else [v]


def _check_archs(ctx: _Ctx, where: str, value: Any) -> list[str] | None:
    vals = _as_list(value)
    if not vals:
        ctx.err(where, 'archs = [] is empty; give at least one arch, e.g. archs = ["sm_90a"]')
        return None
    out = []
    ok = True
    for a in vals:
        try:
            out.append(_settings.check_arch(a))
        except ValueError:
            ok = False
            close = difflib.get_close_matches(str(a), _settings.KNOWN_ARCHS, n=1)
            hint = f' (did you mean "{close[0]}"?)' if close else ""
            ctx.err(
                where,
                f"archs: {_show(a)} is not a CUDA arch cutlass-dsl knows{hint}; allowed: "
                + ", ".join(_settings.KNOWN_ARCHS),
            )
    return out if ok else None


_SHOW_BAD = 3


def _values(ctx: _Ctx, where: str, spec, pname: str, raw: Any) -> list | None:
    """Check one params entry (scalar or list) against the kernel's parameter."""
    p = spec.params[pname]
    is_config = isinstance(p, ConfigParam)
    if isinstance(raw, list):
        if not raw:
            ctx.err(where, f"params.{pname} = [] is empty; allowed: {p.describe()}")
            return None
        items = raw
    else:
        items = [raw]
    out = []
    bad: list[str] = []
    for v in items:
        if (
            isinstance(v, list)
            or (isinstance(v, dict) and not is_config)
            or not isinstance(v, (*_SCALARS, dict))
        ):
            tn = _tname(v)
            bad.append(
                f"params.{pname} = {_show(v)}: {'an' if tn[0] in 'aeiou' else 'a'} {tn} is not allowed here; "
                f"expected {p.describe()} (or a list of them)"
            )
            continue
        try:
            out.append(p.check(pname, v))
        except ParamError as e:
            bad.append(
                f"params.{pname} = {_show(v)} ({_tname(v)}) is not allowed for kernel "
                f"{spec.name}; expected {p.describe()}" + _extra(e)
            )
    ok = not bad
    # A long list of bad values is one problem: the first few, then a count.
    for msg in bad[:_SHOW_BAD]:
        ctx.err(where, msg)
    if len(bad) > _SHOW_BAD:
        ctx.err(
            where,
            f"params.{pname}: {len(bad) - _SHOW_BAD} more of its {len(items)} values are not "
            f"allowed either (not listed)",
        )
    if ok and len(set(map(repr, out))) != len(out):
        ctx.warnings.append(f"{where}: params.{pname} lists a value twice (ignored)")
        seen, uniq = set(), []
        for v in out:
            if repr(v) not in seen:
                seen.add(repr(v))
                uniq.append(v)
        out = uniq
    return out if ok else None


def _extra(e: ParamError) -> str:
    m = re.search(r"\((unknown fields.*|field .*)\)$", str(e))
    return f" ({m.group(1)})" if m else ""


def _unknown_param(ctx: _Ctx, where: str, spec, pname: str, what: str = "params") -> None:
    allowed = ", ".join(f"{n} ({p.describe()})" for n, p in spec.params.items())
    close = difflib.get_close_matches(pname, list(spec.params), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    ctx.err(
        where,
        f"{what}.{pname}: kernel {spec.name} has no parameter {pname!r}{hint}; its parameters are: {allowed}",
    )


def _matcher(ctx: _Ctx, where: str, spec, table: Any, what: str) -> dict | None:
    if not isinstance(table, dict):
        ctx.err(where, f'{what} entries must be tables like {{ dtype = "float32" }}, got {_show(table)}')
        return None
    if not table:
        ctx.err(where, f"{what} entry {{}} is empty")
        return None
    out = {}
    ok = True
    for k, v in table.items():
        if k not in spec.params:
            _unknown_param(ctx, where, spec, k, what)
            ok = False
            continue
        vals = _values(ctx, f"{where}: {what}", spec, k, v)
        if vals is None:
            ok = False
        else:
            out[k] = vals
    return out if ok else None


def _matches(combo: dict, matcher: dict) -> bool:
    return all(combo[k] in vals for k, vals in matcher.items())


@dataclasses.dataclass
class Budget:
    """The limit on configurations after expansion, over every table of every manifest
    given at once (a per-table limit alone is bypassed by many tables). A table counts
    its whole cross product (before ``exclude``) plus its ``include`` entries: the count
    is known before anything is expanded, so a refused build costs nothing."""

    limit: int = DEFAULT_MAX_CONFIGS
    used: int = 0
    exceeded: bool = False


@dataclasses.dataclass
class _Table:
    """One [[kernel]] table that passed validation: what ``_generate`` expands."""

    where: str
    origin: str
    name: str
    spec: Any
    names: list[str]
    axes: list[list]
    archs: list[str]
    excludes: list[dict]
    includes: list[dict]


def _prepare_kernel(
    ctx: _Ctx,
    idx: int,
    table: Any,
    defaults: dict,
    default_archs: list[str],
    arch_override: list[str] | None,
    budget: Budget,
    used_defaults: set,
) -> _Table | None:
    """Validate one table and count it against the budget; expands nothing."""
    label = f"[[kernel]] #{idx + 1}"
    if not isinstance(table, dict):
        ctx.err(ctx.where(label, idx), f"must be a table, got {_show(table)}")
        return None
    name = table.get("name")
    if name is None:
        ctx.err(ctx.where(label, idx), "missing key 'name' (the registered kernel name)")
        return None
    if not isinstance(name, str):
        ctx.err(ctx.where(label, idx), f"name = {_show(name)} must be a string")
        return None
    where = ctx.where(f"{label} ({escape(name)[:80]})", idx)
    try:
        spec = registry.get(name)
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
            f"name = {_show(name)}: no kernel is registered under this name{hint}; "
            f"registered kernels: {', '.join(known) or '(none)'}. Kernels are registered from "
            f"{src}: {pk}; scanned: {registry.SCANNED}",
        )
        return None
    used_defaults.add("\0resolved")
    ok = True
    for k in table:
        if k not in KERNEL_KEYS:
            ok = False
            if k in spec.params:
                ctx.err(
                    where,
                    f"unknown key {k!r}: parameters go under params, e.g. "
                    f"params = {{ {k} = {_show(table[k])} }}",
                )
            else:
                ctx.err(where, f"unknown key {k!r}; allowed keys: {', '.join(KERNEL_KEYS)}")
    archs: list[str] | None = default_archs
    if "archs" in table:
        archs = _check_archs(ctx, where, table["archs"])
        ok = ok and archs is not None
    if arch_override:
        archs = arch_override
    params = table.get("params", {})
    if not isinstance(params, dict):
        ctx.err(where, f"params = {_show(params)} must be a table of parameter = value or list")
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
    given: dict[str, list] = {}
    invalid: set[str] = set()  # given, but with a bad value: reported once, not also "missing"
    for k, v in params.items():
        if k not in spec.params:
            _unknown_param(ctx, where, spec, k)
            ok = False
            continue
        vals = _values(ctx, where, spec, k, v)
        if vals is None:
            ok = False
            invalid.add(k)
        else:
            given[k] = vals
    for k, v in defaults.items():
        if k in spec.params and k not in params:
            used_defaults.add(k)
            vals = _values(ctx, f"{ctx.where('[defaults]')} (for {label} {name})", spec, k, v)
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
    excludes: list = []
    includes: list = []
    for what, dest in (("exclude", excludes), ("include", includes)):
        raw = table.get(what, [])
        if not isinstance(raw, list):
            raw = [raw]
        for j, t in enumerate(raw):
            m = _matcher(ctx, f"{where}: {what}[{j}]", spec, t, what)
            if m is None:
                ok = False
            else:
                dest.append(m)
    if not ok or archs is None:
        return None
    names = list(spec.params)
    axes = [given[n] if n in given else [spec.defaults[n]] for n in names]
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
                    f"values for it ({', '.join(map(_show, axes[names.index(n)]))})",
                )
                return None
        resolved.append(combo)
    product = math.prod(len(a) for a in axes)
    total = (product + len(resolved)) * len(archs)
    if budget.exceeded:
        return None  # reported once, at the table that crossed the limit
    if budget.used + total > budget.limit:
        budget.exceeded = True
        dims = " x ".join(f"{n} {len(a)}" for n, a in zip(names, axes) if len(a) > 1)
        plus = f", plus {len(resolved)} include entries" if resolved else ""
        before = f"; the tables before it already expand to {budget.used}" if budget.used else ""
        ctx.err(
            where,
            f"the cross product has {total} configurations ({dims} x archs {len(archs)}{plus}){before}: "
            f"over the limit of {budget.limit} configurations per build; narrow the lists or raise "
            f"the limit with --max-configs",
        )
        return None
    budget.used += total
    return _Table(where, f"{ctx.path}:{label}", name, spec, names, axes, archs, excludes, resolved)


def _generate(ctx: _Ctx, t: _Table) -> Iterator[BuildConfig]:
    """The table's configurations, one at a time (the cross product is never held in
    memory). Problems seen only here (combinations the kernel's rules refuse, every
    combination excluded) and unused excludes go to ``ctx`` once the table is done."""
    matched = [False] * len(t.excludes)
    n_combos = n_kept = 0
    refused: list[str] = []

    def bound(combo: dict) -> Iterator[BuildConfig]:
        try:
            b = t.spec.bind((), combo)
        except ParamError as e:  # the kernel's rules across parameters (quack.params.Rule)
            if len(refused) < _SHOW_BAD:
                refused.append(
                    f"{e}; drop it from the lists or exclude it: exclude = "
                    f"[{{ {', '.join(f'{k} = {_show(v)}' for k, v in combo.items())} }}]"
                )
            else:
                refused.append("")  # counted, not listed
            return
        for arch in t.archs:
            yield BuildConfig(t.name, b, arch, t.spec.key(b, arch), t.origin, t.spec)

    for values in itertools.product(*t.axes):
        n_combos += 1
        combo = dict(zip(t.names, values))
        hit = False
        for j, m in enumerate(t.excludes):
            if _matches(combo, m):
                matched[j] = hit = True
        if not hit:
            n_kept += 1
            yield from bound(combo)
    for j, ok in enumerate(matched):
        if not ok:
            ctx.warnings.append(f"{t.where}: exclude[{j}] matches no combination")
    for combo in t.includes:
        n_kept += 1
        yield from bound(combo)
    if not n_kept:
        ctx.err(t.where, f"the cross product is empty: all {n_combos} combinations are excluded")
    for msg in refused[:_SHOW_BAD]:
        ctx.err(t.where, msg)
    if len(refused) > _SHOW_BAD:
        ctx.err(
            t.where,
            f"{len(refused) - _SHOW_BAD} more of its {n_kept} combinations are refused "
            f"by the kernel's rules (not listed)",
        )


def _prepare_document(
    path: Path, doc: dict, *, archs: Iterable[str], arch_override, budget: Budget
) -> tuple[_Ctx, list[_Table]]:
    """Validate one parsed manifest: its problems land in the returned context."""
    kernels = doc.get("kernel", [])
    ctx = _Ctx(path, len(kernels) if isinstance(kernels, list) else 0)
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
            a = _check_archs(ctx, ctx.where("[defaults]"), defaults["archs"])
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
    tables: list[_Table] = []
    used: set = set()
    for i, t in enumerate(kernels):
        tb = _prepare_kernel(ctx, i, t, dparams, default_archs, arch_override, budget, used)
        if tb is not None:
            tables.append(tb)
    for k in dparams:
        if k not in used and "\0resolved" in used:
            ctx.err(ctx.where("[defaults]"), f"params.{k}: no kernel in this manifest has a parameter {k!r}")
    return ctx, tables


@dataclasses.dataclass
class Expansion:
    configs: list[BuildConfig]  # unique by key, in manifest order
    duplicates: int
    warnings: list[str]
    files: list[str]


class ExpansionStream:
    """Manifests expanded one configuration at a time, for output that streams
    (``quack build --dry-run``). Iterating first reads and validates every file and
    table (syntax, keys, values, the ``max_configs`` total: all counted, nothing
    expanded yet) and, if any is invalid, raises ManifestError with every problem
    (those of the valid tables' expansion too) before yielding anything;
    then yields the unique configurations in manifest order as they are expanded.
    Problems seen only while expanding (combinations the kernel's rules refuse, a table
    whose combinations are all excluded) raise ManifestError when the iteration ends.
    ``warnings``, ``duplicates`` and ``files`` fill in as it goes; iterate once."""

    def __init__(
        self,
        paths: Iterable[Path | str],
        *,
        archs: Iterable[str] = (),
        arch_override=None,
        max_configs: int = DEFAULT_MAX_CONFIGS,
    ):
        self._paths = [Path(p) for p in paths]
        self._archs = list(archs)
        self._arch_override = arch_override
        self._max_configs = max_configs
        self.files = [str(p) for p in self._paths]
        self.warnings: list[str] = []
        self.duplicates = 0

    def __iter__(self) -> Iterator[BuildConfig]:
        if self._arch_override:
            bad = [a for a in self._arch_override if a not in _settings.KNOWN_ARCHS]
            if bad:
                raise ManifestError(
                    [
                        f"--arch {bad[0]!r} is not a CUDA arch cutlass-dsl knows; allowed: "
                        + ", ".join(_settings.KNOWN_ARCHS)
                    ]
                )
        problems: list[str] = []
        budget = Budget(self._max_configs)
        prepared: list[tuple[_Ctx, list[_Table]]] = []
        for path in self._paths:
            try:
                doc = read_document(path)
            except ManifestError as e:
                problems.extend(e.problems)
                continue
            ctx, tables = _prepare_document(
                path, doc, archs=self._archs, arch_override=self._arch_override, budget=budget
            )
            del doc  # the parsed lists can be large; the tables hold what expansion needs
            prepared.append((ctx, tables))
            problems.extend(ctx.problems)
            self.warnings.extend(ctx.warnings)
        if problems:
            # Expand the valid tables anyway (yielding nothing) so that problems only
            # expansion finds are reported in the same run: every problem at once.
            # Not past the limit: that refusal must cost nothing.
            for ctx, tables in prepared if not budget.exceeded else ():
                n_problems = len(ctx.problems)
                for t in tables:
                    for _ in _generate(ctx, t):
                        pass
                problems.extend(ctx.problems[n_problems:])
            raise ManifestError(problems)
        seen: set[str] = set()
        for ctx, tables in prepared:
            n_problems, n_warnings = len(ctx.problems), len(ctx.warnings)
            for t in tables:
                for c in _generate(ctx, t):
                    if c.key in seen:
                        self.duplicates += 1
                        continue
                    seen.add(c.key)
                    yield c
            problems.extend(ctx.problems[n_problems:])
            self.warnings.extend(ctx.warnings[n_warnings:])
        if problems:
            raise ManifestError(problems)


def expand(
    paths: Iterable[Path | str],
    *,
    archs: Iterable[str] = (),
    arch_override=None,
    max_configs: int = DEFAULT_MAX_CONFIGS,
) -> Expansion:
    """Read, validate and expand manifests; raises ManifestError with every problem."""
    stream = ExpansionStream(paths, archs=archs, arch_override=arch_override, max_configs=max_configs)
    configs = list(stream)
    return Expansion(configs, stream.duplicates, stream.warnings, stream.files)
