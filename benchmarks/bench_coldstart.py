"""Runtime cold start (issue 15): a fresh process, after ``import torch``, to its first kernels.

    python benchmarks/bench_coldstart.py [--baseline PATH] [--n 15] [--launch] [--out FILE]

One self-contained command: builds the benchmark's kernels (four families, bf16) into a
private cache per checkout with that checkout's own ``quack build``, then measures in fresh
processes (prebuilt mode, cwd without a quack.toml), ours and the baseline alternating so
load on the machine hits both alike, and prints medians side by side:

  - import of the kernel modules (softmax, rmsnorm, layernorm, cross_entropy), after torch
  - first kernel loaded (load only: the compile function returns the callable; of it, the
    loader's share and tvm_ffi's import), and each further kernel of another family; with
    ``--launch`` (GPU) the first kernel RESULT in stages: 1 load, 2 first call until the
    host returns (argument conversion, the CUDA load of the kernel's cubin, the enqueue),
    3 synchronize; each kernel's launch time (median of its later calls), and each further
    kernel's first use minus its launch time. Notes per checkout: how tvm_ffi was imported,
    and on a GPU the torch version and whether torch offers tvm-ffi its C DLPack exchange
    API (without it tvm_ffi loads, or first builds, a torch extension at import)
  - ``import quack`` (in process) and ``quack --help`` (whole process, wall)

``--baseline PATH`` is another checkout of the repository (a copy of main); each checkout
runs with its own ``quack``/``quack_build`` on PYTHONPATH and its ``kernels/`` as
``quack_kernels``, in the same interpreter. Byte-compiled files go to a private
PYTHONPYCACHEPREFIX (warmed by one unmeasured run) as in an installed package;
``--no-bytecode`` adds PYTHONDONTWRITEBYTECODE=1, so nothing is byte-compiled and every
import (torch and site-packages too) compiles its source. Writes JSON to ``--out``.

On the GPU machine (no git there), extract the baseline into an ignored folder and carry
it: ``mkdir -p .device/coldstart-base && git archive main | tar -x -C .device/coldstart-base``,
then run (carry ``.device/coldstart-base``; about 1 MB)
``python benchmarks/bench_coldstart.py --launch --baseline .device/coldstart-base --out $OUT/coldstart.json``.
With git, ``--baseline-ref main`` does the extraction itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (family module, compile function, its arguments as the torch op passes them)
KERNELS = [
    ("softmax", "compile_softmax_fwd", ("bfloat16", 4096)),
    ("rmsnorm", "compile_rmsnorm_fwd", ("bfloat16", 4096, True, False, False)),
    ("layernorm", "compile_layernorm_fwd", ("bfloat16", 4096, True, True)),
    ("cross_entropy", "compile_cross_entropy_fwd", ("bfloat16", 32768)),
]

MANIFEST = """[defaults]
archs = ["{arch}"]
[[kernel]]
name = "softmax_fwd"
[kernel.params]
dtype = "bfloat16"
n = 4096
[[kernel]]
name = "rmsnorm_fwd"
[kernel.params]
dtype = "bfloat16"
n = 4096
has_weight = true
has_bias = false
has_residual = false
[[kernel]]
name = "layernorm_fwd"
[kernel.params]
dtype = "bfloat16"
n = 4096
has_weight = true
has_bias = true
[[kernel]]
name = "cross_entropy_fwd"
[kernel.params]
dtype = "bfloat16"
n = 32768
"""

# The measured child. Timers start after `import torch`; `--launch` allocates the inputs
# (CUDA context included) before the clock starts, so what is timed is ours + the launch.
# Each kernel's first use is timed in stages: its load (the compile function returns the
# callable), then with --launch its first call (until the host call returns: argument
# conversion, the CUDA library load of its cubin, the enqueue) and the synchronize (the
# kernel itself); later calls give its launch time. The same code runs against the
# baseline checkout, so what only ours has is read defensively.
CHILD = r"""
import json, sys, time
pc = time.perf_counter
t0 = pc()
import torch
t_torch = pc()
launch = {launch!r}
kernels = {kernels!r}
if launch:
    if not torch.cuda.is_available():
        sys.exit("--launch needs a CUDA GPU: torch.cuda.is_available() is False")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    M, N = 4096, 4096
    x = torch.randn(M, N, device=dev, dtype=torch.bfloat16, generator=g)
    w = torch.randn(N, device=dev, dtype=torch.bfloat16, generator=g)
    b = torch.randn(N, device=dev, dtype=torch.bfloat16, generator=g)
    logits = torch.randn(M, 32768, device=dev, dtype=torch.bfloat16, generator=g)
    target = torch.randint(0, 32768, (M,), device=dev, generator=g)
    torch.cuda.synchronize()
