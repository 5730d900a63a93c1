"""``Settings``: the immutable record of one process's resolved settings, with the
values derived from it (project root, manifest paths, build archs, job count).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable


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
    # Modules imported once per compile worker (forkserver, Ray actor) before any key:
    # a heavy library a compile function imports ([build] preload, QUACK_PRELOAD).
    preload: tuple[str, ...] = ()
    remote_url: str | None = None
    remote_write: bool = False
    remote_timeout: float = 5.0  # per operation; connecting waits at most 0.5 s
    signing_key: str | None = None
    trusted_keys: tuple[str, ...] = ()
    executor: str = "local"
    tune_gpu: str | None = None  # [tune] gpu / QUACK_TUNE_GPU (quack.tuning.gpu)
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
