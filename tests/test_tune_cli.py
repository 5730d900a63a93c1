"""``quack tune`` on the CPU: --dry-run lists each problem's candidates (compiling nothing),
--compile-only builds a small search's candidates through the real pool into the cache, each
under its own key (what a CPU build farm does before the GPU machine measures), --budget parses, a candidate forced with ``use_config`` is in the key, and without a GPU the
measuring run refuses with a clear error."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]


def _quack(*args, env_extra=None, unset=(), timeout=300):
    """``quack ARGS`` in a subprocess at the project root: this environment plus
    ``env_extra``, less the variables named in ``unset``."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in unset}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "quack_build", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def test_dry_run_lists_candidates_and_compiles_nothing(tmp_path):
    r = _quack(
        "tune",
        "manifests/tuning.toml",
        "--kernel",
        "rmsnorm_fwd",
        "--dry-run",
        "--json",
        env_extra={"QUACK_CACHE_DIR": str(tmp_path / "c")},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["dry_run"] and len(out["problems"]) == 8  # 4 N x 2 weight dtypes
    (p,) = [
        p for p in out["problems"] if "n=262144" in p["problem"] and "weight_dtype=float32" in p["problem"]
    ]
    assert {"ring_pipe": True, "ring_threads": 512, "ring_wregs": "wb", "stages": 3} in p["candidates"]
    assert not list((tmp_path / "c").rglob("*.o")), "a dry run compiles nothing"
    r = _quack("tune", "manifests/tuning.toml", "--kernel", "rmsnorm_fwd", "--dry-run", "--budget", "2c")
    assert r.returncode == 0 and r.stdout.count("2 candidates") == 8


def test_compile_only_builds_each_candidate_under_its_own_key(tmp_path):
    """The whole path but the GPU: manifest -> search space -> the build scheduler and its
    compile workers -> the cache. Three candidates of one small RMSNorm problem; each one's
    object is in the cache under the key the measuring run asks for, with its config."""
    from quack_kernels import rmsnorm

    from quack.cache.store import DiskStore
    from quack.compile import builder

    m = tmp_path / "m.toml"
    m.write_text(
        '[defaults]\narchs = ["sm_90a"]\n[[kernel]]\nname = "rmsnorm_fwd"\n[kernel.params]\n'
        'dtype = "bfloat16"\nn = 4096\n'
    )
    cache = tmp_path / "c"
    r = _quack(
        "tune", str(m), "--compile-only", "--budget", "3c", "-j", "2", "--json",
        env_extra={"QUACK_CACHE_DIR": str(cache)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["ok"] and out["total"] == out["compiled"] == 3
    spec = rmsnorm.compile_rmsnorm_fwd.spec
    base = spec.bind((), dict(dtype="bfloat16", n=4096), arch="sm_90a")
    cands = list(dict.fromkeys([base["config"], *rmsnorm.search_space(base)]))[:3]
    assert len(cands) == 3
    store = DiskStore(cache)
    keys = set()
    for cand in cands:
        params = spec.bind((), dict(dtype="bfloat16", n=4096, config=cand), arch="sm_90a")
        entry = store.lookup(builder.entry_ref(spec, params, "sm_90a"))
        assert entry is not None, f"candidate {cand.label()} not in the cache"
        assert entry.meta["params"]["config"] == spec.plain(params)["config"]
        keys.add(entry.ref.key)
    assert len(keys) == 3, "every candidate is its own kernel under its own key"
    assert len(list(cache.rglob("*.o"))) == 3  # nothing else was built


def test_dry_run_and_compile_only_together_are_refused():
    r = _quack("tune", "manifests/tuning.toml", "--dry-run", "--compile-only")
    assert r.returncode == 2 and "--compile-only" in r.stdout + r.stderr


def test_unknown_kernel_and_bad_budget_are_named():
    r = _quack("tune", "manifests/tuning.toml", "--kernel", "nosuch", "--dry-run")
    assert r.returncode == 1 and "--kernel nosuch" in r.stdout + r.stderr
    r = _quack("tune", "manifests/tuning.toml", "--budget", "soon", "--dry-run")
    assert r.returncode == 2 and "--budget" in r.stdout + r.stderr


def test_parse_budget():
    from quack_build.cli.tune import parse_budget

    assert parse_budget("90s") == (90.0, None) and parse_budget("3") == (3.0, None)
    assert parse_budget("12c") == (None, 12) and parse_budget(None) == (None, None)
    for bad in ("0", "-1s", "0c", "x"):
        with pytest.raises(typer.BadParameter):
            parse_budget(bad)


def test_use_config_is_in_the_key():
    from quack_kernels import rmsnorm
    from quack_kernels._configs import RmsNormFwdConfig

    from quack.tuning import use_config

    spec = rmsnorm.compile_rmsnorm_fwd.spec
    plain = spec.bind(("bfloat16", 4096), {}, arch="sm_90a")
    cand = RmsNormFwdConfig(x_smem=True, x_min_blocks=3)
    with use_config("rmsnorm_fwd", cand):
        forced = spec.bind(("bfloat16", 4096), {}, arch="sm_90a")
        assert rmsnorm.fwd_config("bfloat16", 4096, True, False, False, "same") == cand  # the grid follows
    assert forced["config"] == cand and spec.key(forced, "sm_90a") != spec.key(plain, "sm_90a")
    assert spec.bind(("bfloat16", 4096), {}, arch="sm_90a") == plain  # the block's end restores


@pytest.mark.skipif(__import__("conftest").has_gpu(), reason="checks the no-GPU refusal")
def test_measuring_without_a_gpu_is_refused_clearly(tmp_path):
    r = _quack(
        "tune", "manifests/tuning.toml", "--kernel", "softmax_fwd", "--table", str(tmp_path / "t.toml")
    )
    assert r.returncode == 1 and "CUDA GPU" in r.stdout + r.stderr
    assert not (tmp_path / "t.toml").exists()


def test_verify_run_checks_the_entrys_own_configuration(monkeypatch):
    """``quack verify --run`` calls the reference hook, which runs the kernel's own op, which
    derives its configuration: the op must run the ENTRY's (an explicit candidate of a
    manifest), not today's table default. Before: the hook ran the table's kernel and an
    explicit candidate was reported ok unchecked."""
    from quack_kernels import _verify, softmax
    from quack_kernels._configs import SoftmaxFwdConfig

    from quack.runtime import loader
    from quack_build.verify import child as _verify_child

    spec = softmax.compile_softmax_fwd.spec
    seen = []

    def hook(params, device):  # what the op binds inside the hook, beside the entry's
        op = spec.bind((), dict(dtype=params["dtype"], n=params["n"]))["config"]
        seen.append((params["config"], op))

    monkeypatch.setattr(loader, "load_object", lambda path: (lambda *a: None, object()))
    monkeypatch.setattr(_verify, "verify_softmax_fwd", hook)
    cand = SoftmaxFwdConfig(online=True, fwd_min_blocks=3)
    assert spec.bind((), dict(dtype="bfloat16", n=4096))["config"] != cand
    plain = spec.plain(spec.bind((), dict(dtype="bfloat16", n=4096, config=cand)))
    req = dict(key="k", obj="unused.o", kernel="softmax_fwd", module=spec.module, params=plain, run=True)
    out = _verify_child._one(req, [])
    assert out["ok"] and out["run"] == "ok", out
    assert seen == [(cand, cand)]
    assert spec.bind((), dict(dtype="bfloat16", n=4096))["config"] != cand  # only inside the run


def test_every_tuning_problem_has_a_table_class():
    """A winner is written under its problem's class (the key the kernel's derive looks up):
    a problem whose class is None was measured and then could not be written. Before: 10 of
    manifests/tuning.toml's 40 problems (N = 65536 of softmax / cross-entropy / the norm
    backwards, RMSNorm forwards with a same-width weight)."""
    from quack import registry, settings
    from quack_build.cli.tune import problems

    s = settings.get()
    registry.load_packages(s.kernel_packages)
    probs = problems(s, [ROOT / "manifests" / "tuning.toml"], None, 10_000)
    assert len(probs) == 40
    unclassed = [
        (c.kernel, base["n"], base.get("weight_dtype"))
        for c, spec, base, _cands, _cur, _sizes in probs
        if spec.params["config"].derive.classify(base) is None
    ]
    assert not unclassed


def test_tune_table_shows_labels_as_text_not_markup():
    """Labels come from the manifest and the tuning table: a "[/]" in one raised rich's
    MarkupError from the results table, after the whole GPU run."""
    from rich.console import Console

    from quack_build.cli.tune import _print_table

    con = Console(record=True, width=200)
    row = {"problem": "p[/]", "old": "[bold]old[/bold]", "new": "new[/]", "failed": []}
    _print_table(con, [dict(row, old_us=2.0, new_us=1.0, speedup=2.0)])
    text = con.export_text()
    assert "p[/]" in text and "[bold]old[/bold]" in text and "new[/]" in text, text
