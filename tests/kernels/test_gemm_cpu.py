"""CPU tier of the Hopper GEMM (issue 28): the manifests expand, configurations the kernel
cannot build are refused by name before compiling, torch inputs are validated with errors
naming the argument, the fake implementation gives the output's shape, and a representative
configuration compiles for sm_90a through quack's cache and loads back."""

import os

import pytest
from _fixtures import kernel_cache, module_ptx, session_ptx  # noqa: F401  (fixtures, used by name)

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _expand(name):
    from quack import registry, settings
    from quack_build.manifest.read import expand

    registry.load_packages(settings.get().kernel_packages)
    return [c for c in expand([os.path.join(ROOT, "manifests", name)]).configs if c.kernel == "gemm"]


def test_manifests_expand():
    assert len(_expand("gemm.toml")) >= 100
    sub = _expand("tests.toml")
    # tests.toml's GEMM entries: the CPU tier's 8 plus the GPU tests' 41 requests (23, the
    # float16 autocast test's 2, the 4 swizzled orders and the 6 ping-pong candidates of
    # test_gemm_ping_pong_on_a_grid_of_many_waves, fp8's 6; one key is in both lists, built
    # once), plus what the GPU model's table rows pick at 4096^3 where no other entry holds
    # it (tests.toml lists those by size, not by configuration): what the tests use and no
    # more, a GEMM compile taking seconds
    assert 8 <= len(sub) <= 8 + 42, len(sub)
    scheds = {c.params["config"].schedule for c in sub}
    assert scheds == {"coop", "ping"}


@pytest.mark.filterwarnings("ignore:quack_kernels. no tuning")  # QX9: no GEMM rows, said once
@pytest.mark.parametrize("gpu", ["H200", "H100", "QX9"])
def test_gemm_manifest_builds_what_a_call_at_each_tuned_shape_asks_for(gpu):
    """For each problem quack tune measures (manifests/tuning_gemm.toml), and for a small odd
    one, the key a call of that shape asks for on this GPU model (the model's row, else the
    heuristic) is among the GEMM manifest's: plain, and bf16 with each fused epilogue (a
    row is chosen by shape and dtype, so a fused call at a tuned shape runs the row's
    configuration). `quack build manifests/gemm.toml` then serves a prebuilt server at
    every tuned shape. Before, none of the swizzled / stream-K winners was built, nor a
    bias without an activation."""
    import tomllib
    from quack_kernels.gemm import compile_gemm, gemm_config

    from quack import settings

    with open(os.path.join(ROOT, "manifests", "tuning_gemm.toml"), "rb") as f:
        tuning = tomllib.load(f)
    spec = compile_gemm.spec
    families = []  # (params, shapes)
    for entry in tuning["kernel"]:
        fasts = entry["params"].get("fast_accum", False)
        for fast in fasts if isinstance(fasts, list) else [fasts]:
            families.append(dict(entry["params"], fast_accum=fast))
    bf16 = {"dtype": "bfloat16", "d_dtype": "bfloat16"}
    families += [dict(bf16, has_bias=True, activation=a) for a in ("none", "relu", "gelu_tanh", "silu")]
    families += [dict(bf16, has_c=True, has_bias=hb) for hb in (True, False)]
    shapes = [tuple(x) for x in tuning["kernel"][0]["problems"]] + [(1000, 1048, 776)]
    with settings.override(tune_gpu=gpu):
        built = {c.key for c in _expand("gemm.toml")}
        asked = {}
        for params in families:
            for m, n, k in shapes:
                cfg = gemm_config(m, n, k, 1, params["dtype"], params.get("fast_accum", False))
                b = spec.bind((), dict(params, config=cfg), arch="sm_90a")
                asked[spec.key(b, "sm_90a")] = (m, n, k, params)
    assert len(families) == 9 and len(shapes) == 8
    missing = [v for key, v in asked.items() if key not in built]
    assert not missing, missing


def test_search_space_candidates_all_pass_the_rules():
    from quack_kernels.gemm import compile_gemm, search_space

    cands = search_space(compile_gemm.spec.bind(("bfloat16",), {}, arch="sm_90a"))
    # tile x cluster x schedule, then 24 swizzled orders, then a stream-K twin of each of the
    # 30 large cooperative candidates
    assert len(cands) == 18 + 24 + 30
    for cfg in cands:
        compile_gemm.spec.bind(("bfloat16",), {"config": cfg}, arch="sm_90a")
    # fp8 with fast accumulation: one accumulator, the same space
    fast = {"fast_accum": True}
    assert search_space(compile_gemm.spec.bind(("float8_e4m3fn",), fast, arch="sm_90a")) == cands


