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
    problems = [[8192, 4096, 4096]]     # quack tune's sizes, for a kernel declaring problem=

Every value is a scalar or a list (the cross product is built); a Config
parameter takes an inline table. Everything is validated before anything
compiles, and all problems are reported together, each naming the file (and
line where it can be found), the table, the key, the value and what is allowed.

This module reads the files and drives the expansion over all of them; the checks of
single values are quack_build.manifest.values, the [[kernel]] tables (validate, count,
expand) quack_build.manifest.tables, and BuildConfig lives in quack_build.manifest.config.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from quack import settings as _settings
from quack.errors import ManifestError, TomlFileError
from quack_build.manifest.budget import DEFAULT_MAX_CONFIGS, Budget
from quack_build.manifest.config import BuildConfig
from quack_build.manifest.expand import generate
from quack_build.manifest.tables import KernelTable, prepare_document
from quack_build.manifest.values import FileCheck


def read_document(path: Path) -> dict:
    """Parse one manifest (quack.tomlfile: a regular file of at most 16 MiB, nesting
    bounded); any problem is a ManifestError naming file, line and column."""
    from quack.tomlfile import load

    try:
        return load(path, "manifest file")
    except TomlFileError as e:
        raise ManifestError([str(e)]) from None


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
        gpus: Sequence[str] = (),
    ):
        self._paths = [Path(p) for p in paths]
        # GPU models whose tuning rows choose the tables' configurations (``--gpu``): each
        # table expanded once per model, the union kept; none: the model in force
        # (quack.tuning.gpu), one pass that streams
        self._gpus = list(gpus)
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
        prepared: list[tuple[FileCheck, list[KernelTable]]] = []
        for path in self._paths:
            try:
                doc = read_document(path)
            except ManifestError as e:
                problems.extend(e.problems)
                continue
            ctx, tables = prepare_document(
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
                    for _ in generate(ctx, t):
                        pass
                problems.extend(ctx.problems[n_problems:])
            raise ManifestError(problems)
        seen: set[str] = set()
        for ctx, tables in prepared:
            n_problems, n_warnings = len(ctx.problems), len(ctx.warnings)
            for t in tables:
                for c in self._generate(ctx, t):
                    if c.key in seen:
                        self.duplicates += 1
                        continue
                    seen.add(c.key)
                    yield c
            problems.extend(ctx.problems[n_problems:])
            self.warnings.extend(ctx.warnings[n_warnings:])
        if problems:
            raise ManifestError(problems)

    def _generate(self, ctx, t) -> Iterable[BuildConfig]:
        if not self._gpus:
            return generate(ctx, t)
        from quack import settings

        out: list[BuildConfig] = []
        earlier: set[str] = set()  # keys of the table's earlier passes: not "duplicates"
        said: tuple[set, set] = (set(), set())  # this table's problems / warnings so far
        for i, gpu in enumerate(self._gpus):  # a table's configurations, once per model (not across yields:
            n_p, n_w = len(ctx.problems), len(ctx.warnings)
            with settings.override(tune_gpu=gpu):  # the override must not outlive the pass)
                batch = list(generate(ctx, t))
            out.extend(c for c in batch if c.key not in earlier)
            earlier.update(c.key for c in batch)
            # the models' passes find the same problems and warnings: each said once (the first
            # pass's as they are; a later pass's only what is new)
            for got, n, seen in ((ctx.problems, n_p, said[0]), (ctx.warnings, n_w, said[1])):
                if i:
                    new = [x for x in dict.fromkeys(got[n:]) if x not in seen]
                    del got[n:]
                    got.extend(new)
                seen.update(got[n:])
        return out


def expand(
    paths: Iterable[Path | str],
    *,
    archs: Iterable[str] = (),
    arch_override=None,
    max_configs: int = DEFAULT_MAX_CONFIGS,
    gpus: Sequence[str] = (),
) -> Expansion:
    """Read, validate and expand manifests; raises ManifestError with every problem."""
    stream = ExpansionStream(
        paths, archs=archs, arch_override=arch_override, max_configs=max_configs, gpus=gpus
    )
    configs = list(stream)
    return Expansion(configs, stream.duplicates, stream.warnings, stream.files)
