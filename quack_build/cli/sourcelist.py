"""``quack build -v``: what each kernel's source fingerprint covers (the files hashed and
the installed distributions named by version; quack.cache.sources), so a user can see
whether an edit will invalidate its objects."""

from __future__ import annotations

from quack_build.cli.context import Fail


def lines(kernels) -> list[str]:
    """One block per kernel name, in name order. Raises Fail for a bad depends_on entry."""
    from quack import registry
    from quack.errors import KernelDependencyError

    out: list[str] = []
    for name in sorted(set(kernels)):
        spec = registry.get(name)
        if spec.module == "__main__":
            out.append(f"sources of {name}: not fingerprinted (defined in __main__)")
            continue
        try:
            fp = spec.source_fingerprint()
            cov = spec.coverage()
        except KernelDependencyError as e:
            raise Fail(f"error: {e}") from None
        out.append(
            f"sources of {name} (fingerprint {fp}): {len(cov.files)} files, "
            f"{len(cov.dists)} installed distributions"
        )
        out += [f"  file  {path}  ({mod})" for mod, path in sorted(cov.files.items())]
        out += [f"  dist  {dist} {version}" for dist, (version, _) in sorted(cov.dists.items())]
    return out


def print_sources(con, kernels) -> None:
    text = "\n".join(lines(kernels))
    if text:
        con.print(text, markup=False, soft_wrap=True)
