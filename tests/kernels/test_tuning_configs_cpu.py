"""Typed kernel configurations and the tuning tables (issue 25; docs/tuning.md), CPU only:
the configuration is validated, derived from kernels/tuned/<arch>.toml at bind time (so it
is in the key), and the table reproduces the hand tables it replaced."""

import dataclasses
import warnings

import pytest
from _fixtures import h200_rows  # noqa: F401  (a fixture, used by name)
from quack_kernels import _tuning, cross_entropy, layernorm, rmsnorm, softmax
from quack_kernels._configs import LayerNormFwdConfig, RmsNormFwdConfig, SoftmaxBwdConfig

from quack.errors import ParamError, TuningTableError
from quack.tuning import Row, Table, normalise_gpu

# the assertions name the checked-in H200 rows (_fixtures.TABLE_GPU), whatever GPU is here
pytestmark = pytest.mark.usefixtures("h200_rows")

A = "sm_90a"


def cfg(fn, *args):
    return fn.spec.bind(args, {}, arch=A)["config"]


def test_config_fields_are_checked():
    with pytest.raises(ParamError, match="x_rows"):
        RmsNormFwdConfig(x_rows=0)
    with pytest.raises(ParamError, match="threads"):
        LayerNormFwdConfig(threads=384)
    with pytest.raises(ParamError, match="unknown field 'x_rowz'"):
        RmsNormFwdConfig.from_dict({"x_rowz": 2})
    with pytest.raises(ParamError, match="bwd_ld"):
        SoftmaxBwdConfig(bwd_ld="last:evict_sometimes")
    with pytest.raises(dataclasses.FrozenInstanceError):
        RmsNormFwdConfig().x_rows = 2  # type: ignore[misc]
    # a misspelt knob in a call's dict is refused, not ignored
    with pytest.raises(ParamError, match="unknown fields"):
        rmsnorm.compile_rmsnorm_fwd.spec.bind(("bfloat16", 4096), {"config": {"x_rowz": 2}}, arch=A)


def test_table_rows_select_the_measured_configurations():
    # RMSNorm fp32 weight beside 16-bit rows at clusters of 4 and at N = 262144
    kn = cfg(rmsnorm.compile_rmsnorm_fwd, "bfloat16", 65536, True, False, False, "float32").knobs()
    assert kn == {"ring": False, "x_smem": True, "x_smem_wide": True, "x_rows": 2, "x_min_blocks": 3}
    kn = cfg(rmsnorm.compile_rmsnorm_fwd, "float16", 262144, True, False, False, "float32").knobs()
    assert kn == {"ring_threads": 512, "ring_pipe": True, "ring_wregs": "wb", "stages": 3}
    assert cfg(rmsnorm.compile_rmsnorm_fwd, "bfloat16", 65536, True, False, False, "same").knobs() == {}
    assert cfg(rmsnorm.compile_rmsnorm_fwd, "float32", 65536, True, False, False, "same").knobs() == {}
    # LayerNorm: the exact-N row beats the class's range; rows / clusters / small
    ln = layernorm.compile_layernorm_fwd
    assert cfg(ln, "bfloat16", 16384, True, True, "float32").knobs()["x_rows"] == 4
    assert cfg(ln, "bfloat16", 14336, True, True, "float32").knobs()["x_rows"] == 2
    assert cfg(ln, "bfloat16", 12288, True, True, "same").knobs() == {
        "x_smem": True,
        "threads": 512,
        "x_min_blocks": 3,
    }
    assert cfg(ln, "bfloat16", 262144, True, True, "same").knobs()["stages"] == 4
    assert cfg(ln, "bfloat16", 196608, True, True, "same").knobs().get("ring") is False
    assert cfg(ln, "bfloat16", 4096, True, True, "float32").knobs()["row_budget"] == 32
    # the small-rows set only where its 32-element plan is one even row a CTA
    assert cfg(ln, "bfloat16", 1000, True, True, "float32").knobs() == {}
    # softmax / cross-entropy by row-length class; cross-entropy's forward: the heuristic
    assert cfg(softmax.compile_softmax_bwd, "bfloat16", 12288).knobs() == {"bwd_min_blocks": 4}
    assert cfg(softmax.compile_softmax_bwd, "float32", 12288).knobs() == {}
    assert cfg(cross_entropy.compile_cross_entropy_bwd, "float16", 16384, "none").knobs()["bwd_budget"] == 128
    assert cfg(cross_entropy.compile_cross_entropy_fwd, "bfloat16", 262144, "none").knobs() == {
        "stream": True,
        "tpr": 256,
        "cluster": 2,
    }


def test_config_is_in_the_key():
    spec = rmsnorm.compile_rmsnorm_fwd.spec
    default = spec.bind(("bfloat16", 65536, True, False, False, "float32"), {}, arch=A)
    other = dict(default, config=RmsNormFwdConfig(x_rows=1, x_smem=True))
    assert spec.key(default, A) != spec.key(other, A)
    # a call that names the default configuration gets the derived one's key
    same = spec.bind(("bfloat16", 65536, True, False, False, "float32", default["config"]), {}, arch=A)
    assert spec.key(same, A) == spec.key(default, A)


