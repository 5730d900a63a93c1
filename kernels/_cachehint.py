"""Cache hints of global loads / stores and cp.async copies (issue 14 part 6): the L2
cache-policy operands, hinted tiled copies of a row plan's fragments (round 5, engineer E:
moved here from ``softmax.py`` so that the norms use them without importing softmax's
privates), and round 6's pieces for the norm forwards: 16-byte loads of a broadcast vector
wider than the rows (an fp32 weight / bias beside 16-bit x) with an L2 policy, and cp.async
(global -> shared, ``.cg``) with an ``.L2::cache_hint`` operand, which ``CopyG2SOp`` cannot
carry.

Measured on the H200 (softmax bwd, docs/kernels.md "Round 5, softmax backward"): an L2
evict_last policy on data read again made 3 % where nothing else did, a createpolicy'd
operand (the "cp:" prefix) lost 12 %, evict-first hints on a first read cost 10-13 %.

Imported only from inside compile functions (cutlass is imported inside the functions).
"""

# L2 cache-policy operands (``.L2::cache_hint``): the encodings of
# ``createpolicy.fractional.L2::<priority>.b64 p, 1.0`` (CUTLASS's CacheHintSm90); a "cp:"
# prefix creates the policy in the kernel with createpolicy instead (as Triton does).
L2_POLICY = {
    "evict_first": 0x12F0000000000000,
    "evict_last": 0x14F0000000000000,
    "normal": 0x1000000000000000,
}


def l2_policy(spec):
    """The L2 policy of a hint ``spec`` (``io_copy``): None, a constant, or the priority
    name to createpolicy in the kernel."""
    l2 = (spec or {}).get("l2")
    if not l2:
        return None
    return l2[3:] if l2.startswith("cp:") else L2_POLICY[l2]


def io_copy(dt, plan, direction: str, spec, plain):
    """The tiled copy of a hinted load / store of the plan's fragments (built while the
    kernel is traced; ``plain`` without ``spec``). ``spec``: a dict with ``mode`` (loads: "ca",
    "cg", "cs", "lu", "nc" (invariant: ld.global.nc), stores: "wb", "cg", "cs", "wt"),
    ``evict`` (L1: "first", "last", "no_allocate", "unchanged") and ``l2`` (a key of
    ``L2_POLICY``)."""
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
    if direction == "load":
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
    else:
        sm = {
            None: nvgpu.StoreCacheMode.WRITE_BACK,
            "wb": nvgpu.StoreCacheMode.WRITE_BACK,
            "cg": nvgpu.StoreCacheMode.GLOBAL,
            "cs": nvgpu.StoreCacheMode.STREAMING,
            "wt": nvgpu.StoreCacheMode.WRITE_THROUGH,
        }[mode]
        atom = cute.make_copy_atom(
            nvgpu.CopyR2GOp(), dt, num_bits_per_copy=bits, l1c_evict_priority=evict, store_cache_mode=sm
        )
    thr_layout = cute.make_ordered_layout((plan.rows_per_cta, plan.threads_per_row), order=(1, 0))
    tc = cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, plan.vec)))
    return tc


def wide_load_atom(dtype, spec):
    """A 16-byte global -> register copy atom of ``dtype`` with the L1 hints of ``spec``
    (``io_copy``'s keys "mode" / "evict"; its "l2" policy is the copy's ``cache_policy``
    operand: ``l2_policy``). For a broadcast vector whose fragment vector is wider than 16
    bytes (8 fp32 beside 16-bit rows): ``load_wide`` splits it into 16-byte copies."""
    import cutlass.cute as cute
    from cutlass.cute import nvgpu

    spec = spec or {}
    evict = {
        None: nvgpu.CacheEvictionPriority.EVICT_NORMAL,
        "first": nvgpu.CacheEvictionPriority.EVICT_FIRST,
        "last": nvgpu.CacheEvictionPriority.EVICT_LAST,
        "no_allocate": nvgpu.CacheEvictionPriority.NO_ALLOCATE,
    }[spec.get("evict")]
    lm = {
        None: nvgpu.LoadCacheMode.ALWAYS,
        "ca": nvgpu.LoadCacheMode.ALWAYS,
        "nc": nvgpu.LoadCacheMode.ALWAYS,
        "cg": nvgpu.LoadCacheMode.GLOBAL,
    }[spec.get("mode")]
    return cute.make_copy_atom(
        nvgpu.CopyG2ROp(),
        dtype,
        num_bits_per_copy=128,
        l1c_evict_priority=evict,
        load_cache_mode=lm,
        invariant=spec.get("mode") == "nc",
    )


