"""Fixtures shared by the kernel tiers (imported by the test modules: a conftest.py here
would shadow tests/conftest.py for the `from conftest import ...` of other tests)."""

import contextlib
import os

import pytest


def seeded_randn(shape, dtype=None, *, seed: int, scale: float = 1.0, shift: float = 0.0):
    """Normal draws on the GPU from a generator of their own, times ``scale`` plus ``shift``,
    cast to ``dtype`` (torch's default when None). Never the global generator: its state
    depends on which tests ran before, and a cold `--async-compile` run reorders them
    (deferrals), so a test's data, and a tolerance failure, followed the order (session 26:
    the GEMM autocast test failed in cold runs only)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g)
    if scale != 1.0:
        x = x * scale
    if shift != 0.0:
        x = x + shift
    return x if dtype is None else x.to(dtype)


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


# The GPU model whose rows of kernels/tuned/sm_90a.toml the CPU tier's assertions name (its
# default_gpu). Pinned by ``h200_rows``: on a GPU host, or under QUACK_TUNE_GPU, the detected
# model's rows apply (an H100 has rows of its own), and these tests would check those instead
# (README command 2 on an H100: 20 of them failed).
TABLE_GPU = "H200"


@pytest.fixture
def h200_rows():
    """The test reasons about the table's H200 rows: look them up whatever GPU is here."""
    from quack import settings

    with settings.override(tune_gpu=TABLE_GPU):
        yield


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


# The PTX a test reads: compiled ONCE a session for every case the session asks for, kept
# in the session's cache directory under the kernel's source fingerprint and key, so a
# later session with the same sources reads it back without compiling (the cache holds
# cubins only: no PTX to read). The cases are shared out over up to 8 child processes
# (one after another in one child, the ten cases took 19 s of the H200 tier's setup);
# each child has a dump directory of its own, since it finds the .ptx a compile wrote by
# listing that directory (CUTE_DSL_KEEP is read once a process: hence children at all).
# A case whose compile raises is that case's failure alone: the child writes the traceback
# beside its dump (never into the cache: the next session tries again) and goes on with its
# other cases; anything that ends the child (an exit, a crash) fails the whole batch.
_PTX_SCRIPT = """
import glob, importlib, json, os, shutil, sys, traceback
import cutlass.cutlass_dsl  # first: compile_to then builds no JIT engine (builder.no_jit_engine)
from quack import registry
from quack.compile.builder import compile_to
out, todo = sys.argv[1], json.loads(sys.argv[2])
for module, name, params, dest in todo:
    before = set(glob.glob(os.path.join(out, "*.ptx")))
    try:
        importlib.import_module(module)
        spec = registry.get(name)
        compile_to(spec, spec.bind((), params, arch="sm_90a"), "sm_90a", os.path.join(out, "obj.o"))
        (new,) = set(glob.glob(os.path.join(out, "*.ptx"))) - before
    except Exception:
        with open(os.path.join(out, os.path.basename(dest) + ".err"), "w") as f:
            f.write(traceback.format_exc()[-4000:])
        continue
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.move(new, dest + ".tmp")
    os.replace(dest + ".tmp", dest)
"""
PTX_TIMEOUT_S = 1200.0  # all children together; one compile takes seconds


def _compile_ptx(todo: list, tmp_dir) -> None:
    """Run ``_PTX_SCRIPT`` over ``todo`` in min(CPU count, len(todo), 8) children at once.
    The first failure, the deadline or an interrupt (KeyboardInterrupt here) kills every
    child still running: none outlives the fixture, none keeps compiling for nothing."""
    import json
    import subprocess
    import sys
    import tempfile
    import time

    n = max(1, min(os.cpu_count() or 1, len(todo), 8))
    procs = []
    try:
        for i in range(n):
            out = os.path.join(str(tmp_dir), f"child-{i}")
            os.makedirs(out, exist_ok=True)
            env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=out, CUTE_DSL_ARCH="sm_90a")
            err = tempfile.TemporaryFile()
            cmd = [sys.executable, "-c", _PTX_SCRIPT, out, json.dumps(todo[i::n])]
            procs.append((subprocess.Popen(cmd, env=env, stdout=err, stderr=err), err))
        deadline = time.monotonic() + PTX_TIMEOUT_S
        while True:  # bounded by the deadline: each pass waits at most 0.5 s
            codes = [p.poll() for p, _ in procs]
            for (_, err), code in zip(procs, codes):
                if code not in (None, 0):
                    err.seek(0)
                    tail = err.read()[-4000:].decode("utf-8", "replace")
                    raise AssertionError(f"compiling PTX cases failed (exit {code}):\n{tail}")
            if all(c == 0 for c in codes):
                return
            assert time.monotonic() < deadline, f"compiling the PTX cases took over {PTX_TIMEOUT_S:.0f} s"
            try:
                procs[codes.index(None)][0].wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass  # poll the children again; the deadline above ends the loop
    finally:
        for p, err in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            err.close()


