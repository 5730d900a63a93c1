"""Deployment bundles: prebuilt kernels installed as Python distributions.

``quack bundle`` (quack_build.bundle.wheel) writes a wheel whose package holds objects in
the store's layout and an index (quack.bundles.index); once installed, the runtime
finds it through the ``quack.bundles`` entry point group and uses it as a read-only
tier after the local cache (quack.bundles.tier). Importing this package is cheap:
nothing is discovered until the first lookup that reaches the tier."""

from __future__ import annotations

from quack.bundles.index import ENTRY_POINT_GROUP, INDEX_NAME, SIG_NAME

__all__ = ["ENTRY_POINT_GROUP", "INDEX_NAME", "SIG_NAME"]
