"""The GEMM's epilogue: the fused math, applied to the fp32 accumulator in registers
(acc = act(scale * acc + bias[col] + beta * C[row, col]); scale: fp8's scale_a * scale_b,
else 1), then the store of the tile
(``GemmEpilogue``, a base of ``_gemm_kernel``'s ``HopperGemm``). Imported only by
_gemm_kernel.

The accumulator fragment is partitioned by the tiled MMA; an identity tensor partitioned
the same way gives each element's (row, col) in the tile, so bias and C are read for
exactly the elements a thread holds (a tail tile's rows and columns past M / N read
the last row / column, without a branch; TMA drops their stores)."""

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, const_expr

from ._gemm_plan import EPI_N, WG, GemmPlan
from ._gemm_store import make_r2s_copy, subtile_sources

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
LOG2_E = math.log2(math.e)


@cute.jit
def _over_one_plus(x: cute.TensorSSA, e: cute.TensorSSA) -> cute.TensorSSA:
    """x / (1 + e), approximate (2 ulp; a divisor past 2^126, inf included, gives 0, the
    limit): the IEEE div.rn.f32 expands to a Newton iteration with a slow-path branch per
    element."""
    return x * cute.math.rcp(1.0 + e, approx=True, ftz=True)


@cute.jit
def activate(x: cute.TensorSSA, activation: cutlass.Constexpr) -> cute.TensorSSA:
    """relu / gelu (tanh approximation, torch's approximate="tanh") / silu of fp32 values."""
    if const_expr(activation == "relu"):
        return cute.where(x > 0.0, x, cute.full_like(x, 0.0))
    elif const_expr(activation == "gelu_tanh"):
        # 0.5 x (1 + tanh(u)) is x * sigmoid(2u) = x / (1 + e^(-2u)): one ex2.approx and a
        # division, and no 1 + tanh cancellation for negative x. The precise tanh it replaces
        # was ~20 us of a 4096^3 GEMM's 200 us on the H200 (fused bias + gelu 0.99x of
        # torch.compile's cuBLAS + Triton epilogue); e^(-2u) -> inf for x << 0 gives -0
        u2 = x * (1.0 + 0.044715 * x * x) * (2.0 * SQRT_2_OVER_PI)
        return _over_one_plus(x, cute.math.exp2(u2 * (-LOG2_E), fastmath=True))
    elif const_expr(activation == "silu"):
        # x * sigmoid(x) = x / (1 + e^-x); e^-x -> inf for x << 0 gives x / inf = -0
        return _over_one_plus(x, cute.math.exp2(x * (-LOG2_E), fastmath=True))
    else:
        return x


@cute.jit
def apply_epilogue(
    epi: cutlass.Constexpr,
    acc: cute.Tensor,
    thr_mma,
    tile,
    tile_mn: cutlass.Constexpr,
    mD: cute.Tensor,
    mC: cute.Tensor,
    mBias: cute.Tensor,
    beta: Float32,
    scale,
):
    """``scale``: fp8's scale_a * scale_b (a Float32), or None (16-bit operands: no multiply)."""
    has_c, has_bias, activation = epi["has_c"], epi["has_bias"], epi["activation"]
    if const_expr(scale is not None and not (has_c or has_bias)):
        acc.store(acc.load() * scale)
    if const_expr(has_c or has_bias):
        m, n = cute.size(mD, mode=[0]), cute.size(mD, mode=[1])
        row0, col0 = tile[0] * tile_mn[0], tile[1] * tile_mn[1]
        tCc = thr_mma.partition_C(cute.make_identity_tensor(tile_mn))
        # Rows and columns past M / N read the last row / column instead of branching
        # around the load: TMA never stores those elements, so what they add is moot, and
        # a branch per element kept every load behind its own compare (64 dependent
        # round trips to memory a thread; the fused bias + gelu GEMM spent ~18 us of its
        # 197 us at 4096^3 over the plain one) and kept the compiler from merging the two
        # loads of each bias column a thread holds (rows r and r + 8).
        m_last, n_last = m - 1, n - 1
        for i in cutlass.range_constexpr(cute.size(acc)):
            c = cutlass.min(col0 + tCc[i][1], n_last)
            v = acc[i]
            if const_expr(scale is not None):
                v = v * scale
            if const_expr(has_bias):
                v = v + mBias[c]
            if const_expr(has_c):
                r = cutlass.min(row0 + tCc[i][0], m_last)
                v = v + beta * mC[(r, c, tile[2])].to(Float32)
            acc[i] = v
    if const_expr(activation != "none"):
        acc.store(activate(acc.load(), activation))


