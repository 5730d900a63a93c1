"""The Hopper GEMM's host side (CuTe DSL, sm_90a), a base of ``_gemm_kernel``'s
``HopperGemm``: the staged shared-memory layouts, the TMA atoms of A, B and D, the persistent
grid and the shared storage, then the launch of ``HopperGemm.kernel``. Reads the attributes
``HopperGemm.__init__`` sets (plan, dtypes, majors, cluster, epilogue tile, K depth).
Imported only from inside compile functions."""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr

from ._gemm_plan import GemmPlan
from ._gemm_store import make_tiled_mma


def _smem_layout(dtype, major, rows: int, stages: int, tile_k: int):
    """Staged, swizzled shared-memory layout of a rows x tile_k operand tile."""
    k_major = major == "k"
    atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
        sm90.get_smem_layout_atom(
            utils.LayoutEnum.ROW_MAJOR if k_major else utils.LayoutEnum.COL_MAJOR,
            dtype,
            tile_k if k_major else rows,
        ),
        dtype,
    )
    return cute.tile_to_shape(atom, (rows, tile_k, stages), order=(0, 1, 2) if k_major else (1, 0, 2))


class GemmLaunch:
    """``__call__``: the compiled function's entry (the runtime signature of
    ``gemm.compile_gemm``)."""

    p: GemmPlan
    ab: type
    dt: type
    a_major: str
    b_major: str
    ping: bool
    cluster: tuple
    epi_tile: tuple
    tile_k: int
    fp8: bool

    @cute.jit
    def __call__(
        self,
        mA,
        mB,
        mD,
        mC,
        mBias,
        mScaleA,
        mScaleB,
        beta: Float32,
        max_clusters: Int32,
        mWs,
        mFlags,
        sk_tiles: Int32,
        stream,
    ):
        p = self.p
        tiled_mma = make_tiled_mma(self.ab, self.a_major, self.b_major, self.ping, p.tile_n)
        sA_l = _smem_layout(self.ab, self.a_major, p.tile_m, p.stages, self.tile_k)
        sB_l = _smem_layout(self.ab, self.b_major, p.tile_n, p.stages, self.tile_k)
        n_epi = p.epi_stages * (2 if self.ping else 1)
        sD_l = sm90.make_smem_layout_epi(self.dt, utils.LayoutEnum.ROW_MAJOR, self.epi_tile, n_epi)

        def g2s(mX, sl, rows, mcast):
            op = (
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
                if mcast == 1
                else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            )
            return cute.nvgpu.cpasync.make_tiled_tma_atom(
                op, mX, cute.slice_(sl, (None, None, 0)), (rows, self.tile_k), num_multicast=mcast
            )

        # A is shared by the CTAs of a cluster row (multicast along N), B along M
        tma_a, gA = g2s(mA, sA_l, p.tile_m, p.cluster_n)
        tma_b, gB = g2s(mB, sB_l, p.tile_n, p.cluster_m)
        tma_d, gD = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            mD,
            cute.slice_(sD_l, (None, None, 0)),
            self.epi_tile,
        )
        ntiles = cute.zipped_divide(mD, (p.tile_m, p.tile_n))[(0, (None, None, None))].shape
        # A swizzled order is ours (tile_at): the scheduler enumerates the clusters of the
        # problem exactly (column-major: no swizzle, along M), and each is mapped through
        # the swizzle; its own swizzle pads the grid with clusters outside the problem.
        if const_expr(p.swizzle > 1):
            sched = utils.PersistentTileSchedulerParams(ntiles, (*self.cluster, 1), 1, True)
        else:
            sched = utils.PersistentTileSchedulerParams(ntiles, (*self.cluster, 1), 1, p.raster_m)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(sched, max_clusters)

        @cute.struct
        class Storage:
            ab_bar: cute.struct.MemRange[cutlass.Int64, p.stages * 2]
            order_bar: cute.struct.MemRange[cutlass.Int64, 2]
            sk_word: cute.struct.MemRange[cutlass.Int32, 1]  # stream-K: sk_arrive's count, to the CTA
            sA: cute.struct.Align[cute.struct.MemRange[self.ab, cute.cosize(sA_l)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.ab, cute.cosize(sB_l)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.dt, cute.cosize(sD_l)], 1024]

        self.storage = Storage
        self.kernel(
            tma_a,
            gA,
            tma_b,
            gB,
            tma_d,
            gD,
            mD,
            mC,
            mBias,
            # fp8's scale tensors; none for 16-bit operands, whose kernel reads no scale
            # (its parameters, and so its PTX, as before fp8 was added)
            (mScaleA, mScaleB) if const_expr(self.fp8) else None,
            beta,
            tiled_mma,
            sA_l,
            sB_l,
            sD_l,
            sched,
            mWs,
            mFlags,
            sk_tiles,
        ).launch(
            grid=grid, block=[p.threads, 1, 1], cluster=(*self.cluster, 1), min_blocks_per_mp=1, stream=stream
        )
