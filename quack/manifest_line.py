"""The manifest entry that would build one configuration (for error messages
and ``quack prewarm --emit-manifest``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from quack.params import plain


def _config_value(spec, name: str, params: dict, arch: str, problem: dict | None = None) -> Any:
    """A ``Config`` parameter as a manifest writes it, or None to leave it out.

    Left out when it is the configuration the kernel derives for the other parameters
    (the tuning table's), at the ``problem`` sizes when given (the GEMM's m, n, k): the
    manifest then follows the table, as the calls do, instead of pinning today's winner.
    Otherwise its fields, less the unset (None) ones: TOML has no null, and a field left
    out of a manifest's inline table takes its default."""
    p = spec.params[name]
    value = params[name]
    if getattr(p, "derive", None) is not None:
        rest = {k: v for k, v in params.items() if k != name}
        try:
            bound = spec.bind((), rest, arch=arch)
            if problem:
                bound = spec.derive_at(bound, problem, arch, (name,))
            derived = spec.plain(bound)[name]
        except Exception:  # noqa: BLE001 - the line is for a message: write the value out
            derived = None
        if derived == value:
            return None
    defaults = {f.name: f.default for f in dataclasses.fields(p.cls)}
    return {k: v for k, v in value.items() if not (v is None and defaults.get(k) is None)}


def entry_params(kernel: str, params: dict, arch: str, problem: dict | None = None) -> dict:
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
                v = _config_value(spec, name, out, arch, problem)  # before the arrays are wrapped
                if v is None:
                    del out[name]
                else:
                    out[name] = v
    return {k: [list(v)] if isinstance(v, (list, tuple)) else v for k, v in out.items()}


def manifest_entries(configs, problem: dict | None = None) -> dict:
    """configs: iterable of (kernel, params, arch) -> a manifest document. ``problem``: the
    sizes of the call (``quack.tuning.at_problem``) for a kernel that declares them: the
    entry lists them (``problems``) and, where the configuration is the one the table
    chooses at those sizes, leaves it out (``quack build`` derives it per size)."""
    out = []
    for kernel, params, arch in configs:
        names = _problem_names(kernel) if problem else ()
        sizes = problem if problem and names and all(d in problem for d in names) else None
        entry: dict = {"name": kernel, "archs": [arch]}
        if sizes:
            entry["problems"] = [[int(sizes[d]) for d in names]]
        entry["params"] = entry_params(kernel, params, arch, sizes)
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

    return tomli_w.dumps(manifest_entries([(kernel, params, arch)], problem)).strip()
