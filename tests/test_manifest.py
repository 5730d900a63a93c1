"""Manifest parsing, validation and expansion (no compiles)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import toykernels  # noqa: F401  (registers toy_scale)

from quack import jit_cache, registry, settings, tomlfile
from quack.errors import KernelNotPrebuilt, ManifestError
from quack.manifest_line import manifest_line
from quack.params import Bool, Choice, Config, Dtype, Float, Int, Tuple
from quack_build.manifest.read import expand

CORPUS = Path(__file__).parent / "data" / "manifests"


@dataclasses.dataclass(frozen=True)
class Tile:
    m: int = 64
    n: int = 128
    swizzle: bool = False


def _cfg_kernel(tile: Tile, stages: int = 2):  # never compiled here
    raise NotImplementedError


if "mf_tiled" not in registry.all_specs():
    registry.register("mf_tiled", _cfg_kernel, {"tile": Config(cls=Tile), "stages": Int(min=1, max=8)})


@dataclasses.dataclass(frozen=True, eq=False)
class Knob:
    """A configuration whose comparisons are counted: what expanding a table costs."""

    v: int = 0
    compared = 0  # class attribute, not a field

    def __eq__(self, other):
        Knob.compared += 1
        return isinstance(other, Knob) and self.v == other.v

    def __hash__(self):
        return hash(self.v)


def _knob_kernel(knob: Knob, i: int = 0):  # never compiled here
    raise NotImplementedError


if "mf_knob" not in registry.all_specs():
    registry.register("mf_knob", _knob_kernel, {"knob": Config(cls=Knob), "i": Int(min=0, max=100_000)})


def _write(tmp_path, text, name="m.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _expects(path: Path) -> list[str]:
    try:
        lines = path.read_text("utf-8").splitlines()
    except UnicodeDecodeError:
        return ["not UTF-8"]
    return [ln.split("# expect:", 1)[1].strip() for ln in lines if ln.startswith("# expect:")]


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.toml")), ids=lambda p: p.stem)
def test_malformed_corpus(path):
    expects = _expects(path)
    assert expects, f"{path} has no '# expect:' lines"
    with pytest.raises(ManifestError) as ei:
        expand([path], archs=["sm_90a"])
    text = str(ei.value)
    assert str(path) in text  # every problem names its file
    for e in expects:
        assert e in text, f"expected {e!r} in:\n{text}"


def test_several_problems_all_reported():
    with pytest.raises(ManifestError) as ei:
        expand([CORPUS / "several_problems.toml"], archs=["sm_90a"])
    assert len(ei.value.problems) == 3


def test_cross_product_exclude_include_defaults(tmp_path):
    p = _write(
        tmp_path,
        """
[defaults]
archs = ["sm_90a"]
params = { dtype = ["float16", "bfloat16"] }

