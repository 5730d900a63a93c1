"""``quack prewarm`` for a kernel whose tuned configuration depends on problem sizes its
parameters do not carry (the GEMM's m, n, k) and for the configurations the tuning table
chooses. The journal keeps, per key, whether the calls asked for the table's choice
(``derived``) and a sized kernel's call sizes (``problems``); prewarm then builds the
table's choice of its own day at each size, and ``--emit-manifest`` writes the sizes with
the configuration left to the table. Before: the journal had no sizes, so prewarm rebuilt
the configuration as used (a re-tune since then left the next run's calls cold) and the
emitted manifest pinned it.

Unit tests with the fake sized kernel (tests/tunefakes.py) for the runtime's notes, and
the CLI's dry runs over the real GEMM's registration (nothing compiles)."""

import json
import time

import pytest
import tomllib
import tunefakes
from typer.testing import CliRunner

from quack import settings
from quack.cache import journal
from quack.runtime import generation
from quack.runtime.jit import SizedJitKernel, kernel
from quack.runtime.loaded import MAX_SIZES, Loaded
from quack.tuning import at_problem
from quack_build.build.prewarm import usage
from quack_build.cli.app import app
from quack_build.manifest.read import expand

runner = CliRunner()


@pytest.fixture
def fake():
    """The fake sized kernel with one loaded key planted in its memory (no compile), cleared
    after: other tests use the same registration."""
    k = kernel("tune_fake")
    assert isinstance(k, SizedJitKernel)
    planted = []

    def plant(config):
        params = k.spec.bind((), {"dtype": "bfloat16", "config": config})
        ld = Loaded(lambda *a: None, None, f"key-{len(planted)}", params, "sm_90a", "planted")
        with k._lock:
            # settings installed anew by an earlier test on this worker bumped the generation:
            # the first call would clear what is planted here (CI: a KernelNotPrebuilt)
            k._gen = generation.value
            k._by_key[ld.key] = ld
        planted.append(ld)
        return ld

    yield k, plant
    with k._lock:
        k._memo.clear()
        k._by_key.clear()


def test_calls_note_their_sizes_and_whether_the_table_chose_the_configuration(fake):
    k, plant = fake
    chosen = plant(tunefakes.OLD)  # what the fake's table derives: the calls' choice
    with at_problem(m=8192, n=4096, k=4096):
        with k._lock:
            fn = k._memoize(("bfloat16",), {"config": tunefakes.OLD}, chosen)  # the slow path's end
        assert fn is chosen.fn
    for m in (8192, 8192, 1024):
        with at_problem(m=m, n=4096, k=4096):
            assert k("bfloat16", config=tunefakes.OLD) is chosen.fn  # the hot path
    k("bfloat16", config=tunefakes.OLD)  # no sizes in force: nothing noted
    assert chosen.hits == 4
    assert chosen.sizes == {(8192, 4096, 4096): 3, (1024, 4096, 4096): 1}
    # a configuration the caller spelled out (quack tune's candidate): not the table's
    pinned = plant(tunefakes.CANDIDATES[1])
    with at_problem(m=64, n=64, k=64), k._lock:
        k._memoize(("bfloat16",), {"config": tunefakes.CANDIDATES[1]}, pinned)
    assert pinned.sizes == {(64, 64, 64): 1}
    # whether each was the table's choice: asked when the journal is written
    recs = {u["key"]: u for u in k.usage()}
    assert recs[chosen.key]["derived"] is True
    assert recs[chosen.key]["problems"] == [[8192, 4096, 4096], [1024, 4096, 4096]]  # most used first
    assert recs[pinned.key]["derived"] is False


