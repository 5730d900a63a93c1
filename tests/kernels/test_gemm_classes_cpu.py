"""The GEMM's tuning-table classes (issue 28; docs/tuning.md "The GEMM's problem classes"):
M, N and K each rounded to the nearest power of two on a log scale, so every goal shape
has a row of its own. Before: output-size / K-depth classes ("mid/k") put 4096^3,
8192x4096x4096 and 8192x4096x14336 into one row at N = 4096, and 8192^3 and
8192x8192x28672 into one at N = 8192: one winner served shapes that want different tiles."""

import pytest
from _fixtures import h200_rows  # noqa: F401  (a fixture, used by name)

GOALS = [
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (8192, 4096, 4096),
    (8192, 14336, 4096),
    (8192, 4096, 14336),
    (8192, 28672, 8192),
    (8192, 8192, 28672),
]


def _row_ident(m, n, k, batch=1):
    """What a table row is keyed by for a problem (dtype aside): its class and N range."""
    from quack_kernels._gemm_plan import class_n_range, shape_class

    return shape_class(m, n, k, batch), class_n_range(n)


def test_every_goal_shape_has_a_row_of_its_own():
    idents = [_row_ident(*s) for s in GOALS]
    assert len(set(idents)) == len(GOALS), idents
    # and each row's N range holds its own N
    assert all(lo <= n <= hi for (_, n, _), (_, (lo, hi)) in zip(GOALS, idents))


def test_classes_read_as_the_nearest_powers_of_two():
    from quack_kernels._gemm_plan import shape_class

    assert shape_class(8192, 14336, 4096) == "m8k/n16k/k4k"
    assert shape_class(1000, 1048, 776) == "m1k/n1k/k1k"  # odd: the nearest powers of two
    assert shape_class(1, 1, 1) == "m1/n1/k1"
    assert shape_class(3, 5, 7) == "m4/n4/k8"  # log2 3 = 1.58, 5: 2.32, 7: 2.81
    assert shape_class(1 << 20, 8, 64) == "m1024k/n8/k64"


@pytest.mark.parametrize("b", [0, 1, 2, 11, 12, 13, 14, 15, 20])
def test_bucket_boundaries_are_the_half_powers_of_two(b):
    from quack_kernels._gemm_plan import bucket_range, size_bucket

    lo, hi = bucket_range(b)
    assert size_bucket(lo) == b and size_bucket(hi) == b
    if lo > 1:
        assert size_bucket(lo - 1) == b - 1
    assert size_bucket(hi + 1) == b + 1
    # the boundaries are 2^(b -+ 1/2): lo^2 >= 2^(2b-1) > (lo-1)^2, hi^2 < 2^(2b+1) <= (hi+1)^2
    assert hi * hi < 2 ** (2 * b + 1) <= (hi + 1) ** 2
    if b:
        assert lo * lo >= 2 ** (2 * b - 1) > (lo - 1) ** 2


def test_buckets_tile_the_sizes_without_gaps():
    from quack_kernels._gemm_plan import bucket_range, size_bucket

    nxt = 1
    for b in range(18):
        lo, hi = bucket_range(b)
        assert lo == nxt and hi >= lo
        nxt = hi + 1
    assert all(
        bucket_range(size_bucket(x))[0] <= x <= bucket_range(size_bucket(x))[1] for x in range(1, 5000)
    )


def test_goal_sizes_sit_inside_their_buckets_not_on_an_edge():
    """4096 (and 14336, 28672) are well inside: a near shape (4000, 14000) reaches the row."""
    from quack_kernels._gemm_plan import shape_class

    assert shape_class(8000, 14000, 4200) == shape_class(8192, 14336, 4096)
    assert shape_class(4095, 4095, 4095) == shape_class(4096, 4096, 4096) == shape_class(4097, 4097, 4097)
    assert shape_class(8192, 2896, 4096) != shape_class(8192, 2897, 4096)  # 2^11.5 = 2896.3


def test_a_batch_counts_as_l_times_m_rows():
    from quack_kernels._gemm_plan import shape_class

    assert shape_class(512, 4096, 4096, batch=16) == shape_class(8192, 4096, 4096)
    assert shape_class(512, 4096, 4096, batch=16) != shape_class(512, 4096, 4096)
    assert shape_class(1000, 1048, 776, batch=3) == "m4k/n1k/k1k"


