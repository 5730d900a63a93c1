"""Where settings come from, and the one reader of them: the environment and
quack.toml (found upward from the current directory), merged with CLI values by
precedence CLI flag > environment > quack.toml > default (``resolve``). No other
module of quack reads either (docs/architecture.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from quack.errors import SettingsError, TomlFileError
from quack.settings.fields import FIELDS, SECTIONS, parse_bool
from quack.settings.record import Settings

CONFIG_NAME = "quack.toml"
#: Set by the pytest plugin in strict mode (``--quack-prebuilt``) for the session and
#: every process it starts: the session's cache directory. A process whose cache is that
#: directory, or that sets none (it would compile into the default cache), resolves
#: ``mode = "prebuilt"`` whatever QUACK_MODE or quack.toml say; only an explicit
#: ``resolve({"mode": ...})`` (a CLI flag, code) wins. A process that chose another cache
#: (a test's private QUACK_CACHE_DIR) resolves as it would without it.
PREBUILT_CACHE_ENV = "QUACK_PYTEST_PREBUILT_CACHE"


def default_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "quack"


def find_config(start: Path | None = None) -> Path | None:
    d = (start or Path.cwd()).resolve()
    for p in (d, *d.parents):
        c = p / CONFIG_NAME
        # Anything but a directory counts: a FIFO or device named quack.toml is refused
        # by read_config with a clear message instead of being silently skipped.
        if os.path.lexists(c) and not c.is_dir():
            return c
    return None


def read_config(path: Path) -> dict[str, Any]:
    """Parse quack.toml into {field: value}; errors name the file and key."""
    from quack.tomlfile import load

    try:
        raw = load(path, "settings file")
    except TomlFileError as e:  # not a regular file, too large, too deep, syntax: file:line
        raise SettingsError(str(e), source=str(path)) from None
    out: dict[str, Any] = {}
    by_loc = {(f.section, f.key): name for name, f in FIELDS.items()}
    for section, table in raw.items():
        if section in SECTIONS and not isinstance(table, dict):
            raise SettingsError(
                f"{path}: {section} = {table!r} must be a table: write [{section}] and its keys below it",
                source=str(path),
                key=section,
            )
        if section not in SECTIONS:
            raise SettingsError(
                f"{path}: unknown section [{section}]; allowed sections: "
                + ", ".join(f"[{s}]" for s in SECTIONS),
                source=str(path),
                key=section,
            )
        for key, value in table.items():
            name = by_loc.get((section, key))
            if name is None:
                allowed = ", ".join(f.key for f in FIELDS.values() if f.section == section)
                raise SettingsError(
                    f"{path}: unknown key {section}.{key}; allowed in [{section}]: {allowed}",
                    source=str(path),
                    key=f"{section}.{key}",
                )
            f = FIELDS[name]
            try:
                if f.parse is str and not isinstance(value, str):
                    raise ValueError("expected a string")
                if f.parse in (parse_bool,) and not isinstance(value, bool):
                    raise ValueError("expected true or false")
                out[name] = f.parse(value)
            except (ValueError, TypeError) as e:
                raise SettingsError(
                    f"{path}: {section}.{key} = {f.show(value)} is invalid: {e} ({f.form})",
                    source=str(path),
                    key=f"{section}.{key}",
                ) from None
    return out


def resolve(
    overrides: dict[str, Any] | None = None, *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Settings:
    """Resolve all settings. ``overrides`` are CLI values (None = not given)."""
    environ: Mapping[str, str] = os.environ if env is None else env
    config = find_config(cwd)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config is not None:
        for k, v in read_config(config).items():
            values[k] = v
            sources[k] = str(config)
    for name, f in FIELDS.items():
        for var in f.env:
            text = environ.get(var)
            if text is None or text == "":
                continue
            try:
                values[name] = f.parse(text)
            except (ValueError, TypeError) as e:
                raise SettingsError(
                    f"environment variable {var}={f.show(text)} is invalid: {e}", source=var, key=var
                ) from None
            sources[name] = var
            break
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k not in FIELDS:
            raise SettingsError(f"unknown setting {k!r}", source="cli", key=k)
        values[k] = v
        sources[k] = "cli"
    cache_dir = values.pop("cache_dir", None)
    if cache_dir is None:
        cache_path = default_cache_dir()
    else:
        cache_path = Path(os.path.expanduser(str(cache_dir)))
        if not cache_path.is_absolute():
            base = (
                config.parent
                if config is not None and sources.get("cache_dir") == str(config)
                else Path.cwd()
            )
            cache_path = base / cache_path
    strict = environ.get(PREBUILT_CACHE_ENV)
    if (
        strict
        and sources.get("mode") != "cli"
        and ("cache_dir" not in sources or _same_dir(cache_path, strict))
    ):
        values["mode"] = "prebuilt"
        sources["mode"] = PREBUILT_CACHE_ENV
    # Key paths in quack.toml are relative to it, as cache_dir is; from the
    # environment or the CLI, relative to the current directory.
    key_base = config.parent if config is not None else Path.cwd()
    if "signing_key" in values:
        p = Path(os.path.expanduser(values["signing_key"]))
        if not p.is_absolute() and sources.get("signing_key") == str(config):
            p = key_base / p
        values["signing_key"] = str(p)
    if "trusted_keys" in values:
        keys = [Path(os.path.expanduser(x)) for x in values["trusted_keys"]]
        if sources.get("trusted_keys") == str(config):
            keys = [k if k.is_absolute() else key_base / k for k in keys]
        values["trusted_keys"] = [str(k) for k in keys]
    if config is not None and "kernel_packages" not in values:
        # A project with its own quack.toml gets the kernels it lists, not quack's bundled
        # demo kernels (quack_kernels is installed, so importable from anywhere).
        values["kernel_packages"] = ()
    for k in ("manifests", "archs", "kernel_packages", "trusted_keys", "preload"):
        if k in values:
            values[k] = tuple(values[k])
    return Settings(cache_dir=cache_path, config_file=config, sources=sources, **values)


def _same_dir(a: Path | str, b: Path | str) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):
        return False