@pytest.mark.parametrize(
    "knobs, match",
    [
        ({"tile_m": 128, "tile_n": 256, "schedule": "ping"}, "config"),
        ({"tile_m": 256, "tile_n": 192}, "config"),
        ({"cluster_m": 2, "cluster_n": 2}, "config"),
        ({"tile_m": 256, "tile_n": 128, "stages": 12}, "config"),
        ({"tile_m": 128, "tile_n": 128, "schedule": "ping", "stream_k": True}, "stream-K"),
    ],
)
def test_unbuildable_configurations_are_refused_before_compiling(knobs, match):
    from quack_kernels._configs import GemmConfig
    from quack_kernels._gemm_plan import check_plan
    from quack_kernels.gemm import compile_gemm

    from quack.errors import ParamError

    assert check_plan(knobs, "bfloat16") is not None
    with pytest.raises(ParamError, match=match):
        compile_gemm.spec.bind(("bfloat16",), {"config": GemmConfig(**knobs)}, arch="sm_90a")


# Binding derives the configuration before the arch rule refuses the target: for sm_100a
# that says, once a process, that no tuning table exists (whichever test binds it first).
@pytest.mark.filterwarnings("ignore:quack_kernels. no tuning table for sm_100a:UserWarning")
def test_arch_rule_refuses_other_targets():
    from quack_kernels.gemm import compile_gemm

    from quack.errors import ParamError

    with pytest.raises(ParamError, match="sm_90a"):
        compile_gemm.spec.bind(("bfloat16",), {}, arch="sm_100a")


def test_plan_fits_shared_memory():
    from quack_kernels._gemm_plan import CLUSTERS, SMEM_BYTES, TILES, fits, resolve

    for tm, tn in TILES:
        for d in ("bfloat16", "float32"):
            for s in ("coop", "ping"):
                if fits((tm, tn), s):
                    p = resolve({"tile_m": tm, "tile_n": tn, "schedule": s}, d)
                    assert 2 <= p.stages and p.smem_bytes(d) <= SMEM_BYTES, (tm, tn, s, d, p)
    assert (2, 2) not in CLUSTERS


torch = pytest.importorskip("torch")


def _t(shape, dtype=torch.bfloat16, stride=None):
    t = torch.zeros(shape if not stride else (64 * 256,), dtype=dtype)
    return t.as_strided(shape, stride) if stride else t


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((_t((64, 64)), _t((64, 64), torch.float16)), TypeError, "b has dtype torch.float16"),
        (
            (_t((64, 64), torch.float32), _t((64, 64), torch.float32)),
            TypeError,
            r"a has dtype torch.float32.*torch.autocast",
        ),
        ((_t((64, 48)), _t((64, 64))), ValueError, r"b has shape \(64, 64\), expected \(48, N\)"),
        ((_t((2, 64, 64)), _t((64, 64))), ValueError, "must both be 2-D"),
        ((_t((64, 60)), _t((60, 64))), ValueError, "a: stride 60 of dim 0 is 120 bytes"),
        ((_t((64, 64)), _t((64, 60))), ValueError, "b: stride 60 of dim 0"),
        ((_t((64, 64)), _t((64, 64)).t()[:, :60]), ValueError, "b: N = 60 columns"),
        ((_t((64, 64)), _t((64, 64), stride=(2, 128))), ValueError, "b has strides"),
    ],
)
def test_bad_inputs_name_the_argument(args, exc, match):
    from quack_kernels._gemm_args import check

    with pytest.raises(exc, match=match):
        check(*args, None, "none", None, None, 1.0)


def test_bad_epilogue_arguments():
    from quack_kernels._gemm_args import check

    a, b = _t((64, 64)), _t((64, 128))
    with pytest.raises(ValueError, match=r"bias must be a float \(128,\)"):
        check(a, b, _t((64,)), "none", None, None, 1.0)
    with pytest.raises(ValueError, match=r"c must be a float \(64, 128\)"):
        check(a, b, None, "none", None, _t((64, 64)), 1.0)
    with pytest.raises(ValueError, match="activation must be one of"):
        check(a, b, None, "tanh", None, None, 1.0)
    with pytest.raises(TypeError, match="out_dtype"):
        check(a, b, None, "none", torch.float64, None, 1.0)


