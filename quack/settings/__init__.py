"""Settings, resolved once: CLI flag > environment > quack.toml > default.

A leaf package: it imports nothing from quack except errors, so every other
module may import it without an import-order hazard. This module holds the process's
current settings (``get``, ``set_current``, ``installed``, ``override``) and the
"quack" logger's configuration; the schema lives in quack.settings.fields, the
``Settings`` record in quack.settings.record, and the one reader of the environment
and quack.toml in quack.settings.sources. Their public names are re-exported here."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from quack.errors import SettingsError, TomlFileError
from quack.settings.fields import (
    EXECUTOR_FORMS,
    FIELDS,
    KNOWN_ARCHS,
    LOG_LEVELS,
    MODES,
    START_METHODS,
    check_arch,
    check_executor,
)
from quack.settings.record import Settings
from quack.settings.sources import (
    CONFIG_NAME,
    PREBUILT_CACHE_ENV,
    default_cache_dir,
    find_config,
    read_config,
    resolve,
)

__all__ = [
    "CONFIG_NAME",
    "EXECUTOR_FORMS",
    "KNOWN_ARCHS",
    "LOG_LEVELS",
    "MODES",
    "PREBUILT_CACHE_ENV",
    "START_METHODS",
    "Settings",
    "SettingsError",
    "TomlFileError",
    "check_arch",
    "check_executor",
    "configure_logging",
    "default_cache_dir",
    "find_config",
    "get",
    "installed",
    "override",
    "read_config",
    "resolve",
    "set_current",
]


def __getattr__(name: str) -> Any:
    if name == "ARCH_RE":  # public, unused here: compiled on first use
        return re.compile(r"^sm_(\d{2,3})([af]?)$")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    from quack.runtime import generation

    generation.bump()
    if s is not None:
        configure_logging(s)


def installed() -> Settings | None:
    """The settings installed for this process, or None if none are (the next
    ``get`` resolves them). Unlike ``get``, never resolves."""
    return _current


def _parse_override(name: str, value: Any) -> Any:
    f = FIELDS.get(name)
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
