"""The GEMM epilogue's store placement, by cute's layout algebra on the CPU (issue 28): for
every tile shape, schedule and D width, each accumulator element goes through the
vectorized shared-memory store (``_gemm_store``) and the subtile's TMA store to its own
(m, n) of the output tile, for every consumer thread, and each element of the tile is
written exactly once. The first version of the kernel misplaced values exactly here once a
warpgroup repeats along M (ping-pong, 256 x 128 cooperative)."""

import os

import pytest
from _fixtures import module_ptx, session_ptx  # noqa: F401  (fixtures, used by name)
from quack_kernels._gemm_plan import SCHEDULES, TILES, fits

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

# every (tile, schedule) the kernel builds (check_plan refuses the others), 16- and 32-bit D
CASES = [(tm, tn, s, width) for tm, tn in TILES for s in SCHEDULES if fits((tm, tn), s) for width in (16, 32)]


def _placements(tm, tn, ping, width, pairing):
    """thread -> list of (tile coordinate of the accumulator register stored, tile coordinate
    the store writes it to), over every subtile. ``pairing`` maps (tiled_mma, r2s) to the
    per-subtile register lists (the kernel's ``subtile_sources``, or a wrong rule)."""
    import cutlass
    import cutlass.cute as cute
    from quack_kernels._gemm_plan import EPI_N
    from quack_kernels._gemm_store import make_r2s_copy, make_tiled_mma

    out = {}

    @cute.jit
    def trace():
        dt = cutlass.BFloat16 if width == 16 else cutlass.Float32
        mma = make_tiled_mma(cutlass.BFloat16, "k", "k", ping, tn)
        r2s = make_r2s_copy(mma, dt)
        threads = 128 if ping else 256
        sources = pairing(mma, r2s, (tm, tn), EPI_N)
        _walk(mma, r2s, sources, (tm, tn), EPI_N, threads, out)

    trace()
    return out


def _coords(t, offsets: dict):
    """Every element's (m, n) of a partitioned identity tensor: its base coordinate plus its
    layout's offset (an identity tensor's element is exactly that; evaluating the layout in
    Python is ~10x faster than indexing the tensor element by element). ``offsets`` keeps a
    static layout's offsets by its text: the threads' partitions share a few layouts at
    different bases, and evaluating them afresh for each thread was half of a case's 15 s
    (issue 25). A dynamic layout's text does not say it all: evaluated every time."""
    import cutlass.cute as cute

    base, lay = t.iterator, t.layout
    key = str(lay) if cute.is_static(lay) else None
    offs = offsets.get(key) if key else None
    if offs is None:
        offs = [(int(o[0]), int(o[1])) for o in map(lay, range(cute.size(lay)))]
        if key:
            offsets[key] = offs
    b0, b1 = int(base[0]), int(base[1])
    return [(b0 + o0, b1 + o1) for o0, o1 in offs]


