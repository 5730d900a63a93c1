"""The build's budget of configurations: every table of every manifest given at once is
counted against one limit before anything is expanded (quack_build.manifest.tables
charges each table as it validates it)."""

from __future__ import annotations

import dataclasses
import math

from quack_build.manifest.values import FileCheck

DEFAULT_MAX_CONFIGS = 10_000


@dataclasses.dataclass
class Budget:
    """The limit on configurations after expansion, over every table of every manifest
    given at once (a per-table limit alone is bypassed by many tables). A table counts
    its whole cross product (before ``exclude``) plus its ``include`` entries: the count
    is known before anything is expanded, so a refused build costs nothing. ``exclude``
    entries are not counted: they are indexed (quack_build.manifest.expand.ExcludeIndex),
    a set lookup per combination whatever their number."""

    limit: int = DEFAULT_MAX_CONFIGS
    used: int = 0
    exceeded: bool = False


def charge(
    ctx: FileCheck,
    where: str,
    budget: Budget,
    names: list[str],
    axes: list[list],
    resolved: list[dict],
    archs: list[str],
    per_size: int = 1,
) -> bool:
    """Count the table's configurations against the build's budget; False when over it
    (reported once, at the table that crossed the limit). ``per_size``: the problem sizes
    each combination is built at (an entry whose tuned configuration is derived per size)."""
    product = math.prod(len(a) for a in axes)
    total = (product + len(resolved)) * len(archs) * per_size
    if budget.exceeded:
        return False
    if budget.used + total > budget.limit:
        budget.exceeded = True
        dims = " x ".join(f"{n} {len(a)}" for n, a in zip(names, axes) if len(a) > 1)
        plus = f", plus {len(resolved)} include entries" if resolved else ""
        plus += f", x {per_size} problem sizes" if per_size > 1 else ""
        before = f"; the tables before it already expand to {budget.used}" if budget.used else ""
        ctx.err(
            where,
            f"the cross product has {total} configurations ({dims} x archs {len(archs)}{plus}){before}: "
            f"over the limit of {budget.limit} configurations per build; narrow the lists or raise "
            f"the limit with --max-configs",
        )
        return False
    budget.used += total
    return True
