"""One configuration to build, the unit everything downstream of a manifest works on
(the scheduler, prewarm, verify, bundles), and how its parameters are printed.
Produced by quack_build.manifest.read (``expand``); kept apart so that those modules need
not import the manifest parser."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """One (kernel, canonical parameters, arch) to build, with its cache key."""

    kernel: str
    params: dict
    arch: str
    key: str
    origin: str
    spec: Any = dataclasses.field(compare=False, repr=False, hash=False)
    # the tuning problems its manifest entry lists (``problems``; quack tune): tuples of
    # (size name, value) in the kernel's ``problem`` order; nothing else reads them
    problems: tuple = dataclasses.field(default=(), compare=False, repr=False, hash=False)
    # the sizes among ``problems`` whose tuned configuration this is (an entry that leaves
    # the configuration to the table builds one per size: quack_build.manifest.expand), as
    # "8192x4096x4096" strings; () for every other configuration
    sizes: tuple = dataclasses.field(default=(), compare=False, repr=False, hash=False)

    @property
    def plain_params(self) -> dict:
        return self.spec.plain(self.params)

    def label(self) -> str:
        return f"{self.kernel}({format_params(self.plain_params)}) {self.arch}"


def format_params(params: dict) -> str:
    out = []
    for k, v in params.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, dict):
            # A typed configuration's unset fields (None: the kernel's own default) would
            # fill a build line with 20-odd "=None"s; what is set is what differs.
            v = "{" + ",".join(f"{a}={b}" for a, b in v.items() if b is not None) + "}"
        out.append(f"{k}={v}")
    return " ".join(out)
