"""Checks of a parameter spec's own arguments (``Int(min=10, max=1)``, ``Choice("ab")``),
run when the spec is constructed: a bad spec used to be accepted and then refuse (or,
for ``Choice("ab")``, accept substrings of) every value at call time, with a message
blaming the caller. Raises TypeError for a wrong type, ValueError for an empty or
inverted set of allowed values; each message names the spec, the argument and what it
allows."""

from __future__ import annotations

import math
from typing import Any


def number(spec: str, field: str, value: Any, *, floats: bool) -> Any:
    """``value`` as a bound of ``spec``: None, an int (not a bool) or, with ``floats``, a
    finite float. A str bound gave a bare ``'<' not supported`` TypeError at call time."""
    if value is None:
        return None
    kinds = (int, float) if floats else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds):
        what = "a finite number (int or float)" if floats else "an integer"
        raise TypeError(f"{spec}: {field}={value!r} is not allowed; {field} must be {what} or None")
    if floats and not math.isfinite(value):
        raise ValueError(f"{spec}: {field}={value!r} is not allowed; {field} must be finite (or None)")
    return value


def ordered(spec: str, lo: Any, hi: Any) -> None:
    """min <= max, or no value is ever allowed."""
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(
            f"{spec}: min={lo!r} is greater than max={hi!r}, so no value is allowed; "
            f"give min <= max (bounds are inclusive)"
        )


def choices(spec: str, values: Any, item: type, what: str) -> tuple:
    """A non-empty tuple (a list is taken too) of ``item``s. A str is refused: ``value in
    "ab"`` accepts every substring (``"a"``, ``""``); so is a bool where ints are listed."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (tuple, list)):
        raise TypeError(
            f"{spec}: choices={values!r} is not allowed; choices must be a tuple of {what}, "
            f"e.g. ({_example(item)},) for a single choice"
        )
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, item)]
    if bad:
        raise TypeError(f"{spec}: choice {bad[0]!r} is not allowed; choices must all be {what}")
    if not values:
        raise ValueError(f"{spec}: choices=() allows no value; give at least one choice ({what})")
    return tuple(values)


def _example(item: type) -> str:
    return "'a'" if item is str else "64"
