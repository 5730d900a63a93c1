"""The GEMM epilogue's register -> shared-memory store: which accumulator register goes to
which element of a vectorized store (``stmatrix`` for 16-bit D, 64-bit ``st.shared`` for
fp32 D), for each tile_m x EPI_N subtile. Imported only from inside compile functions.

The store is a tiled copy built from the tiled MMA's accumulator layout
(``make_tiled_copy_C_atom``): a thread's source fragment for one subtile holds values the
thread already owns, so no shuffle is needed, but the ORDER of the fragment differs from the
accumulator's. ``retile(acc)`` folds the copy's N repeats into its first mode
(((8, 8), 2, 1) for a 128 x 128 ping-pong tile) while a subtile's fragment is
(CPY, CPY_M, CPY_N) ((8, 2, 2)): taking consecutive flat ranges of the retiled accumulator
(the public Hopper example's way) mixes the two M repeats of a warpgroup into one subtile
and drops the other half of the columns: the misplaced D the first version of this kernel hit.

Here the pairing is by coordinate instead: the accumulator element of each fragment slot is
the one whose (m, n) in the tile, from the tiled MMA's partition of an identity tensor,
equals the slot's (m, n) from the copy's partition of the same identity tensor (plus the
subtile's column offset). Both partitions are a per-thread base plus a static offset, so the
pairing found for thread 0 at trace time holds for every thread when the bases agree;
tests/kernels/test_gemm_store_cpu.py checks that for every thread of every tile shape,
schedule and D width, and that the subtiles cover the tile exactly once."""

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32


def make_tiled_mma(ab_dtype, a_major: str, b_major: str, ping: bool, tile_n: int):
    """The consumers' tiled MMA. coop: two warpgroups side by side along M (128 x tile_n);
    ping: one warpgroup's 64 x tile_n, repeated along M over the tile."""

    def mode(major):
        return cute.nvgpu.OperandMajorMode.K if major == "k" else cute.nvgpu.OperandMajorMode.MN

    atom_mnk = (1, 1, 1) if ping else (2, 1, 1)
    return sm90.make_trivial_tiled_mma(
        ab_dtype, ab_dtype, mode(a_major), mode(b_major), Float32, atom_mnk, tiler_mn=(64, tile_n)
    )


def make_r2s_copy(tiled_mma, d_dtype):
    """The tiled copy of accumulator values (converted to ``d_dtype``) into a row-major
    (N-major) shared-memory tile: stmatrix.x4 for 16-bit D (8 values a thread an
    instruction), else 64-bit stores of the accumulator's column pairs."""
    if d_dtype.width == 16:
        atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), d_dtype)
    else:
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), d_dtype, num_bits_per_copy=64)
    return cute.make_tiled_copy_S(atom, cute.make_tiled_copy_C_atom(atom, tiled_mma))


def _coord(c) -> tuple:
    return tuple(int(x) for x in c)


def subtile_sources(tiled_mma, r2s, tile_mn: tuple, epi_n: int, thr: int = 0) -> list:
    """Plain Python at trace time (not rewritten by cute.jit): for each tile_m x epi_n
    subtile e, the accumulator register index of each flat slot of thread ``thr``'s source
    fragment (``r2s.get_slice(thr).partition_S`` of the subtile). A slot whose coordinate
    the thread's accumulator does not hold is a compile error, never a wrong D."""
    tm, tn = tile_mn
    tCc = tiled_mma.get_slice(thr).partition_C(cute.make_identity_tensor(tile_mn))
    reg = {_coord(tCc[r]): r for r in range(cute.size(tCc))}
    pS = r2s.get_slice(thr).partition_S(cute.make_identity_tensor((tm, epi_n)))
    out = []
    for e in range(tn // epi_n):
        row = []
        for k in range(cute.size(pS)):
            m, n = _coord(pS[k])
            r = reg.get((m, n + e * epi_n))
            if r is None:
                raise ValueError(
                    f"gemm epilogue: thread {thr}'s store slot {k} of subtile {e} is element "
                    f"({m}, {n + e * epi_n}) of the tile, which its accumulator does not hold"
                )
            row.append(r)
        out.append(row)
    return out
