"""Settings, resolved once: CLI flag > environment > quack.toml > default.

A leaf module: it imports nothing from quack except errors, so every other
module may import it without an import-order hazard."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from quack.errors import SettingsError, TomlFileError

CONFIG_NAME = "quack.toml"
MODES = ("jit", "prebuilt")
KNOWN_ARCHS = (
    "sm_80",
    "sm_86",
    "sm_89",
    "sm_90",
    "sm_90a",
    "sm_100",
    "sm_100a",
    "sm_100f",
    "sm_103a",
    "sm_110a",
    "sm_120",
    "sm_120a",
    "sm_121a",
)


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


START_METHODS = ("forkserver", "spawn", "fork")
LOG_LEVELS = ("debug", "info", "warning", "error")


def _start_method(text: str) -> str:
    if text not in START_METHODS:
        raise ValueError("expected one of " + ", ".join(START_METHODS))
    return text


def _log_level(text: str) -> str:
    t = text.strip().lower() if isinstance(text, str) else text
    if t not in LOG_LEVELS:
        raise ValueError("expected one of " + ", ".join(LOG_LEVELS))
    return t


def _auto_bool(text: str | bool) -> bool | None:
    """true/false, or 'auto' (None: decide from the situation)."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return None
    return _bool(text)


def _remote_url(text: str) -> str:
    if not isinstance(text, str):
        raise ValueError("expected a URL string")
    scheme = text.partition("://")[0].lower()
    if scheme not in ("redis", "rediss", "s3", "file") or "://" not in text:
        raise ValueError("expected redis://host:port/db, s3://bucket/prefix or file:///shared/path")
    return text


def _remote_timeout(text: str | float) -> float:
    v = _pos_float(text)
    if v > 5:
        raise ValueError("expected seconds > 0 and <= 5 (a slow remote must not stall a build)")
    return v


def _path_list(v: Any) -> list[str]:
    """Paths: a ``:``-separated string (the environment, or quack.toml) or a list."""
    if isinstance(v, str):
        return [x for x in v.split(":") if x.strip()]
    return _str_list(v)


EXECUTOR_FORMS = "'local', 'ray', 'auto', 'ray://HOST:PORT' or 'HOST:PORT'"
# A pattern, compiled (and cached by re) on first use: a kernel's first load never needs it.
_ADDR = r"^(ray://)?[A-Za-z0-9._-]+:[0-9]{1,5}$"


def check_executor(text: str) -> str:
    """Where ``quack build`` compiles: 'local' (the forkserver pool, the default), 'ray'
    (a Ray instance started for the build), 'auto' (the running cluster Ray finds, or
    RAY_ADDRESS), 'ray://HOST:PORT' (Ray Client) or 'HOST:PORT' (a cluster's GCS)."""
    if not isinstance(text, str):
        raise ValueError(f"expected {EXECUTOR_FORMS}")
    t = text.strip()
    if t in ("local", "ray", "auto") or re.fullmatch(_ADDR, t):
        return t
    raise ValueError(f"expected {EXECUTOR_FORMS}")


