"""CPU tier: properties of the generated code (sm_90a PTX) of the default configurations the
tuning table selects: the LayerNorm forward's w / b loads issued ahead of the reductions,
the pipelined ring's cluster pushes, the softmax backward's cache-hinted two-pass kernel.

Every PTX text comes from ONE compile a session, through the session's cache directory
(``_fixtures.session_ptx``, with the other modules' cases): a later session with the same
kernel sources compiles nothing."""

import re

import pytest
from _fixtures import module_ptx, session_ptx  # noqa: F401  (fixtures, used by name)
from quack_kernels import layernorm, softmax

F32 = "float32"


def _ln(n, w=True, b=True, wdt=F32, dt="bfloat16"):
    p = dict(dtype=dt, n=n, has_weight=w, has_bias=b, weight_dtype=wdt)
    return (layernorm.compile_layernorm_fwd, p)


def _sm_bwd(dt, n):
    return (softmax.compile_softmax_bwd, dict(dtype=dt, n=n))


PTX_CASES = {
    # 16-bit rows of 4096 with an fp32 weight: the table's "wide/rows" row, 4 rows a CTA
    "ln-4096-wb": _ln(4096),
    "ln-4096-w": _ln(4096, b=False),
    "ln-4096-b": _ln(4096, w=False),
    # one-CTA rows with an fp32 weight ("wide/cta256"): 2 rows a CTA, 2 vectors ahead
    "ln-14336": _ln(14336),
    "ln-10240": _ln(10240),
    # N = 16384: its own row, 4 rows a 512-thread CTA, every w / b vector ahead
    "ln-16384": _ln(16384),
    # rows over 16-CTA clusters ("wide/cluster16"): the pipelined ring
    "ln-262144": _ln(262144),
    # the softmax backward's small class: torch.compile's kernel; mid class: the plain one
    "sm-bf16-4096": _sm_bwd("bfloat16", 4096),
    "sm-f16-8192": _sm_bwd("float16", 8192),
    "sm-bf16-16384": _sm_bwd("bfloat16", 16384),
}


@pytest.fixture
def ptx(module_ptx):  # noqa: F811
    return {cid: t[t.index(".entry") :] for cid, t in module_ptx.items()}


@pytest.mark.parametrize("case, w, b", [("ln-4096-wb", 1, 1), ("ln-4096-w", 1, 0), ("ln-4096-b", 0, 1)])
def test_layernorm_rows_kernel_loads_wb_before_the_reductions(ptx, case, w, b):
    body = ptx[case]
    # 4 rows' cp.async, then every w / b vector of the thread (4 a tensor: 2 16-byte loads
    # each), then the first reduction's wait; y's 16-byte stores after it
    first_wait = body.index("cp.async.wait_group")
    assert len(re.findall(r"ld\.global\.v4", body[:first_wait])) == 8 * (w + b)
    assert "ld.global" not in body[first_wait:]
    assert len(re.findall(r"st\.global\.v4", body)) == 4 * 4  # 4 rows x 4 vectors


@pytest.mark.parametrize(("case", "nvec"), [("ln-14336", 7), ("ln-10240", 5)])
def test_layernorm_one_cta_rows_load_two_wb_vectors_ahead(ptx, case, nvec):
    body = ptx[case]
    first_wait = body.index("cp.async.wait_group")
    # 2 vectors of fp32 w and of b (8 fp32 a vector: 2 16-byte loads each) ahead of the first
    # row's wait; the rest of them (nvec - 2 vectors) in the y loop
    assert len(re.findall(r"ld\.global\.v4", body[:first_wait])) == 2 * 2 * 2
    assert len(re.findall(r"ld\.global\.v4", body[first_wait:])) == 2 * 2 * (nvec - 2)
    assert len(re.findall(r"st\.global\.v4", body)) == 2 * nvec  # 2 rows x nvec vectors of y


def test_layernorm_16384_reads_each_wb_vector_once_for_four_rows(ptx):
    """4 vectors a thread (512 threads x 8 x 4 = 16384), all of a thread's w / b loaded
    before the first row's wait, none in the y loop; y of four rows stored."""
    body = ptx["ln-16384"]
    first_wait = body.index("cp.async.wait_group")
    assert len(re.findall(r"ld\.global\.v4", body[:first_wait])) == 4 * 2 * 2
    assert len(re.findall(r"ld\.global\.v4", body[first_wait:])) == 0
    assert len(re.findall(r"st\.global\.v4", body)) == 4 * 4


