"""Typed compile-time parameters of a registered kernel.

Each Param checks a value (from a runtime call or a TOML manifest), turns it
into its canonical Python form, and encodes it as tagged JSON for the key.
Tags keep ``True`` and ``1`` (and ``1`` and ``1.0``) apart."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from quack import param_specs
from quack.errors import ParamError

DTYPES = ("float32", "float16", "bfloat16")  # Dtype()'s default choices (unchanged: issue 27)
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
INT_DTYPES = ("int8", "uint8", "int16", "int32", "int64")
# Every canonical name Dtype(choices=...) may list. fp8 and integer dtypes are opt-in
# (``Dtype(choices=DTYPES + FP8_DTYPES)``): a kernel declared with ``Dtype()`` keeps
# refusing them, and the key of an existing value (["dtype", name]) never changes.
ALL_DTYPES = DTYPES + FP8_DTYPES + INT_DTYPES
# Spellings accepted for a dtype, beside the canonical names: torch's and
# cutlass's names, so callers can pass ``torch.bfloat16`` or ``cutlass.BFloat16``
# (``torch.float8_e4m3fn`` / ``cutlass.Float8E4M3FN``, ``torch.int8`` / ``cutlass.Int8``).
# Each maps to one canonical name, so every spelling gives the same key.
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
    "float8_e4m3fn": "float8_e4m3fn",
    "float8e4m3fn": "float8_e4m3fn",  # cutlass.Float8E4M3FN
    "float8e4m3": "float8_e4m3fn",  # cutlass.Float8E4M3 (the same finite-only format)
    "fp8_e4m3fn": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "e4m3": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "float8e5m2": "float8_e5m2",  # cutlass.Float8E5M2
    "fp8_e5m2": "float8_e5m2",
    "e5m2": "float8_e5m2",
    "int8": "int8",
    "uint8": "uint8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
}


class _Frozen:
    """A frozen value: equal to (and hashed as) one of the same class with the same
    ``_fields``, printed as ``Int(min=1, max=None, choices=None)``. Written out rather than
    ``@dataclass(frozen=True)``: a dataclass builds its methods with ``exec`` when the class
    is defined, ~0.4 ms a class: 2.7 ms of the first kernel module's import (issue 15)."""

    _fields: tuple[str, ...] = ()  # in constructor order

    def _set(self, **values: Any) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

    def _values(self) -> tuple:
        return tuple(getattr(self, f) for f in self._fields)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return (
            f"{type(self).__qualname__}(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in self._fields) + ")"
        )


class Param(_Frozen):
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


class Dtype(Param):
    """A dtype, by canonical name: 'float32', 'float16', 'bfloat16' by default; fp8
    ('float8_e4m3fn', 'float8_e5m2') and integers ('int8', 'uint8', 'int16', 'int32',
    'int64') when ``choices`` lists them (``DTYPES + FP8_DTYPES``). torch's and cutlass's
    names are accepted and canonicalised, so ``torch.float8_e4m3fn`` and
    ``cutlass.Float8E4M3FN`` give the same key as ``"float8_e4m3fn"``."""

    kind = "dtype"
    _fields = ("choices",)
    choices: tuple[str, ...]

    def __init__(self, choices: tuple[str, ...] = DTYPES):
        bad = [c for c in choices if c not in ALL_DTYPES] if isinstance(choices, tuple) else [choices]
        if bad or not choices:
            # A typo here would refuse every value with a message blaming the caller.
            raise TypeError(
                f"Dtype(choices=...) needs a non-empty tuple of canonical dtype names "
                f"({', '.join(ALL_DTYPES)}); got {bad[0] if bad else choices!r}"
            )
        self._set(choices=choices)

    def check(self, name, value):
        canon = dtype_name(value) if not isinstance(value, bool) else None
        if canon is None or canon not in self.choices:
            raise self._fail(name, value)
        return canon

    def encode(self, value):
        return ["dtype", value]

    def describe(self):
        return "one of the dtypes " + ", ".join(self.choices)


class Int(Param):
    """An integer in [min, max], optionally one of ``choices``; bools are refused."""

    kind = "int"
    _fields = ("min", "max", "choices")
    min: int | None
    max: int | None
    choices: tuple[int, ...] | None

    def __init__(
        self, min: int | None = None, max: int | None = None, choices: tuple[int, ...] | None = None
    ):
        spec = "Int(...)"
        min = param_specs.number(spec, "min", min, floats=False)
        max = param_specs.number(spec, "max", max, floats=False)
        param_specs.ordered(spec, min, max)
        if choices is not None:
            choices = param_specs.choices(spec, choices, int, "integers")
            outside = [c for c in choices if (min is not None and c < min) or (max is not None and c > max)]
            if outside:  # a choice no call could ever pass: a typo in the spec
                raise ValueError(f"{spec}: choice {outside[0]!r} is outside [min, max] = [{min}, {max}]")
        self._set(min=min, max=max, choices=choices)

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


class Float(Param):
    """A finite float (encoded exactly, through float.hex)."""

    kind = "float"
    _fields = ("min", "max")
    min: float | None
    max: float | None

    def __init__(self, min: float | None = None, max: float | None = None):
        min = param_specs.number("Float(...)", "min", min, floats=True)
        max = param_specs.number("Float(...)", "max", max, floats=True)
        param_specs.ordered("Float(...)", min, max)
        self._set(min=min, max=max)

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


