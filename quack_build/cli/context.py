"""Helpers shared by the typer app and the typer-free fast path of ``quack cache
stats``: settings, kernel registration, consoles, JSON output."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

# Injected by tests; None = a Console on stdout (stderr when --json owns stdout).
console_factory = None


def console(to_stderr: bool = False):
    if console_factory is not None:
        return console_factory(to_stderr)
    from rich.console import Console

    file = sys.stderr if to_stderr else sys.stdout
    width = None
    if not file.isatty() and "COLUMNS" not in os.environ:
        width = 160
    return Console(file=file, width=width, highlight=False)


class Fail(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def manifest_fail(e, outcome: str = "nothing was built") -> Fail:
    """The CLI's error for a ManifestError: every problem, then the count and what the
    command did not do (``outcome``: "nothing was verified", "no bundle written", ...;
    "nothing was built" from ``quack verify`` misled)."""
    n = len(e.problems)
    return Fail("\n".join(e.problems) + f"\n{n} problem{'s' if n != 1 else ''} in the manifests; {outcome}")


def cli_settings(
    cache_dir: Optional[Path] = None,
    jobs: Optional[int] = None,
    executor: Optional[str] = None,
    manifests=(),
    mode: Optional[str] = None,
):
    """Resolve and install the settings. With manifests given, quack.toml is looked for
    from the first manifest's directory up (its project), else from the working directory.
    ``mode``: a command's own runtime mode, over QUACK_MODE, quack.toml and strict pytest's
    QUACK_PYTEST_PREBUILT_CACHE (``quack tune`` compiles its candidates by purpose)."""
    from quack import settings as qs
    from quack.errors import SettingsError

    try:
        near = None
        for m in list(manifests)[:1]:
            d = Path(m).absolute().parent
            if qs.find_config(d) is not None:
                near = d
        s = qs.resolve(
            {
                "cache_dir": str(cache_dir) if cache_dir else None,
                "jobs": jobs,
                "executor": executor,
                "mode": mode,
            },
            cwd=near,
        )
    except SettingsError as e:
        raise Fail(f"error: {e}") from None
    qs.set_current(s)
    return s


def load_kernels(s, *, required: bool = True) -> None:
    from quack import registry

    root = str(s.project_root)
    if root not in sys.path:
        sys.path.append(root)
    try:
        registry.load_packages(s.kernel_packages)
    except Exception as e:  # noqa: BLE001
        if required:
            raise Fail(
                f"error: importing the kernel packages {list(s.kernel_packages)} "
                f"([build] kernel_packages) failed: {type(e).__name__}: {e}"
            ) from None


def current_srcfps() -> dict:
    from quack import registry

    out = {}
    for name, spec in registry.all_specs().items():
        try:
            out[name] = spec.source_fingerprint()
        except Exception:  # noqa: BLE001
            pass
    return out


def cache_dir_origin(s) -> str:
    """Where the settings ``s`` took their cache directory from, as a user would change it."""
    src = s.sources.get("cache_dir")
    if src == "cli":
        return "--cache-dir"
    if src and src.startswith("QUACK_"):
        return src
    if src:
        return f"[cache] dir in {src}"
    return "the default (set QUACK_CACHE_DIR or [cache] dir in quack.toml to use another)"


def cache_fail(s, e: Exception) -> Fail:
    """The CLI's error for a cache directory it can't use (a CacheError), naming the
    setting that chose it: the directory is the user's to fix, not quack's."""
    return Fail(f"error: {e} (cache directory set by {cache_dir_origin(s)})")


def store_fail(s, e: Exception) -> Fail:
    """The CLI's error for the cache failing under a command (planning a build, listing
    a dry run): a CacheError says what is wrong with the directory itself; another
    OSError is explained against the root (a file on its path, no permission). Either
    names the setting that chose the directory, said once (it read "error: cache X:
    cache directory X: ..." before)."""
    from quack.cache import fsutil
    from quack.errors import CacheError

    if isinstance(e, CacheError):
        return cache_fail(s, e)
    return cache_fail(s, fsutil.reach_error(Path(s.cache_dir), e))  # type: ignore[arg-type]


def check_root(s) -> None:
    """Refuse the cache root of settings ``s`` when it is unsafe (a symlink, not ours,
    group/other-writable) the way ``quack build`` does: stats and clean must not report
    on, or delete in, a directory someone else can plant files in; or when it can't be
    reached or listed (a file on its path, no permission), which otherwise escaped as a
    NotADirectoryError / PermissionError traceback, or (prewarm) read as an empty journal."""
    from quack.cache import fsutil
    from quack.errors import CacheError

    root = Path(s.cache_dir)
    try:
        fsutil.check_root(root)
        if os.path.isdir(root):
            with os.scandir(root):
                pass
    except CacheError as e:
        raise cache_fail(s, e) from None
    except OSError as e:
        raise cache_fail(s, fsutil.reach_error(root, e)) from None


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=1, default=str) + "\n")
    sys.stdout.flush()


def stats(as_json, cache_dir, top) -> int:
    from quack.cache import journal
    from quack.errors import CacheError
    from quack_build.cachedir import stats as cachestats

    s = cli_settings(cache_dir)
    check_root(s)
    load_kernels(s, required=False)
    try:
        info = cachestats.summarize(s.cache_dir, current_srcfps())
    except CacheError as e:  # a directory in the cache that can't be read (walk)
        raise cache_fail(s, e) from None
    info["journal"] = cachestats.journal_summary(journal.read(s.cache_dir), top=top)
    from quack.bundles import tier as _bundle_tier

    info["bundles"] = _bundle_tier.summary(s)
    from quack.remote.stats import read_stats

    info["remote"] = read_stats(s.cache_dir)
    info["remote"]["configured"] = s.remote_url and _redact(s.remote_url)
    if as_json:
        emit_json(info)
        return 0
    from quack_build.cli.stats_view import print_stats

    print_stats(console(), info)
    return 0


def _redact(url: str) -> str:
    from quack.remote.base import redact

    return redact(url)


def stats_fast(as_json: bool) -> int:
    """``quack cache stats [--json]`` without typer (whose import costs 0.1-0.2 s)."""
    try:
        return stats(as_json, None, 10) or 0
    except Fail as e:
        sys.stderr.write(f"{e}\n")
        return e.code
