"""Fixtures shared by the kernel tiers (imported by the test modules: a conftest.py here
would shadow tests/conftest.py for the `from conftest import ...` of other tests)."""

import os

import pytest


@pytest.fixture(scope="module")
def kernel_cache():
    """The session's cache (QUACK_CACHE_DIR, quack.toml): README command 2's `quack build
    manifests/tests.toml manifests/training.toml` fills it, so under `pytest --quack-prebuilt`
    (CI) these tests prove every prebuilt entry loads, and without it they compile what is missing in the workers.
    QUACK_TEST_KERNEL_CACHE points them at another cache instead."""
    from quack import settings

    d = os.environ.get("QUACK_TEST_KERNEL_CACHE")
    if not d:
        yield str(settings.get().cache_dir)
        return
    saved = settings.installed()
    settings.set_current(settings.resolve({"cache_dir": d, "arch": "sm_90a", "mode": "jit"}))
    yield d
    settings.set_current(saved)


_PRESSURED: set[str] = set()


@pytest.fixture
def oom_pressure(request):
    """Issue 16's test-only memory pressure, so the OOM retry runs on real hardware:
    with QUACK_TEST_OOM_PRESSURE=K, the first K large tests (M x N >= 2**24) of this
    process run their FIRST attempt with all but 256 MiB of the GPU's free memory
    taken, so allocating their inputs raises a real CUDA out-of-memory error; the
    memory is released at teardown and the plugin's retry (gc, empty_cache, GPU held
    exclusively) runs them again without pressure. Workers sharing the GPU meanwhile
    may hit OOM too: the retry must save them as well. Off (a no-op) by default."""
    k = int(os.environ.get("QUACK_TEST_OOM_PRESSURE", "0") or 0)
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    m, n = params.get("m", 0), params.get("n", 0)
    if k <= 0 or m * n < 2**24 or request.node.nodeid in _PRESSURED or len(_PRESSURED) >= k:
        yield
        return
    import torch

    _PRESSURED.add(request.node.nodeid)
    torch.cuda.empty_cache()  # blocks the allocator kept would let the test dodge the pressure
    free, _total = torch.cuda.mem_get_info()
    hog = torch.empty(max(0, free - (256 << 20)), dtype=torch.uint8, device="cuda")
    try:
        yield
    finally:
        del hog
        torch.cuda.empty_cache()


@pytest.fixture
def poison_allocations(monkeypatch):
    """Every floating torch.empty / empty_like (the kernels' wrappers allocate their outputs
    with them) returns NaN-filled memory, so an element a kernel never wrote fails the
    comparison. Used autouse by the GPU kernel tiers."""
    import torch

    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*a, **k):
        t = real_empty(*a, **k)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    def empty_like(*a, **k):
        t = real_empty_like(*a, **k)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    # No torch.cuda.empty_cache() after each test: handing every block back made the next test
    # cudaMalloc its GB-sized tensors afresh (a device-wide synchronizing call) ~2,300 times
    # a GPU tier. The caching allocator frees its cached blocks itself before it reports an
    # out-of-memory, and the plugin's OOM retry empties the cache explicitly (quack.testing.oom).
    yield


# The PTX a test reads: compiled ONCE a session for every case the session asks for (one
# child process: CUTE_DSL_KEEP is read once a process), kept in the session's cache
# directory under the kernel's source fingerprint and key, so a later session with the same
# sources reads it back without compiling (the cache holds cubins only: no PTX to read).
_PTX_SCRIPT = """
import glob, importlib, json, os, shutil, sys
from quack import registry
from quack.compile.builder import compile_to
out, todo = sys.argv[1], json.loads(sys.argv[2])
for module, name, params, dest in todo:
    importlib.import_module(module)
    spec = registry.get(name)
    before = set(glob.glob(os.path.join(out, "*.ptx")))
    compile_to(spec, spec.bind((), params, arch="sm_90a"), "sm_90a", os.path.join(out, "obj.o"))
    (new,) = set(glob.glob(os.path.join(out, "*.ptx"))) - before
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.move(new, dest + ".tmp")
    os.replace(dest + ".tmp", dest)
"""


def ptx_of(cases: dict, tmp_dir) -> dict:
    """``cases``: id -> (kernel compile function, its params dict; config derived when left
    out) -> id -> the PTX text of that kernel for sm_90a."""
    import json
    import subprocess
    import sys

    from quack import settings

    root = settings.get().cache_dir
    where, todo = {}, []
    for cid, (fn, params) in cases.items():
        spec = fn.spec
        bound = spec.bind((), params, arch="sm_90a")
        path = os.path.join(root, "test-ptx", spec.source_fingerprint(), spec.key(bound, "sm_90a") + ".ptx")
        where[cid] = path
        if not os.path.exists(path):
            todo.append((spec.module, spec.name, spec.plain(bound), path))
    if todo:
        env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_dir), CUTE_DSL_ARCH="sm_90a")
        r = subprocess.run(
            [sys.executable, "-c", _PTX_SCRIPT, str(tmp_dir), json.dumps(todo)],
            env=env,
            timeout=1200,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr[-4000:]
    return {cid: open(p).read() for cid, p in where.items()}
