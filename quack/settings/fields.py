"""The settings' schema: each setting's quack.toml section and key, its environment
variables, and the parser that checks its value (``FIELDS``), with the value checkers
other modules use too (``check_arch``, ``check_executor``, ``KNOWN_ARCHS``). Reads
nothing: quack.settings.sources reads the environment and quack.toml through it.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

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


def parse_bool(text: str | bool) -> bool:
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
    want = "expected an integer >= 0 (0 means one per CPU)"
    if isinstance(text, (bool, float)):  # 2.5 must not silently become 2
        raise ValueError(want)
    try:
        v = int(text)
    except ValueError:  # int()'s own "invalid literal for int() with base 10" said not what is allowed
        raise ValueError(want) from None
    if v < 0:
        raise ValueError(want)
    return v


def _pos_float(text: str | float) -> float:
    want = "expected a number of seconds > 0"
    if isinstance(text, bool):
        raise ValueError(want)
    try:
        v = float(text)
    except ValueError:  # float()'s "could not convert string to float" said not what is allowed
        raise ValueError(want) from None
    if not 0 < v < math.inf:  # nan fails every comparison; inf overflows a timed wait
        raise ValueError(want.replace("a number", "a finite number"))
    return v


def _dir_path(text: Any) -> str:
    """A directory path that is not empty. ``[cache] dir = ""`` and ``QUACK_CACHE_DIR=' '``
    were Path('') == '.' (or ' ' under it): the cache silently went into the project or
    working directory, and ``quack cache clean --all`` would have cleaned there.
    (``QUACK_CACHE_DIR=''`` stays "unset", as for every variable.)"""
    if not isinstance(text, str):
        raise ValueError("expected a string")
    if not text.strip():
        raise ValueError(
            "must not be empty or blank: give the directory's path, or leave it out for the default"
        )
    return text


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
    try:
        return parse_bool(text)
    except ValueError:  # parse_bool's own list left 'auto' out
        raise ValueError("expected 'auto' or one of 1/0, true/false, yes/no, on/off") from None


REMOTE_FORMS = "redis://host:port/db, s3://bucket/prefix or file:///shared/path"
_S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_CONTROL = re.compile(r"[\x00-\x20\x7f]")


def check_remote_url(text: str) -> str:
    """``text`` if it is a well-formed remote cache URL, else ValueError naming what
    is wrong and the allowed forms. One rule for the settings and the backends: a
    malformed URL must never quietly mean something else (``redis://:@@/`` was read
    as localhost:6379 by the client library)."""
    from urllib.parse import urlsplit

    if not isinstance(text, str):
        raise ValueError("expected a URL string")
    scheme = text.partition("://")[0].lower()
    if scheme not in ("redis", "rediss", "s3", "file") or "://" not in text:
        raise ValueError(f"expected {REMOTE_FORMS}")
    if _CONTROL.search(text):
        raise ValueError(f"a space or control character in the URL; expected {REMOTE_FORMS}")
    try:
        parts = urlsplit(text)
        port = parts.port  # raises for a non-numeric or out-of-range port
    except ValueError as e:
        raise ValueError(f"malformed URL ({e}); expected {REMOTE_FORMS}") from None
    if parts.fragment:
        raise ValueError(f"a '#' fragment has no meaning here; expected {REMOTE_FORMS}")
    segments = parts.path.split("/")[1:]
    if scheme in ("redis", "rediss"):
        form = f"expected {scheme}://[user:password@]host[:port][/db]"
        if parts.netloc.count("@") > 1:
            raise ValueError(
                # Name the host only: what stands before the '@' may be a password.
                f"more than one '@' before host {parts.netloc.rpartition('@')[2]!r} "
                f"(percent-encode '@' in a password); {form}"
            )
        if not parts.hostname:
            raise ValueError(f"no host name; {form}")
        if port == 0:
            raise ValueError(f"port 0; {form}")
        db = parts.path.strip("/")
        if "/" in parts.path.rstrip("/")[1:] or (db and not db.isdigit()):
            raise ValueError(f"database {parts.path!r} is not a number; {form}")
    elif scheme == "s3":
        form = "expected s3://bucket/prefix (a bucket name of 3-63 lowercase letters, digits, '.', '-')"
        if "@" in parts.netloc or ":" in parts.netloc or not _S3_BUCKET.fullmatch(parts.netloc):
            raise ValueError(f"bucket {parts.netloc!r} is not a valid bucket name; {form}")
        if parts.query or any(s in (".", "..") for s in segments) or "" in segments[:-1]:
            raise ValueError(f"prefix {parts.path!r} has an empty, '.' or '..' part or a query; {form}")
    else:
        form = "expected file:///absolute/path (three slashes)"
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(form)
        if parts.query or any(s in (".", "..") for s in segments):
            raise ValueError(f"path {parts.path!r} has a '.' or '..' part or a query; {form}")
    return text


def _remote_url(text: str) -> str:
    return check_remote_url(text)


def redact_url(url: str) -> str:
    """The URL without a password, for messages and logs (also for a malformed URL,
    which is named in the error that refuses it)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        if parts.password:
            netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (
                f":{parts.port}" if parts.port else ""
            )
            return parts._replace(netloc=netloc).geturl()
        return url
    except ValueError:  # a bad port or IPv6 bracket: hide all of the user part
        head, sep, rest = url.partition("://")
        netloc, slash, tail = rest.partition("/")
        if "@" in netloc:
            netloc = "***@" + netloc.rpartition("@")[2]
        return head + sep + netloc + slash + tail