def ptx_error(tmp_dir, dest: str) -> str | None:
    """The traceback a child of ``_compile_ptx(..., tmp_dir)`` wrote for the case bound
    for ``dest``, or None."""
    import glob

    for path in glob.glob(os.path.join(str(tmp_dir), "child-*", os.path.basename(dest) + ".err")):
        with open(path) as f:
            return f.read()
    return None


def ptx_of(cases: dict, tmp_dir, errors: dict | None = None) -> dict:
    """``cases``: id -> (kernel compile function, its params dict; config derived when left
    out) -> id -> the PTX text of that kernel for sm_90a. A case whose compile raised:
    AssertionError with its traceback, or, given ``errors``, id -> that traceback there
    and the other cases' texts returned."""
    from quack import settings

    root = settings.get().cache_dir
    where, todo = {}, []
    for cid, (fn, params) in cases.items():
        spec = fn.spec
        with settings.override(tune_gpu=TABLE_GPU):  # the tests assert the H200 rows' code
            bound = spec.bind((), params, arch="sm_90a")
        path = os.path.join(root, "test-ptx", spec.source_fingerprint(), spec.key(bound, "sm_90a") + ".ptx")
        if path not in where.values() and not os.path.exists(path):  # two cases, one kernel: one compile
            todo.append((spec.module, spec.name, spec.plain(bound), path))
        where[cid] = path
    if todo:
        _compile_ptx(todo, tmp_dir)
    texts = {}
    for cid, path in where.items():
        if os.path.exists(path):
            with open(path) as f:
                texts[cid] = f.read()
            continue
        why = ptx_error(tmp_dir, path) or "the child wrote neither its PTX nor an error"
        if errors is None:
            raise AssertionError(f"compiling the PTX of case {cid!r} failed:\n{why}")
        errors[cid] = why
    return texts


# Every module's PTX in ONE batch a session: a module declares its cases as PTX_CASES and its
# tests take ``module_ptx``. Each module calling ptx_of for itself made four batches in a
# row, each paying its children's start and cutlass import (~3 s): 21 s of the H200 tier's
# first session after `quack build` (6.0 + 6.0 + 5.0 + 4.4 s, four calls in three files),
# and on 2 cores seven children's imports where two do. Under xdist these tests are one unit
# (tests/xdist_units.py "ptx"), so one worker compiles the batch.
def ptx_cases_in(items) -> dict:
    """module name -> that module's PTX_CASES, for each module with a test among ``items``
    that uses ``module_ptx`` (itself or through a fixture of its own)."""
    out: dict = {}
    for it in items:
        mod = getattr(it, "module", None)
        if mod is not None and "module_ptx" in getattr(it, "fixturenames", ()):
            out.setdefault(mod.__name__, mod.PTX_CASES)
    return out


@pytest.fixture(scope="session")
def session_ptx(request, tmp_path_factory) -> dict:
    """module name -> (case id -> PTX text, case id -> why its compile failed), for every
    case of ``ptx_cases_in`` the session's tests: one ``ptx_of`` over all of them (what the
    cache holds already is only read)."""
    per_module = ptx_cases_in(request.session.items)
    flat = {(m, cid): case for m, cases in per_module.items() for cid, case in cases.items()}
    errors: dict = {}
    texts = ptx_of(flat, tmp_path_factory.mktemp("ptx"), errors) if flat else {}
    out: dict = {m: ({}, {}) for m in per_module}  # module -> (texts, errors)
    for (m, cid), text in texts.items():
        out[m][0][cid] = text
    for (m, cid), why in errors.items():
        out[m][1][cid] = why
    return out


@pytest.fixture
def module_ptx(request, session_ptx) -> dict:
    """case id -> PTX text of the requesting module's PTX_CASES (see ``session_ptx``). A case
    of this module that did not compile fails its tests, naming it; another module's failed
    case is that module's alone."""
    texts, errors = session_ptx[request.module.__name__]
    if errors:
        cid, why = next(iter(errors.items()))
        raise AssertionError(f"compiling the PTX of {sorted(errors)} failed; {cid!r}:\n{why}")
    return texts


