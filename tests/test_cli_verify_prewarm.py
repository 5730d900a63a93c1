"""`quack verify`, `quack prewarm` and a dry run's plan, on entries really compiled for
sm_90a / sm_80 on CPU."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import toykernels  # noqa: F401
from interrupt_support import scaled
from typer.testing import CliRunner

from quack import registry, settings
from quack.cache import journal
from quack_build.cli.app import app
from quack_build.manifest.read import expand

runner = CliRunner()

MANIFEST = """
[[kernel]]
name = "toy_scale"
archs = ["sm_90a"]
params = { dtype = "float16", block = [64, 128] }
[[kernel]]
name = "toy_scale"
archs = ["sm_80"]
params = { dtype = "float16", block = 64 }
"""


def _project(d: Path, cache: Path, monkeypatch) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "quack.toml").write_text(
        '[build]\nkernel_packages = ["toykernels"]\nmanifests = ["m.toml"]\n[runtime]\narch = "sm_90a"\n'
    )
    (d / "m.toml").write_text(MANIFEST)
    monkeypatch.chdir(d)
    monkeypatch.setenv("QUACK_CACHE_DIR", str(cache))
    return d


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    base = tmp_path_factory.mktemp("verify")
    saved = settings.installed()
    try:
        _project(base / "proj", base / "cache", mp)
        r = runner.invoke(app, ["build", "-j", "2", "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["compiled"] == 3
    finally:
        mp.undo()
        settings.set_current(saved)
    return base / "cache"


@pytest.fixture
def proj(built, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    shutil.copytree(built, cache)
    d = _project(tmp_path / "proj", cache, monkeypatch)
    saved = settings.installed()
    yield {"dir": d, "cache": cache}
    settings.set_current(saved)


def _entry(cache: Path, arch: str, block: int) -> dict:
    spec = registry.get("toy_scale")
    key = spec.key(spec.bind((), {"dtype": "float16", "block": block}), arch)
    (o,) = cache.glob(f"v1/*-{arch}/toy_scale/*/{key}.o")
    return {
        "o": o,
        "meta": o.with_suffix(".json"),
        "so": o.with_suffix(".so"),
        "so_meta": o.with_name(o.name[:-2] + ".so.json"),
        "key": key,
    }


def _rewrite(e: dict, data: bytes) -> None:
    e["o"].write_bytes(data)
    meta = json.loads(e["meta"].read_text())
    meta.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    e["meta"].write_text(json.dumps(meta))


def test_verify_all_good(proj):
    r = runner.invoke(app, ["verify", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["ok"] and res["total"] == 3 and res["problems"] == 0 and res["loaded"]
    assert sorted(tuple(e["gpu_code"]) for e in res["entries"]) == [("sm_80",), ("sm_90a",), ("sm_90a",)]
    assert all(e.get("loaded") in ("so", "o") for e in res["entries"])
    r = runner.invoke(app, ["verify"])
    assert r.exit_code == 0 and "all good" in r.output


def test_verify_reports_problems_without_touching_the_cache(proj):
    cache = proj["cache"]
    a = _entry(cache, "sm_90a", 64)
    b = _entry(cache, "sm_90a", 128)
    c80 = _entry(cache, "sm_80", 64)
    a["o"].write_bytes(a["o"].read_bytes()[:-10])  # truncated
    _rewrite(b, c80["o"].read_bytes())  # an sm_80 object under an sm_90a key
    extra = proj["dir"] / "extra.toml"
    extra.write_text('[[kernel]]\nname = "toy_scale"\narchs = ["sm_90a"]\nparams = { dtype = "float32" }\n')
    r = runner.invoke(app, ["verify", "--json", "m.toml", str(extra)])
    assert r.exit_code == 1
    res = json.loads(r.stdout)
    probs = {e["key"]: " ".join(e["problems"]) for e in res["entries"] if e["problems"]}
    assert len(probs) == 3
    assert "truncated" in probs[a["key"]]
    assert "built for sm_80, expected sm_90a" in probs[b["key"]]
    assert any("missing: not built" in p for p in probs.values())
    assert a["o"].exists() and not (cache / "quarantine").exists()  # verify is read-only
    r = runner.invoke(app, ["verify", "m.toml", str(extra)])
    assert r.exit_code == 1 and "quack verify: problems" in r.output and "3 with problems" in r.output


def test_verify_load_in_fresh_process_fails_on_broken_object(proj):
    e = _entry(proj["cache"], "sm_90a", 64)
    for k in ("so", "so_meta"):
        e[k].unlink(missing_ok=True)
    data = bytearray(e["o"].read_bytes())
    data[0:4] = b"JUNK"  # host ELF header broken; the embedded cubin is intact
    _rewrite(e, bytes(data))
    r = runner.invoke(app, ["verify", "--json"])
    assert r.exit_code == 1
    res = json.loads(r.stdout)
    (bad,) = [x for x in res["entries"] if x["problems"]]
    assert bad["key"] == e["key"] and bad["gpu_code"] == ["sm_90a"]
    assert "load" in bad["problems"][0] or "died" in bad["problems"][0]
    r = runner.invoke(app, ["verify", "--json", "--no-load"])
    assert r.exit_code == 0


def _tree(root: Path) -> dict:
    """Every path under ``root`` with its bytes (a directory: None): what a read-only
    command must leave exactly as it found it."""
    return {
        str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))
    }


def test_verify_problems_name_the_file_and_the_fix(proj, monkeypatch):
    """A corrupt entry's problem names its file (the .o, or the .json for a metadata
    problem) and what fixes it, in the table and in --json (which also gives each entry's
    "obj"); and that fix is the real one: `quack build` quarantines and rebuilds them.
    Before: kernel, params, a 12-character key and "object file checksum mismatch"."""
    cache = proj["cache"]
    flipped, empty, badjson = (
        _entry(cache, "sm_90a", 64),
        _entry(cache, "sm_90a", 128),
        _entry(cache, "sm_80", 64),
    )
    data = bytearray(flipped["o"].read_bytes())
    data[100] ^= 0xFF
    flipped["o"].write_bytes(bytes(data))
    empty["o"].write_bytes(b"")
    badjson["meta"].write_text("{bad")
    r = runner.invoke(app, ["verify", "--json"])
    assert r.exit_code == 1, r.output
    res = json.loads(r.stdout)
    rows = {e["key"]: e for e in res["entries"]}
    fix = "quack build moves the entry to quarantine/ and rebuilds it"
    for e, file, why in (
        (flipped, flipped["o"], "checksum mismatch"),
        (empty, empty["o"], "is 0 bytes"),
        (badjson, badjson["meta"], "metadata is not valid JSON"),
    ):
        row = rows[e["key"]]
        assert row["obj"] == str(e["o"]), row
        (problem,) = row["problems"]
        assert why in problem and f": {file}; {fix}" in problem, problem
    monkeypatch.setenv("COLUMNS", "1000")  # one table row a line: each path whole
    r = runner.invoke(app, ["verify"])
    assert r.exit_code == 1 and "3 with problems" in r.output, r.output
    for file in (flipped["o"], empty["o"], badjson["meta"]):
        assert f"{file}; {fix}" in r.output, r.output
    r = runner.invoke(app, ["build", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["compiled"] == 3, r.output
    assert len(list((cache / "quarantine").glob("*.reason"))) == 3
    r = runner.invoke(app, ["verify"])
    assert r.exit_code == 0 and "all good" in r.output, r.output


def test_verify_reports_a_damaged_so_with_the_remedy_that_works(proj):
    """A linked .so whose bytes no longer match its sidecar: the runtime warns about it
    and will not load it, so verify reports it (its path, and what fixes it), exit 1; and
    the fix it names is the runtime's: the kernel's next load links a new .so, after which
    verify is all good. Before: "all good", exit 0, while every load warned."""
    e = _entry(proj["cache"], "sm_90a", 64)
    if not e["so"].exists():
        pytest.skip("no .so was linked (no C compiler)")
    data = bytearray(e["so"].read_bytes())
    data[300] ^= 0xFF
    e["so"].write_bytes(bytes(data))
    r = runner.invoke(app, ["verify", "--json"])
    assert r.exit_code == 1, r.output
    res = json.loads(r.stdout)
    (row,) = [x for x in res["entries"] if x["problems"]]
    assert row["key"] == e["key"] and row["so"] == str(e["so"])
    (problem,) = row["problems"]
    assert f"the linked kernel {e['so']} is damaged" in problem and "truncated or tampered" in problem
    assert "links a new one from the verified .o when the kernel next loads" in problem
    load = subprocess.run(
        [sys.executable, "-W", "always", "-c", "import toykernels; toykernels.toy_scale('float16', 64)"],
        cwd=proj["dir"],
        env=dict(
            os.environ,
            QUACK_MODE="prebuilt",
            PYTHONPATH=os.pathsep.join([str(Path(toykernels.__file__).parent), *sys.path]),
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert load.returncode == 0 and f"the linked kernel {e['so']} is damaged" in load.stderr, load.stderr
    r = runner.invoke(app, ["verify"])
    assert r.exit_code == 0 and "all good" in r.output, r.output


def test_dry_runs_leave_a_corrupt_entry_in_place_and_say_a_build_rebuilds_it(proj):
    """`quack build --dry-run` (and `quack prewarm --dry-run`) read the cache only: a
    corrupt entry is listed as one to compile, named corrupt with its file, and nothing
    is moved. Before: the plan's lookup moved it to quarantine/ (with a warning)."""
    cache = proj["cache"]
    e = _entry(cache, "sm_90a", 128)
    data = bytearray(e["o"].read_bytes())
    data[100] ^= 0xFF
    e["o"].write_bytes(bytes(data))
    journal.append(
        cache,
        [
            {
                "kernel": "toy_scale",
                "key": e["key"],
                "arch": "sm_90a",
                "params": {"dtype": "float16", "block": 128, "bias": False},
                "hits": 3,
                "misses": 1,
                "compiles": 1,
                "compile_s": 0.4,
                "t": time.time(),
            }
        ],
    )
    before = _tree(cache)
    r = runner.invoke(app, ["build", "--dry-run"])
    assert r.exit_code == 0, r.output
    (line,) = [x for x in r.output.splitlines() if e["key"][:16] in x]
    assert line.startswith("compile ") and "(corrupt: object file checksum mismatch" in line, line
    assert f"{e['o']}; a build moves it to quarantine/ and rebuilds it)" in line, line
    assert "1 to compile (1 of them corrupt in the cache, left as they are" in r.output, r.output
    r = runner.invoke(app, ["build", "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert (res["to_compile"], res["corrupt"]) == (1, 1)
    (k,) = [k for k in res["keys"] if k["key"] == e["key"]]
    assert k["status"] == "todo" and "checksum mismatch" in k["corrupt"] and str(e["o"]) in k["corrupt"]
    r = runner.invoke(app, ["prewarm", "--dry-run"])
    assert r.exit_code == 0 and "(corrupt: object file checksum mismatch" in r.output, r.output
    assert "was corrupt" not in r.output  # no quarantine warning: nothing was moved
    assert _tree(cache) == before  # nothing moved, created or written
    r = runner.invoke(app, ["build", "--json"])  # the real build does what the dry run said
    assert r.exit_code == 0 and json.loads(r.stdout)["compiled"] == 1, r.output
    assert len(list((cache / "quarantine").glob("*.reason"))) == 1


# --- quack verify --run without a GPU here: the loaders' GPU probe answered yes ----------

FAKE_GPU = """
import os
if os.environ.get("QUACK_TEST_FAKE_GPU"):
    # verify's GPU probe (torch.cuda.is_available in the loader) says yes; nothing here
    # launches a kernel: the hooks these tests run never touch the GPU
    import torch
    torch.cuda.is_available = lambda: True
"""


def _fake_gpu_loaders(tmp_path: Path, monkeypatch) -> None:
    """From now on, the loader processes see a GPU (a sitecustomize on their PYTHONPATH)."""
    d = tmp_path / "fakegpu"
    d.mkdir()
    (d / "sitecustomize.py").write_text(FAKE_GPU)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(d), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("QUACK_TEST_FAKE_GPU", "1")


def test_verify_run_that_runs_no_kernel_fails_and_says_why(proj, tmp_path, monkeypatch):
    """--run on a GPU where no configuration's kernel has a reference hook ran nothing: exit
    1, a line saying so, and the count of entries not run (text and --json). Before:
    "verified 3 configurations (..., reference run): all good", exit 0."""
    _fake_gpu_loaders(tmp_path, monkeypatch)
    r = runner.invoke(app, ["verify", "--run", "--json"])
    assert r.exit_code == 1, r.output
    res = json.loads(r.stdout)
    assert not res["ok"] and res["problems"] == 0 and not res["ran"]
    assert (res["reference_runs"], res["not_run"], res["not_run_why"]) == (0, 3, {"no reference hook": 3})
    assert res["note"].startswith("--run ran no kernel (no reference hook: toy_scale)")
    assert all(e["run"] == "no reference hook" for e in res["entries"])
    r = runner.invoke(app, ["verify", "--run"])
    assert r.exit_code == 1, r.output
    assert "--run ran no kernel (no reference hook: toy_scale)" in r.output
    assert "no kernel was run; 3 not run: no reference hook (toy_scale)" in r.output
    assert "all good" not in r.output and "reference run" not in r.output and "slowest" not in r.output


HOOKED_MODULE = """
import toykernels
from quack import jit_cache
from quack.params import Int


@jit_cache("verify_hooked", params={"block": Int(min=32, max=1024)}, reference="verify_hooked:check")
def verify_hooked(block: int = 64):
    return toykernels.toy_scale.compile_uncached("float32", block, False)


def check(params, device):
    assert params == {"block": 64} and device == "cuda", (params, device)
"""


def test_verify_run_counts_the_entries_run_and_those_not_run(proj, tmp_path, monkeypatch):
    """One kernel with a reference hook, one without: --run succeeds (the hook ran and
    passed) and its summary counts both, the ones not run with why and their kernel."""
    d = proj["dir"]
    (d / "verify_hooked.py").write_text(HOOKED_MODULE)
    (d / "quack.toml").write_text(
        (d / "quack.toml").read_text().replace('["toykernels"]', '["toykernels", "verify_hooked"]')
    )
    (d / "m.toml").write_text(
        MANIFEST + '[[kernel]]\nname = "verify_hooked"\narchs = ["sm_90a"]\nparams = { block = 64 }\n'
    )
    r = runner.invoke(app, ["build", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["compiled"] == 1, r.output
    _fake_gpu_loaders(tmp_path, monkeypatch)
    r = runner.invoke(app, ["verify", "--run", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["ok"] and res["ran"] and res["note"] == ""
    assert (res["reference_runs"], res["not_run"], res["not_run_why"]) == (1, 3, {"no reference hook": 3})
    assert {e["kernel"]: e["run"] for e in res["entries"]} == {
        "toy_scale": "no reference hook",
        "verify_hooked": "ok",
    }
    r = runner.invoke(app, ["verify", "--run"])
    assert r.exit_code == 0, r.output
    assert "1 reference run): all good; 3 not run: no reference hook (toy_scale) in " in r.output, r.output


def test_verify_bundles_run_that_runs_no_kernel_fails_and_says_why(proj, tmp_path, monkeypatch):
    """The same for `verify --bundles --run`: an installed bundle whose kernel has no
    reference hook is loaded, not run, counted so, and the command exits 1."""
    from test_bundles_tier import bfile, install, ref_for

    from quack.bundles import tier as bt

    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    bt.reset()
    try:
        real = _entry(proj["cache"], "sm_90a", 64)["o"].read_bytes()  # a real sm_90a object: it loads
        install(site, [bfile(ref_for(), obj=real, so=None)], name="hookless")
        _fake_gpu_loaders(tmp_path, monkeypatch)
        r = runner.invoke(app, ["verify", "--bundles", "--run", "--json"])
        assert r.exit_code == 1, r.output
        res = json.loads(r.stdout)
        assert res["problems"] == 0 and res["note"].startswith(
            "--run ran no kernel (no reference hook: toy_scale)"
        )
        assert (res["reference_runs"], res["not_run"]) == (0, 1)
        r = runner.invoke(app, ["verify", "--bundles", "--run"])
        assert r.exit_code == 1 and "no kernel was run; 1 not run: no reference hook (toy_scale)" in r.output
        assert "all good" not in r.output, r.output
    finally:
        bt.reset()


def test_prewarm_from_journal(proj):
    cache = proj["cache"]
    now = time.time()
    rec = lambda params, hits, t=now, kernel="toy_scale", arch="sm_90a": {  # noqa: E731
        "kernel": kernel,
        "key": "x",
        "arch": arch,
        "params": params,
        "hits": hits,
        "misses": 1,
        "compiles": 1,
        "compile_s": 0.4,
        "t": t,
    }
    journal.append(
        cache,
        [
            rec({"dtype": "float16", "block": 64, "bias": False}, 50),  # cached already
            rec({"dtype": "bfloat16", "block": 64, "bias": False}, 90),  # most used, missing
            rec({"dtype": "float32", "block": 32, "bias": True}, 5),  # missing
            rec({"dtype": "float32", "block": 32, "bias": True}, 5),  # same config again
            rec({"dtype": "float16", "block": 512, "bias": False}, 99, t=now - 40 * 86400),  # too old
            rec({"n": 3}, 7, kernel="gone_kernel"),  # no longer registered
            rec({"dtype": "float16", "block": 5000, "bias": False}, 3),  # no longer valid
        ],
    )
    out = proj["dir"] / "used.toml"
    r = runner.invoke(app, ["prewarm", "--since", "30d", "--dry-run", "--json", "--emit-manifest", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert (res["configurations"], res["cached"], res["to_compile"]) == (3, 1, 2)
    assert len(res["skipped"]) == 2
    exp = expand([out])
    assert [c.params["dtype"] for c in exp.configs] == ["bfloat16", "float16", "float32"]  # most used first
    assert exp.configs[2].params["bias"] is True
    r = runner.invoke(app, ["prewarm", "--since", "30d", "--top", "1", "--dry-run", "--json"])
    assert json.loads(r.stdout)["configurations"] == 1
    r = runner.invoke(app, ["prewarm", "--since", "30d", "-j", "2", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["compiled"] == 2 and res["ok"]
    assert [k["params"]["dtype"] for k in res["keys"] if k["status"] == "compiled"][0] == "bfloat16"
    r = runner.invoke(app, ["prewarm", "--since", "30d"])
    assert r.exit_code == 0 and "0 to rebuild" in r.output
    r = runner.invoke(app, ["build", "--json", str(out)])
    assert json.loads(r.stdout)["cached"] == 3


# --- quack verify -j: the loads shared out over several fresh processes ------------------


def _reqs(cache: Path) -> list[dict]:
    """One load request per built entry (quack_build.verify.child's format), real objects."""
    out = []
    for arch, block in (("sm_90a", 64), ("sm_90a", 128), ("sm_80", 64)):
        e = _entry(cache, arch, block)
        so = e["so"] if e["so"].exists() else None
        out.append(
            {"key": e["key"], "obj": str(e["o"]), "so": str(so) if so else None, "kernel": "toy_scale"}
        )
    return out


def _shared_object(d: Path, name: str, constructor_body: str) -> str:
    """A .so whose load runs ``constructor_body`` (the loader dlopens it: a real crash or
    hang inside the fresh process, not a Python exception it could report)."""
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler to build the crashing object")
    src = d / f"{name}.c"
    src.write_text(
        "#include <stdio.h>\n#include <stdlib.h>\n#include <unistd.h>\n"
        f"__attribute__((constructor)) static void quack_test_ctor(void) {{ {constructor_body} }}\n"
    )
    so = d / f"{name}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True, timeout=120)
    return str(so)


def test_verify_jobs_reports_are_identical_in_request_order(proj):
    e = _entry(proj["cache"], "sm_90a", 128)
    for k in ("so", "so_meta"):
        e[k].unlink(missing_ok=True)
    data = bytearray(e["o"].read_bytes())
    data[0:4] = b"JUNK"  # a load failure in the middle of the manifest: must stay on its entry
    _rewrite(e, bytes(data))
    reports = []
    for jobs in ("1", "2"):
        r = runner.invoke(app, ["verify", "--json", "-j", jobs])
        assert r.exit_code == 1, r.output
        res = json.loads(r.stdout)
        res.pop("seconds")
        for x in res["entries"]:  # each entry's own time: the one thing that may differ
            assert x.pop("seconds", 0) >= 0
        reports.append(res)
    assert reports[0] == reports[1]
    assert [x["key"] for x in reports[0]["entries"] if x["problems"]] == [e["key"]]
    assert sum(1 for x in reports[0]["entries"] if x.get("loaded") in ("so", "o")) == 2
    r = runner.invoke(app, ["verify", "-j", "0"])
    assert r.exit_code == 2 and "--jobs" in r.output


def test_verify_default_loaders_three_with_run_else_the_job_count(proj, monkeypatch):
    """With --run the loaders share one GPU: three were the fastest measured (H200, 1,178
    entries: 9.7 s with 1, 8.9 s with 2, 8.1 s with 3; the per-entry work is mostly the
    host's). Loading only is CPU work and keeps the job count (at most 8). A given -j is
    kept either way, and the loaders are started before the static checks with that count
    (capped by the entries)."""
    from quack_build.verify import manifest as vm

    seen, started, closed, sizes = [], [], [], []

    class FakeLoaders:
        def __init__(self, jobs, run):
            started.append((run, jobs))
            self.run = run

        def close(self):
            closed.append(self)

    def record(reqs, run=False, progress=None, jobs=1, started=None):
        assert started is not None and started.run == run
        seen.append((run, jobs))
        sizes.append(len(reqs))
        return [{"key": r["key"], "ok": True, "how": "o"} for r in reqs], ""

    monkeypatch.setattr(vm, "load_fresh", record)
    monkeypatch.setattr(vm, "start_loaders", FakeLoaders)
    monkeypatch.setattr(settings.Settings, "effective_jobs", lambda self, requested=None: 6)
    for args in (["verify"], ["verify", "--run"], ["verify", "--run", "-j", "1"], ["verify", "-j", "2"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
    assert seen == [(False, 6), (True, 3), (True, 1), (False, 2)]
    n = sizes[0]  # every entry is present: each run asks for all of them
    assert n >= 2 and set(sizes) == {n}
    assert started == [(False, min(6, n)), (True, min(3, n)), (True, 1), (False, min(2, n))]
    assert len(closed) == 4  # closed every time (a no-op once load_fresh took them over)


def test_started_loaders_serve_load_fresh_and_end_when_the_checks_fail(proj, monkeypatch):
    """The loaders verify starts before its static checks: handed to load_fresh they load
    the entries (the spare ones end at once); when a check raises in between, every one of
    them ends with it instead of waiting on stdin for requests that never come."""
    from quack_build.verify import loaders
    from quack_build.verify import manifest as vm

    reqs = _reqs(proj["cache"])[:2]
    started = loaders.start_loaders(3)
    procs = [c.p for c in started.children]
    answers, note = loaders.load_fresh(reqs, jobs=3, started=started)
    assert note == "" and [a["key"] for a in answers] == [r["key"] for r in reqs]
    assert all(a["ok"] for a in answers)
    assert all(p.poll() is not None for p in procs)  # the spare one too
    other = loaders.start_loaders(1)
    with pytest.raises(ValueError, match="another run mode"):
        loaders.load_fresh(reqs, run=True, started=other)
    other.close()
    assert other.children[0].p.poll() is not None

    made = []

    def start(jobs, run=False):
        made.append(loaders.start_loaders(jobs, run))
        return made[-1]

    def boom(store, cfg):
        raise RuntimeError("check failed")

    monkeypatch.setattr(vm, "start_loaders", start)
    monkeypatch.setattr(vm, "check_static", boom)
    cfgs = [object(), object()]
    with pytest.raises(RuntimeError, match="check failed"):
        vm.verify(cfgs, store=None, jobs=2)
    (s,) = made
    assert len(s.children) == 2 and all(c.p.poll() is not None for c in s.children)


def test_load_fresh_blames_a_crash_on_its_entry_only(proj, tmp_path):
    from quack_build.verify.loaders import load_fresh

    good = _reqs(proj["cache"])
    crash = _shared_object(tmp_path, "crash", 'fputs("quack-test: aborting on load", stderr); abort();')
    bad = {"key": "crashing", "obj": crash, "so": crash, "kernel": "toy_scale"}
    reqs = [good[0], bad, good[1], good[2]]
    seen: list[int] = []
    answers, note = load_fresh(reqs, jobs=2, progress=seen.append)
    assert note == "" and seen == [1, 2, 3, 4]  # counted across the children
    assert not answers[1]["ok"] and "the loader process died (signal 6)" in answers[1]["error"]
    assert "quack-test: aborting on load" in answers[1]["error"]  # that child's own stderr
    for i in (0, 2, 3):  # in request order, loaded whichever child took them
        assert answers[i]["ok"] and answers[i]["key"] == reqs[i]["key"] and answers[i]["how"] in ("so", "o")


def test_load_fresh_answers_survive_a_library_printing_to_stdout(proj, tmp_path):
    """A loaded library that prints to stdout (a kernel runtime printed "Error: kernel ..."
    after a failed launch on the H200) must not be read as an answer: before, the noise was
    taken as the noisy entry's answer and every later answer of that process went to the
    entry after its own."""
    from quack_build.verify.loaders import load_fresh

    good = _reqs(proj["cache"])
    noisy_so = _shared_object(tmp_path, "noisy", 'printf("Error: kernel noise\\n{}\\n"); fflush(stdout);')
    noisy = {"key": "noisy", "obj": noisy_so, "so": noisy_so, "kernel": "toy_scale"}
    reqs = [noisy, good[0], good[1], good[2]]
    answers, note = load_fresh(reqs, jobs=1)
    assert note == ""
    assert answers[0]["key"] == "noisy" and not answers[0]["ok"] and "load failed" in answers[0]["error"]
    for i in (1, 2, 3):
        assert answers[i]["ok"] and answers[i]["key"] == reqs[i]["key"], answers[i]


REF_MODULE = """
from quack import jit_cache
from quack.params import Int

@jit_cache("verify_ref_probe", params={"i": Int()}, reference="verify_ref_probe:reference")
def compile_probe(i):
    raise AssertionError("never compiled")

def reference(params, device):
    if params["i"] == 1:
        raise RuntimeError("CUDA Error Code: 1 (a launch failed: the process's context is gone)")
"""


def test_a_failed_reference_run_restarts_the_fresh_process(proj, tmp_path):
    """A reference run that raises (a CUDA error is sticky: every later launch in that
    process fails too) is answered with ``restart`` and that process ends; the next entry
    runs in a new one. The child is driven directly: its run path needs no GPU."""
    import os
    import sys

    (tmp_path / "verify_ref_probe.py").write_text(REF_MODULE)
    good = _reqs(proj["cache"])[0]
    reqs = [
        dict(good, kernel="verify_ref_probe", module="verify_ref_probe", params={"i": i}, run=True)
        for i in (0, 1, 2)
    ]
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "quack_build.verify.child",
            "--sys-path=" + os.pathsep.join([str(tmp_path), *sys.path]),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = p.communicate("\n".join(json.dumps(r) for r in reqs) + "\n", timeout=300)
    answers = [json.loads(line) for line in out.splitlines()]
    # "failed": the hook ran and raised (verify counts it as run, and as a problem)
    assert [a.get("run") for a in answers] == ["ok", "failed"], (answers, err[-2000:])
    assert answers[1]["restart"] and "CUDA Error Code: 1" in answers[1]["error"]
    assert p.returncode == 0  # ended after that answer: the third entry was not run in it


DRIVER = """
import json, os, signal, sys
from quack_build.verify.loaders import load_fresh
# What the quack command does first (quack_build.build.interrupts.install): a handler of its
# own. Without it this process would inherit the test process's disposition, and a SIG_IGN
# left there (quack.compile._preload sets it in any process that imports it) ignored the
# SIGINT: the driver never ended (CI under xdist, 'did not end within 29 s').
signal.signal(signal.SIGINT, signal.default_int_handler)
try:
    load_fresh(json.loads(sys.argv[1]), jobs=2)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
print("finished", flush=True)
"""


def test_load_fresh_interrupted_kills_every_child_and_starts_no_more(tmp_path):
    """Ctrl-C / SIGTERM (quack_build.build.interrupts turns both into KeyboardInterrupt)
    while two children hang in a load and four requests wait: the command ends at once,
    every child killed and reaped, none started for the queued work."""
    from quack_build.verify import loaders

    marks = tmp_path / "marks"
    marks.mkdir()
    hang = _shared_object(
        tmp_path,
        "hang",
        f'char p[4096]; snprintf(p, sizeof p, "{marks}/%d", (int)getpid()); '
        'FILE *f = fopen(p, "w"); if (f) fclose(f); for (;;) pause();',
    )
    reqs = [{"key": f"hang-{i}", "obj": hang, "so": hang, "kernel": "toy_scale"} for i in range(6)]
    p = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(reqs)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(marks.iterdir())) < 2:  # both children are inside their load
            assert p.poll() is None, p.stdout.read() if p.stdout else ""
            assert time.monotonic() < deadline, "the two loader processes never started their load"
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        # Sooner than two worker-join time-outs: without the kill the driver waits that long
        # per child stuck in its load (two here; and a child for the queued work could start
        # meanwhile). Within that, the bound scales with the load: under xdist on 2 cores the
        # interpreter's exit alone once took longer than one time-out (15 s).
        limit = min(scaled(loaders.JOIN_TIMEOUT), 2 * loaders.JOIN_TIMEOUT - 1)
        try:
            out, _ = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the interrupted load_fresh did not end within {limit:.0f} s")
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 130 and out.strip() == "interrupted"
    pids = [int(m.name) for m in marks.iterdir()]
    assert len(pids) == 2  # the four queued requests started no new child
    for pid in pids:
        with pytest.raises(ProcessLookupError):  # killed and reaped, not left running or a zombie
            os.kill(pid, 0)


def test_static_loaders_load_without_importing_torch(proj):
    """A loader that only loads (verify without --run) hands no tensor to a kernel, so it
    imports tvm_ffi with torch hidden: tvm_ffi's own import of torch was ~3 of a loader's
    ~4 CPU-s of start-up on 2 cores, paid by every loader of every verify."""
    from quack_build.verify.loaders import start_loaders

    reqs = _reqs(proj["cache"])
    started = start_loaders(1)  # no run: the pool's own choice of child
    try:
        (c,) = started.children
        assert c.ask(reqs[0])["ok"]
        seen = c.ask({"op": "imported", "names": ["torch", "tvm_ffi", "quack.runtime.loader"]})
        assert seen == {"imported": {"torch": False, "tvm_ffi": True, "quack.runtime.loader": True}}
    finally:
        started.close()


def test_torch_hidden_only_while_open_and_only_when_not_imported(monkeypatch):
    import importlib

    from quack.runtime.ffi import torch_hidden

    torch = importlib.import_module("torch")
    with torch_hidden():
        assert importlib.import_module("torch") is torch  # imported already: nothing hidden
    monkeypatch.delitem(sys.modules, "torch")  # restored at teardown: nothing re-imports it
    with torch_hidden():
        with pytest.raises(ImportError):
            importlib.import_module("torch")
    assert "torch" not in sys.modules  # importable again: a compile function may import it
