"""Checks of the command line's option values, run before a command does any work: a bad
value must fail at once with the option named and what it allows, not after a whole build
or GPU measuring run (issue: ``--trace /nonexistent/t.json`` raised a traceback after the
build; ``--table /tmp`` after every candidate was measured).

The ``*_option`` functions are typer callbacks (a bad value is typer's usage error, exit 2,
"Invalid value for '--X': ..."); ``output_file_problem`` and ``out_dir_problem`` say what
is wrong with a path the command will write, for the command's own ``error:`` line."""

from __future__ import annotations

import math
import os
import stat
import tempfile
from pathlib import Path
from typing import List, Optional

import typer

from quack.filekind import describe


def executor_option(value: Optional[str]) -> Optional[str]:
    """``--executor``: the forms QUACK_BUILD_EXECUTOR allows (quack.settings.check_executor);
    ``quack tune --executor bogus`` went on to fail at "cannot reach the Ray cluster"."""
    if value is None:
        return None
    from quack.settings import check_executor

    try:
        return check_executor(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def finite_option(value: Optional[float]) -> Optional[float]:
    """A float option: typer's min/max let ``nan`` through (every comparison with it is
    false), and ``inf`` is no useful fraction or time either."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def arch_option(values: Optional[List[str]]) -> Optional[List[str]]:
    """``--arch``: each a CUDA arch cutlass-dsl knows. Checked here, not with the manifests:
    ``--arch sm_xx`` was reported as "1 problem in the manifests; nothing was built"."""
    from quack.settings import check_arch

    for a in values or []:
        try:
            check_arch(a)
        except ValueError as e:
            raise typer.BadParameter(f"{a!r}: {e}") from None
    return values


# Each model re-expands every table (--max-configs counts a table once): a fleet has a few.
MAX_GPU_MODELS = 16


def gpu_option(values: Optional[List[str]]) -> Optional[List[str]]:
    """``--gpu``: GPU models (repeatable, or comma-separated; an empty item is skipped),
    normalised as the tuning rows spell them ('h100' -> 'H100'); each once, in the order
    given; at most MAX_GPU_MODELS."""
    from quack.settings.fields import FIELDS

    out: list[str] = []
    for v in values or []:
        for part in v.split(","):
            if not part.strip():
                continue  # "H100," / "H100,,H200"
            try:
                m = FIELDS["tune_gpu"].parse(part)
            except ValueError as e:
                raise typer.BadParameter(f"{part.strip()!r}: {e}") from None
            if m not in out:
                out.append(m)
    if len(out) > MAX_GPU_MODELS:
        raise typer.BadParameter(
            f"{len(out)} GPU models; at most {MAX_GPU_MODELS} (each re-expands every table)"
        )
    return out or None


def _dir_problem(d: Path) -> str:
    """'' if files can be created in the existing directory ``d``, else why not. A real
    probe, not os.access: root passes access checks that a read-only mount still fails."""
    try:
        fd, probe = tempfile.mkstemp(dir=d, prefix=".quack-probe-")
    except OSError as e:
        return f"cannot create files in {d} ({e.strerror or e})"
    os.close(fd)
    os.unlink(probe)
    return ""


def output_file_problem(path: Path, example: str = "out.json") -> str:
    """'' if the command can (re)write the file ``path``, else what is wrong and how to fix
    it: a directory or a special file in its place, a missing or unwritable directory."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        return f"cannot look at it ({e.strerror or e})"
    if st is not None and not stat.S_ISREG(st.st_mode):
        return f"is {describe(st.st_mode)}; give the path of a file to write (e.g. {p / example})"
    parent = p.absolute().parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        return f"its directory {parent} {what}: create it first, or give another path"
    return _dir_problem(parent)


def out_dir_problem(path: Path) -> str:
    """'' if ``path`` is a directory the command can write into, or one it can create."""
    p = Path(path)
    if p.is_dir():
        return _dir_problem(p)
    if p.exists() or p.is_symlink():
        try:
            kind = describe(os.stat(p).st_mode)
        except OSError:
            kind = "a dangling symbolic link"
        return f"is {kind}, not a directory: give a directory (it is created if missing)"
    up = p.absolute().parent
    while not up.exists():  # created with its parents: the nearest existing one must be a dir
        up = up.parent
    if not up.is_dir():
        return f"{up} is not a directory, so it cannot be created: give another directory"
    return _dir_problem(up)