[[kernel]]
name = "toy_scale"
[kernel.params]
block = [64, 128]
bias = [true, false]
exclude = [{ block = 64, bias = true }]
include = [{ dtype = "float32", block = 256, bias = false }]
""",
    )
    exp = expand([p])
    got = [(c.params["dtype"], c.params["block"], c.params["bias"], c.arch) for c in exp.configs]
    assert len(got) == 2 * 3 + 1
    assert ("float16", 64, True, "sm_90a") not in got
    assert ("float32", 256, False, "sm_90a") in got
    assert exp.duplicates == 0


def test_keys_match_runtime_keys(tmp_path):
    p = _write(
        tmp_path,
        '[[kernel]]\nname = "toy_scale"\narchs = ["sm_90a", "sm_80"]\n'
        'params = { dtype = "bf16", block = 256 }\n',
    )
    exp = expand([p])
    assert {c.key for c in exp.configs} == {
        toykernels.toy_scale.key(dtype="bfloat16", block=256, arch="sm_90a"),
        toykernels.toy_scale.key("bfloat16", 256, False, arch="sm_80"),
    }


def test_archs_precedence_and_override(tmp_path):
    p = _write(
        tmp_path,
        '[defaults]\narchs = ["sm_80"]\n[[kernel]]\nname = "toy_scale"\n'
        'params = { dtype = "float16" }\n[[kernel]]\nname = "toy_scale"\narchs = "sm_100a"\n'
        'params = { dtype = "float32" }\n',
    )
    assert sorted(c.arch for c in expand([p], archs=["sm_90a"]).configs) == ["sm_100a", "sm_80"]
    p2 = _write(tmp_path, '[[kernel]]\nname = "toy_scale"\nparams = { dtype = "float16" }\n', "n.toml")
    assert [c.arch for c in expand([p2], archs=["sm_90a"]).configs] == ["sm_90a"]
    assert {c.arch for c in expand([p, p2], arch_override=["sm_120a"]).configs} == {"sm_120a"}
    with pytest.raises(ManifestError, match="--arch 'sm_7'"):
        expand([p2], arch_override=["sm_7"])


def test_duplicates_across_files_dropped(tmp_path):
    a = _write(
        tmp_path, '[[kernel]]\nname = "toy_scale"\nparams = { dtype = ["float16", "float32"] }\n', "a.toml"
    )
    b = _write(
        tmp_path, '[[kernel]]\nname = "toy_scale"\nparams = { dtype = "fp16", block = 128 }\n', "b.toml"
    )
    exp = expand([a, b], archs=["sm_90a"])
    assert len(exp.configs) == 2 and exp.duplicates == 1


def test_limit_on_cross_product(tmp_path):
    p = _write(
        tmp_path,
        '[[kernel]]\nname = "toy_scale"\nparams = { dtype = ["float16", "float32"], '
        "block = [32, 64, 128, 256], bias = [true, false] }\n",
    )
    assert len(expand([p], archs=["sm_90a"]).configs) == 16
    with pytest.raises(ManifestError, match=r"16 configurations .*over the limit of 10.*--max-configs"):
        expand([p], archs=["sm_90a"], max_configs=10)


def test_excludes_cost_one_lookup_per_combination_not_one_per_entry(tmp_path):
    """Each combination was compared with every exclude entry: 2,000 combinations x 50,000
    excludes took 48 s and printed 50,000 warnings, whatever --max-configs said. Now the
    entries are indexed (comparisons ~ entries + combinations, not their product) and
    the unused ones are one warning line with a count."""
    combos, unused = 300, 3000
    entries = [f"{{ knob = {{ v = 0 }}, i = {1000 + j} }}" for j in range(unused)]
    entries[7:7] = ["{ i = 5 }", "{ knob = { v = 0 }, i = [6, 7] }", "{ i = 5, knob = { v = 0 } }"]
    p = _write(
        tmp_path,
        '[[kernel]]\nname = "mf_knob"\narchs = ["sm_90a"]\n'
        f"params = {{ knob = {{ v = 0 }}, i = {list(range(combos))} }}\n"
        f"exclude = [{', '.join(entries)}]\n",
    )
    Knob.compared = 0
    exp = expand([p])
    assert sorted(c.params["i"] for c in exp.configs) == [i for i in range(combos) if i not in (5, 6, 7)]
    assert Knob.compared < 5 * (combos + unused), Knob.compared  # was combos x entries: 900,000
    (w,) = exp.warnings
    assert w.endswith(
        f"{unused} exclude entries match no combination: exclude[0], exclude[1], exclude[2], "
        f"... ({unused - 3} more)"
    ), w


def test_one_unused_exclude_is_named_and_config_values_still_match(tmp_path):
    p = _write(
        tmp_path,
        '[[kernel]]\nname = "mf_tiled"\narchs = ["sm_90a"]\n'
        "params = { tile = [{ m = 64 }, { m = 128 }], stages = [2, 3] }\n"
        "exclude = [{ tile = { m = 64 } }, { tile = { m = 256 } }, { stages = [3, 4], tile = { m = 128 } }]\n",
    )
    exp = expand([p])
    assert [(c.params["tile"].m, c.params["stages"]) for c in exp.configs] == [(128, 2)]
    (w,) = exp.warnings
    assert w.endswith("(mf_tiled): exclude[1] matches no combination"), w


def test_config_params_inline_tables(tmp_path):
    p = _write(
        tmp_path,
        '[[kernel]]\nname = "mf_tiled"\n'
        "params = { tile = [{ m = 64, n = 128 }, { m = 128, n = 128, swizzle = true }], stages = [2, 3] }\n"
        "exclude = [{ tile = { m = 64, n = 128 }, stages = 3 }]\n",
    )
    exp = expand([p], archs=["sm_90a"])
    assert len(exp.configs) == 3
    assert {(c.params["tile"], c.params["stages"]) for c in exp.configs} == {
        (Tile(64, 128), 2),
        (Tile(128, 128, True), 2),
        (Tile(128, 128, True), 3),
    }
    bad = _write(
        tmp_path, '[[kernel]]\nname = "mf_tiled"\nparams = { tile = { m = 64, k = 1 } }\n', "bad.toml"
    )
    with pytest.raises(ManifestError) as ei:
        expand([bad], archs=["sm_90a"])
    assert "unknown fields ['k']" in str(ei.value) and "fields are ['m', 'n', 'swizzle']" in str(ei.value)


def test_manifest_line_round_trip(tmp_path):
    """What KernelNotPrebuilt prints (and prewarm --emit-manifest writes) is a valid manifest
    that builds exactly the missing key."""
    spec = registry.get("toy_scale")
    params = spec.bind((), {"dtype": "bfloat16", "block": 512, "bias": True})
    p = _write(tmp_path, manifest_line("toy_scale", params, "sm_90a"))
    (c,) = expand([p]).configs
    assert c.key == spec.key(params, "sm_90a")
    spec2 = registry.get("mf_tiled")
    params2 = spec2.bind((), {"tile": Tile(128, 64, True), "stages": 4})
    p2 = _write(tmp_path, manifest_line("mf_tiled", params2, "sm_100a"), "t.toml")
    (c2,) = expand([p2]).configs
    assert c2.key == spec2.key(params2, "sm_100a")


def test_manifest_line_of_a_tuned_kernel_round_trips(tmp_path):
    """A kernel with a typed configuration (unset knobs are None: TOML has no null). The
    derived default is left out (the manifest follows the tuning table, as calls do); an
    explicit candidate is written with its set knobs only; both build exactly the key.
    Before: tomli_w raised TypeError on the None knobs, so a prebuilt-mode miss of any
    tuned kernel crashed instead of raising KernelNotPrebuilt."""
    from quack_kernels import softmax
    from quack_kernels._configs import SoftmaxFwdConfig

    spec = softmax.compile_softmax_fwd.spec
    derived = spec.bind((), {"dtype": "bfloat16", "n": 4096}, arch="sm_90a")
    forced = spec.bind(
        (), {"dtype": "bfloat16", "n": 4096, "config": SoftmaxFwdConfig(online=True)}, arch="sm_90a"
    )
    for i, params in enumerate((derived, spec.plain(derived), forced, spec.plain(forced))):
        line = manifest_line("softmax_fwd", params, "sm_90a")
        assert ("config" in line) == (i >= 2), line
        (c,) = expand([_write(tmp_path, line, f"m{i}.toml")]).configs
        assert c.key == spec.key(params if i % 2 == 0 else spec.bind((), params, arch="sm_90a"), "sm_90a")


@jit_cache(
    "mf_every_kind",
    params={
        "dtype": Dtype(),
        "n": Int(min=1),
        "bias": Bool(),
        "eps": Float(min=0.0),
        "mode": Choice(("a", "b")),
        "tile": Tuple(Int(min=1), Int(min=1)),
        "mix": Tuple(Dtype(), Bool(), Float(), Choice(("x", "y"))),
        "cfg": Config(cls=Tile),
    },
)
def every_kind(dtype, n, bias, eps, mode, tile, mix, cfg):  # never compiled: prebuilt mode misses
    raise NotImplementedError


def test_manifest_entry_of_every_param_kind_round_trips(tmp_path):
    """The entry a prebuilt-mode miss prints, and the one ``quack prewarm --emit-manifest``
    writes, build exactly the missing key for every parameter kind. Before: a Tuple
    parameter was written flat (``tile = [64, 32]``: two values), which quack build refuses
    ("tile is a tuple parameter ...; tile = [[128, 256]] is one value")."""
    from quack_build.build.prewarm import emit

    call = {
        "dtype": "bfloat16",
        "n": 416,
        "bias": True,
        "eps": 1e-6,
        "mode": "b",
        "tile": (64, 32),
        "mix": ("float16", False, 0.25, "y"),
        "cfg": Tile(128, 64, True),
    }
    with settings.override(cache_dir=tmp_path / "cache", arch="sm_90a", mode="prebuilt"):
        with pytest.raises(KernelNotPrebuilt) as ei:
            every_kind(**call)
    err = ei.value
    assert err.manifest_line in str(err)
    (entry,) = tomlfile.loads(err.manifest_line, "the entry")["kernel"]
    assert entry["params"]["tile"] == [[64, 32]] and entry["params"]["mix"] == [["float16", False, 0.25, "y"]]
    (c,) = expand([_write(tmp_path, err.manifest_line)]).configs
    assert c.key == err.key
    assert c.params == every_kind.spec.bind((), call)
    emitted = tmp_path / "emitted.toml"
    emit(emitted, [c])
    (c2,) = expand([emitted]).configs
    assert c2.key == err.key


def test_missing_file(tmp_path):
    with pytest.raises(ManifestError, match="no such manifest file"):
        expand([tmp_path / "nope.toml"])


def test_duplicate_list_values_warn(tmp_path):
    p = _write(tmp_path, '[[kernel]]\nname = "toy_scale"\nparams = { dtype = ["float16", "fp16"] }\n')
    exp = expand([p], archs=["sm_90a"])
    assert len(exp.configs) == 1
    assert any("lists a value twice" in w for w in exp.warnings)


def test_a_build_line_names_only_the_set_fields_of_a_configuration():
    from quack_build.manifest.config import format_params

    line = format_params({"dtype": "bfloat16", "config": {"ring": True, "stages": None, "x_rows": 2}})
    assert line == "dtype=bfloat16 config={ring=True,x_rows=2}"
    assert format_params({"config": {"ring": None}}) == "config={}"