def test_a_server_at_every_length_keeps_the_first_sizes_only(fake):
    k, plant = fake
    ld = plant(tunefakes.OLD)
    with k._lock:
        k._memoize(("bfloat16",), {"config": tunefakes.OLD}, ld)
    for m in range(1, MAX_SIZES + 40):
        with at_problem(m=m, n=8, k=8):
            k("bfloat16", config=tunefakes.OLD)
    assert len(ld.sizes) == MAX_SIZES and (1, 8, 8) in ld.sizes and (MAX_SIZES + 1, 8, 8) not in ld.sizes
    with at_problem(m="x", n=8, k=8):  # not sizes: ignored, the call goes on
        k("bfloat16", config=tunefakes.OLD)
    with at_problem(m=1, n=8):  # one missing
        k("bfloat16", config=tunefakes.OLD)
    assert ld.hits == MAX_SIZES + 39 + 2


def test_the_journal_keeps_the_new_fields_and_refuses_them_mistyped(tmp_path):
    base = {"kernel": "gemm", "key": "k", "arch": "sm_90a", "params": {}, "hits": 1, "t": 1.0}
    journal.append(
        tmp_path,
        [
            dict(base, derived=True, problems=[[1, 2, 3]]),
            dict(base, derived=1),  # an int is not a bool here
            dict(base, problems="8192x4096x4096"),
            dict(base, hits=True),  # nor a bool an int (as before)
        ],
    )
    recs = journal.read(tmp_path)
    assert len(recs) == 1 and recs[0]["derived"] is True and recs[0]["problems"] == [[1, 2, 3]]
    # the aggregate: any call derived; sizes merged, malformed ones dropped
    agg = usage(
        [
            dict(base, derived=False, problems=[[1, 2, 3], [4, 5, 6]]),
            dict(base, derived=True, problems=[[4, 5, 6], [7, 8, 9], ["x"], [True, 1, 1], [], "no"]),
        ]
    )
    assert len(agg) == 1 and agg[0]["derived"] is True
    assert agg[0]["problems"] == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]


# --- the CLI over the real GEMM registration: dry runs, nothing compiles -------------------


@pytest.fixture
def gemm_proj(tmp_path, monkeypatch):
    import quack_kernels.gemm  # noqa: F401  (registers the kernels these tests name)
    import quack_kernels.softmax  # noqa: F401

    d = tmp_path / "proj"
    d.mkdir()
    (d / "quack.toml").write_text(
        '[build]\nkernel_packages = ["quack_kernels"]\n[runtime]\narch = "sm_90a"\n'
    )
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.chdir(d)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(cache))
    monkeypatch.setenv("QUACK_TUNE_GPU", "H200")  # the table's rows for one model, whatever runs this
    saved = settings.installed()
    # Resolved again from this environment at the next get(): settings an earlier test left
    # installed would give _table_choice the rows of the GPU NVML names (an H100's, session
    # 24 on the H100) while the CLI under test reads QUACK_TUNE_GPU (the H200's).
    settings.set_current(None)
    yield d, cache
    settings.set_current(saved)


def _gemm_record(config: dict, derived: bool | None, problems, hits=10) -> dict:
    params = {
        "dtype": "bfloat16",
        "d_dtype": "bfloat16",
        "a_major": "k",
        "b_major": "k",
        "has_c": False,
        "has_bias": False,
        "activation": "none",
        "fast_accum": False,
        "config": config,
    }
    r = {"kernel": "gemm", "key": "x", "arch": "sm_90a", "params": params, "hits": hits, "t": time.time()}
    if derived is not None:
        r["derived"] = derived
    if problems is not None:
        r["problems"] = problems
    return r


def _table_choice(m, n, k):
    """The configuration a call of this size asks for (the H200 rows: QUACK_TUNE_GPU)."""
    from quack import registry

    spec = registry.get("gemm")
    bound = spec.bind((), _gemm_record({}, None, None)["params"] | {"config": None}, arch="sm_90a")
    cfg = spec.plain(spec.derive_at(bound, {"m": m, "n": n, "k": k}, "sm_90a"))["config"]
    return {f: v for f, v in cfg.items() if v is not None}


