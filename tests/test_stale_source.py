"""An object is filed under the fingerprint of the source it was compiled from, whatever
the process that compiled it had imported (review of 2026-12-05, both reproduced):

- a long-lived process (a notebook, a pytest session) whose kernel module is edited
  between two calls: the pool's worker still ran the OLD module and published its object
  under the NEW fingerprint, which every later process then loaded;
- a kernel defined in a script (``__main__``) had the constant fingerprint "main": after
  an edit, the next run loaded the object of the old code (and two scripts defining a
  kernel of one name shared entries).

Real compiles in real processes (the compile pool's forkserver and workers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reliability_support import NO_TORCH, run_py

SOURCE = """
from quack import jit_cache
from quack.params import Dtype, Int

BIAS = 1.0


@jit_cache("stale_scale", params={"dtype": Dtype(), "block": Int(min=32, max=1024)})
def stale_scale(dtype: str, block: int = 128):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    @cute.kernel
    def k(gx: cute.Tensor, gy: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * block + tidx
        if i < cute.size(gx, mode=[0]):
            gy[i] = gx[i] + cutlass.Float32(BIAS)

    @cute.jit
    def launch(x: cute.Tensor, y: cute.Tensor, stream):
        n = cute.size(x, mode=[0])
        k(x, y).launch(grid=((n + block - 1) // block, 1, 1), block=(block, 1, 1), stream=stream)

    n = cute.sym_int()
    x = make_fake_tensor(cutlass.Float32, (n,), stride=(1,))
    y = make_fake_tensor(cutlass.Float32, (n,), stride=(1,))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, x, y, stream, options="--enable-tvm-ffi")
"""


def _objects(cache: Path, block: int) -> list[tuple[str, str]]:
    """(source fingerprint, object sha256) of each entry of stale_scale at ``block``."""
    out = []
    for meta in cache.glob("v1/*/stale_scale/*/*.json"):
        if meta.name.endswith(".so.json"):
            continue
        m = json.loads(meta.read_text())
        if m["params"]["block"] == block:
            out.append((m["srcfp"], m["sha256"]))
    return out


def test_a_worker_that_imported_the_old_source_never_files_its_object_under_the_new(tmp_path):
    mods = tmp_path / "mods"
    mods.mkdir()
    src = mods / "staletoy.py"
    src.write_text(SOURCE)
    code = (
        NO_TORCH
        + f"""
import json, sys
from pathlib import Path
sys.path.insert(0, {str(mods)!r})
import staletoy
from quack.compile import pool
staletoy.stale_scale("float32", 64)         # a worker imports staletoy (BIAS = 1.0)
p = Path({str(src)!r})
p.write_text(p.read_text().replace("BIAS = 1.0", "BIAS = 7.25"))   # the user edits it
staletoy.stale_scale("float32", 128)        # compiled after the edit
print(json.dumps({{"fp": staletoy.stale_scale.spec.source_fingerprint(),
                  "restarts": pool.default_pool().stats()["stale_restarts"]}}))
"""
    )
    r = run_py(code, QUACK_CACHE_DIR=tmp_path / "long")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["restarts"] == 1, r.stderr[-3000:]
    # the object a fresh process compiles from the edited source: the one filed
    fresh = (
        NO_TORCH
        + f"import sys\nsys.path.insert(0, {str(mods)!r})\nimport staletoy\nstaletoy.stale_scale('float32', 128)\n"
    )
    run_py(fresh, QUACK_CACHE_DIR=tmp_path / "fresh")
    (want,) = _objects(tmp_path / "fresh", 128)
    assert want[0] == got["fp"]
    assert _objects(tmp_path / "long", 128) == [want]


def test_in_the_calling_process_an_edited_kernel_is_refused_not_compiled(
    tmp_path, monkeypatch, quack_settings
):
    """A kernel compiled in the caller (one a worker cannot import) after its module was
    edited: SourceChanged naming the file, nothing published, not remembered."""
    import importlib
    import sys

    from quack.cache.store import local_store
    from quack.compile import builder
    from quack.errors import SourceChanged

    mods = tmp_path / "mods"
    mods.mkdir()
    src = mods / "staletoy_inproc.py"
    src.write_text(SOURCE.replace('"stale_scale"', '"stale_inproc"'))
    monkeypatch.syspath_prepend(str(mods))
    mod = importlib.import_module("staletoy_inproc")
    try:
        spec = mod.stale_scale.spec
        params = spec.bind(("float32", 64), arch="sm_90a")
        src.write_text(src.read_text().replace("BIAS = 1.0", "BIAS = 7.25"))
        store = local_store(quack_settings)
        with pytest.raises(SourceChanged) as e:
            builder.build(spec, params, "sm_90a", store)
        assert e.value.transient and e.value.files == ["staletoy_inproc"]
        assert "reload the kernel's module" in str(e.value)
        assert store.lookup(builder.entry_ref(spec, params, "sm_90a")) is None
        assert not list(Path(store.root).glob("v1/*/stale_inproc/*/*.o"))
        # reloaded: registered anew, so compiled and published from the new source
        mod = importlib.reload(mod)
        assert mod.stale_scale.spec.changed_since_load() == []
    finally:
        sys.modules.pop("staletoy_inproc", None)


SCRIPT = (
    SOURCE.replace('"stale_scale"', '"script_scale"')
    + """
if __name__ == "__main__":
    import json
    stale_scale("float32", 64)
    print(json.dumps({"fp": stale_scale.spec.source_fingerprint(), "usage": stale_scale.usage()[0]["tier"]}))
"""
)


def test_a_script_kernel_is_fingerprinted_by_its_script(tmp_path):
    """Edited, it compiles again (it loaded the old object); another script's kernel of
    the same name has its own fingerprint."""
    import subprocess

    from reliability_support import env

    script = tmp_path / "script.py"
    script.write_text(SCRIPT)

    def run(path: Path) -> dict:
        r = subprocess.run(
            [sys_exe(), str(path)],
            env=env(QUACK_CACHE_DIR=tmp_path / "c"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = run(script)
    assert first["usage"] == "compile"
    assert run(script) == dict(first, usage="cache")  # unchanged: loaded
    script.write_text(SCRIPT.replace("BIAS = 1.0", "BIAS = 7.25"))
    edited = run(script)
    assert edited["usage"] == "compile" and edited["fp"] != first["fp"]
    other = tmp_path / "other.py"
    other.write_text(SCRIPT.replace("BIAS = 1.0", "BIAS = 3.5"))
    assert run(other)["fp"] not in (first["fp"], edited["fp"])


def sys_exe() -> str:
    import sys

    return sys.executable


def test_a_kernel_without_a_file_is_fingerprinted_by_its_code_and_what_it_names():
    """``python -c`` (a notebook alike): the kernel's code and the ``__main__`` helpers it
    calls, by value; the same code gives the same fingerprint in another process."""
    base = (
        "from quack import jit_cache\nfrom quack.params import Int\n"
        "def helper():\n    return {v}\n"
        "@jit_cache('nofile_k', params={{'n': Int()}})\n"
        "def k(n: int = 1):\n    return helper() + n\n"
        "print(k.spec.source_fingerprint())\n"
    )
    fp1 = run_py(base.format(v=1.0)).stdout.strip()
    assert run_py(base.format(v=1.0)).stdout.strip() == fp1
    assert run_py(base.format(v=7.25)).stdout.strip() != fp1  # only the helper changed
    assert len(fp1) == 16 and fp1 != "main"
