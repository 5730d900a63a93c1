"""The manifest entry that would build one configuration (for error messages
and ``quack prewarm --emit-manifest``)."""

from __future__ import annotations

from quack.params import plain


def manifest_entries(configs) -> dict:
    """configs: iterable of (kernel, params, arch) -> a manifest document."""
    out = []
    for kernel, params, arch in configs:
        out.append({"name": kernel, "archs": [arch], "params": {k: plain(v) for k, v in params.items()}})
    return {"kernel": out}


def manifest_line(kernel: str, params: dict, arch: str) -> str:
    import tomli_w

    return tomli_w.dumps(manifest_entries([(kernel, params, arch)])).strip()
