"""The weight / bias staging shared by the two ring forwards (``_norm_fwd.ring_kernel``
and ``_ring_pipe.ring_pipe_kernel``). Its own module, not ``_norm_fwd``: ``_norm_fwd``
imports ``_ring_pipe``, and ``_ring_pipe`` taking this back from ``_norm_fwd`` was an
import cycle (tests/test_layering.py).

Imported only from inside compile functions (the kernel builder imports cutlass inside).
"""


def stage_ring_wb(t0, smem, wdt, mW, mB, cfg):
    """The ring's weight / bias slices into shared memory once, (sW, sB) (None where the
    vector is None): cp.async (one commit group, first, so the ring's waits cover it) where
    a vector of them fits a 16-byte copy, else element-wise by the thread that reads them
    back (fp32 beside 16-bit rows; ``cfg["wide_perm"]``: the conflict-free layout). Traced
    inline from a kernel body."""
    from cutlass import const_expr

    sW = None
    sB = None
    if const_expr(cfg["cp_async_wb"]):
        sW, sB = t0.stage_bcast(smem, wdt, mW, mB)
    else:
        if const_expr(mW is not None):
            sW = t0.alloc_smem_bcast(smem, wdt, spread=cfg["wide_perm"])
            t0.stage_bcast_own(mW, sW)
        if const_expr(mB is not None):
            sB = t0.alloc_smem_bcast(smem, wdt, spread=cfg["wide_perm"])
            t0.stage_bcast_own(mB, sB)
    return sW, sB