def test_layout_detection_and_kernel_views():
    from quack_kernels._gemm_args import check

    a, b = _t((1000, 776)), _t((776, 1048))
    g = check(a.t().contiguous().t(), b.t().contiguous().t(), None, "none", torch.float32, None, 1.0)
    assert (g.a_major, g.b_major, g.d_dtype) == ("m", "k", "float32")
    assert g.a3.shape == (1000, 776, 1) and g.b3.shape == (1048, 776, 1)
    assert g.a3.stride()[:2] == (1, 1000) and g.b3.stride()[:2] == (776, 1)
    g = check(_t((3, 64, 32)), _t((3, 32, 16)), None, "none", None, None, 1.0)
    assert (g.a_major, g.b_major, g.batch) == ("k", "n", 3) and g.b3.shape == (16, 32, 3)


def test_cpu_tensors_are_refused_by_the_op():
    from quack_kernels.ops import gemm

    with pytest.raises(ValueError, match="a must be a CUDA tensor"):
        gemm(_t((64, 64)), _t((64, 64)))


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "4"])
def test_a_bad_cluster_count_is_named(bad):
    """gemm_fwd's ``clusters`` (the persistent grid's clusters at most) is checked before
    anything touches a device."""
    from quack_kernels.gemm import gemm_fwd

    with pytest.raises(ValueError, match=f"clusters must be a positive int.*got {bad!r}"):
        gemm_fwd(_t((64, 64)), _t((64, 64)), clusters=bad)


def test_fake_implementation_shapes():
    from quack_kernels.ops import gemm

    a, b = torch.empty(1000, 776, device="meta"), torch.empty(776, 1048, device="meta")
    a, b = a.bfloat16(), b.bfloat16()
    assert gemm(a, b).shape == (1000, 1048) and gemm(a, b).dtype == torch.bfloat16
    assert gemm(a, b, out_dtype=torch.float32).dtype == torch.float32
    a3, b3 = a.expand(3, -1, -1), b.expand(3, -1, -1)
    assert gemm(a3, b3).shape == (3, 1000, 1048)
    with pytest.raises(ValueError, match="expected"):
        gemm(a, b[:700])
    # the dtypes the kernel refuses stop a trace at the fake implementation, with the
    # wrappers' own message (before, a float32 GEMM traced and failed at run time)
    with pytest.raises(TypeError, match=r"a has dtype torch.float32.*torch.autocast"):
        gemm(a.float(), b.float())
    with pytest.raises(TypeError, match="b has dtype torch.float16"):
        gemm(a, b.half())
    with pytest.raises(TypeError, match="out_dtype torch.float64"):
        gemm(a, b, out_dtype=torch.float64)


def test_heuristic_and_classes():
    from quack_kernels._gemm_plan import heuristic, shape_class

    assert heuristic(8192, 8192, 8192)["tile_n"] == 256
    assert heuristic(1000, 1048, 776)["schedule"] == "ping"
    assert shape_class(8192, 4096, 14336) == "m8k/n4k/k16k" and shape_class(256, 256, 8192) == "m256/n256/k8k"


@pytest.mark.usefixtures("kernel_cache")
def test_compile_export_load_through_the_cache():
    """One representative configuration of the subset (ping-pong, 1x2 cluster: the ordering
    barrier and A's multicast) compiles for sm_90a in a worker, is exported and loads back."""
    from quack_kernels._configs import GemmConfig
    from quack_kernels.gemm import compile_gemm

    cfg = GemmConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=2, schedule="ping")
    assert callable(compile_gemm("bfloat16", "bfloat16", config=cfg))