def _str_list(v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("expected a list of strings")
    return list(v)


class _Field:
    """Where one setting is read from and how it is parsed. A plain slotted class, not a
    dataclass: a dataclass is generated (exec) at import, ~0.3 ms of every fresh
    process's first kernel load for a record nothing compares or copies."""

    __slots__ = ("section", "key", "env", "parse", "form")

    def __init__(self, section: str, key: str, env: tuple[str, ...], parse: Callable[[Any], Any], form: str):
        self.section, self.key, self.env, self.parse, self.form = section, key, env, parse, form


_FIELDS: dict[str, _Field] = {
    "cache_dir": _Field("cache", "dir", ("QUACK_CACHE_DIR",), str, "a directory path"),
    "cache_enabled": _Field("cache", "enabled", ("QUACK_CACHE_ENABLED",), _bool, "true or false"),
    "fsync": _Field("cache", "fsync", ("QUACK_FSYNC",), _bool, "true or false"),
    "lock_timeout": _Field("cache", "lock_timeout", ("QUACK_LOCK_TIMEOUT",), _pos_float, "seconds > 0"),
    "mode": _Field("runtime", "mode", ("QUACK_MODE",), _mode, "'jit' or 'prebuilt'"),
    "arch": _Field(
        "runtime", "arch", ("QUACK_ARCH", "CUTE_DSL_ARCH"), check_arch, "a CUDA arch like 'sm_90a'"
    ),
    "compile_jobs": _Field("runtime", "compile_jobs", ("QUACK_COMPILE_JOBS",), _pos_int, "an integer >= 0"),
    "compile_timeout": _Field(
        "runtime", "compile_timeout", ("QUACK_COMPILE_TIMEOUT",), _pos_float, "seconds > 0"
    ),
    "pool_start": _Field(
        "runtime", "pool_start", ("QUACK_POOL_START",), _start_method, "'forkserver', 'spawn' or 'fork'"
    ),
    "no_preload": _Field("runtime", "no_preload", ("QUACK_NO_PRELOAD",), _bool, "true or false"),
    "log": _Field("runtime", "log", ("QUACK_LOG",), _log_level, "a log level: debug, info, warning or error"),
    "pytest_gpu_pin": _Field(
        "pytest", "gpu_pin", ("QUACK_PYTEST_GPU_PIN",), _auto_bool, "true, false or 'auto'"
    ),
    "manifests": _Field("build", "manifests", (), _str_list, "a list of manifest paths"),
    "jobs": _Field("build", "jobs", (), _pos_int, "an integer >= 0 (0 = one per CPU)"),
    "archs": _Field(
        "build", "archs", (), lambda v: [check_arch(a) for a in _str_list(v)], "a list of CUDA archs"
    ),
    "kernel_packages": _Field("build", "kernel_packages", (), _str_list, "a list of package names"),
    "remote_url": _Field(
        "remote",
        "url",
        ("QUACK_REMOTE",),
        _remote_url,
        "redis://host:port/db, s3://bucket/prefix or file:///path",
    ),
    "remote_write": _Field("remote", "write", ("QUACK_REMOTE_WRITE",), _bool, "true or false"),
    "remote_timeout": _Field(
        "remote", "timeout", ("QUACK_REMOTE_TIMEOUT",), _remote_timeout, "seconds, > 0 and <= 5"
    ),
    "signing_key": _Field("remote", "signing_key", ("QUACK_SIGNING_KEY",), str, "a private key file path"),
    "trusted_keys": _Field(
        "remote",
        "trusted_keys",
        ("QUACK_TRUSTED_KEYS",),
        _path_list,
        "public key files or directories (a list, or ':'-separated)",
    ),
    "executor": _Field("build", "executor", ("QUACK_BUILD_EXECUTOR",), check_executor, EXECUTOR_FORMS),
}
_SECTIONS = sorted({f.section for f in _FIELDS.values()})


# A frozen dataclass (fields, replace, asdict work) whose methods are written out below
# instead of generated: @dataclass(frozen=True) execs the source of seven methods over 26
# fields, ~1.2 ms of every fresh process's first kernel load (issue 15).
# tests/test_settings.py checks them against what @dataclass(frozen=True) generates.
@dataclasses.dataclass(init=False, repr=False, eq=False)
class Settings:
    """The process's settings (quack.settings.get()); immutable: derive with
    ``dataclasses.replace`` or ``settings.override``."""

    cache_dir: Path
    cache_enabled: bool = True
    fsync: bool = True
    lock_timeout: float = 600.0
    mode: str = "jit"
    arch: str = "sm_90a"
    compile_jobs: int = 0
    compile_timeout: float = 900.0
    pool_start: str = "forkserver"  # how compile workers start (QUACK_POOL_START)
    no_preload: bool = False  # skip the forkserver's warm imports (QUACK_NO_PRELOAD)
    log: str = ""  # level of the "quack" logger; "" = silent (QUACK_LOG)
    pytest_gpu_pin: bool | None = None  # pin xdist workers to GPUs; None = auto (QUACK_PYTEST_GPU_PIN)
    manifests: tuple[str, ...] = ()
    jobs: int = 0
    archs: tuple[str, ...] = ()
    # Without any quack.toml: quack's bundled kernels; with one: what it lists, else none.
    kernel_packages: tuple[str, ...] = ("quack_kernels",)
    remote_url: str | None = None
    remote_write: bool = False
    remote_timeout: float = 5.0  # per operation; connecting waits at most 0.5 s
    signing_key: str | None = None
    trusted_keys: tuple[str, ...] = ()
    executor: str = "local"
    config_file: Path | None = None
    sources: dict = dataclasses.field(default_factory=dict, compare=False)

    def __init__(self, cache_dir: Path, **values: Any):
        d = self.__dict__
        d["cache_dir"] = cache_dir
        for name, default, factory in _defaults():
            d[name] = values.pop(name) if name in values else (factory() if factory else default)
        if values:
            raise TypeError(f"Settings.__init__() got an unexpected keyword argument {next(iter(values))!r}")

    def _compared(self) -> tuple:
        d = self.__dict__
        return tuple(d[n] for n in _compared_names())

    def __eq__(self, other):
        if other.__class__ is self.__class__:
            return self._compared() == other._compared()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._compared())

    def __repr__(self) -> str:
        d = self.__dict__
        return (
            type(self).__qualname__
            + "("
            + ", ".join(f"{f.name}={d[f.name]!r}" for f in dataclasses.fields(self))
            + ")"
        )

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

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


_DEFAULTS: list[tuple[str, Any, Callable[[], Any] | None]] = []
_COMPARED: list[str] = []


def _defaults() -> list[tuple[str, Any, Callable[[], Any] | None]]:
    """(name, default, default_factory) of every field after cache_dir, from the fields."""
    if not _DEFAULTS:
        for f in dataclasses.fields(Settings)[1:]:
            factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
            _DEFAULTS.append((f.name, f.default, factory))
    return _DEFAULTS


def _compared_names() -> list[str]:
    if not _COMPARED:
        _COMPARED.extend(f.name for f in dataclasses.fields(Settings) if f.compare)
    return _COMPARED


