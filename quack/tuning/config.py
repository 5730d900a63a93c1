"""``TuneConfig``: the base of a kernel family's typed launch configuration.

    @dataclasses.dataclass(frozen=True)
    class SoftmaxFwdConfig(TuneConfig):
        online: bool | None = knob(Bool(), "one all-reduce round trip of (max, sum exp)")
        fwd_min_blocks: int | None = knob(Int(min=0, max=32), "CTAs / SM asked of ptxas")

Every field is a ``knob``: a ``quack.params`` scalar Param that checks it, and a line of
documentation. ``None`` means "the kernel's own heuristic decides" (the compile function
reads ``cfg.knobs()``, a dict of the fields that are set). Constructing one checks each
field, so a misspelt or out-of-range knob is refused where it is written (a dict with an
unknown field: ``from_dict`` / ``quack.params.Config``), never silently ignored."""

from __future__ import annotations

import dataclasses
from typing import Any

from quack.errors import ParamError
from quack.params import Param


def knob(param: Param, doc: str = "") -> Any:
    """A configuration field: checked by ``param`` when set, ``None`` by default."""
    return dataclasses.field(default=None, metadata={"param": param, "doc": doc})


_FIELDS: dict[type, tuple[tuple[str, Param | None], ...]] = {}


def _knob_fields(cls: type) -> tuple[tuple[str, Param | None], ...]:
    """(name, its Param) of each field, read once a class: ``dataclasses.fields`` on every
    construction and ``knobs()`` was ~a quarter of ``spec.bind``'s CPU time (a configuration
    is derived on every bind; tests/kernels/test_default_configs_cpu.py's sweeps bind ~100k)."""
    got = _FIELDS.get(cls)
    if got is None:
        got = _FIELDS[cls] = tuple((f.name, f.metadata.get("param")) for f in dataclasses.fields(cls))
    return got


class TuneConfig:
    """Base of the typed configurations (subclasses are ``@dataclass(frozen=True)``)."""

    _set_knobs: dict  # set by __post_init__ (a plain attribute: not a dataclass field)

    def __post_init__(self) -> None:
        knobs = {}
        for name, p in _knob_fields(type(self)):
            if p is None:
                raise TypeError(f"{type(self).__name__}.{name}: declare it with quack.tuning.knob(...)")
            v = getattr(self, name)
            if v is None:
                continue
            try:
                canon = p.check(name, v)
            except ParamError as e:
                raise ParamError(f"{type(self).__name__}: {e}", param=name) from None
            object.__setattr__(self, name, canon)
            knobs[name] = canon
        # The set fields, kept for ``knobs()``: the instance is frozen, and a bind reads them
        # once or twice per derived configuration (a dict built from every field each time
        # was a tenth of a sweep's bind). Not a field: equality, hashing, ``fields`` and the
        # key see only the knobs themselves.
        object.__setattr__(self, "_set_knobs", knobs)

    @classmethod
    def from_dict(cls, values: dict, where: str = "") -> "TuneConfig":
        """An instance from a plain dict (a table row, a manifest); unknown fields refused."""
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ParamError(
                f"{where + ': ' if where else ''}{cls.__name__}: unknown field {unknown[0]!r}; "
                f"fields are {', '.join(names)}",
                param=str(unknown[0]),
            )
        try:
            return cls(**values)
        except ParamError as e:  # a bad value: say which row of which file holds it
            if not where:
                raise
            raise ParamError(f"{where}: {e}", kernel=e.kernel, param=e.param) from None

    def knobs(self) -> dict:
        """The fields that are set, as a fresh dict (what the kernel code reads)."""
        return dict(self._set_knobs)

    def label(self) -> str:
        """A short readable form for tables and logs: ``x_rows=2 x_smem=true``."""
        kn = self.knobs()
        return (
            " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in kn.items())
            or "default"
        )
