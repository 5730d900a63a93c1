"""A kernel family's source fingerprint covers its own helpers, not the other families
(issue 26): while ``_ops`` imported every family and each family imported ``_ops`` back,
every family's fingerprint covered all of quack_kernels, so an edit to softmax.py moved
every RMSNorm object to a new fingerprint directory and rebuilt it for nothing."""

import pytest

from quack.cache import keys

FAMILIES = ("rmsnorm", "layernorm", "softmax", "cross_entropy")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_familys_fingerprint_covers_no_other_family(family):
    covered = set(keys.source_files(f"quack_kernels.{family}"))
    assert f"quack_kernels.{family}" in covered
    others = {f"quack_kernels.{f}" for f in FAMILIES if f != family}
    # ops imports every family (and torch): a family reaching it reaches them all
    assert not covered & (others | {"quack_kernels.ops"}), sorted(covered)