def _ptx_cases() -> dict:
    from quack_kernels._configs import GemmConfig
    from quack_kernels.gemm import compile_gemm

    ping = GemmConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=1, schedule="ping")
    # the smallest cooperative tile: a third less compile time than 128 x 256 (CPU tier)
    coop = GemmConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=1, schedule="coop")
    cases = {
        "ping": (
            compile_gemm,
            dict(dtype="bfloat16", d_dtype="bfloat16", a_major="k", b_major="k", config=ping),
        )
    }
    for act in ("none", "gelu_tanh", "silu"):
        params = dict(dtype="bfloat16", d_dtype="bfloat16", has_bias=True, activation=act, config=coop)
        cases[f"act-{act}"] = (compile_gemm, params)
    return cases


#: the PTX these tests read (_fixtures.session_ptx: one batch with the other modules' cases)
PTX_CASES = _ptx_cases()


def test_ping_pong_ordering_barrier_phase_flips_every_tile(module_ptx):  # noqa: F811
    """The consumers' ordering barrier (PipelineOrder) must wait at a phase that flips with
    every tile. Its own state lives in a frozen dataclass, which the DSL's while loop does not
    carry: the wait's parity was recomputed from the warpgroup index at every tile, the two
    mainloops overlapped from a CTA's third tile on, and ping-pong on a grid of several tiles
    per CTA died on the H200 with "unspecified launch failure" (the full barriers' parity let
    a warpgroup a ring lap ahead read a stage still loading)."""
    import re

    text = module_ptx["ping"]
    consumers = text[text.index("setmaxnreg.inc") :]  # the producer's code comes before
    # the consumers' first wait in program order is the ordering barrier's, at each tile's top
    (parity,) = re.search(
        r"mbarrier\.try_wait\.parity\.shared\.b64 P1, \[%r\d+\], (%r\d+),", consumers
    ).groups()
    assert re.search(rf"xor\.b32\s+{parity}, {parity}, 1;", consumers), (
        f"the ordering barrier's parity {parity} is never flipped: every tile waits at the first tile's phase"
    )


def test_activation_epilogues_are_short_and_use_no_ieee_division(module_ptx):  # noqa: F811
    """gelu-tanh and silu cost an exp2 and a reciprocal per accumulator element, both
    approximate (MUFU), plus a few FMAs: gelu as x * sigmoid(2u), not 0.5 x (1 + tanh(u))
    with the precise tanh (~24 PTX instructions an element), which made the fused bias +
    gelu op 0.99x of torch.compile's cuBLAS + Triton epilogue on the H200; no div.rn.f32
    (a Newton iteration with a slow-path branch in SASS). Counted against the same kernel
    without an activation (same bias loads, same tile: 64 accumulator values a thread)."""
    import re

    from quack_kernels._gemm_plan import acc_regs

    cfg = PTX_CASES["act-none"][1]["config"]
    ptx = {act: module_ptx[f"act-{act}"] for act in ("none", "gelu_tanh", "silu")}

    def ops(act):
        body = ptx[act][ptx[act].index(".entry") :]
        return re.findall(r"^\s+([a-z][\w.:]*)", body, re.M)

    # accumulator values a consumer thread holds: the kernel's own plan says how many
    base, per_thread = len(ops("none")), acc_regs(cfg.tile_m, cfg.tile_n, cfg.schedule)
    for act, most in (("gelu_tanh", 12), ("silu", 8)):
        got = ops(act)
        assert got.count("ex2.approx.ftz.f32") == per_thread, act
        assert got.count("rcp.approx.ftz.f32") == per_thread, act
        assert not [o for o in got if o.startswith("div.")], f"{act}: an IEEE division per element"
        extra = (len(got) - base) / per_thread
        assert extra <= most, f"{act}: {extra:.1f} PTX instructions an element over no activation"
    # The bias: one load per column a thread holds (each column in two of its rows), none
    # behind a branch of its own. A compare-and-branch around each element's load (the
    # tail guard) made 64 dependent loads a thread: the fused bias + gelu GEMM ran 2.6 %
    # slower on the H200 (0.195 against 0.190 ms at 4096^3).
    body = ptx["none"][ptx["none"].index(".entry") :]
    assert body.count("ld.global") == per_thread // 2
    guarded = re.findall(r"@%p\d+\s+bra\s+\S+;\s*ld\.global", body)
    assert not guarded, f"{len(guarded)} bias loads behind a branch each"


