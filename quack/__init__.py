"""quack: a precompile build system and zero-overhead runtime cache for CuTe DSL kernels.

Importing quack is cheap (no torch, no cutlass); names resolve lazily."""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "jit_cache": "quack.runtime.jit",
    "JitKernel": "quack.runtime.jit",
    "cache_stats": "quack.runtime.jit",
    "KernelNotPrebuilt": "quack.errors",
    "CompileError": "quack.errors",
    "CompilePending": "quack.errors",
    "ParamError": "quack.errors",
    "SettingsError": "quack.errors",
    "CacheError": "quack.errors",
    "QuackError": "quack.errors",
    "Dtype": "quack.params",
    "Int": "quack.params",
    "Bool": "quack.params",
    "Float": "quack.params",
    "Choice": "quack.params",
    "Config": "quack.params",
    "pool_scope": "quack.compile.pool",
    "suppress_pool": "quack.compile.pool",
    "CompilePool": "quack.compile.pool",
    "autotune": "quack.compile.autotune",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'quack' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