def test_gpu_without_rows_gets_the_heuristic_and_one_warning():
    from quack import settings

    old = settings.get()
    settings.set_current(dataclasses.replace(old, tune_gpu="B200"))
    _tuning.reload()
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            a = cfg(rmsnorm.compile_rmsnorm_fwd, "bfloat16", 65536, True, False, False, "float32")
            cfg(softmax.compile_softmax_bwd, "bfloat16", 12288)
        assert a.knobs() == {}
        msgs = [str(x.message) for x in w if "quack tune" in str(x.message)]
        assert len(msgs) == 1 and "B200" in msgs[0]
    finally:
        settings.set_current(old)
        _tuning.reload()


def test_table_round_trips_stably(tmp_path):
    t = Table.load(_tuning.table_path(A))
    text = t.dumps()
    p = tmp_path / "t.toml"
    p.write_text(text)
    assert Table.load(p).dumps() == text
    # a re-tune's winner replaces its row in place; the file stays sorted
    r = Row(
        "softmax_bwd",
        "H200",
        "mid",
        (12288, 12288),
        {"bwd_min_blocks": 3},
        (),
        101.5,
        "32768x12288",
        "2025-01-01",
    )
    t.put(r)
    t.put(Row("softmax_bwd", "H200", "mid", (12288, 12288), {"bwd_min_blocks": 2}, (), 99.0))
    t.write(p)
    again = Table.load(p)
    assert again.lookup("softmax_bwd", "H200", "mid", "bfloat16", 12288).config == {"bwd_min_blocks": 2}
    assert again.lookup("softmax_bwd", "H200", "mid", "bfloat16", 12289).config == {"bwd_min_blocks": 4}
    assert Table.load(p).dumps() == p.read_text()


