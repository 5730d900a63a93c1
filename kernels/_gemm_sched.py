"""The Hopper GEMM's persistent schedule (CuTe DSL, sm_90a), a base of ``_gemm_kernel``'s
``HopperGemm``: which output tile a CTA computes next (the swizzled order of
``_gemm_plan.swizzled_cluster``; stream-K's units of whole tiles and of K-pieces cut at tile
edges, ``_gemm_plan.stream_k_units``) and how the pieces of a cut tile are summed (the
fix-up: each piece counts itself in, the last to arrive adds the others' partial sums in K
order from the workspace; the others hand theirs on through a slot and a release flag).

The methods read ``self.p`` (the GemmPlan) and ``self.math_threads`` (the consumer
threads), which ``HopperGemm`` sets. ``sk`` is the kernel's stream-K tuple: (cluster,
clusters, the data-parallel tiles (the stream-K region starts after them), this cluster's
data-parallel units, its first and end iteration of the stream-K region, iterations per
cluster and how many clusters take one more, the fp32 workspace, the int32 flags, a
shared-memory word). Imported only
from inside compile functions.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ._gemm_plan import GemmPlan, swizzled_cluster


class GemmSchedule:
    """The tile order and the stream-K fix-up protocol of ``HopperGemm`` (its base)."""

    p: GemmPlan
    math_threads: int

    @cute.jit
    def sk_share(self, gA, grid_c, k_tiles, sk_tiles, mWs, mFlags, st):
        """This cluster's share of the stream-K schedule (_gemm_plan.stream_k_units): the
        kernel's ``sk`` tuple (the module doc). ``gA``: the CTA-tiled A (its L mode is the
        batch), ``sk_tiles``: the tiles of the stream-K region, ``st``: the shared storage."""
        mc, nc = grid_c
        nclusters = cute.arch.grid_dim()[2]
        c = cute.arch.block_idx()[2]
        tiles = mc * nc * cute.size(gA, mode=[4])
        dp = tiles - sk_tiles
        n_dp = (dp - c + nclusters - 1) // nclusters
        iters = sk_tiles * k_tiles
        base = iters // nclusters
        extra = iters - base * nclusters
        start = c * base + cutlass.min(c, extra)
        end = start + base + (Int32(1) if c < extra else Int32(0))
        word = st.sk_word.get_tensor(cute.make_layout(1))
        return (c, nclusters, dp, n_dp, start, end, base, extra, mWs, mFlags, word)

    @cute.jit
    def tile_at(self, t, grid_c):
        """A swizzled order: the scheduler's tile ``t`` (CTA tile coordinates, its clusters
        enumerated in column-major order) -> the tile this CTA computes: its cluster's index
        in that enumeration mapped through the swizzled order (_gemm_plan.swizzled_cluster),
        the CTA's place in its cluster kept. The producer and the consumers map alike."""
        p = self.p
        cm, cn = t[0] // p.cluster_m, t[1] // p.cluster_n
        m, n = swizzled_cluster(cm + grid_c[0] * cn, grid_c[0], grid_c[1], p.swizzle, p.raster_m, cutlass.min)
        return (m * p.cluster_m + t[0] % p.cluster_m, n * p.cluster_n + t[1] % p.cluster_n, t[2])

    @cute.jit
    def sk_unit(self, q, u, sk, k_tiles):
        """A stream-K cluster's next unit: (tile index in the order, k_begin, k_end, q, u)
        after it; whole data-parallel tiles first (q counts them), then pieces of the
        stream-K region's iterations (u) cut at tile edges (_gemm_plan.stream_k_units)."""
        c, nclusters, dp, n_dp, _start, end, _base, _extra, _ws, _flags, _word = sk
        jt = c + q * nclusters
        kb = Int32(0)
        ke = k_tiles
        q_next = q + 1
        u_next = u
        if q >= n_dp:
            jt = dp + u // k_tiles
            kb = u % k_tiles
            ke = cutlass.min(k_tiles, kb + end - u)
            q_next = q
            u_next = u + (ke - kb)
        return jt, kb, ke, q_next, u_next

    @cute.jit
    def tile_of(self, jt, grid_c):
        """The CTA tile of the order's ``jt``-th cluster (stream-K: the schedule is ours)."""
        p = self.p
        per = grid_c[0] * grid_c[1]
        j, batch = jt % per, jt // per
        if const_expr(p.swizzle > 1):
            m, n = swizzled_cluster(j, grid_c[0], grid_c[1], p.swizzle, p.raster_m, cutlass.min)
        elif const_expr(p.raster_m):
            m, n = j % grid_c[0], j // grid_c[0]
        else:
            m, n = j // grid_c[1], j % grid_c[1]
        bx, by, _ = cute.arch.block_idx()
        return (m * p.cluster_m + bx % p.cluster_m, n * p.cluster_n + by % p.cluster_n, batch)

    @cute.jit
    def sk_owner(self, x, sk):
        """The cluster whose share holds the stream-K region's iteration ``x``
        (_gemm_plan.stream_k_owner)."""
        _c, _n, _dp, _n_dp, _start, _end, base, extra, _ws, _flags, _word = sk
        big = extra * (base + 1)
        owner = x // (base + 1)
        if x >= big:
            owner = extra + (x - big) // base
        return owner

    @cute.jit
    def sk_piece(self, u0, sk, k_tiles):
        """The tile a stream-K unit starting at the region's iteration ``u0`` belongs to, as
        (head, pieces): the cluster holding its first iteration and how many consecutive
        clusters hold it (_gemm_plan.stream_k_units)."""
        ts = u0 - u0 % k_tiles
        head = self.sk_owner(ts, sk)
        return head, self.sk_owner(ts + k_tiles - 1, sk) - head + 1

    @cute.jit
    def sk_cta(self, index):
        """This CTA's place in the ``index``-th cluster-sized block of the flags / workspace."""
        bx, by, _ = cute.arch.block_idx()
        return (index * self.p.cluster_m + bx % self.p.cluster_m) * self.p.cluster_n + by % self.p.cluster_n

    @cute.jit
    def sk_slot(self, cluster, head):
        """The partial-sum slot and its ready flag of ``cluster``'s piece of a cut tile: its
        head piece (head 1: the tile's first piece, the cluster's last unit) or the piece it
        starts inside a tile (head 0: its first unit). A cluster has at most one of each."""
        return self.sk_cta(cluster * 2 + head)

    @cute.jit
    def sk_arrive(self, sk, head, thr, bar):
        """Count this CTA's piece of the tile ``head`` starts in: how many pieces arrived
        before it (one atomic per CTA, read back by every consumer thread)."""
        _c, nclusters, _dp, _n_dp, _start, _end, _base, _extra, _ws, flags, word = sk
        if thr == 0:
            counter = flags.iterator + self.sk_cta(2 * nclusters + head)
            word[0] = cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu")
        bar.arrive_and_wait()
        return word[0]

    @cute.jit
    def sk_store(self, acc, sk, slot, thr):
        """Each of the 256 consumer threads its fp32 sums to ``slot`` of the workspace,
        thread-fastest, so a warp's stores coalesce."""
        _c, _n, _dp, _n_dp, _start, _end, _base, _extra, ws, _flags, _word = sk
        n_acc = cute.size(acc)
        off = slot * (n_acc * self.math_threads) + thr
        for r in cutlass.range_constexpr(n_acc):
            ws[off + r * self.math_threads] = acc[r]

    @cute.jit
    def sk_hand_on(self, acc, sk, slot, thr, bar):
        """A piece that is not the last of its tile to arrive: its sums to its slot, then the
        slot's flag, released once every thread's stores are visible device-wide."""
        _c, _n, _dp, _n_dp, _start, _end, _base, _extra, _ws, flags, _word = sk
        self.sk_store(acc, sk, slot, thr)
        cute.arch.fence_acq_rel_gpu()
        bar.arrive_and_wait()
        if thr == 0:
            cute.arch.atomic_exch(flags.iterator + slot, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def sk_combine(self, acc, sk, head, pieces, thr, bar):
        """The last piece of a tile to arrive: the tile's sum in K order, ((p0 + p1) + p2)
        + ..., whoever arrives last, so the same bits every run. Its own sums are in
        ``acc``: the head's are p0; with two pieces p1 + p0 is p0 + p1; otherwise (a cut
        tile of three or more pieces: a grid with fewer tiles than clusters) they go to its
        slot and are read back in their place.

        It waits only for pieces that have counted themselves in (sk_arrive) before it: they
        are running and have nothing left but their stores (sk_hand_on), so the wait ends
        however few clusters the GPU holds at once (an MPS share of the SMs, a kernel on
        another stream). A piece that waited for peers yet to start could hold the SM
        they need."""
        c, _n, _dp, _n_dp, _start, _end, _base, _extra, ws, flags, _word = sk
        n_acc = cute.size(acc)
        j = c - head  # this piece's place in K order
        spill = (j > 0) & (pieces > 2)
        if spill:
            self.sk_store(acc, sk, self.sk_slot(c, Int32(0)), thr)
        for i in range(pieces):
            if (i != j) | spill:
                slot = self.sk_slot(head + i, Int32(1) if i == 0 else Int32(0))
                if i != j:
                    if thr == 0:
                        while cute.arch.load(flags.iterator + slot, Int32, sem="acquire", scope="gpu") == 0:
                            pass
                    bar.arrive_and_wait()
                    cute.arch.fence_acq_rel_gpu()
                off = slot * (n_acc * self.math_threads) + thr
                if (i == 0) & spill:
                    for r in cutlass.range_constexpr(n_acc):
                        acc[r] = ws[off + r * self.math_threads]
                else:
                    for r in cutlass.range_constexpr(n_acc):
                        acc[r] = acc[r] + ws[off + r * self.math_threads]
