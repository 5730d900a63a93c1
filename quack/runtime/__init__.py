"""Kernels at run time: the object loader and the jit lookup through the cache tiers;
``max_active_clusters`` (quack.runtime.occupancy), the compiler-free occupancy query a
persistent kernel sizes its grid with."""

from typing import Any


def __getattr__(name: str) -> Any:
    # Lazy: importing quack.runtime (every kernel load does) must not import the helper.
    if name == "max_active_clusters":
        from quack.runtime.occupancy import max_active_clusters

        return max_active_clusters
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