def _show_url(value: Any) -> str:
    return repr(redact_url(value)) if isinstance(value, str) else repr(value)


def _remote_timeout(text: str | float) -> float:
    want = "expected seconds > 0 and <= 5 (a slow remote must not stall a build)"
    try:
        v = _pos_float(text)
    except ValueError:
        raise ValueError(want) from None
    if v > 5:
        raise ValueError(want)
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
    if t in ("local", "ray", "auto"):
        return t
    if re.fullmatch(_ADDR, t):
        port = int(t.rpartition(":")[2])
        if not 1 <= port <= 65535:  # as QUACK_REMOTE's port: 0 or 99999 is no address
            raise ValueError(f"port {port} is not 1-65535; expected {EXECUTOR_FORMS}")
        return t
    raise ValueError(f"expected {EXECUTOR_FORMS}")


def _str_list(v: Any) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError("expected a list of strings")
    return list(v)


_MODULE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


def _module_list(v: Any) -> list[str]:
    """Module names to import: a list (quack.toml) or a ``,``-separated string (QUACK_PRELOAD)."""
    mods = [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else _str_list(v)
    for m in mods:
        if not re.fullmatch(_MODULE, m):
            raise ValueError(f"{m!r} is not a module name (dotted Python identifiers, like 'pkg.mod')")
    return mods


def _gpu_model(v: Any) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}", v.strip()):
        raise ValueError("expected a GPU model name of letters, digits, '_', '.', '-' (like 'H200')")
    # the rows' spelling: 'h100' and 'H100-SXM' keyed the heuristic (no rows for 'h100')
    # and said only "no tuning-table rows for GPU 'h100'"
    from quack.gpumodel import normalise_gpu

    return normalise_gpu(v.strip())


class Field:
    """Where one setting is read from and how it is parsed. A plain slotted class, not a
    dataclass: a dataclass is generated (exec) at import, ~0.3 ms of every fresh
    process's first kernel load for a record nothing compares or copies."""

    __slots__ = ("section", "key", "env", "parse", "form", "show")

    def __init__(
        self,
        section: str,
        key: str,
        env: tuple[str, ...],
        parse: Callable[[Any], Any],
        form: str,
        show: Callable[[Any], str] = repr,
    ):
        self.section, self.key, self.env, self.parse, self.form = section, key, env, parse, form
        # How an invalid value is quoted in an error: a remote URL's password must never
        # reach a terminal or a CI log through a settings error.
        self.show = show