def test_pipelined_ring_pushes_partials_and_keeps_the_bias_in_registers(ptx):
    """The fp32-w + b kernel at 262144: st.async of each warp's (mean, M2) to the cluster's
    16 CTAs (2 values a lane, in two places: the first row before the loop and row it+1
    inside it); the fp32 bias read once, before the loop (16 loads: 64 fp32 a thread); the
    weight staged into shared memory and read back there; 3 x stages of 16-byte cp.async."""
    body = ptx["ln-262144"]
    assert len(re.findall(r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.f32", body)) == 2 * 2
    assert len(re.findall(r"ld\.global\.v4", body)) == 2 * 16  # w staged + b into registers
    assert len(re.findall(r"cp\.async\.cg\.shared\.global", body)) == 8 * 3
    assert len(re.findall(r"ld\.shared\.v4\.b32", body)) >= 16  # the fp32 weight, 2 a vector


@pytest.mark.parametrize("case, threads, loads", [("sm-bf16-4096", 512, 4), ("sm-f16-8192", 512, 8)])
def test_softmax_bwd_small_rows_compile_to_the_hinted_two_pass_kernel(ptx, case, threads, loads):
    text = ptx[case]
    assert f".reqntid {threads}, 1, 1" in text
    first = re.findall(r"ld\.global\.L1::evict_last\.L2::cache_hint\.v4\.b32", text)
    second = re.findall(r"ld\.global\.L1::evict_first\.L2::cache_hint\.v4\.b32", text)
    assert len(first) == len(second) == loads // 2
    assert len(re.findall(r"ld\.global", text)) == loads
    assert re.findall(r"st\.global[.\w:]*", text) == ["st.global.v4.b32"] * (loads // 4)


def test_softmax_bwd_other_rows_keep_the_plain_kernel(ptx):
    text = ptx["sm-bf16-16384"]  # the mid class (a cluster of 4)
    assert "cache_hint" not in text and "evict" not in text
    assert len(re.findall(r"ld\.global\.v4\.b32", text)) == 4


def test_ptx_children_a_failure_is_reported_and_ends_every_child(tmp_path, monkeypatch):
    """``ptx_of``'s children: one failing ends the others at once (no compile left running
    for nothing, none outliving the fixture), and its own output is in the message."""
    import os

    from _fixtures import _compile_ptx

    mods = tmp_path / "mods"
    mods.mkdir()
    pidfile = tmp_path / "sleeper.pid"
    (mods / "ptx_sleeper.py").write_text(
        f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    (mods / "ptx_failer.py").write_text(
        "import os, time\n"
        f"for _ in range(1200):  # the sleeper is running first (bounded: 60 s)\n"
        f"    if os.path.exists({str(pidfile)!r}): break\n"
        "    time.sleep(0.05)\n"
        "raise SystemExit('ptx-test: this case fails')\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(mods), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    todo = [
        ("ptx_sleeper", "x", {}, str(tmp_path / "a.ptx")),
        ("ptx_failer", "y", {}, str(tmp_path / "b.ptx")),
    ]
    with pytest.raises(AssertionError, match="ptx-test: this case fails"):
        _compile_ptx(todo, tmp_path / "dump")
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(pid, 0)


def test_ptx_of_a_case_that_does_not_compile_is_its_own_failure(tmp_path, monkeypatch, quack_settings):
    """A kernel whose compile raises fails its own case, with its own text; the batch's
    other cases still come back (``errors``: what ``session_ptx`` passes, so one family's
    broken kernel does not fail another module's PTX tests). Without ``errors``: raised,
    naming the case. A failure is not kept: the next call compiles it again.

    One real child (the first call: a failing case must not end it). The second call's
    child is a stand-in that replays the first's error file: it checks what the second
    call asks to compile and how it reports, without a second cutlass start (2.5 s of the
    GPU tier's every session)."""
    import os
    import shutil

    import _fixtures
    import toykernels
    from _fixtures import ptx_of

    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # one child: a failing case must not end it
    cases = {
        "bad": (toykernels.toy_fail, {"boom": True}),
        "ok": (toykernels.toy_scale, {"dtype": "float32", "block": 128, "bias": False}),
    }
    errors: dict = {}
    texts = ptx_of(cases, tmp_path / "one", errors)
    assert set(texts) == {"ok"} and ".entry" in texts["ok"]
    assert set(errors) == {"bad"} and "ValueError: toy_fail: boom requested" in errors["bad"]
    asked = []

    def replay(todo, tmp_dir):
        asked.extend(todo)
        (err,) = (tmp_path / "one").glob("child-*/*.err")
        os.makedirs(tmp_dir / "child-0")
        shutil.copy(err, tmp_dir / "child-0" / err.name)

    monkeypatch.setattr(_fixtures, "_compile_ptx", replay)
    with pytest.raises(AssertionError, match=r"(?s)case 'bad' failed:.*toy_fail: boom requested"):
        ptx_of(cases, tmp_path / "two")
    # "ok" read back from the cache, "bad" (not kept) asked for again
    assert [(module, name) for module, name, _params, _dest in asked] == [("toykernels", "toy_fail")]