def derived_memo(kind: str, fn, source_file: str, case: str) -> str:
    """Where a test keeps a pure function of the kernel's sources that is slow to derive
    (the GEMM store placement walk: 8.4 s of the H200's warm tier), like ``ptx_of``'s PTX:
    under the session's cache, by the kernel's source fingerprint, the toolchain (cute's
    layout algebra is the library's) and a hash of the deriving test file's own source, so
    an edit to any of them derives afresh. A test writes its result here only once every
    assertion on it has passed, and re-asserts what it reads back."""
    import hashlib

    from quack import settings
    from quack.cache import keys

    with open(source_file, "rb") as f:
        test_src = hashlib.sha256(f.read()).hexdigest()[:16]
    spec = fn.spec
    return os.path.join(
        str(settings.get().cache_dir),
        kind,
        spec.source_fingerprint(),
        keys.toolchain_stamp("sm_90a"),
        test_src,
        case + ".json",
    )


def read_memo(path: str):
    import json

    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):  # absent, or torn by a crash: derived afresh
        return None


def write_memo(path: str, value) -> None:
    """Atomically (a reader sees the whole file or none), as the cache publishes."""
    import json
    from pathlib import Path

    from quack.cache.fsutil import write_atomic

    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(Path(path), json.dumps(value, separators=(",", ":")).encode(), fsync=False)


# The verify-all test's build of every shipped manifest (test_reference_hooks_gpu.py), started
# in the background as the session's collection ends (tests/conftest.py) when that test is
# selected, a GPU is visible and the run is one process: on a cold cache the build (1,178
# configurations, 55-70 s on the H200's 16 cores) then overlaps the tests before it instead
# of running in line (cold --async-compile=16: 147.6 s, 67 s of it that build). CPU work
# only, niced below the plugin's compiles, which gate the tests; a no-op on a warm cache.
# Not under xdist: there the other workers keep the CPUs busy already.
_SHIPPED: dict = {}
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shipped_manifests() -> list[str]:
    import glob

    return sorted(glob.glob(os.path.join(_ROOT, "manifests", "*.toml")))


def session_kernel_cache() -> str:
    """The cache the ``kernel_cache`` fixture gives the kernel tiers."""
    from quack import settings

    return os.environ.get("QUACK_TEST_KERNEL_CACHE") or str(settings.get().cache_dir)


def _build_cmd():
    import sys

    jobs = str(min(16, os.cpu_count() or 1))
    return [sys.executable, "-m", "quack_build", "build", "-j", jobs, *shipped_manifests()]


def start_shipped_build(cache_dir: str) -> None:
    """Start the build of every shipped manifest into ``cache_dir`` (once a session)."""
    import subprocess
    import tempfile

    if cache_dir in _SHIPPED:
        return
    log = tempfile.TemporaryFile()
    p = subprocess.Popen(
        _build_cmd(),
        cwd=_ROOT,
        env=dict(os.environ, QUACK_CACHE_DIR=cache_dir),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    # the plugin's own compiles first: they gate tests. Set here, not in a preexec_fn (unsafe
    # in a process with threads, as torch's is); the build forks its workers after its imports
    with contextlib.suppress(OSError):  # already ended: nothing to lower
        os.setpriority(os.PRIO_PROCESS, p.pid, 10)
    _SHIPPED[cache_dir] = (p, log)


def finish_shipped_build(cache_dir: str, timeout: float) -> tuple[int, str]:
    """(exit status, output) of the shipped manifests' build into ``cache_dir``: the one
    started in the background, waited for; else one run now. Past ``timeout`` the build is
    killed and the status is 124."""
    import subprocess

    got = _SHIPPED.pop(cache_dir, None)
    if got is None:
        env = dict(os.environ, QUACK_CACHE_DIR=cache_dir)
        try:
            r = subprocess.run(
                _build_cmd(), cwd=_ROOT, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as e:
            return 124, f"the build took over {timeout:.0f} s: {e}"
        return r.returncode, r.stdout + r.stderr
    p, log = got
    try:
        rc = p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        rc = 124
    log.seek(0)
    out = log.read().decode("utf-8", "replace")
    log.close()
    return rc, out


def stop_shipped_builds() -> None:
    """End a background build no test waited for (deselected by -x, an interrupt)."""
    while _SHIPPED:
        _, (p, log) = _SHIPPED.popitem()
        if p.poll() is None:
            p.kill()
        p.wait()
        log.close()