FIELDS: dict[str, Field] = {
    "cache_dir": Field("cache", "dir", ("QUACK_CACHE_DIR",), _dir_path, "a non-empty directory path"),
    "cache_enabled": Field("cache", "enabled", ("QUACK_CACHE_ENABLED",), parse_bool, "true or false"),
    "fsync": Field("cache", "fsync", ("QUACK_FSYNC",), parse_bool, "true or false"),
    "lock_timeout": Field("cache", "lock_timeout", ("QUACK_LOCK_TIMEOUT",), _pos_float, "seconds > 0"),
    "mode": Field("runtime", "mode", ("QUACK_MODE",), _mode, "'jit' or 'prebuilt'"),
    "arch": Field(
        "runtime", "arch", ("QUACK_ARCH", "CUTE_DSL_ARCH"), check_arch, "a CUDA arch like 'sm_90a'"
    ),
    "compile_jobs": Field("runtime", "compile_jobs", ("QUACK_COMPILE_JOBS",), _pos_int, "an integer >= 0"),
    "compile_timeout": Field(
        "runtime", "compile_timeout", ("QUACK_COMPILE_TIMEOUT",), _pos_float, "seconds > 0"
    ),
    "pool_start": Field(
        "runtime", "pool_start", ("QUACK_POOL_START",), _start_method, "'forkserver', 'spawn' or 'fork'"
    ),
    "no_preload": Field("runtime", "no_preload", ("QUACK_NO_PRELOAD",), parse_bool, "true or false"),
    "log": Field("runtime", "log", ("QUACK_LOG",), _log_level, "a log level: debug, info, warning or error"),
    "pytest_gpu_pin": Field(
        "pytest", "gpu_pin", ("QUACK_PYTEST_GPU_PIN",), _auto_bool, "true, false or 'auto'"
    ),
    "manifests": Field("build", "manifests", (), _str_list, "a list of manifest paths"),
    "jobs": Field("build", "jobs", (), _pos_int, "an integer >= 0 (0 = one per CPU)"),
    "archs": Field(
        "build", "archs", (), lambda v: [check_arch(a) for a in _str_list(v)], "a list of CUDA archs"
    ),
    "kernel_packages": Field("build", "kernel_packages", (), _str_list, "a list of package names"),
    "preload": Field(
        "build",
        "preload",
        ("QUACK_PRELOAD",),
        _module_list,
        "a list of module names to import once in every compile worker (comma-separated in QUACK_PRELOAD)",
    ),
    "remote_url": Field(
        "remote",
        "url",
        ("QUACK_REMOTE",),
        _remote_url,
        REMOTE_FORMS,
        _show_url,
    ),
    "remote_write": Field("remote", "write", ("QUACK_REMOTE_WRITE",), parse_bool, "true or false"),
    "remote_timeout": Field(
        "remote", "timeout", ("QUACK_REMOTE_TIMEOUT",), _remote_timeout, "seconds, > 0 and <= 5"
    ),
    "signing_key": Field("remote", "signing_key", ("QUACK_SIGNING_KEY",), str, "a private key file path"),
    "trusted_keys": Field(
        "remote",
        "trusted_keys",
        ("QUACK_TRUSTED_KEYS",),
        _path_list,
        "public key files or directories (a list, or ':'-separated)",
    ),
    "executor": Field("build", "executor", ("QUACK_BUILD_EXECUTOR",), check_executor, EXECUTOR_FORMS),
    # The GPU model whose tuning-table rows pick default kernel configurations (issue 25;
    # docs/tuning.md): unset = the detected GPU where CUDA is up, else the table's default.
    "tune_gpu": Field("tune", "gpu", ("QUACK_TUNE_GPU",), _gpu_model, "a GPU model name like 'H200'"),
}
SECTIONS = sorted({f.section for f in FIELDS.values()})
