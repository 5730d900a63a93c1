"""``quack tune`` for a kernel whose problems are not its parameters (issue 28): the GEMM
declares ``problem=("m", "n", "k")`` and a tuning manifest lists the sizes (``problems``).
On the CPU: the dry run lists one problem per size with the current default derived for
that size, the manifest's ``problems`` key is checked, and the measuring path (a fake
measurement) writes a row keyed by the GEMM's shape class and N that ``gemm_config`` then
reads. Before: ``problems`` was an unknown manifest key and the tuner keyed problems by the
row kernels' ``n`` (a KeyError for the GEMM), so the GEMM could not be tuned."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = (
    '[defaults]\narchs = ["sm_90a"]\n[[kernel]]\nname = "gemm"\n'
    "problems = [[1024, 1024, 1024], [8192, 4096, 4096], [1024, 1024, 1024]]\n"
    '[kernel.params]\ndtype = "bfloat16"\n'
)


def _quack(*args, env_extra=None):
    import os

    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "quack_build", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )


class _NoPool:
    """The compile pool, absent: these tests fake the engine that would use it."""

    def __init__(self, *a, **k):
        """Takes the pool's arguments and starts nothing."""

    def shutdown(self):
        """Nothing was started: nothing to stop."""


def test_dry_run_lists_each_problem_size_with_its_own_default(tmp_path):
    from quack_kernels._gemm_plan import heuristic
    from quack_kernels.gemm import gemm_config

    m = tmp_path / "m.toml"
    m.write_text(MANIFEST)
    r = _quack("tune", str(m), "-n", "--json", env_extra={"QUACK_CACHE_DIR": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    # a size listed twice is one problem
    assert [p["sizes"] for p in out["problems"]] == [
        {"m": 1024, "n": 1024, "k": 1024},
        {"m": 8192, "n": 4096, "k": 4096},
    ]
    small, big = out["problems"]
    assert "1024x1024x1024" in small["problem"] and "8192x4096x4096" in big["problem"]
    # the first candidate is today's default FOR THE SIZE: the heuristic where the table has
    # no row for the size's class (1024^3), the tuned row where it has one (8192x4096x4096)
    assert small["candidates"][0] == heuristic(1024, 1024, 1024)
    assert big["candidates"][0] == gemm_config(8192, 4096, 4096, 1, "bfloat16").knobs()
    assert small["candidates"][0] != big["candidates"][0]
    assert len(big["candidates"]) == 72 and len(small["candidates"]) == 72
    assert not list((tmp_path / "c").rglob("*.o")), "a dry run compiles nothing"


def test_the_gemm_tuning_manifest_lists_the_goal_shapes():
    r = _quack("tune", "manifests/tuning_gemm.toml", "-n", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    probs = json.loads(r.stdout)["problems"]
    goal = [
        (4096, 4096, 4096),
        (8192, 8192, 8192),
        (8192, 4096, 4096),
        (8192, 14336, 4096),
        (8192, 4096, 14336),
        (8192, 28672, 8192),
        (8192, 8192, 28672),
    ]
    # bf16, then fp8 e4m3 promoted and with fast accumulation: the goal shapes each, one
    # table row each (a class of its own within the dtype; before, three shared "mid/k" at
    # N = 4096), fast accumulation's classes apart from promoted's
    kinds = [("dtype=bfloat16", "fast_accum=false"), ("dtype=float8_e4m3fn", "fast_accum=false"),
             ("dtype=float8_e4m3fn", "fast_accum=true")]  # fmt: skip
    assert len(probs) == 7 * len(kinds)
    for i, words in enumerate(kinds):
        group = probs[7 * i : 7 * i + 7]
        assert all(all(w in p["problem"] for w in words) for p in group), [p["problem"] for p in group]
        assert [tuple(p["sizes"].values()) for p in group] == goal
        classes = [p["table_class"] for p in group]
        assert len(set(classes)) == 7
        assert all(c.endswith("/fast") == (words[1] == "fast_accum=true") for c in classes)


def _expand(tmp_path, text):
    from quack import registry, settings
    from quack_build.manifest.read import expand

    registry.load_packages(settings.get().kernel_packages)
    m = tmp_path / "m.toml"
    m.write_text(text)
    return expand([m])


@pytest.mark.parametrize(
    "problems, says",
    [
        ("[[8192, 4096]]", "problems[0]"),
        ("[[8192, 4096, 0]]", "positive integers"),
        ("[{ m = 1, n = 2 }]", "problems[0]"),
        ("[]", "non-empty list of [m, n, k]"),
    ],
)
def test_malformed_problems_are_named(tmp_path, problems, says):
    from quack.errors import ManifestError

    text = MANIFEST.replace("[[1024, 1024, 1024], [8192, 4096, 4096], [1024, 1024, 1024]]", problems)
    with pytest.raises(ManifestError) as e:
        _expand(tmp_path, text)
    assert says in str(e.value) and "gemm" in str(e.value)


def test_problems_for_a_kernel_sized_by_its_parameters_are_refused(tmp_path):
    from quack.errors import ManifestError

    with pytest.raises(ManifestError, match="declares no problem sizes"):
        _expand(
            tmp_path,
            '[[kernel]]\nname = "softmax_fwd"\nproblems = [[4096]]\n'
            '[kernel.params]\ndtype = "bfloat16"\nn = 4096\n',
        )


def test_table_form_and_build_builds_each_sizes_configuration(tmp_path):
    """An entry listing problems and no config builds, per size, the configuration a call of
    that shape chooses (the H200 row of its class, else the heuristic); a configuration two
    sizes share, once. Before, the build ignored problems: it built the one shapeless default,
    so every tuned winner at another shape was a miss for a prebuilt server."""
    from quack_kernels.gemm import gemm_config

    from quack import settings

    text = MANIFEST.replace("[[1024, 1024, 1024], [8192", "[{ k = 64, n = 32, m = 16 }, [8192")
    sizes = [(16, 32, 64), (8192, 4096, 4096), (1024, 1024, 1024)]
    with settings.override(tune_gpu="H200"):
        exp = _expand(tmp_path, text)
        want = list(dict.fromkeys(gemm_config(m, n, k, 1, "bfloat16") for m, n, k in sizes))
    assert [c.params["config"] for c in exp.configs] == want and exp.duplicates == 0
    assert want[1].swizzle == 8  # the checked-in H200 row of m8k/n4k/k4k, not the heuristic
    # the sizes whose configuration each is (the two small ones share the heuristic's)
    assert [c.sizes for c in exp.configs] == [("16x32x64", "1024x1024x1024"), ("8192x4096x4096",)]
    m = tmp_path / "sized.toml"
    m.write_text(text)
    env = {"QUACK_CACHE_DIR": str(tmp_path / "c"), "QUACK_TUNE_GPU": "H200"}
    r = _quack("build", str(m), "--dry-run", env_extra=env)
    assert r.returncode == 0 and "  for 16x32x64, 1024x1024x1024" in r.stdout, r.stdout + r.stderr
    assert "  for 8192x4096x4096" in r.stdout
    r = _quack("build", str(m), "--dry-run", "--json", env_extra=env)
    assert sorted(k["sizes"] for k in json.loads(r.stdout)["keys"]) == [
        ["16x32x64", "1024x1024x1024"],
        ["8192x4096x4096"],
    ]
    for c in exp.configs:
        assert [dict(p) for p in c.problems] == [
            {"m": 16, "n": 32, "k": 64},
            {"m": 8192, "n": 4096, "k": 4096},
            {"m": 1024, "n": 1024, "k": 1024},
        ]
    # an explicit config is built as given, whatever the sizes
    given = text.replace(
        'dtype = "bfloat16"\n', 'dtype = "bfloat16"\nconfig = { tile_m = 128, tile_n = 128 }\n'
    )
    (c,) = _expand(tmp_path, given).configs
    assert (c.params["config"].tile_m, c.params["config"].tile_n, c.params["config"].swizzle) == (
        128,
        128,
        None,
    )


def test_each_problem_size_counts_against_max_configs(tmp_path):
    from quack.errors import ManifestError
    from quack_build.manifest.read import expand

    m = tmp_path / "m.toml"
    m.write_text(MANIFEST.replace('dtype = "bfloat16"', 'dtype = ["bfloat16", "float16"]'))
    # 2 dtypes x 2 sizes (the third listed twice): 4 counted, whatever the keys come to
    assert len(expand([m], max_configs=4).configs) >= 2
    with pytest.raises(ManifestError, match="x 2 problem sizes"):
        expand([m], max_configs=3)


def test_a_gemm_entry_without_problems_is_refused_by_tune(tmp_path):
    m = tmp_path / "m.toml"
    m.write_text(
        MANIFEST.replace("problems = [[1024, 1024, 1024], [8192, 4096, 4096], [1024, 1024, 1024]]\n", "")
    )
    r = _quack("tune", str(m), "-n")
    assert r.returncode == 1 and "problems = [[m, n, k], ...]" in r.stdout + r.stderr


def test_a_measured_winner_is_written_under_the_shape_class(tmp_path, monkeypatch):
    """The GPU side with a fake measurement: the measuring process is asked for the
    problem's m, n, k;
    the winner's row is keyed by shape_class(m, n, k), dtype and N; gemm_config reads it."""
    from quack_kernels._configs import GemmConfig
    from quack_kernels._gemm_plan import shape_class
    from quack_kernels.gemm import gemm_config
    from rich.console import Console

    from quack import registry, settings
    from quack.compile import autotune as at
    from quack.compile import pool as qpool
    from quack.tuning import Table, use_table
    from quack_build.cli.tune import _label, problems
    from quack_build.cli.tune_measure import measure_and_write

    s = dataclasses.replace(settings.get(), tune_gpu="H200")
    registry.load_packages(s.kernel_packages)
    m = tmp_path / "m.toml"
    m.write_text(MANIFEST)
    probs = problems(s, [m], None, 10_000)
    winner = GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2, schedule="coop")
    benched = []

    class FakeMeasurer:  # the measuring process's stand-in: what it would be asked to time
        broken = ""

        def time(self, prob, config):
            assert prob["bench"] == "quack_kernels._verify_gemm:bench_gemm" and config == winner
            benched.append(tuple(prob["sizes"].values()))
            return 1e-3

        def close(self):
            """The fake measurer holds no process."""

    def fake_autotune(kernel, configs, bench, **kw):
        assert {"config": winner} in configs
        bench(None, {"config": winner})
        return at.TuneResult({"config": winner}, 1e-3, [({"config": winner}, 1e-3)], [], 0, 0.0)

    monkeypatch.setattr(at, "autotune", fake_autotune)
    monkeypatch.setattr(qpool, "CompilePool", _NoPool)
    path = tmp_path / "t.toml"
    gpu, results, tables = measure_and_write(
        s, Console(file=None), probs, None, None, path, True, _label, measurer=FakeMeasurer()
    )
    assert gpu == "H200" and tables == [path] and all(r["written"] for r in results)
    assert benched == [(1024, 1024, 1024), (8192, 4096, 4096)]
    t = Table.load(path)
    rows = {(r.cls, r.n, r.shape) for r in t.rows}
    # the N range is the class's N bucket: a shape of the same class reaches the row
    assert rows == {
        (shape_class(1024, 1024, 1024), (725, 1448), "1024x1024x1024"),
        (shape_class(8192, 4096, 4096), (2897, 5792), "8192x4096x4096"),
    }
    assert all(r.kernel == "gemm" and r.dtype == ("bfloat16",) and r.config == winner.knobs() for r in t.rows)
    monkeypatch.setattr("quack_kernels._tuning.runtime_arch", lambda: "sm_90a")
    with settings.override(tune_gpu="H200"), use_table(t):  # the rows' model, whatever GPU is here
        assert gemm_config(8192, 4096, 4096, 1, "bfloat16") == winner
        assert gemm_config(8000, 4000, 4200, 1, "bfloat16") == winner  # same class, another N
    assert gemm_config(8192, 4096, 4096, 1, "bfloat16") != winner  # the checked-in table: untuned


def test_two_sizes_of_one_class_share_a_row_and_the_tuner_says_so(tmp_path, monkeypatch):
    """8192x4096x4096 and 8000x4000x4200 are one class: one row, the last winner's, and a
    note naming both sizes (before: the earlier winner was overwritten without a word)."""
    import io

    import torch
    from quack_kernels._configs import GemmConfig
    from rich.console import Console

    from quack import registry, settings
    from quack.compile import autotune as at
    from quack.compile import pool as qpool
    from quack.tuning import Table
    from quack_build.cli.tune import _label, problems
    from quack_build.cli.tune_measure import measure_and_write

    s = dataclasses.replace(settings.get(), tune_gpu="H200")
    registry.load_packages(s.kernel_packages)
    m = tmp_path / "m.toml"
    m.write_text(MANIFEST.replace("[[1024, 1024, 1024], [8192", "[[8000, 4000, 4200], [8192"))
    probs = problems(s, [m], None, 10_000)
    wins = iter(
        [
            GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2, schedule="coop"),
            GemmConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=1, schedule="ping"),
            GemmConfig(tile_m=128, tile_n=192, cluster_m=2, cluster_n=1, schedule="coop"),
        ]
    )

    def fake_autotune(kernel, configs, bench, **kw):
        w = next(wins)
        return at.TuneResult({"config": w}, 1e-3, [({"config": w}, 1e-3)], [], 0, 0.0)

    monkeypatch.setattr(at, "autotune", fake_autotune)
    monkeypatch.setattr(qpool, "CompilePool", _NoPool)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    out = io.StringIO()
    path = tmp_path / "t.toml"
    _gpu, results, _ = measure_and_write(
        s, Console(file=out, width=300), probs, None, None, path, True, _label
    )
    assert [r.get("replaced") for r in results] == [None, "8000x4000x4200", None]
    assert "8192x4096x4096 shares the table row (class m8k/n4k/k4k" in out.getvalue()
    rows = Table.load(path).rows
    assert len(rows) == 2 and {r.shape for r in rows} == {"8192x4096x4096", "1024x1024x1024"}