@pytest.mark.parametrize(
    "args, says",
    [
        ((0, 1, 1), "size must be a positive integer, got 0"),
        ((1, -4, 1), "got -4"),
        ((1, 1, 2.0), "got 2.0"),
        ((1, 1, True), "got True"),
        ((1, 1, 1, 0), "batch must be a positive integer, got 0"),
    ],
)
def test_bad_sizes_are_named(args, says):
    from quack_kernels._gemm_plan import shape_class

    with pytest.raises(ValueError, match=says):
        shape_class(*args)


@pytest.mark.usefixtures("h200_rows")  # the H200 table below applies whatever GPU is here
def test_a_row_serves_its_class_and_no_other(monkeypatch):
    """A row written for 8192x14336x4096 serves a shape of the same class (8000x14000x4200,
    and a batch of 16 x 512 rows); shapes of other classes keep the heuristic."""
    from quack_kernels._configs import GemmConfig
    from quack_kernels._gemm_plan import class_n_range, heuristic, shape_class
    from quack_kernels.gemm import gemm_config

    from quack.tuning import Row, Table, use_table

    monkeypatch.setattr("quack_kernels._tuning.runtime_arch", lambda: "sm_90a")
    win = GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2, schedule="coop")
    t = Table("sm_90a", "H200")
    t.put(
        Row("gemm", "H200", shape_class(8192, 14336, 4096), class_n_range(14336), win.knobs(), ("bfloat16",))
    )
    with use_table(t):
        assert gemm_config(8192, 14336, 4096, 1, "bfloat16") == win
        assert gemm_config(8000, 14000, 4200, 1, "bfloat16") == win
        assert gemm_config(512, 14336, 4096, 16, "bfloat16") == win
        for m, n, k in [(8192, 4096, 4096), (8192, 14336, 14336), (4096, 14336, 4096)]:
            assert gemm_config(m, n, k, 1, "bfloat16") == GemmConfig(**heuristic(m, n, k)), (m, n, k)
        assert gemm_config(8192, 14336, 4096, 1, "float16") == GemmConfig(**heuristic(8192, 14336, 4096))


@pytest.mark.usefixtures("h200_rows")
def test_the_memoised_choice_follows_the_table_in_force_and_the_gpu(monkeypatch):
    """gemm_config is asked on every op call, so its answer is memoised (host time: ~270 us
    a fused call on the H200): the memo must never outlive the table or GPU it was made for.
    The same shape asked under the checked-in table, a use_table block, again after it, and
    for another GPU model gets each one's own answer."""
    from quack_kernels._configs import GemmConfig
    from quack_kernels._gemm_plan import class_n_range, heuristic, shape_class
    from quack_kernels.gemm import gemm_config

    from quack import settings
    from quack.tuning import Row, Table, use_table

    monkeypatch.setattr("quack_kernels._tuning.runtime_arch", lambda: "sm_90a")
    shape = (8000, 3000, 3000)
    before = gemm_config(*shape, 1, "bfloat16")
    win = GemmConfig(tile_m=256, tile_n=128, cluster_m=2, cluster_n=1, schedule="coop", swizzle=4)
    t = Table("sm_90a", "H200")
    t.put(Row("gemm", "H200", shape_class(*shape), class_n_range(shape[1]), win.knobs(), ("bfloat16",)))
    assert before != win
    with use_table(t):
        assert gemm_config(*shape, 1, "bfloat16") == win
        assert gemm_config(*shape, 1, "bfloat16") == win  # memoised: the same answer
        with settings.override(tune_gpu="QX9"):  # another model, without rows
            with pytest.warns(UserWarning, match="no tuning-table rows for GPU 'QX9'"):
                assert gemm_config(*shape, 1, "bfloat16") == GemmConfig(**heuristic(*shape))
        assert gemm_config(*shape, 1, "bfloat16") == win
    assert gemm_config(*shape, 1, "bfloat16") == before


def test_the_gpu_model_is_asked_of_torch_once_per_device(monkeypatch):
    import sys
    import types

    from quack.tuning import gpu

    asked = []
    cuda = types.SimpleNamespace(
        is_initialized=lambda: True,
        current_device=lambda: 7,
        get_device_name=lambda d: asked.append(d) or "NVIDIA H200",
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(gpu, "_NAMES", {})
    assert [gpu.detected_gpu() for _ in range(3)] == ["H200"] * 3
    assert asked == [7]
    cuda.current_device = lambda: 3  # another device: asked for its own
    assert gpu.detected_gpu() == "H200" and asked == [7, 3]
