"""`quack verify` and `quack prewarm`, on entries really compiled for sm_90a / sm_80 on CPU."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import toykernels  # noqa: F401
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
