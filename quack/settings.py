"""Settings, resolved once: CLI flag > environment > quack.toml > default.

A leaf module: it imports nothing from quack except errors, so every other
module may import it without an import-order hazard."""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from quack.errors import SettingsError


def _tomllib():
    """Imported when a quack.toml is found (~2 ms at import otherwise, for nothing)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return tomllib

CONFIG_NAME = "quack.toml"
MODES = ("jit", "prebuilt")
ARCH_RE = re.compile(r"^sm_(\d{2,3})([af]?)$")
KNOWN_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_100a", "sm_100f",
               "sm_103a", "sm_110a", "sm_120", "sm_120a", "sm_121a")


def _bool(text: str | bool) -> bool:
    if isinstance(text, bool):  # quack.toml gives real booleans
        return text
    if not isinstance(text, str):
        raise ValueError("expected true or false")
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _pos_int(text: str | int) -> int:
    if isinstance(text, (bool, float)):  # 2.5 must not silently become 2
        raise ValueError("expected an integer >= 0 (0 means one per CPU)")
    v = int(text)
    if v < 0:
        raise ValueError("expected an integer >= 0 (0 means one per CPU)")
    return v


def _pos_float(text: str | float) -> float:
    if isinstance(text, bool):
        raise ValueError("expected a number of seconds > 0")
    v = float(text)
    if not v > 0:
        raise ValueError("expected a number of seconds > 0")
    return v


def check_arch(text: str) -> str:
    if not isinstance(text, str) or text not in KNOWN_ARCHS:
        raise ValueError("expected a CUDA arch, one of " + ", ".join(KNOWN_ARCHS))
    return text


def _mode(text: str) -> str:
    if text not in MODES:
        raise ValueError("expected 'jit' or 'prebuilt'")
    return text


def _path_list(v: Any) -> list[str]:
    """Paths: a ``:``-separated string (the environment, or quack.toml) or a list."""
    if isinstance(v, str):
        return [x for x in v.split(":") if x.strip()]
    return _str_list(v)


def _str_list(v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("expected a list of strings")
    return list(v)


@dataclasses.dataclass(frozen=True)
class _Field:
    section: str
    key: str
    env: tuple[str, ...]
    parse: Callable[[Any], Any]
    form: str


_FIELDS: dict[str, _Field] = {
    "cache_dir": _Field("cache", "dir", ("QUACK_CACHE_DIR",), str, "a directory path"),
    "cache_enabled": _Field("cache", "enabled", ("QUACK_CACHE_ENABLED",), _bool, "true or false"),
    "fsync": _Field("cache", "fsync", ("QUACK_FSYNC",), _bool, "true or false"),
    "lock_timeout": _Field("cache", "lock_timeout", ("QUACK_LOCK_TIMEOUT",), _pos_float, "seconds > 0"),
    "mode": _Field("runtime", "mode", ("QUACK_MODE",), _mode, "'jit' or 'prebuilt'"),
    "arch": _Field("runtime", "arch", ("QUACK_ARCH", "CUTE_DSL_ARCH"), check_arch, "a CUDA arch like 'sm_90a'"),
    "compile_jobs": _Field("runtime", "compile_jobs", ("QUACK_COMPILE_JOBS",), _pos_int, "an integer >= 0"),
    "compile_timeout": _Field("runtime", "compile_timeout", ("QUACK_COMPILE_TIMEOUT",), _pos_float,
                              "seconds > 0"),
    "manifests": _Field("build", "manifests", (), _str_list, "a list of manifest paths"),
    "jobs": _Field("build", "jobs", (), _pos_int, "an integer >= 0 (0 = one per CPU)"),
    "archs": _Field("build", "archs", (), lambda v: [check_arch(a) for a in _str_list(v)],
                    "a list of CUDA archs"),
    "kernel_packages": _Field("build", "kernel_packages", (), _str_list, "a list of package names"),
    "signing_key": _Field("remote", "signing_key", ("QUACK_SIGNING_KEY",), str, "a private key file path"),
    "trusted_keys": _Field("remote", "trusted_keys", ("QUACK_TRUSTED_KEYS",), _path_list,
                           "public key files or directories (a list, or ':'-separated)"),
}
_SECTIONS = sorted({f.section for f in _FIELDS.values()})


@dataclasses.dataclass(frozen=True)
class Settings:
    cache_dir: Path
    cache_enabled: bool = True
    fsync: bool = True
    lock_timeout: float = 600.0
    mode: str = "jit"
    arch: str = "sm_90a"
    compile_jobs: int = 0
    compile_timeout: float = 900.0
    manifests: tuple[str, ...] = ()
    jobs: int = 0
    archs: tuple[str, ...] = ()
    kernel_packages: tuple[str, ...] = ("quack_kernels",)
    signing_key: str | None = None
    trusted_keys: tuple[str, ...] = ()
    config_file: Path | None = None
    sources: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def project_root(self) -> Path:
        return self.config_file.parent if self.config_file else Path.cwd()

    def manifest_paths(self) -> list[Path]:
        return [(self.project_root / m) for m in self.manifests]

    def build_archs(self) -> tuple[str, ...]:
        return self.archs or (self.arch,)

    def effective_jobs(self, requested: int | None = None) -> int:
        n = requested if requested else (self.jobs or self.compile_jobs)
        return n or (os.cpu_count() or 1)


def default_cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "quack"


def find_config(start: Path | None = None) -> Path | None:
    d = (start or Path.cwd()).resolve()
    for p in (d, *d.parents):
        c = p / CONFIG_NAME
        if c.is_file():
            return c
    return None


def read_config(path: Path) -> dict[str, Any]:
    """Parse quack.toml into {field: value}; errors name the file and key."""
    tomllib = _tomllib()
    try:
        raw = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SettingsError(f"{path}: not UTF-8 text ({e})", source=str(path)) from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"{path}: TOML syntax error: {e}", source=str(path)) from None
    except OSError as e:
        raise SettingsError(f"{path}: cannot read ({e.strerror})", source=str(path)) from None
    out: dict[str, Any] = {}
    by_loc = {(f.section, f.key): name for name, f in _FIELDS.items()}
    for section, table in raw.items():
        if section in _SECTIONS and not isinstance(table, dict):
            raise SettingsError(f"{path}: {section} = {table!r} must be a table: write [{section}] "
                                f"and its keys below it", source=str(path), key=section)
        if section not in _SECTIONS:
            raise SettingsError(
                f"{path}: unknown section [{section}]; allowed sections: "
                + ", ".join(f"[{s}]" for s in _SECTIONS), source=str(path), key=section)
        for key, value in table.items():
            name = by_loc.get((section, key))
            if name is None:
                allowed = ", ".join(f.key for f in _FIELDS.values() if f.section == section)
                raise SettingsError(f"{path}: unknown key {section}.{key}; allowed in [{section}]: {allowed}",
                                    source=str(path), key=f"{section}.{key}")
            f = _FIELDS[name]
            try:
                if f.parse is str and not isinstance(value, str):
                    raise ValueError("expected a string")
                if f.parse in (_bool,) and not isinstance(value, bool):
                    raise ValueError("expected true or false")
                out[name] = f.parse(value)
            except (ValueError, TypeError) as e:
                raise SettingsError(f"{path}: {section}.{key} = {value!r} is invalid: {e} ({f.form})",
                                    source=str(path), key=f"{section}.{key}") from None
    return out


def resolve(overrides: dict[str, Any] | None = None, *, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> Settings:
    """Resolve all settings. ``overrides`` are CLI values (None = not given)."""
    env = os.environ if env is None else env
    config = find_config(cwd)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config is not None:
        for k, v in read_config(config).items():
            values[k] = v
            sources[k] = str(config)
    for name, f in _FIELDS.items():
        for var in f.env:
            text = env.get(var)
            if text is None or text == "":
                continue
            try:
                values[name] = f.parse(text)
            except (ValueError, TypeError) as e:
                raise SettingsError(f"environment variable {var}={text!r} is invalid: {e}",
                                    source=var, key=var) from None
            sources[name] = var
            break
    for k, v in (overrides or {}).items():
        if v is None:
            continue
        if k not in _FIELDS:
            raise SettingsError(f"unknown setting {k!r}", source="cli", key=k)
        values[k] = v
        sources[k] = "cli"
    cache_dir = values.pop("cache_dir", None)
    if cache_dir is None:
        cache_path = default_cache_dir()
    else:
        cache_path = Path(os.path.expanduser(str(cache_dir)))
        if not cache_path.is_absolute():
            base = config.parent if sources.get("cache_dir") == str(config) else Path.cwd()
            cache_path = base / cache_path
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
    for k in ("manifests", "archs", "kernel_packages", "trusted_keys"):
        if k in values:
            values[k] = tuple(values[k])
    return Settings(cache_dir=cache_path, config_file=config, sources=sources, **values)


_current: Settings | None = None


def get() -> Settings:
    """The process-wide settings (resolved on first use)."""
    global _current
    if _current is None:
        _current = resolve()
    return _current


def set_current(s: Settings | None) -> None:
    """Install settings for this process (the CLI after parsing flags; tests).
    None forgets them, so the next ``get`` resolves again."""
    global _current
    _current = s
    from quack.runtime import _generation

    _generation.bump()