@pytest.mark.parametrize("raster_m", [True, False], ids=["along-m", "along-n"])
@pytest.mark.parametrize("swizzle", [2, 4, 8])
def test_swizzled_order_visits_each_cluster_once_band_by_band(swizzle, raster_m):
    """The swizzled persistent order (_gemm_plan.swizzled_cluster, which the kernel maps its
    tiles through) is a bijection onto the cluster grid for every grid, whole bands or not:
    cutlass.utils' own swizzle padded the grid to whole bands and the padding ran as work
    (at M = 8448 on an order tuned at 8192, 1.22-1.36x the time). Bands come one after
    another, ``swizzle`` wide (the last one what is left), walked across the band first."""
    from quack_kernels._gemm_plan import swizzled_cluster

    for mc in range(1, 21):
        for nc in range(1, 21):
            order = [swizzled_cluster(j, mc, nc, swizzle, raster_m) for j in range(mc * nc)]
            assert sorted(order) == [(m, n) for m in range(mc) for n in range(nc)], (mc, nc)
            across = [n if raster_m else m for m, n in order]  # the swizzled coordinate
            along = [m if raster_m else n for m, n in order]
            length = mc if raster_m else nc
            for j, a in enumerate(across):
                band = a // swizzle
                width = min(swizzle, (nc if raster_m else mc) - band * swizzle)
                start = band * swizzle * length
                assert start <= j < start + width * length, (mc, nc, j)  # bands in order
                # inside a band: row by row (column by column), each across the band
                assert (along[j], a % swizzle) == divmod(j - start, width), (mc, nc, j)


def _stream_k_grid(tiles, clusters, k_tiles):
    from quack_kernels._gemm_plan import stream_k_grid, stream_k_units

    grid, sk = stream_k_grid(tiles, clusters)  # the wrapper's grid: no more clusters than tiles
    return grid, sk, {c: stream_k_units(c, grid, tiles, sk, k_tiles) for c in range(grid)}


def test_stream_k_gpu_shapes_cover_each_kind_of_grid():
    """test_gemm_gpu.STREAM_K_SHAPES are the kinds of grid its comment says, on the H200's 66
    resident clusters (one 2-CTA cluster per two of its 132 SMs: both STREAM_K configurations
    fill the shared memory), with the wrapper's grid and stream-K region (gemm_fwd)."""
    import test_gemm_gpu as g
    from quack_kernels._gemm_plan import cluster_tiles, resolve, stream_k_grid

    def kind(plan, L, M, N, K):
        tiles = cluster_tiles(plan, M, N, L)
        _grid, sk = stream_k_grid(tiles, 66)
        return "none" if sk == 0 else "all" if sk == tiles else "partial"

    plans = [
        resolve(
            dict(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, schedule="coop", stream_k=True), "bfloat16"
        )
        for tm, tn, cm, cn, _ in g.STREAM_K
    ]
    # both configurations make cluster tiles of 256 x 256, so one kind a shape
    kinds = {s: {kind(p, *s) for p in plans} for s in g.STREAM_K_SHAPES}
    assert all(len(k) == 1 for k in kinds.values()), kinds
    assert {s: k.pop() for s, k in kinds.items()} == {
        (1, 4096, 4096, 4096): "partial",
        (1, 8192, 4096, 4096): "partial",
        g.ODD: "none",
        (1, 3000, 5000, 1000): "partial",
        (3, 1000, 1048, 776): "none",
        (1, 256, 512, 128): "none",
        (2, 4096, 4096, 1024): "partial",
        (1, 2048, 2304, 256): "all",
        (1, 3072, 2816, 512): "none",
    }


