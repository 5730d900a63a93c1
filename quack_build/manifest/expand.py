"""Expanding a validated [[kernel]] table (quack_build.manifest.tables.KernelTable) into
its configurations, one at a time: excludes, includes, the kernel's rules across
parameters and per arch. quack_build.manifest.read drives it over every table."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Iterator

from quack.errors import ParamError
from quack_build.manifest.config import BuildConfig
from quack_build.manifest.values import SHOW_BAD, FileCheck, show_value

if TYPE_CHECKING:
    from quack_build.manifest.tables import KernelTable


def _on_axis(axis: list, index: dict | None, values: list) -> set[int]:
    """The positions on ``axis`` of the values an exclude entry lists for its parameter,
    compared as ``in`` compares them; ``index`` (value -> positions) is None when a value
    on the axis is unhashable (a configuration table), and then, as for an unhashable
    entry value, the axis is scanned."""
    out: set[int] = set()
    for v in values:
        if index is not None:
            try:
                out.update(index.get(v, ()))
                continue
            except TypeError:  # unhashable: scanned below
                pass
        out.update(i for i, a in enumerate(axis) if a is v or v == a)
    return out


class ExcludeIndex:
    """A table's ``exclude`` entries, indexed so that each combination costs one set lookup
    per group of entries constraining the same parameters, whatever their number. (Each
    combination was tested against every entry: 2,000 combinations x 50,000 excludes took
    48 s, whatever --max-configs said.) An entry becomes the tuples of axis positions it
    matches, the set of its group; which entries match no combination is known up front:
    the combinations are the whole cross product, so an entry matches one exactly when
    each of its parameters lists a value on that parameter's axis. An entry costs the
    values it lists plus the axis combinations it covers over its own parameters (one
    for an entry of single values; at most the table's cross product, which
    --max-configs bounds); an entry given twice is expanded once."""

    def __init__(self, names: list[str], axes: list[list], excludes: list[dict]):
        col = {n: i for i, n in enumerate(names)}
        indexes: list[dict | None] = []
        for axis in axes:
            index: dict = {}
            try:
                for i, a in enumerate(axis):
                    index.setdefault(a, []).append(i)
            except TypeError:  # an unhashable value on the axis: scanned instead
                indexes.append(None)
                continue
            indexes.append(index)
        self.unused: list[int] = []
        self.groups: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
        seen: set = set()
        for j, m in enumerate(excludes):
            cols = tuple(sorted(col[k] for k in m))
            hits = [_on_axis(axes[c], indexes[c], m[names[c]]) for c in cols]
            if not all(hits):
                self.unused.append(j)
                continue
            sig = (cols, tuple(frozenset(h) for h in hits))
            if sig not in seen:  # the same entry again adds nothing: expanded once
                seen.add(sig)
                self.groups.setdefault(cols, set()).update(itertools.product(*(sorted(h) for h in hits)))

    def excludes(self, pos: tuple[int, ...]) -> bool:
        """Whether the combination at axis positions ``pos`` is excluded."""
        return any(tuple(pos[c] for c in cols) in tuples for cols, tuples in self.groups.items())


def unused_warning(where: str, unused: list[int]) -> str:
    """One line for the entries that match no combination: 50,000 unused excludes printed
    50,000 warning lines; the count and the first few say as much."""
    if len(unused) == 1:
        return f"{where}: exclude[{unused[0]}] matches no combination"
    first = ", ".join(f"exclude[{j}]" for j in unused[:SHOW_BAD])
    more = f", ... ({len(unused) - SHOW_BAD} more)" if len(unused) > SHOW_BAD else ""
    return f"{where}: {len(unused)} exclude entries match no combination: {first}{more}"


def _at_sizes(
    t: KernelTable, combo: dict, bound: dict, names: list[str], arch: str
) -> list[tuple[dict, str, tuple]]:
    """(params, key, sizes): the combination bound once per problem size of the entry, each
    derived parameter (the tuned configuration) chosen for that size as a run-time call of
    that shape chooses it (``KernelSpec.derive_at``); a configuration two sizes share, once,
    with the sizes that chose it ("8192x4096x4096"). Bound again with the chosen values:
    the kernel's rules check them."""
    out: dict[str, tuple[dict, list[str]]] = {}
    for sizes in t.problems:
        b = t.spec.bind_at(combo, bound, dict(sizes), arch, names)
        out.setdefault(t.spec.key(b, arch), (b, []))[1].append("x".join(str(v) for _, v in sizes))
    return [(b, key, tuple(label)) for key, (b, label) in out.items()]


def generate(ctx: FileCheck, t: KernelTable) -> Iterator[BuildConfig]:
    """The table's configurations, one at a time (the cross product is never held in
    memory). Problems seen only here (combinations the kernel's rules refuse, every
    combination excluded) and unused excludes go to ``ctx`` once the table is done."""
    ex = ExcludeIndex(t.names, t.axes, t.excludes)
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
        derived = bool(t.spec.derived_params)
        # ... and per problem size, where the entry lists sizes and leaves the configuration to
        # the table: the GEMM's row (or heuristic) depends on m, n, k, which its parameters do
        # not carry, so the one shapeless default left every tuned winner unbuilt, and a
        # prebuilt server missed at each tuned shape (issue 28)
        per_size = [n for n in t.spec.derived_params if combo.get(n) is None] if t.problems else []
        for arch in t.archs:
            try:
                if derived:
                    b = t.spec.bind((), combo, arch=arch)
                t.spec.check_arch(b, arch)  # the rules naming `arch` (quack.params.Rule)
                sized = (
                    [(b, t.spec.key(b, arch), ())] if not per_size else _at_sizes(t, combo, b, per_size, arch)
                )
            except ParamError as e:
                refused.append(
                    f"{e}; build it for another arch (--arch, archs = [...]) "
                    f"or drop the kernel from this manifest"
                    if len(refused) < SHOW_BAD
                    else ""
                )
                continue
            for bs, key, chose in sized:
                yield BuildConfig(t.name, bs, arch, key, t.origin, t.spec, t.problems, chose)

    for pos in itertools.product(*(range(len(a)) for a in t.axes)):
        n_combos += 1
        if not ex.excludes(pos):
            n_kept += 1
            yield from bound({n: t.axes[i][p] for i, (n, p) in enumerate(zip(t.names, pos))})
    if ex.unused:
        ctx.warnings.append(unused_warning(t.where, ex.unused))
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
