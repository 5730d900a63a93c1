"""The manifest entry that would build one configuration (for error messages
and ``quack prewarm --emit-manifest``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from quack.params import plain


def _config_value(spec, name: str, params: dict, arch: str, problems: list[dict] | None = None) -> Any:
    """A ``Config`` parameter as a manifest writes it, or None to leave it out.

    Left out when it is the configuration the kernel derives for the other parameters
    (the tuning table's), at each of the ``problems`` sizes when given (the GEMM's m, n,
    k): the manifest then follows the table, as the calls do, instead of pinning today's
    winner. Otherwise its fields, less the unset (None) ones: TOML has no null, and a
    field left out of a manifest's inline table takes its default."""
    p = spec.params[name]
    value = params[name]
    if getattr(p, "derive", None) is not None:
        rest = {k: v for k, v in params.items() if k != name}
        try:
            bound = spec.bind((), rest, arch=arch)
            derived = [spec.plain(spec.derive_at(bound, pr, arch, (name,)))[name] for pr in problems or ()]
            if not problems:
                derived = [spec.plain(bound)[name]]
        except Exception:  # noqa: BLE001 - the line is for a message: write the value out
            derived = [None]
        if all(d == value for d in derived):
            return None
    defaults = {f.name: f.default for f in dataclasses.fields(p.cls)}
    return {k: v for k, v in value.items() if not (v is None and defaults.get(k) is None)}


def entry_params(kernel: str, params: dict, arch: str, problems: list[dict] | None = None) -> dict:
    """The ``params`` table of the manifest entry that builds exactly these (canonical
    or plain) parameters. A manifest's value is a list of values or one scalar or table,
    so a ``Tuple`` parameter's value, an array, is written inside the list of values:
    ``tile = [[64, 32]]`` (``tile = [64, 32]`` would be two values, and ``quack build``
    refuses it). A ``Config`` is one inline table. Only a Tuple parameter has an array
    value (plain() makes a tuple a list; a Config's fields are scalars), so an array is
    wrapped even for a kernel not registered here."""
    out = {k: plain(v) for k, v in params.items()}
    from quack import registry

    try:
        spec = registry.get(kernel)
    except Exception:  # noqa: BLE001 - not registered here: the parameters as given
        spec = None
    if spec is not None:
        for name, p in spec.params.items():
            if getattr(p, "kind", None) == "config" and isinstance(out.get(name), dict):
                v = _config_value(spec, name, out, arch, problems)  # before the arrays are wrapped
                if v is None:
                    del out[name]
                else:
                    out[name] = v
    return {k: [list(v)] if isinstance(v, (list, tuple)) else v for k, v in out.items()}


def manifest_entries(configs) -> dict:
    """configs: iterable of (kernel, params, arch) or (kernel, params, arch, problems) ->
    a manifest document. ``problems``: the sizes of the calls (``quack.tuning.at_problem``
    dicts) for a kernel that declares them: the entry lists them (``problems``) and, where
    the configuration is the one the table chooses at each of those sizes, leaves it out
    (``quack build`` derives it per size). Entries left alike but for their sizes become one."""
    out: list[dict] = []
    alike: dict[str, dict] = {}
    for c in configs:
        kernel, params, arch = c[0], c[1], c[2]
        given = c[3] if len(c) > 3 else []
        names = _problem_names(kernel) if given else ()
        sizes = [pr for pr in given if names and all(d in pr for d in names)]
        entry: dict = {"name": kernel, "archs": [arch]}
        if sizes:
            entry["problems"] = [[int(pr[d]) for d in names] for pr in sizes]
        entry["params"] = entry_params(kernel, params, arch, sizes)
        if sizes:
            # one entry for the sizes whose configurations the table chooses (two keys the
            # table gave two sizes of one kernel were two entries of one size each)
            ident = repr((kernel, arch, sorted(entry["params"].items())))
            prev = alike.get(ident)
            if prev is not None:
                prev["problems"] += [p for p in entry["problems"] if p not in prev["problems"]]
                continue
            alike[ident] = entry
        out.append(entry)
    return {"kernel": out}


def _problem_names(kernel: str) -> tuple:
    from quack import registry

    try:
        return tuple(registry.get(kernel).problem or ())
    except Exception:  # noqa: BLE001 - not registered here: no sizes to write
        return ()


def manifest_line(kernel: str, params: dict, arch: str, problem: dict | None = None) -> str:
    import tomli_w

    return tomli_w.dumps(manifest_entries([(kernel, params, arch, [problem] if problem else [])])).strip()
