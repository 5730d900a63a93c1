"""Typed compile-time parameters of a registered kernel.

Each Param checks a value (from a runtime call or a TOML manifest), turns it
into its canonical Python form, and encodes it as tagged JSON for the key.
Tags keep ``True`` and ``1`` (and ``1`` and ``1.0``) apart."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from quack.errors import ParamError

DTYPES = ("float32", "float16", "bfloat16")
# Spellings accepted for a dtype, beside the canonical names: torch's and
# cutlass's names, so callers can pass ``torch.bfloat16`` or ``cutlass.BFloat16``.
_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


class Param:
    """Base of parameter specs. ``check`` raises ParamError naming the parameter."""

    kind = "param"

    def check(self, name: str, value: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def encode(self, value: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _fail(self, name: str, value: Any, extra: str = "") -> ParamError:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return ParamError(
            f"parameter {name!r}: {shown} is not allowed; expected {self.describe()}{extra}",
            param=name,
        )


def dtype_name(value: Any) -> str | None:
    """Canonical dtype name of a str / torch.dtype / cutlass type, or None."""
    if isinstance(value, str):
        s = value
    else:
        s = getattr(value, "__name__", None) or str(value)
    s = s.strip().lower()
    if s.startswith("torch."):
        s = s[len("torch.") :]
    return _DTYPE_ALIASES.get(s)


@dataclasses.dataclass(frozen=True)
class Dtype(Param):
    """A floating dtype, by canonical name ('float32', 'float16', 'bfloat16')."""

    choices: tuple[str, ...] = DTYPES
    kind = "dtype"

    def check(self, name, value):
        canon = dtype_name(value) if not isinstance(value, bool) else None
        if canon is None or canon not in self.choices:
            raise self._fail(name, value)
        return canon

    def encode(self, value):
        return ["dtype", value]

    def describe(self):
        return "one of the dtypes " + ", ".join(self.choices)


@dataclasses.dataclass(frozen=True)
class Int(Param):
    """An integer in [min, max], optionally one of ``choices``; bools are refused."""

    min: int | None = None
    max: int | None = None
    choices: tuple[int, ...] | None = None
    kind = "int"

    def check(self, name, value):
        if isinstance(value, bool) or not isinstance(value, int):
            # Integral values from numpy / torch are fine; bools and floats are not.
            if not isinstance(value, bool) and hasattr(value, "__index__"):
                value = value.__index__()
            else:
                raise self._fail(name, value)
        if self.choices is not None and value not in self.choices:
            raise self._fail(name, value)
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            raise self._fail(name, value)
        return int(value)

    def encode(self, value):
        return ["int", value]

    def describe(self):
        if self.choices is not None:
            return "an integer, one of " + ", ".join(map(str, self.choices))
        lo = "-inf" if self.min is None else str(self.min)
        hi = "inf" if self.max is None else str(self.max)
        return f"an integer in [{lo}, {hi}]"


@dataclasses.dataclass(frozen=True)
class Bool(Param):
    """true or false; 0/1 are refused so that True and 1 never share a key."""

    kind = "bool"

    def check(self, name, value):
        if not isinstance(value, bool):
            raise self._fail(name, value)
        return value

    def encode(self, value):
        return ["bool", value]

    def describe(self):
        return "a boolean (true or false)"


@dataclasses.dataclass(frozen=True)
class Float(Param):
    """A finite float (encoded exactly, through float.hex)."""

    min: float | None = None
    max: float | None = None
    kind = "float"

    def check(self, name, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._fail(name, value)
        value = float(value)
        if not math.isfinite(value):
            raise self._fail(name, value)
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            raise self._fail(name, value)
        return value

    def encode(self, value):
        return ["float", float(value).hex()]

    def describe(self):
        return f"a finite float in [{self.min}, {self.max}]"


@dataclasses.dataclass(frozen=True)
class Choice(Param):
    """One of a fixed set of strings."""

    choices: tuple[str, ...] = ()
    kind = "choice"

    def check(self, name, value):
        if not isinstance(value, str) or value not in self.choices:
            raise self._fail(name, value)
        return value

    def encode(self, value):
        return ["str", value]

    def describe(self):
        return "one of " + ", ".join(repr(c) for c in self.choices)


@dataclasses.dataclass(frozen=True)
class Config(Param):
    """A small frozen dataclass of ints / bools / floats / strs. A manifest
    gives it as an inline table; a runtime call as an instance or a dict."""

    cls: type = object
    kind = "config"

    def __post_init__(self):
        if not (dataclasses.is_dataclass(self.cls) and self.cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
            raise TypeError(f"Config needs a frozen dataclass, got {self.cls!r}")

    def check(self, name, value):
        if isinstance(value, dict):
            names = {f.name for f in dataclasses.fields(self.cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise self._fail(name, value, f" (unknown fields {unknown}; fields are {sorted(names)})")
            try:
                value = self.cls(**value)
            except TypeError as e:
                raise self._fail(name, value, f" ({e})") from None
        if type(value) is not self.cls:
            raise self._fail(name, value)
        for f in dataclasses.fields(value):  # type: ignore[arg-type]  # checked: an instance of cls
            v = getattr(value, f.name)
            if v is not None and not isinstance(v, (bool, int, float, str)):
                raise self._fail(name, value, f" (field {f.name!r} must be a bool, int, float or str)")
            if isinstance(v, float) and not math.isfinite(v):
                raise self._fail(name, value, f" (field {f.name!r} is not finite)")
        return value

    def encode(self, value):
        fields = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            fields[f.name] = _encode_scalar(v)
        return ["config", f"{self.cls.__module__}.{self.cls.__qualname__}", fields]

    def describe(self):
        names = ", ".join(f.name for f in dataclasses.fields(self.cls))
        return f"a {self.cls.__name__} (a table with fields {names})"

    def to_plain(self, value) -> dict:
        return dataclasses.asdict(value)


def _encode_scalar(v):
    if v is None:
        return ["none"]
    if isinstance(v, bool):
        return ["bool", v]
    if isinstance(v, int):
        return ["int", v]
    if isinstance(v, float):
        return ["float", v.hex()]
    return ["str", v]


def plain(value: Any) -> Any:
    """A JSON/TOML-friendly form of a canonical parameter value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


@dataclasses.dataclass(frozen=True)
class Rule:
    """A constraint across a kernel's parameters, declared at registration
    (``@jit_cache(..., rules=[Rule(...)])``) and applied wherever parameters are bound:
    manifest validation (``quack build``, ``verify``) and every run-time call, before
    anything compiles. It refuses configurations each parameter alone would allow but
    the kernel cannot compile (e.g. a row length its vector width does not divide).

    ``check(params)`` gets the bound, canonical parameters (defaults applied) and
    returns True when the combination is allowed; ``param`` is the parameter the
    message names, ``allowed`` says what is allowed, in words. A refusal is a
    ParamError: ``<kernel>: <param> = <value> is not allowed with <the others>:
    <allowed>``."""

    param: str
    allowed: str
    check: Any  # Callable[[dict[str, Any]], bool]

    def apply(self, kernel: str, params: dict[str, Any]) -> None:
        if self.check(params):
            return
        others = ", ".join(f"{n}={plain(v)!r}" for n, v in params.items() if n != self.param)
        raise ParamError(
            f"{kernel}: {self.param} = {plain(params.get(self.param))!r} is not allowed"
            + (f" with {others}" if others else "")
            + f": {self.allowed}",
            kernel=kernel,
            param=self.param,
        )