@pytest.mark.parametrize("k_tiles", [1, 2, 7, 64, 224])
@pytest.mark.parametrize("clusters", [1, 3, 64, 66])
def test_stream_k_schedule_covers_every_k_tile_once_in_pieces_held_by_consecutive_clusters(clusters, k_tiles):
    """The stream-K schedule (``_gemm_plan.stream_k_units``, which the kernel's ``sk_unit`` /
    ``sk_piece`` compute on Int32): every (tile, K tile) of the grid falls to exactly one
    cluster; a tile cut into pieces is held by ``head``, ``head + 1``, ... in K order, the
    head's piece starting it; each cluster starts at most one piece inside a tile and heads
    at most one cut tile, so the two workspace slots a cluster has never collide."""
    for tiles in (1, 5, clusters, clusters + 1, 2 * clusters - 1, 100, 512, 1000):
        grid, sk, units = _stream_k_grid(tiles, clusters, k_tiles)
        dp = tiles - sk
        assert sk == 0 or (tiles % grid and sk in (tiles % grid + grid, tiles))
        owner, cut = {}, {}
        for c, us in units.items():
            slots = []
            for t, k0, k1, head, pieces in us:
                assert 0 <= k0 < k1 <= k_tiles
                assert t < dp and (k0, k1, head, pieces) == (0, k_tiles, c, 1) or t >= dp, (t, k0, k1)
                for kt in range(k0, k1):
                    assert (t, kt) not in owner
                    owner[t, kt] = c
                if pieces > 1:
                    slots.append((c, k0 == 0))
                    cut.setdefault(t, []).append((c - head, k0, k1, head, pieces))
                else:
                    assert (k0, k1, head) == (0, k_tiles, c)  # a whole tile
            assert len(set(slots)) == len(slots), (c, us)
        for ps in cut.values():
            n = ps[0][4]
            assert sorted(j for j, *_ in ps) == list(range(n)) and {p[3:] for p in ps} == {ps[0][3:]}
            # in K order: piece j goes on where piece j - 1 stopped
            assert [k0 for _, k0, *_ in sorted(ps)] == [0] + [k1 for _, _, k1, *_ in sorted(ps)][:-1]
        assert len(owner) == tiles * k_tiles
        if k_tiles * sk >= grid * k_tiles:  # every share is a whole tile's iterations or more
            assert all(p[0][4] <= 2 for p in cut.values())


def _run_stream_k_fixup(units, resident, rng):
    """The kernel's fix-up protocol (``_gemm_sched.sk_arrive`` / ``sk_hand_on`` /
    ``sk_combine``) played out with at most ``resident`` clusters on the GPU at a time,
    admitted in index order as others finish, stepping in a random interleaving. Returns
    each cut tile's sum as the order its pieces were added in; raises on a deadlock."""
    count, ready, partial, sums = {}, set(), {}, {}
    progs = {c: iter(_fixup_steps(c, us, count, ready, partial, sums)) for c, us in units.items()}
    waiting = list(progs)
    running, blocked = [], {}
    while waiting or running:
        while waiting and len(running) < resident:
            running.append(waiting.pop(0))
        live = [c for c in running if blocked.get(c) is None or blocked[c] in ready]
        if not live:
            raise AssertionError(f"deadlock: {running} wait on {[blocked[c] for c in running]}")
        c = rng.choice(live)
        try:
            blocked[c] = next(progs[c])  # None, or the slot it now waits for
        except StopIteration:
            running.remove(c)
    return sums


def _fixup_steps(c, units, count, ready, partial, sums):
    for t, k0, _k1, head, n in units:
        yield None  # the mainloop
        if n == 1:
            continue
        j = c - head
        before = count.get(t, 0)  # the atomic add: one step, nothing in between
        count[t] = before + 1
        yield None
        own = (c, k0 == 0)  # the slot: the cluster's head piece, or its piece inside a tile
        if before < n - 1:
            partial[own] = (j,)
            ready.add(own)
            continue
        in_regs = j == 0 or n == 2  # else: its own partial to its slot, read back in order
        acc = (j,) if in_regs else ()
        for i in range(n):
            if i == j and in_regs:
                continue
            slot = (head + i, i == 0)
            if i != j:
                while slot not in ready:
                    yield slot
            acc = acc + (i,) if acc else (i,)
        sums[t] = acc if j == 0 or n > 2 else tuple(sorted(acc))  # n = 2: a + b is b + a


