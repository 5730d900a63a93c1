"""Tuning tables: TOML data files of measured winners (docs/tuning.md "The table").

    [table]
    arch = "sm_90a"
    default_gpu = "H200"

    [[row]]
    kernel = "layernorm_fwd"
    gpu = "H200"
    class = "wide/cta256"            # the kernel's problem class (its ``problem_class``)
    dtype = ["bfloat16", "float16"]   # optional: every dtype
    n = [16384, 16384]                # inclusive N range
    config = { x_smem = true, x_rows = 4, threads = 512 }
    time_us = 519.0                   # optional: the measured time, its shape, the date
    shape = "32768x16384"
    date = "2025-06-01"

A lookup takes the rows of the kernel, GPU and class whose N range holds n and whose
dtypes (if listed) hold the dtype; the narrowest N range wins, then the row listing the
fewest dtypes (a row without ``dtype`` holds every one). Two rows that could tie for some
(dtype, n) are refused, so no answer depends on the rows' order in the file (``write``
sorts them: a re-tune's diff is its winners). Every value is checked on load for what
``write`` can print back: a table that loads can be written unchanged."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from quack import tomlfile
from quack.errors import TuningTableError

ROW_FIELDS = ("kernel", "gpu", "class", "dtype", "n", "config", "time_us", "shape", "date", "note")
_REQUIRED = ("kernel", "gpu", "class", "n", "config")
_BARE = re.compile(r"^[A-Za-z0-9_-]+$")
# A TOML basic string: a backslash, a quote and every control character escaped (a note
# with a newline was written raw and the table no longer parsed: every kernel call failed)
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_ESCAPES.update({chr(c): f"\\u{c:04x}" for c in (*range(0x20), 0x7F) if chr(c) not in _ESCAPES})


@dataclasses.dataclass(frozen=True)
class Row:
    kernel: str
    gpu: str
    cls: str
    n: tuple[int, int]
    config: dict
    dtype: tuple[str, ...] = ()
    time_us: float | None = None
    shape: str = ""
    date: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        # one spelling of a dtype set: ["float16", "bfloat16"] and its reverse (or a repeat)
        # are one row's identity, not two rows that tie
        object.__setattr__(self, "dtype", tuple(sorted(set(self.dtype))))

    def ident(self) -> tuple:
        return (self.kernel, self.gpu, self.cls, self.dtype, self.n)

    def rank(self) -> tuple:
        """Lower wins among rows that match: the narrowest N range, then the fewest dtypes."""
        return (self.n[1] - self.n[0], len(self.dtype) if self.dtype else math.inf)

    def ties(self, other: "Row") -> bool:
        """Whether a lookup could match both rows with one rank (its answer would depend on
        their order): same kernel, GPU and class, overlapping N ranges, equal rank, dtype
        sets that share a dtype (or neither lists any)."""
        return (
            (self.kernel, self.gpu, self.cls) == (other.kernel, other.gpu, other.cls)
            and self.n[0] <= other.n[1]
            and other.n[0] <= self.n[1]
            and self.rank() == other.rank()
            and (not self.dtype or bool(set(self.dtype) & set(other.dtype)))
        )

    def matches(self, kernel: str, gpu: str, cls: str, dtype: str, n: int) -> bool:
        return (
            self.kernel == kernel
            and self.gpu == gpu
            and self.cls == cls
            and self.n[0] <= n <= self.n[1]
            and (not self.dtype or dtype in self.dtype)
        )


class Table:
    """One arch's table: ``rows`` plus the ``default_gpu`` a CPU-only build keys for."""

    def __init__(self, arch: str, default_gpu: str, rows: list[Row] | None = None, path: str = ""):
        self.arch = arch
        self.default_gpu = default_gpu
        self.path = path
        self.rows: list[Row] = []
        for r in rows or []:
            self.put(r, replace=False)

    # ------------------------------------------------------------------ reading
    @classmethod
    def load(cls, path: Path | str) -> "Table":
        raw = tomlfile.load(path, "tuning table")
        p = str(path)
        extra = sorted(set(raw) - {"table", "row"})
        if extra:
            raise TuningTableError(p, f"unknown key {extra[0]!r}; a table has [table] and [[row]]s")
        head = raw.get("table")
        if (
            not isinstance(head, dict)
            or not isinstance(head.get("arch"), str)
            or not isinstance(head.get("default_gpu"), str)
        ):
            raise TuningTableError(p, 'needs [table] with arch = "sm_.." and default_gpu = "<model>"')
        rows = raw.get("row", [])
        if not isinstance(rows, list):
            raise TuningTableError(p, "row must be an array of tables ([[row]])")
        t = cls(head["arch"], head["default_gpu"], path=p)
        for i, r in enumerate(rows, 1):
            t.put(_row(p, i, r), replace=False, where=(p, i))
        return t

    def lookup(self, kernel: str, gpu: str, cls: str, dtype: str, n: int) -> Row | None:
        best = None
        for r in self.rows:
            if r.matches(kernel, gpu, cls, dtype, n) and (best is None or r.rank() < best.rank()):
                best = r
        return best

    def has_gpu(self, kernel: str, gpu: str) -> bool:
        return any(r.kernel == kernel and r.gpu == gpu for r in self.rows)

    # ------------------------------------------------------------------ writing
    def put(self, row: Row, *, replace: bool = True, where: tuple[str, int] | None = None) -> Row | None:
        """Add ``row``; a row with the same identity is replaced (``replace``) or refused.
        Returns the row it replaced. Raises TuningTableError for a duplicate (``replace``
        off) or a row that would tie with another (``Row.ties``)."""
        p, j = where or (self.path, 0)
        same = next((i for i, r in enumerate(self.rows) if r.ident() == row.ident()), None)
        if same is not None and not replace:
            raise TuningTableError(p, f"duplicate row for {row.ident()!r}", row=j)
        tie = next((r for i, r in enumerate(self.rows) if i != same and r.ties(row)), None)
        if tie is not None:
            raise TuningTableError(
                p,
                f"row {row.kernel} {row.cls} n={list(row.n)} dtype={list(row.dtype)} ties with row "
                f"n={list(tie.n)} dtype={list(tie.dtype)}: both match some (dtype, n) with N ranges "
                "as wide and as many dtypes, so which applies would depend on their order; narrow "
                "one's N range or dtypes, or merge them",
                row=j,
            )
        if same is not None:
            old, self.rows[same] = self.rows[same], row
            return old
        self.rows.append(row)
        return None

    def dumps(self) -> str:
        out = [
            "# Tuning table (docs/tuning.md): measured winners by kernel, GPU model, problem class,",
            "# dtype and N range. Written by `quack tune`; edits are fine: the configuration a row",
            "# selects is in the cache key, so an edit rebuilds exactly the keys it changes.",
            "",
            "[table]",
            f"arch = {_val(self.arch)}",
            f"default_gpu = {_val(self.default_gpu)}",
        ]
        for r in sorted(self.rows, key=lambda r: (r.kernel, r.gpu, r.cls, r.n, r.dtype)):
            out += [
                "",
                "[[row]]",
                f"kernel = {_val(r.kernel)}",
                f"gpu = {_val(r.gpu)}",
                f"class = {_val(r.cls)}",
            ]
            if r.dtype:
                out.append(f"dtype = {_val(list(r.dtype))}")
            out.append(f"n = {_val(list(r.n))}")
            out.append(f"config = {_val(r.config)}")
            if r.time_us is not None:
                out.append(f"time_us = {_val(round(r.time_us, 2))}")
            for name in ("shape", "date", "note"):
                if getattr(r, name):
                    out.append(f"{name} = {_val(getattr(r, name))}")
        return "\n".join(out) + "\n"

    def write(self, path: Path | str | None = None) -> Path:
        """Write the table atomically (a reader never sees half a file; a crash or a full
        disk leaves the old one): a temporary file beside it, flushed to disk, renamed over
        it. The file keeps its permission bits (mkstemp's are 0600: a shared install's
        table became unreadable to other users) and a symbolic link stays one: its target
        is written. Raises OSError (the file's text is made before anything is touched,
        so a value it cannot hold raises ValueError first)."""
        import os
        import stat
        import tempfile

        text = self.dumps()
        dest = Path(os.path.realpath(path or self.path))
        try:
            mode = stat.S_IMODE(os.stat(dest).st_mode)
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fchmod(f.fileno(), mode)
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return dest