def test_prewarm_builds_the_tables_choice_at_each_size_and_emits_the_sizes(gemm_proj):
    d, cache = gemm_proj
    big, small = (8192, 4096, 4096), (1000, 1048, 776)
    want_big, want_small = _table_choice(*big), _table_choice(*small)
    assert want_big != want_small  # a tuned row and the heuristic: two keys
    stale = {"tile_m": 128, "tile_n": 192, "cluster_m": 1, "cluster_n": 1, "schedule": "coop"}
    assert stale not in (want_big, want_small)
    journal.append(
        cache,
        [
            # the calls asked for the table's choice; it has been re-tuned since ("stale")
            _gemm_record(stale, True, [list(big), list(small)], hits=50),
            # a configuration spelled out (a tune candidate): built as used
            _gemm_record({**stale, "cluster_m": 2}, False, [[64, 64, 64]], hits=5),
            # a record from before sizes were kept: as used too
            _gemm_record({**stale, "cluster_n": 2}, None, None, hits=1),
        ],
    )
    out = d / "used.toml"
    r = runner.invoke(app, ["prewarm", "--since", "30d", "--dry-run", "--json", "--emit-manifest", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    got = [{f: v for f, v in k["params"]["config"].items() if v is not None} for k in res["keys"]]
    assert got[:2] == [want_big, want_small], got  # today's choices, most used first
    assert {**stale, "cluster_m": 2} in got and {**stale, "cluster_n": 2} in got
    assert not res["skipped"]
    assert stale not in got and res["configurations"] == 4
    # the manifest: the sizes with the configuration left to the table, one entry for both
    doc = out.read_text()
    entries = list(expand([out]).configs)
    kernels = tomllib.loads(doc)["kernel"]
    sized = [e for e in kernels if "problems" in e]
    assert len(sized) == 1 and "config" not in sized[0]["params"]  # the table's, per size
    assert sized[0]["problems"] == [list(big), list(small)]  # two keys, one entry
    pinned = [e["params"]["config"] for e in kernels if "problems" not in e]
    assert sorted(c.get("cluster_m", 1) + 2 * c.get("cluster_n", 1) for c in pinned) == [4, 5]  # as used
    # the dry run's lines say which sizes chose each configuration
    r = runner.invoke(app, ["prewarm", "--since", "30d", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "  for 8192x4096x4096\n" in r.output and "  for 1000x1048x776\n" in r.output, r.output
    # building it builds exactly the keys prewarm would
    assert {c.key for c in entries} == {k["key"] for k in res["keys"]}


def test_prewarm_of_a_norm_kernel_builds_the_rows_choice_of_today(gemm_proj):
    """Not only the GEMM: a norm's configuration is the table's for its parameters, and a
    re-tune since the journal was written changes which key the next run asks for."""
    d, cache = gemm_proj
    from quack import registry

    spec = registry.get("softmax_fwd")
    today = spec.plain(spec.bind((), {"dtype": "bfloat16", "n": 16384}, arch="sm_90a"))["config"]
    other = {**today, "fwd_smem": not today.get("fwd_smem")}  # a row of another day
    spec.bind((), {"dtype": "bfloat16", "n": 16384, "config": other}, arch="sm_90a")  # valid
    rec = {"kernel": "softmax_fwd", "key": "x", "arch": "sm_90a", "hits": 3, "t": time.time()}
    journal.append(
        cache,
        [
            dict(rec, params={"dtype": "bfloat16", "n": 16384, "config": other}, derived=True),
            dict(rec, params={"dtype": "bfloat16", "n": 4096, "config": other}, derived=False),
        ],
    )
    r = runner.invoke(app, ["prewarm", "--since", "30d", "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    got = {
        (k["params"]["n"], json.dumps(k["params"]["config"], sort_keys=True))
        for k in json.loads(r.stdout)["keys"]
    }
    assert got == {(16384, json.dumps(today, sort_keys=True)), (4096, json.dumps(other, sort_keys=True))}


def test_sizes_without_a_kernel_that_declares_them_are_not_written(tmp_path):
    from quack.manifest_line import manifest_entries

    doc = manifest_entries(
        [("toy_scale", {"dtype": "float16", "block": 64, "bias": False}, "sm_90a", [{"m": 1}])]
    )
    assert "problems" not in doc["kernel"][0]