@pytest.mark.parametrize("k_tiles", [1, 3, 64])
@pytest.mark.parametrize("clusters", [1, 4, 66])
def test_stream_k_fixup_finishes_with_any_number_of_resident_clusters_in_one_sum_order(clusters, k_tiles):
    """No cluster waits for a cluster that has not yet arrived: each piece counts itself in
    first, the last to arrive adds the others' partial sums, and those have arrived, so they
    only have stores left. So the grid finishes even when one cluster at a time fits (an MPS
    share of the SMs, a kernel on another stream), where a head that waits for its peers
    holds the SM they need. Every tile's pieces are added in K order whoever arrives last."""
    import random

    rng = random.Random(clusters * 1000 + k_tiles)
    for tiles in (1, 5, clusters + 1, 2 * clusters - 1, 100):
        _, _, units = _stream_k_grid(tiles, clusters, k_tiles)
        cut = {t: n for us in units.values() for t, _, _, _, n in us if n > 1}
        for resident in sorted({1, 2, max(1, clusters // 2), clusters}):
            for _ in range(3):
                sums = _run_stream_k_fixup(units, resident, rng)
                assert sums == {t: tuple(range(n)) for t, n in cut.items()}, (tiles, resident)


def _old_views(a, b):
    """The kernel views as check() built them before it read sizes from a and b directly:
    a[None] / b[None], operand()'s batch stride for L = 1, then the permutation."""
    from quack_kernels._gemm_args import operand

    a3, b3 = (a, b) if a.dim() == 3 else (a[None], b[None])
    return operand(a3, "a").permute(1, 2, 0), operand(b3, "b").permute(2, 1, 0)


@pytest.mark.parametrize("batch", [None, 1, 3])
@pytest.mark.parametrize("a_major", ["k", "m"])
@pytest.mark.parametrize("b_major", ["n", "k"])
def test_kernel_views_are_the_operands_memory(batch, a_major, b_major):
    """One view each for L = 1 (sizes and strides read from a and b): the same shape,
    strides, storage offset and data pointer as the three-view construction it replaced,
    for row- and column-major operands, 2-D and 3-D, offset into their storage."""
    from quack_kernels._gemm_args import check

    lead = () if batch is None else (batch,)
    a = _t((*lead, 72, 40))[..., 8:, :]  # an offset view: rows 8.. of each batch
    b = _t((*lead, 40, 24))
    if a_major == "m":
        a = _t((*lead, 64, 48)).transpose(-1, -2).contiguous().transpose(-1, -2)[..., :, 8:]
    if b_major == "k":
        b = b.transpose(-1, -2).contiguous().transpose(-1, -2)
    g = check(a, b, None, "none", None, None, 1.0)
    assert (g.a_major, g.b_major) == (a_major, b_major)
    for new, old in zip((g.a3, g.b3), _old_views(a, b)):
        assert new.shape == old.shape and new.stride() == old.stride()
        assert (new.storage_offset(), new.data_ptr()) == (old.storage_offset(), old.data_ptr())


@pytest.mark.parametrize("tuned", [True, False])
def test_a_gemm_miss_suggests_the_entry_listing_its_size(tmp_path, tuned):
    """A prebuilt-mode miss inside the torch wrapper's call (quack.tuning.at_problem, as
    gemm_fwd sets it) suggests an entry listing the call's size: the configuration left to
    the table when it is the table's choice there (a re-tune then rebuilds the right one),
    written out when it is not. Either entry builds exactly the missing key. Before, the
    entry pinned the table's winner of the day as an inline config."""
    from quack_kernels.gemm import compile_gemm, gemm_config

    from quack import settings
    from quack.errors import KernelNotPrebuilt
    from quack.tuning import at_problem
    from quack_build.manifest.read import expand

    m, n, k = 8192, 14336, 4096
    with settings.override(cache_dir=str(tmp_path / "c"), mode="prebuilt", arch="sm_90a", tune_gpu="H200"):
        cfg = gemm_config(m, n, k, 1, "bfloat16") if tuned else gemm_config(64, 64, 64, 1, "bfloat16")
        assert (cfg.stream_k is True) == tuned  # the H200 row of m8k/n16k/k4k
        args = ("bfloat16", "bfloat16", "k", "k", False, True, "gelu_tanh", False, cfg)
        with pytest.raises(KernelNotPrebuilt) as e, at_problem(m=m, n=n, k=k):
            compile_gemm(*args)
        line = e.value.manifest_line
        assert f"problems = [\n    [\n        {m},\n        {n},\n        {k}," in line
        assert ("[kernel.params.config]" in line) == (not tuned), line
        mf = tmp_path / "m.toml"
        mf.write_text(line)
        (c,) = expand([mf]).configs
        assert c.key == e.value.key
        # outside a wrapper's call: no sizes, the configuration written out as before
        with pytest.raises(KernelNotPrebuilt) as e2:
            compile_gemm(*args)
        assert "problems" not in e2.value.manifest_line and "[kernel.params.config]" in e2.value.manifest_line