def _val(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"a tuning table holds finite numbers only, got {v!r}")
        return repr(v)
    if isinstance(v, str):
        return '"' + "".join(_ESCAPES.get(ch, ch) for ch in v) + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_val(x) for x in v) + "]"
    if isinstance(v, dict):
        if not v:
            return "{}"
        parts = []
        for k in sorted(v):
            if not _BARE.match(k):
                raise ValueError(f"config field {k!r} is not a bare TOML key")
            parts.append(f"{k} = {_val(v[k])}")
        return "{ " + ", ".join(parts) + " }"
    raise ValueError(f"a tuning table cannot hold {type(v).__name__} {v!r}")


def _row(path: str, i: int, r: Any) -> Row:
    if not isinstance(r, dict):
        raise TuningTableError(path, "a row must be a table", row=i)
    unknown = sorted(set(r) - set(ROW_FIELDS))
    if unknown:
        raise TuningTableError(
            path, f"unknown field; fields are {', '.join(ROW_FIELDS)}", row=i, field=unknown[0]
        )
    for f in _REQUIRED:
        if f not in r:
            raise TuningTableError(path, "missing", row=i, field=f)

    def want(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise TuningTableError(path, f"must be {what}, got {r.get(field)!r}", row=i, field=field)

    for f in ("kernel", "gpu", "class", "shape", "date", "note"):
        want(isinstance(r.get(f, ""), str), f, "a string")
    n = r["n"]
    want(
        isinstance(n, list)
        and len(n) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in n)
        and 1 <= n[0] <= n[1],
        "n",
        "an inclusive range [lo, hi] of integers, 1 <= lo <= hi",
    )
    dt = r.get("dtype", [])
    want(isinstance(dt, list) and all(isinstance(x, str) for x in dt), "dtype", "a list of dtype names")
    want(isinstance(r["config"], dict), "config", "an inline table of configuration fields")
    for k, v in r["config"].items():
        ok = (
            _BARE.match(k)
            and isinstance(v, (bool, int, float, str))
            and not (isinstance(v, float) and not math.isfinite(v))
        )
        want(
            bool(ok),
            "config",
            f"fields named [A-Za-z0-9_-] holding a bool, int, finite float or string ({k!r})",
        )
    tu = r.get("time_us")
    want(
        tu is None
        or (isinstance(tu, (int, float)) and not isinstance(tu, bool) and 0 < tu and math.isfinite(tu)),
        "time_us",
        "a positive, finite number",
    )
    return Row(
        r["kernel"],
        r["gpu"],
        r["class"],
        (n[0], n[1]),
        dict(r["config"]),
        tuple(dt),
        None if tu is None else float(tu),
        r.get("shape", ""),
        r.get("date", ""),
        r.get("note", ""),
    )