class GemmEpilogue:
    """The store of a tile (a base of ``HopperGemm``, which sets the attributes below):
    registers -> shared memory (vectorized: stmatrix / 64-bit stores) -> global memory (TMA
    store), one tile_m x EPI_N subtile at a time through ``plan.epi_stages`` buffers. Which
    accumulator register fills each slot of a subtile's store fragment is paired by tile
    coordinate at trace time (_gemm_store: the accumulator's flat order is not the store's)."""

    p: GemmPlan
    ping: bool
    math_threads: int
    dt: type
    epi: dict
    epi_tile: tuple

    @cute.jit
    def epi_setup(self, tiled_mma, sD, mma_thr, cw, wg, warp):
        """(the named barrier of the threads that store a tile, this thread's store state:
        the r2s copy, its shared-memory buffers, each subtile's accumulator sources, the fp32
        and D-typed fragments, its first buffer, the TMA-store pipeline, whether this warp
        issues the stores). Consumer warpgroup ``cw`` (``wg`` - 1), its thread ``mma_thr``."""
        p = self.p
        epi_threads = WG if const_expr(self.ping) else self.math_threads
        epi_bar = pipeline.NamedBarrier(
            barrier_id=1 + (cw if const_expr(self.ping) else 0), num_threads=epi_threads
        )
        r2s = make_r2s_copy(tiled_mma, self.dt)
        thr_r2s = r2s.get_slice(mma_thr)
        tRS_sD = thr_r2s.partition_D(sD)  # (CPY, CPY_M, CPY_N, buffer)
        sources = subtile_sources(tiled_mma, r2s, (p.tile_m, p.tile_n), EPI_N)
        frag_shape = thr_r2s.partition_S(cute.make_identity_tensor(self.epi_tile)).shape
        frag = cute.make_rmem_tensor(frag_shape, Float32)
        frag_d = cute.make_rmem_tensor(frag_shape, self.dt)
        n_buf = p.epi_stages
        buf0 = cw * n_buf if const_expr(self.ping) else 0
        store = pipeline.PipelineTmaStore.create(
            num_stages=n_buf, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, epi_threads)
        )
        is_store_warp = warp == 4 * wg if const_expr(self.ping) else warp == 4
        return epi_bar, (r2s, tRS_sD, sources, frag, frag_d, buf0, store, is_store_warp)

    @cute.jit
    def epi_store(self, es, epi_bar, acc, thr_mma, t, tma_d, gD, sD, mD, mC, mBias, beta, scale, done):
        """Tile ``t`` from ``acc``: the fused epilogue, then its tile_n / EPI_N subtiles
        stored; ``done``: the subtiles this warpgroup stored before (the buffers rotate)."""
        p = self.p
        r2s, tRS_sD, sources, frag, frag_d, buf0, store, is_store_warp = es
        n_buf = p.epi_stages
        apply_epilogue(self.epi, acc, thr_mma, t, (p.tile_m, p.tile_n), mD, mC, mBias, beta, scale)
        gD_t = cute.zipped_divide(gD[(None, None, t[0], t[1], t[2])], self.epi_tile)
        bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
            tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), gD_t
        )
        for e in cutlass.range_constexpr(p.tile_n // EPI_N):
            buf = buf0 + (done + e) % n_buf
            for k in cutlass.range_constexpr(len(sources[e])):
                frag[k] = acc[sources[e][k]]
            frag_d.store(frag.load().to(self.dt))
            cute.copy(r2s, frag_d, tRS_sD[(None, None, None, buf)])
            # the shared-memory writes must be visible to the TMA (async proxy) before the store
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_bar.arrive_and_wait()
            if is_store_warp:
                cute.copy(tma_d, bSG_sD[(None, buf)], bSG_gD[(None, e)])
                store.producer_commit()
                store.producer_acquire()
            epi_bar.arrive_and_wait()