def test_bad_table_rows_are_named(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text(
        '[table]\narch = "sm_90a"\ndefault_gpu = "H200"\n[[row]]\nkernel = "x"\ngpu = "H200"\n'
        'class = "mid"\nn = [5, 2]\nconfig = {}\n'
    )
    with pytest.raises(TuningTableError, match=r"row 1 \(n\)"):
        Table.load(p)
    p.write_text(
        '[table]\narch = "sm_90a"\ndefault_gpu = "H200"\n[[row]]\nkernel = "x"\ngpu = "H200"\n'
        'class = "mid"\nn = [1, 2]\nconfig = {}\nspeed = 3\n'
    )
    with pytest.raises(TuningTableError, match="speed"):
        Table.load(p)


def test_gpu_names_normalise():
    assert normalise_gpu("NVIDIA H200") == "H200"
    assert normalise_gpu("NVIDIA H100 80GB HBM3") == "H100"
    assert normalise_gpu("NVIDIA GeForce RTX 4090") == "4090"


def test_use_table_swaps_the_table_for_a_block_only():
    # benchmarks/bench_tune.py times two tables' winners side by side through use_table: the
    # derived configuration (so the key) follows the table in force, and only inside the block
    from quack.tuning import use_table

    ln = layernorm.compile_layernorm_fwd
    checked_in = cfg(ln, "bfloat16", 16384, True, True, "float32")
    args = ("bfloat16", 16384, True, True, "float32")
    bound = ln.spec.bind(args, {}, arch=A)
    cls = ln.spec.params["config"].derive.classify({k: v for k, v in bound.items() if k != "config"})
    other = Table(A, _tuning.table(A).default_gpu)
    other.put(Row("layernorm_fwd", other.default_gpu, cls, (16384, 16384), {"x_rows": 1, "threads": 256}))
    with use_table(other):
        inside = cfg(ln, "bfloat16", 16384, True, True, "float32")
        key_inside = ln.spec.key(ln.spec.bind(args, {}, arch=A), A)
    assert inside.knobs() == {"x_rows": 1, "threads": 256} != checked_in.knobs()
    assert cfg(ln, "bfloat16", 16384, True, True, "float32") == checked_in
    assert key_inside != ln.spec.key(bound, A)
    # an empty table: the heuristic, as for a GPU the checked-in table has no rows for
    with use_table(Table(A, other.default_gpu)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cfg(ln, "bfloat16", 16384, True, True, "float32").knobs() == {}


def test_a_hand_edited_row_with_a_bad_value_is_named_on_every_bind():
    """A row's configuration is built once a process (memoised by its values); a value the
    memo can't key (a list) or a knob can't take still reaches the configuration's own check,
    which names the table and the row, on every bind: never a bare TypeError, never cached."""
    from quack.tuning import use_table

    t = Table(A, "H200")
    # the checked-in table's class for 16-bit rows with an fp32 weight over clusters of 4
    t.put(Row("rmsnorm_fwd", "H200", "wide/cluster4", (65536, 65536), {"x_rows": [2]}, ("bfloat16",)))
    t.put(Row("rmsnorm_fwd", "H200", "wide/cluster4", (40960, 40960), {"x_rows": 0}, ("bfloat16",)))
    with use_table(t):
        for n in (65536, 65536, 40960, 40960):
            with pytest.raises(ParamError, match=r"x_rows") as e:
                cfg(rmsnorm.compile_rmsnorm_fwd, "bfloat16", n, True, False, False, "float32")
            assert "row rmsnorm_fwd wide/cluster4 n=" in str(e.value), str(e.value)


def test_the_wrappers_configuration_is_the_binds_and_follows_table_and_override():
    """The torch wrappers derive a call's configuration through ``_tuning.derived_config``,
    memoised (a bind a call was half of an RMSNorm call's host time): the bind's answer,
    in and out of ``use_table`` / ``use_config`` blocks, and a bad row raises on every
    call (an error is never kept)."""
    from quack.tuning import use_config, use_table

    args = ("bfloat16", 16384, True, True, "float32")
    ln = layernorm.compile_layernorm_fwd
    checked_in = cfg(ln, *args)
    assert layernorm.fwd_config(*args) == checked_in and checked_in.knobs()
    bound = ln.spec.bind(args, {}, arch=A)
    cls = ln.spec.params["config"].derive.classify({k: v for k, v in bound.items() if k != "config"})
    other = Table(A, _tuning.table(A).default_gpu)
    other.put(Row("layernorm_fwd", other.default_gpu, cls, (16384, 16384), {"x_rows": 1, "threads": 256}))
    for _ in range(2):  # the second time from the memo
        with use_table(other):
            assert layernorm.fwd_config(*args).knobs() == {"x_rows": 1, "threads": 256}
        assert layernorm.fwd_config(*args) == checked_in
        forced = LayerNormFwdConfig(x_rows=1, threads=256)
        with use_config("layernorm_fwd", forced):
            assert layernorm.fwd_config(*args) == forced != checked_in
        assert layernorm.fwd_config(*args) == checked_in
    bad = Table(A, "H200")
    bad.put(Row("rmsnorm_fwd", "H200", "wide/cluster4", (65536, 65536), {"x_rows": 0}, ("bfloat16",)))
    with use_table(bad):
        for _ in range(2):
            with pytest.raises(ParamError, match="row rmsnorm_fwd wide/cluster4 n="):
                rmsnorm.fwd_config("bfloat16", 65536, True, False, False, "float32")


def test_a_repeated_call_binds_once(monkeypatch):
    """The memo is what keeps a bind off every call's host path: two wrapper derivations
    of one problem bind once; another problem binds again (counts, not times)."""
    spec = layernorm.compile_layernorm_fwd.spec
    cls = type(spec)
    binds = []
    real = cls.bind

    def counting(self, *a, **kw):
        binds.append(self.name)
        return real(self, *a, **kw)

    monkeypatch.setattr(cls, "bind", counting)
    _tuning.reload()  # an empty memo
    args = ("bfloat16", 16384, True, True, "float32")
    assert layernorm.fwd_config(*args) == layernorm.fwd_config(*args)
    assert binds == ["layernorm_fwd"]
    layernorm.fwd_config("bfloat16", 8192, True, True, "float32")
    assert binds == ["layernorm_fwd"] * 2


def test_a_memoised_configuration_does_not_skip_the_binds_type_checks():
    """True == 1 and 16384 == 16384.0 hash alike: after a valid call has filled the memo,
    the same values with the wrong types are still refused by bind, naming the parameter."""
    args = ("bfloat16", 16384, True, True, "float32")
    layernorm.fwd_config(*args)
    with pytest.raises(ParamError, match="n"):
        layernorm.fwd_config("bfloat16", 16384.0, True, True, "float32")
    with pytest.raises(ParamError, match="has_weight"):
        layernorm.fwd_config("bfloat16", 16384, 1, True, "float32")


def test_a_tuned_gpu_without_rows_for_a_kernel_says_so_once():
    """A GPU with rows for some kernels (here QX9: an RMSNorm row only) gives the others their heuristic
    with one warning each naming the kernel; a kernel no GPU has rows for, or whose rows keep
    the heuristic ({}, as the H100's softmax forward rows do), stays quiet."""
    from quack.tuning import use_table

    t = Table(A, "H200")
    t.put(Row("softmax_bwd", "H200", "mid", (12288, 12288), {"bwd_min_blocks": 4}, ("bfloat16",)))
    t.put(Row("rmsnorm_fwd", "QX9", "same/cluster1", (4096, 4096), {}, ("bfloat16",)))
    t.put(Row("softmax_fwd", "H200", "small", (4096, 4096), {}, ("bfloat16",)))
    from quack import settings

    with settings.override(tune_gpu="QX9"), use_table(t):
        _tuning.reload()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for n in (12288, 12288, 16384):
                assert cfg(softmax.compile_softmax_bwd, "bfloat16", n).knobs() == {}
            cfg(cross_entropy.compile_cross_entropy_fwd, "bfloat16", 4096, "none")
            cfg(softmax.compile_softmax_fwd, "bfloat16", 4096)
    _tuning.reload()
    msgs = [str(x.message) for x in w if "quack tune" in str(x.message)]
    assert len(msgs) == 1, msgs
    assert "no tuning-table rows for softmax_bwd on GPU 'QX9'" in msgs[0] and "rows for H200" in msgs[0]