def load_wide(atom, src, dst, policy):
    """Copy the 1-D fragment ``src`` (global, contiguous, a multiple of 16 bytes) into the
    register fragment ``dst`` 16 bytes at a time with ``atom`` (``wide_load_atom``) and the
    L2 ``policy`` constant (None: no operand). Traced inline from a kernel body."""
    import cutlass
    import cutlass.cute as cute

    per = 128 // src.element_type.width
    s = cute.logical_divide(src, cute.make_layout(per))
    d = cute.logical_divide(dst, cute.make_layout(per))
    for i in range(cute.size(s, mode=[1])):
        if policy is None:
            cute.copy(atom, s[None, i], d[None, i])
        else:
            cute.copy(atom, s[None, i], d[None, i], cache_policy=cutlass.Int64(policy))


def store_hinted(atom, src, dst, policy):
    """``cute.copy(atom, src, dst)`` of a register fragment to global memory with the L2
    ``policy`` constant (None: no operand). Traced inline from a kernel body."""
    import cutlass
    import cutlass.cute as cute

    if policy is None:
        cute.copy(atom, src, dst)
    else:
        cute.copy(atom, src, dst, cache_policy=cutlass.Int64(policy))


def store_atom(dtype, spec):
    """A 16-byte register -> global copy atom with ``spec``'s store mode / L1 eviction
    (``io_copy``'s keys; the "l2" policy goes to ``store_hinted``)."""
    import cutlass.cute as cute
    from cutlass.cute import nvgpu

    spec = spec or {}
    evict = {
        None: nvgpu.CacheEvictionPriority.EVICT_NORMAL,
        "first": nvgpu.CacheEvictionPriority.EVICT_FIRST,
        "no_allocate": nvgpu.CacheEvictionPriority.NO_ALLOCATE,
    }[spec.get("evict")]
    sm = {
        None: nvgpu.StoreCacheMode.WRITE_BACK,
        "wb": nvgpu.StoreCacheMode.WRITE_BACK,
        "cg": nvgpu.StoreCacheMode.GLOBAL,
        "cs": nvgpu.StoreCacheMode.STREAMING,
    }[spec.get("mode")]
    return cute.make_copy_atom(
        nvgpu.CopyR2GOp(), dtype, num_bits_per_copy=128, l1c_evict_priority=evict, store_cache_mode=sm
    )


def cp_async_hinted(src, dst, policy: int):
    """cp.async.cg (16 bytes, global -> shared, L1 bypassed) of each 16-byte vector of the
    thread fragments ``src`` (global) / ``dst`` (shared), shape ((vec, 1), 1, nvec) with
    vec x width = 128 bits, with the L2 cache-policy constant ``policy`` (``L2_POLICY``):
    inline PTX, since ``CopyG2SOp`` has no cache-policy operand. Commit groups as for
    ``cute.copy`` with a cp.async atom (the caller's ``cp_async_commit_group``). Traced
    inline from a kernel body."""
    import cutlass
    import cutlass.cute as cute

    for k in range(cute.size(src, mode=[2])):
        cute.arch.inline_ptx(
            "cp.async.cg.shared.global.L2::cache_hint [{$r0}], [{$r1}], 16, {$r2};",
            read_only_args=[
                dst[None, 0, k].iterator.toint(),
                src[None, 0, k].iterator.toint(),
                cutlass.Int64(policy),
            ],
        )
