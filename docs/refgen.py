"""Regenerate the reference parts of docs/ from the code, so they cannot drift:

- docs/configuration.md, the settings table: every field of ``quack.settings.FIELDS``
  (environment variables, quack.toml section and key, accepted values), its default
  from ``quack.settings.Settings`` and its meaning from ``MEANING`` below;
- docs/cli.md, every command's ``--help`` text, rendered from the typer app at a fixed
  width (100 columns) so the output does not depend on the terminal.

    python docs/refgen.py           # rewrite the generated blocks in place
    python docs/refgen.py --check   # exit 1 naming each stale file (tests/test_docs_reference.py)

Only the text between ``<!-- generated: NAME -->`` and ``<!-- end generated -->`` is
rewritten; the prose around it is written by hand.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 100

# The meaning of each setting, and its default as a reader should see it where the raw
# dataclass default (0, "", None) means "decide at run time". A field of FIELDS missing
# here (a new setting) stops the generator: the table must say what every setting does.
MEANING: dict[str, tuple[str, str | None]] = {
    "cache_dir": ("the cache directory", "`$XDG_CACHE_HOME/quack` or `~/.cache/quack`"),
    "cache_enabled": ("use the disk cache at all (false: nothing is looked up on or written to disk)", None),
    "fsync": ("fsync each object and its directory on publish (crash safety)", None),
    "lock_timeout": (
        "seconds to wait for another process's lock on a cache entry (compile_timeout, where "
        "smaller, bounds the wait too); then a runtime miss has a worker compile it unstored",
        None,
    ),
    "mode": (
        "`jit` compiles a miss in a worker; `prebuilt` makes a miss raise `KernelNotPrebuilt`",
        None,
    ),
    "arch": ("the target arch the runtime looks up and compiles for", None),
    "compile_jobs": (
        "compile workers of the runtime's pool (and of `quack build` when `jobs` is unset)",
        "CPU count (at most 16)",
    ),
    "compile_timeout": (
        "seconds one compile may take before its worker is killed and the call raises `CompileTimeout`",
        None,
    ),
    "pool_start": ("how compile workers start", None),
    "no_preload": (
        "skip the compile server's warm imports (cutlass, one warm-up compile, the `[build] preload` "
        "modules: each worker then imports those on its first key)",
        None,
    ),
    "log": ("level of the `quack` logger", "silent (no handler, no level)"),
    "pytest_gpu_pin": (
        "pin pytest-xdist workers to GPUs round-robin",
        "`auto` (pin when the project has a quack.toml)",
    ),
    "manifests": ("the manifests `quack build` / `verify` / `bundle` read without arguments", None),
    "jobs": ("`quack build` / `prewarm` workers (`-j`)", "`compile_jobs` when set, else CPU count"),
    "archs": ("archs `quack build` targets (`--arch` overrides)", "`arch`'s value"),
    "kernel_packages": (
        "packages whose `@jit_cache` kernels are registered",
        "`quack_kernels` without a quack.toml; with one, only what it lists",
    ),
    "preload": ("modules imported once in every compile worker before any key", None),
    "remote_url": ("the shared remote cache (docs/remote-cache.md)", None),
    "tune_gpu": (
        "the GPU model whose tuning-table rows choose default kernel configurations (docs/tuning.md)",
        "this machine's GPU (CUDA's device, else NVML's, read without CUDA), else the table's `default_gpu`",
    ),
    "remote_write": ("may this process push to the remote (needs a signing key)", None),
    "remote_timeout": ("seconds per remote operation (connecting waits at most 0.5 s)", None),
    "signing_key": ("private Ed25519 key that signs pushed objects and bundles", None),
    "trusted_keys": ("public keys whose signatures are accepted (remote objects, bundles)", None),
    "executor": ("where `quack build` compiles (docs/executors.md)", None),
}


def _show_default(value) -> str:
    if value is None or value == () or value == "":
        return "none"
    if isinstance(value, tuple):
        return ", ".join(f"`{v}`" for v in value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return f"`{value}`"


def settings_table() -> str:
    from quack.settings import Settings
    from quack.settings.fields import FIELDS

    missing = sorted(set(FIELDS) - set(MEANING))
    extra = sorted(set(MEANING) - set(FIELDS))
    if missing or extra:
        raise SystemExit(
            f"docs/refgen.py: MEANING does not match quack.settings.FIELDS: "
            f"missing {missing}, not a setting {extra}"
        )
    defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    rows = [
        "| setting | environment | quack.toml | accepted values | default | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for name, f in FIELDS.items():
        meaning, shown = MEANING[name]
        env = ", ".join(f"`{v}`" for v in f.env) or "-"
        form = f.form.replace("|", "\\|")
        default = shown if shown is not None else _show_default(defaults[name])
        rows.append(f"| `{name}` | {env} | `[{f.section}] {f.key}` | {form} | {default} | {meaning} |")
    return "\n".join(rows)


def _typer_app():
    for mod in ("quack_build.cli.app",):
        try:
            return importlib.import_module(mod).app
        except (ImportError, AttributeError):
            continue
    raise SystemExit("docs/refgen.py: found no typer app in quack_build.cli.app")


# `quack bundle inspect WHEEL` reaches the hidden command `bundle-inspect` (quack_build.cli):
# document it under the name users type.
_ALIASES = {"bundle-inspect": "bundle inspect"}


def cli_help() -> str:
    import typer
    from typer.main import get_command

    root = get_command(_typer_app())
    ctx_type = type(typer.Context(root))  # typer's own (vendored) click Context
    out: list[str] = []

    def walk(cmd, path: list[str], parent) -> None:
        ctx = ctx_type(cmd, info_name=path[-1], parent=parent, terminal_width=WIDTH, max_content_width=WIDTH)
        title = " ".join(_ALIASES.get(p, p) for p in path)
        text = cmd.get_help(ctx)
        for alias, name in _ALIASES.items():
            text = text.replace(f"quack {alias}", f"quack {name}")
        out.append(f"### `{title}`\n\n```text\n{text.rstrip()}\n```\n")
        if hasattr(cmd, "list_commands"):
            for n in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, n)
                if sub is not None and (not sub.hidden or n in _ALIASES):
                    walk(sub, [*path, n], ctx)

    walk(root, ["quack"], None)
    # typer's help layout changes between releases (0.2x renders list options'
    # metavars): the stamp lets a check on another typer tell "stale" from "rendered
    # by a different typer" (tests/test_docs_reference.py).
    stamp = f"<!-- rendered with typer {typer_version()} -->\n\n"
    return stamp + "\n".join(out).rstrip()


def typer_version() -> str:
    from importlib.metadata import version

    return version("typer")


def rendered_typer(text: str) -> str | None:
    """The typer version docs/cli.md's help text was rendered with (None: no stamp)."""
    m = re.search(r"<!-- rendered with typer ([^ ]+) -->", text)
    return m.group(1) if m else None


TARGETS = {
    "docs/configuration.md": ("settings", settings_table),
    "docs/cli.md": ("cli-help", cli_help),
}


def render(path: str) -> tuple[str, str]:
    """(current text, text with the generated block regenerated) of one target file."""
    name, make = TARGETS[path]
    text = (ROOT / path).read_text()
    pat = re.compile(rf"(<!-- generated: {re.escape(name)} -->)(.*?)(<!-- end generated -->)", re.S)
    if not pat.search(text):
        raise SystemExit(f"{path}: no '<!-- generated: {name} -->' ... '<!-- end generated -->' block")
    body = make()
    return text, pat.sub(lambda m: m.group(1) + "\n" + body + "\n" + m.group(3), text, count=1)


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for path in TARGETS:
        old, new = render(path)
        if old != new:
            stale.append(path)
            if not check:
                (ROOT / path).write_text(new)
    if check and stale:
        print("stale (run `python docs/refgen.py`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