class Choice(Param):
    """One of a fixed set of strings."""

    kind = "choice"
    _fields = ("choices",)
    choices: tuple[str, ...]

    def __init__(self, choices: tuple[str, ...]):
        self._set(choices=param_specs.choices("Choice(...)", choices, str, "strings"))

    def check(self, name, value):
        if not isinstance(value, str) or value not in self.choices:
            raise self._fail(name, value)
        return value

    def encode(self, value):
        return ["str", value]

    def describe(self):
        return "one of " + ", ".join(repr(c) for c in self.choices)


class Tuple(Param):
    """A fixed-length tuple, each element its own Param: ``Tuple(Int(min=1), Int(min=1))``
    for a tile shape. A call passes a tuple (or list) of exactly that length; a manifest
    writes each value as a TOML array inside the list of values: ``tile = [[128, 256]]``
    is one value, ``tile = [[128, 256], [256, 128]]`` two (the outer list is always the
    list of values, so a flat ``tile = [128, 256]`` is refused with that hint). Encoded
    as ``["tuple", [<each element's tagged encoding>]]``."""

    kind = "tuple"
    _fields = ("items",)
    items: tuple[Param, ...]

    def __init__(self, *items: Param):
        if not items or not all(isinstance(p, Param) and not isinstance(p, Config) for p in items):
            raise TypeError(f"Tuple(...) needs one or more scalar quack.params.Param elements, got {items!r}")
        self._set(items=tuple(items))

    def check(self, name, value):
        if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
            raise self._fail(name, value)
        if len(value) != len(self.items):
            raise self._fail(name, value, f" (it has {len(value)} elements)")
        out = []
        for i, (p, v) in enumerate(zip(self.items, value)):
            try:
                out.append(p.check(f"{name}[{i}]", v))
            except ParamError as e:
                raise self._fail(name, value, f" (element {i}: {e})") from None
        return tuple(out)

    def encode(self, value):
        return ["tuple", [p.encode(v) for p, v in zip(self.items, value)]]

    def describe(self):
        return f"a tuple of {len(self.items)} (" + "; ".join(p.describe() for p in self.items) + ")"


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> tuple[str, ...]:
    """A dataclass's field names, read once a class: ``dataclasses.fields`` on every check
    was a sixth of ``KernelSpec.bind``'s time (a configuration is checked on every bind)."""
    return tuple(f.name for f in dataclasses.fields(cls))


class Config(Param):
    """A small frozen dataclass of ints / bools / floats / strs. A manifest
    gives it as an inline table; a runtime call as an instance or a dict."""

    kind = "config"
    _fields = ("cls", "derive")
    cls: type
    # ``derive(params, arch) -> instance``: the default when a call or manifest gives none
    # (``None``): applied by KernelSpec.bind once the other parameters are checked, so the
    # derived configuration is in the key (a tuned kernel's ``default_config``; issue 25).
    derive: Any

    def __init__(self, cls: type = object, derive: Any = None):
        if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
            raise TypeError(f"Config needs a frozen dataclass, got {cls!r}")
        if derive is not None and not callable(derive):
            raise TypeError(f"Config(derive=...) needs a callable (params, arch) -> {cls.__name__}")
        self._set(cls=cls, derive=derive)

    def check(self, name, value):
        if value is None and self.derive is not None:
            return None  # KernelSpec.bind derives it
        if isinstance(value, dict):
            names = {f.name for f in dataclasses.fields(self.cls)}
            unknown = sorted(set(value) - names)
            if unknown:
                raise self._fail(name, value, f" (unknown fields {unknown}; fields are {sorted(names)})")
            try:
                value = self.cls(**value)
            except (TypeError, ParamError) as e:  # ParamError: a TuneConfig field's own check
                raise self._fail(name, value, f" ({e})") from None
        if type(value) is not self.cls:
            raise self._fail(name, value)
        for fname in _field_names(self.cls):  # type: ignore[arg-type]  # a class is hashable
            v = getattr(value, fname)
            if v is not None and not isinstance(v, (bool, int, float, str)):
                raise self._fail(name, value, f" (field {fname!r} must be a bool, int, float or str)")
            if isinstance(v, float) and not math.isfinite(v):
                raise self._fail(name, value, f" (field {fname!r} is not finite)")
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
    if isinstance(value, tuple):  # a Tuple parameter: a TOML / JSON array
        return list(value)
    return value


class Rule(_Frozen):
    """A constraint across a kernel's parameters, declared at registration
    (``@jit_cache(..., rules=[Rule(...)])``) and applied wherever parameters are bound:
    manifest validation (``quack build``, ``verify``) and every run-time call, before
    anything compiles. It refuses configurations each parameter alone would allow but
    the kernel cannot compile (e.g. a row length its vector width does not divide).

    ``check(params)`` gets the bound, canonical parameters (defaults applied) and
    returns True when the combination is allowed; ``param`` is the parameter the
    message names, ``allowed`` says what is allowed, in words. A rule whose ``param`` is
    ``"arch"`` is applied where the target arch is known (each arch of a manifest table
    at expansion: ``quack build -n`` lists the refusal and exits 1; every run-time call)
    and its ``check`` finds the arch in ``params["arch"]``:
    ``Rule("arch", "SM90 only (wgmma)", lambda p: p["arch"].startswith("sm_90"))``. A refusal is a
    ParamError: ``<kernel>: <param> = <value> is not allowed with <the others>:
    <allowed>``."""

    _fields = ("param", "allowed", "check")
    param: str
    allowed: str
    check: Any  # Callable[[dict[str, Any]], bool]

    def __init__(self, param: str, allowed: str, check: Any):  # check: Callable[[dict], bool]
        self._set(param=param, allowed=allowed, check=check)

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