def __getattr__(name: str) -> Any:
    if name == "ARCH_RE":  # public, unused here: compiled on first use
        return re.compile(r"^sm_(\d{2,3})([af]?)$")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    by_loc = {(f.section, f.key): name for name, f in _FIELDS.items()}
    for section, table in raw.items():
        if section in _SECTIONS and not isinstance(table, dict):
            raise SettingsError(
                f"{path}: {section} = {table!r} must be a table: write [{section}] and its keys below it",
                source=str(path),
                key=section,
            )
        if section not in _SECTIONS:
            raise SettingsError(
                f"{path}: unknown section [{section}]; allowed sections: "
                + ", ".join(f"[{s}]" for s in _SECTIONS),
                source=str(path),
                key=section,
            )
        for key, value in table.items():
            name = by_loc.get((section, key))
            if name is None:
                allowed = ", ".join(f.key for f in _FIELDS.values() if f.section == section)
                raise SettingsError(
                    f"{path}: unknown key {section}.{key}; allowed in [{section}]: {allowed}",
                    source=str(path),
                    key=f"{section}.{key}",
                )
            f = _FIELDS[name]
            try:
                if f.parse is str and not isinstance(value, str):
                    raise ValueError("expected a string")
                if f.parse in (_bool,) and not isinstance(value, bool):
                    raise ValueError("expected true or false")
                out[name] = f.parse(value)
            except (ValueError, TypeError) as e:
                raise SettingsError(
                    f"{path}: {section}.{key} = {value!r} is invalid: {e} ({f.form})",
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
    for name, f in _FIELDS.items():
        for var in f.env:
            text = environ.get(var)
            if text is None or text == "":
                continue
            try:
                values[name] = f.parse(text)
            except (ValueError, TypeError) as e:
                raise SettingsError(
                    f"environment variable {var}={text!r} is invalid: {e}", source=var, key=var
                ) from None
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
            base = (
                config.parent
                if config is not None and sources.get("cache_dir") == str(config)
                else Path.cwd()
            )
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
    if config is not None and "kernel_packages" not in values:
        # A project with its own quack.toml gets the kernels it lists, not quack's bundled
        # demo kernels (quack_kernels is installed, so importable from anywhere).
        values["kernel_packages"] = ()
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
        configure_logging(_current)
    return _current


def set_current(s: Settings | None) -> None:
    """Install settings for this process (the CLI after parsing flags; tests).
    None forgets them, so the next ``get`` resolves again."""
    global _current
    _current = s
    from quack.runtime import _generation

    _generation.bump()
    if s is not None:
        configure_logging(s)


def installed() -> Settings | None:
    """The settings installed for this process, or None if none are (the next
    ``get`` resolves them). Unlike ``get``, never resolves."""
    return _current


def _parse_override(name: str, value: Any) -> Any:
    f = _FIELDS.get(name)
    if f is None:
        if name == "config_file":
            return value
        raise SettingsError(f"unknown setting {name!r}", source="override", key=name)
    if name == "cache_dir":
        return Path(os.path.expanduser(os.fspath(value))).absolute()
    try:
        v = f.parse(value)
    except (ValueError, TypeError) as e:
        raise SettingsError(
            f"setting {name}={value!r} is invalid: {e} ({f.form})", source="override", key=name
        ) from None
    return tuple(v) if isinstance(v, list) else v


@contextmanager
def override(**changes: Any) -> Iterator[Settings]:
    """Install the current settings with ``changes`` for the block, then put back
    exactly what was installed before (or nothing), like Triton's
    ``knobs.scope()``. Values are checked like quack.toml's; raises SettingsError.

        with settings.override(cache_dir=tmp, mode="prebuilt") as s: ...
    """
    saved = _current
    base = get()
    parsed = {k: _parse_override(k, v) for k, v in changes.items()}
    srcs = dict(base.sources, **{k: "override" for k in parsed})
    s = dataclasses.replace(base, sources=srcs, **parsed)
    set_current(s)
    try:
        yield s
    finally:
        set_current(saved)


# -- the "quack" logger ---------------------------------------------------------------------
# A library's logger: a NullHandler so nothing reaches Python's last-resort
# stderr handler unless QUACK_LOG (or the application's logging config) asks.
logging.getLogger("quack").addHandler(logging.NullHandler())
_log_handler: logging.Handler | None = None


def configure_logging(s: Settings) -> None:
    """Level of ``logging.getLogger("quack")`` from ``s.log`` (QUACK_LOG). Silent by
    default: no handler, no level, so an application's own logging config decides;
    with QUACK_LOG set, quack's records go to stderr at that level."""
    global _log_handler
    logger = logging.getLogger("quack")
    if not s.log:
        if _log_handler is not None:
            logger.removeHandler(_log_handler)
            _log_handler = None
            logger.setLevel(logging.NOTSET)
        return
    logger.setLevel(getattr(logging, s.log.upper()))
    if _log_handler is None:
        _log_handler = logging.StreamHandler()
        _log_handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(_log_handler)