def _walk(mma, r2s, sources, tile_mn, epi_n, threads, out):
    """Plain Python at trace time (cute.jit would stage its loops)."""
    import cutlass.cute as cute

    # the TMA store's view: subtile e of the tile (zipped_divide by the epilogue tile)
    tiles = cute.zipped_divide(cute.make_identity_tensor(tile_mn), (tile_mn[0], epi_n))
    bases = [tuple(int(x) for x in tiles[((0, 0), (0, e))]) for e in range(len(sources))]
    sub = cute.make_identity_tensor((tile_mn[0], epi_n))
    cpy = cute.size(r2s.get_slice(0).partition_S(sub), mode=[0])  # values of one copy instruction
    offsets: dict = {}
    src: dict = {}
    dst: dict = {}
    for t in range(threads):
        acc = _coords(mma.get_slice(t).partition_C(cute.make_identity_tensor(tile_mn)), offsets)
        slot = _coords(r2s.get_slice(t).partition_S(sub), offsets)
        # the copy's contract, checked too: one instruction (a warp, one rest index) writes to
        # shared memory exactly the elements its lanes hold (stmatrix moves values between
        # lanes: a lane's addresses are not its values' coordinates)
        to = _coords(r2s.get_slice(t).partition_D(sub), offsets)
        assert len(to) == len(slot)
        for k in range(len(slot)):
            src.setdefault((t // 32, k // cpy), []).append(slot[k])
            dst.setdefault((t // 32, k // cpy), []).append(to[k])
        out[t] = [
            (acc[r], (bases[e][0] + slot[k][0], bases[e][1] + slot[k][1]))
            for e, regs in enumerate(sources)
            for k, r in enumerate(regs)
        ]
    for key, held in src.items():
        assert sorted(held) == sorted(dst[key]), f"warp {key[0]}, store {key[1]}: lanes hold / write differ"


def _kernel_pairing(mma, r2s, tile_mn, epi_n):
    from quack_kernels._gemm_store import subtile_sources

    return subtile_sources(mma, r2s, tile_mn, epi_n)


def _flat(placed: dict) -> list:
    """``_placements``' result as one flat list of ints, five a stored element: thread, the
    accumulator's (m, n), the written (m, n). The memo's form: a case's 32,768 pairs as
    tuples and lists made the pytest process's garbage collector walk its whole heap
    (~0.15 s a case, 12 cases, of the GPU tier's CPU tests)."""
    return [v for t, pairs in placed.items() for src, dst in pairs for v in (t, *src, *dst)]


def _check_placements(flat: list, tm: int, tn: int, threads: int) -> None:
    """Every element written to its own coordinate, each of the tm x tn exactly once, by
    every one of ``threads`` consumer threads."""
    assert len(flat) % 5 == 0, f"{len(flat)} values: not whole records"
    thr, sm, sn, dm, dn = (flat[i::5] for i in range(5))
    wrong = [i for i in range(len(thr)) if sm[i] != dm[i] or sn[i] != dn[i]]
    assert not wrong, "accumulator element -> written at: " + ", ".join(
        f"thread {thr[i]}: ({sm[i]}, {sn[i]}) -> ({dm[i]}, {dn[i]})" for i in wrong[:4]
    )
    times = [0] * (tm * tn)
    for m, n in zip(dm, dn):
        assert 0 <= m < tm and 0 <= n < tn, f"written outside the {tm} x {tn} tile: ({m}, {n})"
        times[m * tn + n] += 1
    # every output element of the tile exactly once (ping: one warpgroup's whole tile)
    off = [(i // tn, i % tn, c) for i, c in enumerate(times) if c != 1]
    assert not off, f"elements written other than once ((m, n, times), first 4): {off[:4]}"
    assert set(thr) == set(range(threads)), "not every consumer thread stores"


@pytest.mark.parametrize("tm, tn, sched, width", CASES)
def test_every_accumulator_element_lands_on_its_own_coordinate(tm, tn, sched, width):
    from _fixtures import derived_memo, read_memo, write_memo
    from quack_kernels.gemm import compile_gemm

    # the walk (0.4-2 s a case) is a function of the kernel's sources, the toolchain and this
    # file: a later session with all three unchanged reads back the placements that passed
    memo = derived_memo("test-gemm-store", compile_gemm, __file__, f"{tm}x{tn}-{sched}-{width}")
    flat = read_memo(memo)
    walked = flat is None
    if walked:
        flat = _flat(_placements(tm, tn, sched == "ping", width, _kernel_pairing))
    _check_placements(flat, tm, tn, 128 if sched == "ping" else 256)
    if walked:
        write_memo(memo, flat)


def test_flat_range_pairing_is_caught():
    """The checker can fail: the public example's pairing (consecutive flat ranges of the
    retiled accumulator) misplaces values on a ping-pong 128 x 128 tile (two M repeats).
    Its walk is kept like the kernel pairing's (a function of the same sources)."""
    import cutlass
    import cutlass.cute as cute
    from _fixtures import derived_memo, read_memo, write_memo
    from quack_kernels.gemm import compile_gemm

    def flat_ranges(mma, r2s, tile_mn, epi_n):
        pS = r2s.get_slice(0).partition_S(cute.make_identity_tensor((tile_mn[0], epi_n)))
        k = cute.size(pS)
        acc = mma.get_slice(0).partition_C(cute.make_identity_tensor(tile_mn))
        view = r2s.retile(cute.make_rmem_tensor(acc.shape, cutlass.Float32))
        return [[int(view.layout(e * k + j)) for j in range(k)] for e in range(tile_mn[1] // epi_n)]

    memo = derived_memo("test-gemm-store", compile_gemm, __file__, "flat-ranges-128x128-ping-16")
    flat = read_memo(memo)
    walked = flat is None
    if walked:
        flat = _flat(_placements(128, 128, True, 16, flat_ranges))
    with pytest.raises(AssertionError, match=r"accumulator element -> written at: thread 0: "):
        _check_placements(flat, 128, 128, 128)
    if walked:
        write_memo(memo, flat)


def _gemm(d_dtype, **knobs):
    from quack_kernels._configs import GemmConfig
    from quack_kernels.gemm import compile_gemm

    return (compile_gemm, dict(dtype="bfloat16", d_dtype=d_dtype, config=GemmConfig(**knobs)))


PTX_CASES = {
    # a warpgroup repeating along M (the misplacement's case), 16-bit D: stmatrix
    "ping-128x128-bf16": _gemm("bfloat16", tile_m=128, tile_n=128, cluster_m=1, cluster_n=1, schedule="ping"),
    # two M repeats of the cooperative MMA, fp32 D: 64-bit shared-memory stores
    "coop-256x128-f32": _gemm("float32", tile_m=256, tile_n=128, cluster_m=2, cluster_n=1, schedule="coop"),
}


@pytest.mark.parametrize(
    "case, vector_store, count",
    [
        # 128 x 128 x 2 bytes by 128 threads, 8 values an stmatrix.x4
        ("ping-128x128-bf16", r"stmatrix\.sync\.aligned\.m8n8\.x4\.shared\.b16", 128 * 128 // 128 // 8),
        # 256 x 128 fp32 by 256 threads, 2 values a store
        ("coop-256x128-f32", r"st\.shared\.v2\.(b32|f32)", 256 * 128 // 256 // 2),
    ],
)
def test_epilogue_stores_are_vectorized_then_tma(module_ptx, case, vector_store, count):  # noqa: F811
    """The epilogue writes shared memory with vector stores only (no element-wise
    st.shared of D) and leaves it by one TMA store per tile_m x 32 subtile."""
    import re

    body = module_ptx[case][module_ptx[case].index(".entry") :]
    assert len(re.findall(vector_store, body)) == count
    assert not re.findall(r"st\.shared\.(b16|u16|f32|b32)\s", body)
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta", body)) == 128 // 32
