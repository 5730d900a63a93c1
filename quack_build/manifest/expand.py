"""Expanding a validated [[kernel]] table (quack_build.manifest.tables.KernelTable) into
its configurations, one at a time: excludes, includes, the kernel's rules across
parameters and per arch. quack_build.manifest.read drives it over every table."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Iterator

from quack.errors import ParamError
from quack_build.manifest.config import BuildConfig
from quack_build.manifest.values import SHOW_BAD, FileCheck, matches, show_value

if TYPE_CHECKING:
    from quack_build.manifest.tables import KernelTable


def generate(ctx: FileCheck, t: KernelTable) -> Iterator[BuildConfig]:
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
            if len(refused) < SHOW_BAD:
                refused.append(
                    f"{e}; drop it from the lists or exclude it: exclude = "
                    f"[{{ {', '.join(f'{k} = {show_value(v)}' for k, v in combo.items())} }}]"
                )
            else:
                refused.append("")  # counted, not listed
            return
        # a configuration derived per arch (its tuning table's default; issue 25)
        derived = any(getattr(p, "derive", None) is not None for p in t.spec.params.values())
        for arch in t.archs:
            try:
                if derived:
                    b = t.spec.bind((), combo, arch=arch)
                t.spec.check_arch(b, arch)  # the rules naming `arch` (quack.params.Rule)
            except ParamError as e:
                refused.append(
                    f"{e}; build it for another arch (--arch, archs = [...]) "
                    f"or drop the kernel from this manifest"
                    if len(refused) < SHOW_BAD
                    else ""
                )
                continue
            yield BuildConfig(t.name, b, arch, t.spec.key(b, arch), t.origin, t.spec, t.problems)

    for values in itertools.product(*t.axes):
        n_combos += 1
        combo = dict(zip(t.names, values))
        hit = False
        for j, m in enumerate(t.excludes):
            if matches(combo, m):
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
    for msg in refused[:SHOW_BAD]:
        ctx.err(t.where, msg)
    if len(refused) > SHOW_BAD:
        ctx.err(
            t.where,
            f"{len(refused) - SHOW_BAD} more of its {n_kept} combinations are refused "
            f"by the kernel's rules (not listed)",
        )
