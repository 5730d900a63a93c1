"""Manifest validation, one value at a time: the per-file problem collector (with the
line of each [[kernel]] header), how values and their types are shown in messages, and
the checks of archs, parameter values and include/exclude matchers against a kernel's
parameters. quack_build.manifest.tables applies them to whole tables."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from quack import settings as _settings
from quack.errors import ParamError, TomlFileError
from quack.params import Config as ConfigParam
from quack.params import Tuple as TupleParam
from quack.tomlfile import escape

_SCALARS = (str, int, float, bool)


def show_value(v: Any) -> str:
    if isinstance(v, bool):
        s = "true" if v else "false"
    elif isinstance(v, str):
        s = '"' + escape(v) + '"'  # a NUL or ESC in a value is shown, never printed raw
    elif isinstance(v, (tuple, list)):  # a Tuple parameter's value, as TOML writes it
        s = "[" + ", ".join(show_value(x) for x in v) + "]"
    else:
        s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def type_name(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, dict):
        return "table"
    if isinstance(v, list):
        return "array"
    return {str: "string", int: "integer", float: "float"}.get(type(v), type(v).__name__)


def _kernel_header_lines(path: Path) -> list[int]:
    from quack.tomlfile import read_bytes

    try:
        lines = read_bytes(path, "manifest file").decode("utf-8").splitlines()
    except (TomlFileError, UnicodeDecodeError):
        return []
    return [i + 1 for i, ln in enumerate(lines) if re.match(r"^\s*\[\[\s*kernel\s*\]\]", ln)]


class FileCheck:
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


def check_archs(ctx: FileCheck, where: str, value: Any) -> list[str] | None:
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
                f"archs: {show_value(a)} is not a CUDA arch cutlass-dsl knows{hint}; allowed: "
                + ", ".join(_settings.KNOWN_ARCHS),
            )
    return out if ok else None


SHOW_BAD = 3


def check_values(ctx: FileCheck, where: str, spec, pname: str, raw: Any) -> list | None:
    """Check one params entry (scalar or list) against the kernel's parameter."""
    p = spec.params[pname]
    is_config = isinstance(p, ConfigParam)
    is_tuple = isinstance(p, TupleParam)
    if is_tuple and not (isinstance(raw, list) and raw and all(isinstance(v, list) for v in raw)):
        # The outer list is always the list of values: [128, 256] would be two values.
        ctx.err(
            where,
            f"params.{pname} = {show_value(raw)}: {pname} is a tuple parameter ({p.describe()}); "
            f"write each value as an array inside the list of values: {pname} = [[128, 256]] is "
            f"one value, {pname} = [[128, 256], [256, 128]] two",
        )
        return None
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
            (isinstance(v, list) and not is_tuple)
            or (isinstance(v, dict) and not is_config)
            or not isinstance(v, (*_SCALARS, dict, list))
        ):
            tn = type_name(v)
            bad.append(
                f"params.{pname} = {show_value(v)}: {'an' if tn[0] in 'aeiou' else 'a'} {tn} is not allowed here; "
                f"expected {p.describe()} (or a list of them)"
            )
            continue
        try:
            out.append(p.check(pname, v))
        except ParamError as e:
            bad.append(
                f"params.{pname} = {show_value(v)} ({type_name(v)}) is not allowed for kernel "
                f"{spec.name}; expected {p.describe()}" + _extra(e, p.describe())
            )
    ok = not bad
    # A long list of bad values is one problem: the first few, then a count.
    for msg in bad[:SHOW_BAD]:
        ctx.err(where, msg)
    if len(bad) > SHOW_BAD:
        ctx.err(
            where,
            f"params.{pname}: {len(bad) - SHOW_BAD} more of its {len(items)} values are not "
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


def _extra(e: ParamError, described: str) -> str:
    """What the parameter's error says beyond "expected <described>": which field of a
    configuration table is wrong and what it allows. A pattern that kept only some forms
    dropped "parameter 'fwd_min_blocks': 99 is not allowed; expected an integer in [0, 32]"."""
    text, said = str(e), f"expected {described}"
    at = text.find(said)
    rest = text[at + len(said) :].strip() if at >= 0 else ""
    return f" {rest}" if rest else ""


def report_unknown_param(ctx: FileCheck, where: str, spec, pname: str, what: str = "params") -> None:
    allowed = ", ".join(f"{n} ({p.describe()})" for n, p in spec.params.items())
    close = difflib.get_close_matches(pname, list(spec.params), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    ctx.err(
        where,
        f"{what}.{pname}: kernel {spec.name} has no parameter {pname!r}{hint}; its parameters are: {allowed}",
    )


def check_matcher(ctx: FileCheck, where: str, spec, table: Any, what: str) -> dict | None:
    if not isinstance(table, dict):
        ctx.err(where, f'{what} entries must be tables like {{ dtype = "float32" }}, got {show_value(table)}')
        return None
    if not table:
        ctx.err(where, f"{what} entry {{}} is empty")
        return None
    out = {}
    ok = True
    for k, v in table.items():
        if k not in spec.params:
            report_unknown_param(ctx, where, spec, k, what)
            ok = False
            continue
        vals = check_values(ctx, f"{where}: {what}", spec, k, v)
        if vals is None:
            ok = False
        else:
            out[k] = vals
    return out if ok else None