t_inputs = pc()
import importlib
mods = [importlib.import_module("quack_kernels." + fam) for fam, _, _ in kernels]
t_import = pc()
ops = {{
    "softmax": lambda m: m.softmax_fwd(x),
    "rmsnorm": lambda m: m.rmsnorm_fwd(x, w),
    "layernorm": lambda m: m.layernorm_fwd(x, w, b),
    "cross_entropy": lambda m: m.cross_entropy_fwd(logits, target),
}}
load, call, sync, later = [], [], [], []
ffi_info = None
# Garbage collections during each load: where a gen-1 collection falls (~1 ms here) moves
# with what ran before (an import that allocates less), not with the load's own work.
import gc
gc_marks, gc_s = [], []
gc.callbacks.append(lambda phase, info: gc_marks.append((phase, pc())))
for m, (fam, fn, args) in zip(mods, kernels):
    gc_marks.clear()
    t = pc()
    f = getattr(m, fn)(*args)
    load.append(pc() - t)
    gc_s.append(sum(b[1] - a[1] for a, b in zip(gc_marks[::2], gc_marks[1::2])))
    assert callable(f)
    if ffi_info is None:
        try:
            from quack.runtime import ffi
            ffi_info = ffi.info()
        except ImportError:  # a checkout without it: tvm_ffi imported whole, inside the load
            ffi_info = {{"how": "plain import", "import_s": None}}
        try:  # cutlass-dsl's runtime library, loaded by the first load (third party)
            from quack.runtime import loader as _ldr
            ffi_info["runtime_lib_s"] = _ldr.runtime_load_s()
        except (ImportError, AttributeError):
            pass
        # cuda-python's driver bindings: does the first load import them (17 ms on the H200)?
        ffi_info["driver_bindings_after_first_load"] = "cuda.bindings.driver" in sys.modules
    if launch:
        t = pc()
        ops[fam](m)
        t1 = pc()
        torch.cuda.synchronize()
        call.append(t1 - t)
        sync.append(pc() - t1)
        reps = []  # this kernel's launch time: the median of its later calls
        for _ in range(5):
            t = pc()
            ops[fam](m)
            torch.cuda.synchronize()
            reps.append(pc() - t)
        later.append(sorted(reps)[len(reps) // 2])
how, loader_s = [], []
for m, (fam, fn, args) in zip(mods, kernels):
    for u in getattr(m, fn).usage():
        how.append(u.get("how"))
        loader_s.append(u.get("load_s"))
extra = {{}}
if launch:
    opt = sys.modules.get("tvm_ffi._optional_torch_c_dlpack")
    extra = {{"torch": torch.__version__,
              "torch_c_dlpack_exchange": hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
              "tvm_ffi_torch_addon_loaded": getattr(opt, "_LIB", None) is not None}}
print(json.dumps({{"import_torch": t_torch - t0, "inputs": t_inputs - t_torch,
                  "import_kernels": t_import - t_inputs, "load": load, "call": call, "sync": sync,
                  "later": later, "how": how, "loader_s": loader_s, "ffi": ffi_info, "extra": extra,
                  "gc_s": gc_s,
                  "cutlass_imported": "cutlass" in sys.modules,
                  "tvm_ffi_imported": "tvm_ffi" in sys.modules}}))
"""

# `import quack` alone (no torch: what the CLI pays), then, after torch, tvm-ffi's own
# import, whole: third party, for scale. Before it, what tvm_ffi's Cython core imports if
# torch has not (cuda-python's driver bindings): inside every first load when it is so.
IMPORT_QUACK = r"""
import json, sys, time
t = time.perf_counter()
import quack
t_quack = time.perf_counter() - t
import torch
cuda_pre = "cuda.bindings.driver" in sys.modules
t = time.perf_counter()
try:
    from cuda.bindings import driver
except ImportError:
    pass
t_cuda = time.perf_counter() - t
t = time.perf_counter()
import tvm_ffi
print(json.dumps({"import_quack": t_quack, "import_tvm_ffi": time.perf_counter() - t,
                  "import_cuda_bindings": t_cuda, "cuda_bindings_by_torch": cuda_pre}))
"""


class Checkout:
    """One source tree, run with its own packages on PYTHONPATH."""

    def __init__(self, label: str, src: Path, work: Path, a):
        self.label, self.src = label, src.resolve()
        if not (self.src / "quack" / "__init__.py").is_file() or not (self.src / "kernels").is_dir():
            sys.exit(f"{label}: {self.src} is not a quack checkout (needs quack/ and kernels/)")
        self.dir = work / label
        shim = self.dir / "shim"
        shim.mkdir(parents=True)
        # kernels/ is installed as quack_kernels: a link gives each checkout its own.
        (shim / "quack_kernels").symlink_to(self.src / "kernels", target_is_directory=True)
        self.cache = self.dir / "cache"
        self.cwd = self.dir / "cwd"  # no quack.toml above it: settings from env only
        self.cwd.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("QUACK_")}
        # This checkout first; what the caller's PYTHONPATH holds (staged site packages on
        # the GPU machine) after it.
        env.update(
            PYTHONPATH=os.pathsep.join(p for p in (str(shim), str(self.src), env.get("PYTHONPATH")) if p),
            QUACK_CACHE_DIR=str(self.cache),
            QUACK_ARCH=a.arch,
            QUACK_MODE="prebuilt",
        )
        # A private pycache either way: __pycache__ folders lying in a checkout are never read.
        env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
        if a.no_bytecode:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        else:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.env = env

    def run(self, args: list[str], timeout: float = 600.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args],
            env=self.env,
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def build(self, manifest: Path, jobs: int) -> None:
        env = dict(self.env, QUACK_MODE="jit")
        r = subprocess.run(
            [sys.executable, "-m", "quack_build", "build", str(manifest), "-j", str(jobs)],
            env=env,
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if r.returncode != 0:
            sys.exit(f"{self.label}: quack build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")

    def child(self, code: str) -> dict:
        r = self.run(["-c", code])
        if r.returncode != 0:
            sys.exit(f"{self.label}: measurement failed:\n{r.stderr[-4000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def help_wall(self) -> float:
        t = time.perf_counter()
        r = self.run(["-m", "quack_build", "--help"], timeout=120)
        wall = time.perf_counter() - t
        if r.returncode != 0:
            sys.exit(f"{self.label}: quack --help failed:\n{r.stderr[-2000:]}")
        return wall


def measure(co: Checkout, launch: bool) -> dict:
    r = co.child(CHILD.format(launch=launch, kernels=KERNELS))
    if r["cutlass_imported"]:
        sys.exit(f"{co.label}: the compiler (cutlass) was imported in prebuilt mode")
    if len(r["how"]) != len(KERNELS):
        sys.exit(f"{co.label}: expected {len(KERNELS)} loaded kernels, got {r['how']}")
    # A kernel's first use: its load, plus with --launch its first call and synchronize.
    firsts = [ld + (r["call"][i] + r["sync"][i] if launch else 0.0) for i, ld in enumerate(r["load"])]
    out = {
        "import_kernels": r["import_kernels"],
        "first_load": r["load"][0],
        "first_loader": r["loader_s"][0] or 0.0,
        "first_gc": r["gc_s"][0],
        "first_kernel": firsts[0],
        "import_plus_first": r["import_kernels"] + firsts[0],
    }
    imp = (r.get("ffi") or {}).get("import_s")
    if imp is not None:
        out["first_tvm_ffi"] = imp
    rt = (r.get("ffi") or {}).get("runtime_lib_s")
    if rt is not None:
        out["first_runtime_lib"] = rt
    if imp is not None and rt is not None:
        # What the first load costs that is not third party's own work: the load minus
        # tvm_ffi's import, the runtime library's dlopen and the collector's passes.
        out["first_ours"] = r["load"][0] - imp - rt - r["gc_s"][0]
    if launch:
        out["first_call"] = r["call"][0]
        out["first_sync"] = r["sync"][0]
        out["first_launch_only"] = r["later"][0]
        out["first_call_sync_over_launch"] = r["call"][0] + r["sync"][0] - r["later"][0]
        out["inputs_cuda_init"] = r["inputs"]
    for i, (fam, _, _) in enumerate(KERNELS[1:], 1):
        out[f"further:{fam}"] = firsts[i] - (r["later"][i] if launch else 0.0)
    out["further_median"] = statistics.median(out[f"further:{f}"] for f, _, _ in KERNELS[1:])
    out["import_torch"] = r["import_torch"]
    q = co.child(IMPORT_QUACK)
    out["import_quack"] = q["import_quack"]
    out["import_tvm_ffi"] = q["import_tvm_ffi"]
    out["import_cuda_bindings"] = q["import_cuda_bindings"]
    out["quack_help_wall"] = co.help_wall()
    # Not figures: how tvm_ffi came in, and on a GPU what torch offers it (a torch without
    # the C DLPack exchange API makes tvm_ffi load, or first build, a torch extension).
    out["_notes"] = {
        "ffi": r.get("ffi"),
        "cuda_bindings_imported_by_torch": q["cuda_bindings_by_torch"],
        **(r.get("extra") or {}),
    }
    return out


ROWS = [
    ("import_kernels", "import kernel modules (4 families)", 10.0),
    ("first_kernel", "first kernel loaded", 10.0),
    ("first_loader", "  of which: the loader (.so, tvm-ffi)", None),
    ("first_tvm_ffi", "  of which: tvm_ffi import (as done)", None),
    ("first_runtime_lib", "  of which: cute-dsl runtime lib (3rd p.)", None),
    ("first_gc", "  of which: garbage collection", None),
    ("first_ours", "  the rest: quack's own work", None),
    ("import_tvm_ffi", "plain `import tvm_ffi` (3rd party)", None),
    ("import_cuda_bindings", "  cuda.bindings.driver, if torch didn't", None),
    ("further_median", "further family, median of 3", 2.0),
    ("further:rmsnorm", "  rmsnorm_fwd", None),
    ("further:layernorm", "  layernorm_fwd", None),
    ("further:cross_entropy", "  cross_entropy_fwd", None),
    ("import_quack", "import quack", None),
    ("quack_help_wall", "quack --help (process wall)", None),
    ("import_torch", "import torch (context)", None),
]
LAUNCH_ROWS = [
    ("import_kernels", "import kernel modules (4 families)", 10.0),
    ("first_kernel", "first kernel RESULT (load+call+sync)", None),
    ("import_plus_first", "import + first RESULT", 50.0),
    ("first_load", "  1 load (compile fn returns)", None),
    ("first_loader", "    of which: the loader", None),
    ("first_tvm_ffi", "    of which: tvm_ffi import", None),
    ("first_runtime_lib", "    of which: cute-dsl runtime .so", None),
    ("first_gc", "    of which: garbage collection", None),
    ("first_ours", "    the rest: quack's own work", None),
    ("first_call", "  2 first call, host (conv+cubin+enqueue)", None),
    ("first_sync", "  3 synchronize (the kernel runs)", None),
    ("first_launch_only", "  its launch alone (later call+sync)", None),
    ("first_call_sync_over_launch", "  first call+sync over a later one", None),
    ("import_tvm_ffi", "plain `import tvm_ffi` (3rd party)", None),
    ("import_cuda_bindings", "  cuda.bindings.driver, if torch didn't", None),
    ("further_median", "further family first use - launch", 5.0),
    ("further:rmsnorm", "  rmsnorm_fwd", None),
    ("further:layernorm", "  layernorm_fwd", None),
    ("further:cross_entropy", "  cross_entropy_fwd", None),
    ("import_quack", "import quack", None),
    ("quack_help_wall", "quack --help (process wall)", None),
    ("inputs_cuda_init", "inputs + CUDA init (context)", None),
    ("import_torch", "import torch (context)", None),
]


def extract_ref(ref: str, dest: Path) -> Path:
    import io
    import tarfile

    r = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", ref], capture_output=True, timeout=300
    )
    if r.returncode != 0:
        sys.exit(f"git archive {ref} failed: {r.stderr.decode(errors='replace').strip()}")
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tf:
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.11.4
        tf.extractall(dest, **kw)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout (a copy of main)")
    ap.add_argument(
        "--baseline-ref",
        default=None,
        help="or a git ref of this repository (needs git): extracted with git archive",
    )
    ap.add_argument("--n", type=int, default=15, help="fresh processes per checkout (median)")
    ap.add_argument("--launch", action="store_true", help="GPU: time the first RESULT (launch + sync)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument("--arch", default=os.environ.get("QUACK_ARCH", "sm_90a"))
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument(
        "--no-bytecode",
        action="store_true",
        help="PYTHONDONTWRITEBYTECODE=1 with an empty pycache: every import compiles its source",
    )
    ap.add_argument("--keep", action="store_true", help="keep the work directory (caches)")
    a = ap.parse_args()
    if a.n < 1:
        ap.error("--n must be >= 1")
    work = Path(tempfile.mkdtemp(prefix="quack-coldstart-"))
    try:
        manifest = work / "coldstart.toml"
        manifest.write_text(MANIFEST.format(arch=a.arch))
        cos = [Checkout("ours", ROOT, work, a)]
        if a.baseline_ref is not None:
            a.baseline = extract_ref(a.baseline_ref, work / "baseline-src")
        if a.baseline is not None:
            cos.append(Checkout("baseline", a.baseline, work, a))
        for co in cos:
            t = time.perf_counter()
            co.build(manifest, a.jobs)
            print(
                f"# {co.label}: built {len(KERNELS)} kernels into {co.cache} in "
                f"{time.perf_counter() - t:.1f} s",
                flush=True,
            )
        for co in cos:  # one unmeasured run: byte-compile, first-run-after-build work
            measure(co, a.launch)
        runs: dict[str, list[dict]] = {co.label: [] for co in cos}
        for i in range(a.n):  # alternate (and swap who goes first), so load hits both alike
            for co in cos if i % 2 == 0 else cos[::-1]:
                runs[co.label].append(measure(co, a.launch))
        report(cos, runs, a, work)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"# kept {work}")


def report(cos, runs, a, work) -> None:
    def figures(rs, pick):  # per key over the runs; "_notes" is not a figure
        return {k: pick(r[k] for r in rs) for k in rs[0] if not k.startswith("_")}

    med = {lbl: figures(rs, statistics.median) for lbl, rs in runs.items()}
    low = {lbl: figures(rs, min) for lbl, rs in runs.items()}
    notes = {lbl: rs[-1].get("_notes") for lbl, rs in runs.items()}
    rows = LAUNCH_ROWS if a.launch else ROWS
    base = "baseline" in med
    mode = "launch (GPU)" if a.launch else "load only"
    print(
        f"\ncold start, {mode}, median of {a.n} fresh processes, ms after `import torch`"
        + (" (bytecode off)" if a.no_bytecode else "")
    )
    head = (
        f"{'measure':38s} {'ours':>9s}"
        + (f" {'baseline':>9s} {'ratio':>7s}" if base else "")
        + f" {'goal':>7s}   {'min: ours':>9s}"
        + (f" {'baseline':>9s}" if base else "")
    )
    print(head)
    print("-" * len(head))
    for key, name, goal in rows:
        if key not in med["ours"]:
            continue
        o = med["ours"][key] * 1e3
        line = f"{name:38s} {o:9.2f}"
        has_b = base and key in med["baseline"]  # a stage the baseline doesn't report: "-"
        if base:
            b = med["baseline"][key] * 1e3 if has_b else 0.0
            line += f" {b:9.2f} {(o / b if b else float('nan')):6.2f}x" if has_b else f" {'-':>9s} {'':>7s}"
        line += f" {('<= ' + format(goal, 'g')) if goal else '':>7s}   {low['ours'][key] * 1e3:9.2f}"
        if base:
            line += f" {low['baseline'][key] * 1e3:9.2f}" if has_b else f" {'-':>9s}"
        print(line)
    for lbl, n in notes.items():
        print(f"# {lbl}: {json.dumps(n)}")
    doc = {
        "mode": mode,
        "n": a.n,
        "arch": a.arch,
        "bytecode": not a.no_bytecode,
        "python": sys.version.split()[0],
        "host": os.uname().nodename,
        "kernels": [{"family": f, "compile_fn": fn, "args": list(args)} for f, fn, args in KERNELS],
        "checkouts": {co.label: str(co.src) for co in cos},
        "median_s": med,
        "min_s": low,
        "notes": notes,
        "runs": runs,
    }
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1))
        print(f"# wrote {a.out}")


if __name__ == "__main__":
    main()
