"""Cache hints of global loads: the L2 cache-policy operands and hinted tiled loads of a
row plan's fragments (the softmax backward's "small" default uses them).

Measured on the H200 (softmax bwd, docs/kernels.md): an L2 evict_last policy on data read
again made 3 % where nothing else did, a createpolicy'd operand lost 12 %, evict-first
hints on a first read cost 10-13 %, store hints nothing; hinted stores, createpolicy'd
operands, and wide hinted loads or cp.async with an L2 policy for the norm forwards lost,
so they are not offered.

Imported only from inside compile functions (cutlass is imported inside the functions).
"""

# L2 cache-policy operands (``.L2::cache_hint``): the encodings of
# ``createpolicy.fractional.L2::<priority>.b64 p, 1.0`` (CUTLASS's CacheHintSm90).
L2_POLICY = {
    "evict_first": 0x12F0000000000000,
    "evict_last": 0x14F0000000000000,
    "normal": 0x1000000000000000,
}


def l2_policy(spec):
    """The L2 policy constant of a hint ``spec`` (``io_copy``), or None."""
    l2 = (spec or {}).get("l2")
    if not l2:
        return None
    return L2_POLICY[l2]


def io_copy(dt, plan, spec, plain):
    """The tiled copy of a hinted load of the plan's fragments (built while the kernel is
    traced; ``plain`` without ``spec``). ``spec``: a dict with ``mode`` ("ca", "cg", "cs",
    "lu", "nc" (invariant: ld.global.nc)), ``evict`` (L1: "first", "last", "no_allocate",
    "unchanged") and ``l2`` (a key of ``L2_POLICY``)."""
    if not spec:
        return plain
    import cutlass.cute as cute
    from cutlass.cute import nvgpu

    evict = {
        None: nvgpu.CacheEvictionPriority.EVICT_NORMAL,
        "first": nvgpu.CacheEvictionPriority.EVICT_FIRST,
        "last": nvgpu.CacheEvictionPriority.EVICT_LAST,
        "no_allocate": nvgpu.CacheEvictionPriority.NO_ALLOCATE,
        "unchanged": nvgpu.CacheEvictionPriority.EVICT_UNCHANGED,
    }[spec.get("evict")]
    bits = plan.vec * dt.width
    mode = spec.get("mode")
    lm = {
        None: nvgpu.LoadCacheMode.ALWAYS,
        "ca": nvgpu.LoadCacheMode.ALWAYS,
        "nc": nvgpu.LoadCacheMode.ALWAYS,
        "cg": nvgpu.LoadCacheMode.GLOBAL,
        "cs": nvgpu.LoadCacheMode.STREAMING,
        "lu": nvgpu.LoadCacheMode.LAST_USE,
    }[mode]
    op = nvgpu.CopyG2ROp()
    atom = cute.make_copy_atom(
        op,
        dt,
        num_bits_per_copy=bits,
        l1c_evict_priority=evict,
        load_cache_mode=lm,
        invariant=mode == "nc",
    )
    thr_layout = cute.make_ordered_layout((plan.rows_per_cta, plan.threads_per_row), order=(1, 0))
    tc = cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, plan.vec)))
    return tc
