"""Benchmark our CuTe DSL kernels against the reference library (QuACK), torch eager and
torch.compile on the GPU, side by side in one run.

    python benchmarks/bench_kernels.py [--ops rmsnorm_fwd,softmax_fwd,...] [--no-compile]
        [--compile-ops OPS] [--no-eager] [--dtype bfloat16]
        [--shapes 32768x4096,32768x16384,32768x65536,4096x262144] [--allocs 3] [--reps 30]
        [--ref DIR] [--ref-ops OPS] [--ref-timeout S] [--json out.json]

Method (every column alike: ours, the reference, torch eager, torch.compile):
- Per op x shape, ``--allocs`` K input sets (default 3) are allocated side by side, all
  alive at once, so each lands elsewhere in device memory: the ~135 µs shapes spread by
  ~10 % between allocations of one binary (docs/kernels.md, "Measurement"). Inputs are
  pure torch, seeded per (shape, k): every process builds the same K sets.
- Each column makes its first call (compile / load) outside the timing, then on set k
  every column is timed once (median of ``--reps`` calls, CUDA events, L2 flushed before
  every call by writing a 256 MiB buffer) before any is timed on set k + 1; the columns'
  order rotates with k. A column's figure is the median of its K medians
  (``median_of_medians``); the JSON keeps the K medians.
- Effective bandwidth = bytes read + written / time (TB = 1e12 B).

``--ref DIR``: the reference library installed in DIR (``pip install --no-deps --target
DIR quack_kernels-0.6.4-py3-none-any.whl``). Its import name is ``quack``, like this
project's build system, so it runs in a worker subprocess (``--ref-worker``) with DIR first
on the path, which builds the same K input sets and is asked, between our columns, for
its time on set k (so its timings interleave with ours). Its replies are awaited with a
deadline (``--ref-timeout`` seconds in all): a late or dead worker ends its column only.
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "--ref-worker" not in sys.argv:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DEFAULT_SHAPES = [(32768, 4096), (32768, 16384), (32768, 65536), (4096, 262144)]


def bench(fn, reps=30, warmup=3, flush_mode="zero"):
    """Median µs of ``fn`` over ``reps``, L2 flushed before each: by writing a 256 MiB
    buffer ("zero", the figures of record) or by reading one ("read": leaves no dirty
    lines for the timed kernel to write back)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    if flush_mode == "read":
        flush.zero_()
        flush64 = flush.view(torch.int64)
        sink = torch.empty((), dtype=torch.int64, device="cuda")
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush_mode == "read":
            torch.sum(flush64, dim=0, out=sink)
        else:
            flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return ts[len(ts) // 2]


def rms_ref(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)


def rms_bwd_ref(x, w, dy, rstd):
    xf, dyf, wf = x.float(), dy.float(), w.float()
    xhat = xf * rstd[:, None]
    g = dyf * wf
    dx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd[:, None]
    return dx.to(x.dtype), (dyf * xhat).sum(0).to(w.dtype)


def ce_bwd_ref(x, t, dl, lse):
    p = torch.exp(x.float() - lse[:, None]) * dl[:, None]
    p.scatter_add_(1, t[:, None], -dl[:, None])
    return p.to(x.dtype)


def ln_bwd_ref(x, w, b, dy, mean, rstd):
    return torch.ops.aten.native_layer_norm_backward(
        dy, x, (x.shape[-1],), mean[:, None], rstd[:, None], w, b, [True, True, True]
    )


def _row_stats(x, layer):
    """(mean | None, rstd) of the rows in fp32, 4096 rows at a time (pure torch: the
    reference's worker process cannot import this project's kernels)."""
    m = x.shape[0]
    mean = torch.empty(m, device=x.device) if layer else None
    rstd = torch.empty(m, device=x.device)
    for i in range(0, m, 4096):
        xf = x[i : i + 4096].float()
        if layer:
            mu = xf.mean(-1)
            mean[i : i + 4096] = mu
            rstd[i : i + 4096] = torch.rsqrt(((xf - mu[:, None]) ** 2).mean(-1) + 1e-5)
        else:
            rstd[i : i + 4096] = torch.rsqrt(xf.pow(2).mean(-1) + 1e-6)
    return mean, rstd


def make_setups(dt):
    """name -> (setup(M, N) -> args, bytes(M, N)). Pure torch, seeded per shape: this
    process and the reference's worker build the same inputs."""
    es = torch.empty((), dtype=dt).element_size()
    w32 = torch.float32

    def rms_bwd_setup(m, n, wdt):
        x, w = rnd(m, n, dt), rnd(1, n, wdt)[0]
        return x, w, rnd(m, n, dt), _row_stats(x, False)[1]

    def ln_bwd_setup(m, n, wdt):
        x, w, b = rnd(m, n, dt), rnd(1, n, wdt)[0], rnd(1, n, wdt)[0]
        mean, rstd = _row_stats(x, True)
        return x, w, b, rnd(m, n, dt), mean, rstd

    def ce_bwd_setup(m, n):
        x, t = rnd(m, n, dt), torch.randint(0, n, (m,), device="cuda")
        lse = torch.cat([torch.logsumexp(x[i : i + 4096].float(), -1) for i in range(0, m, 4096)])
        return x, t, torch.rand(m, device="cuda"), lse

    return {
        # mixed precision: fp32 weight / bias with `dt` activations (the AMP setup)
        "rmsnorm_fwd_w32": (
            lambda m, n: (rnd(m, n, dt), rnd(1, n, w32)[0]),
            lambda m, n: 2 * m * n * es + n * 4 + 4 * m,
        ),
        "rmsnorm_bwd_w32": (
            lambda m, n: rms_bwd_setup(m, n, w32),
            lambda m, n: 3 * m * n * es + 2 * n * 4 + 4 * m,
        ),
        "layernorm_fwd_w32": (
            lambda m, n: (rnd(m, n, dt), rnd(1, n, w32)[0], rnd(1, n, w32)[0]),
            lambda m, n: 2 * m * n * es + 2 * n * 4 + 8 * m,
        ),
        "layernorm_bwd": (
            lambda m, n: ln_bwd_setup(m, n, dt),
            lambda m, n: 3 * m * n * es + 4 * n * es + 8 * m,
        ),
        "layernorm_bwd_w32": (
            lambda m, n: ln_bwd_setup(m, n, w32),
            lambda m, n: 3 * m * n * es + 4 * n * 4 + 8 * m,
        ),
        "rmsnorm_fwd": (
            lambda m, n: (rnd(m, n, dt), rnd(1, n, dt)[0]),
            lambda m, n: 2 * m * n * es + n * es + 4 * m,
        ),
        "softmax_fwd": (lambda m, n: (rnd(m, n, dt),), lambda m, n: 2 * m * n * es),
        "layernorm_fwd": (
            lambda m, n: (rnd(m, n, dt), rnd(1, n, dt)[0], rnd(1, n, dt)[0]),
            lambda m, n: 2 * m * n * es + 2 * n * es + 8 * m,
        ),
        "cross_entropy_fwd": (
            lambda m, n: (rnd(m, n, dt), torch.randint(0, n, (m,), device="cuda")),
            lambda m, n: m * n * es + 16 * m,
        ),
        "softmax_bwd": (
            lambda m, n: (rnd(m, n, dt), torch.softmax(rnd(m, n, dt), -1)),
            lambda m, n: 3 * m * n * es,
        ),
        "rmsnorm_bwd": (
            lambda m, n: rms_bwd_setup(m, n, dt),
            lambda m, n: 3 * m * n * es + 2 * n * es + 4 * m,
        ),
        "cross_entropy_bwd": (ce_bwd_setup, lambda m, n: 2 * m * n * es + 12 * m),
    }


def ours_fns():
    from quack_kernels.cross_entropy import cross_entropy_bwd, cross_entropy_fwd
    from quack_kernels.layernorm import layernorm_bwd, layernorm_fwd
    from quack_kernels.rmsnorm import rmsnorm_bwd, rmsnorm_fwd
    from quack_kernels.softmax import softmax_bwd, softmax_fwd

    def ln_bwd(x, w, b, dy, mean, rstd):
        return layernorm_bwd(x, w, dy, mean, rstd, b)

    return {
        "rmsnorm_fwd": rmsnorm_fwd,
        "rmsnorm_fwd_w32": rmsnorm_fwd,
        "rmsnorm_bwd": rmsnorm_bwd,
        "rmsnorm_bwd_w32": rmsnorm_bwd,
        "layernorm_fwd": layernorm_fwd,
        "layernorm_fwd_w32": layernorm_fwd,
        "layernorm_bwd": ln_bwd,
        "layernorm_bwd_w32": ln_bwd,
        "softmax_fwd": softmax_fwd,
        "softmax_bwd": softmax_bwd,
        "cross_entropy_fwd": cross_entropy_fwd,
        "cross_entropy_bwd": cross_entropy_bwd,
    }


def eager_fns():
    """The torch columns (eager, and torch.compile of the same function); the ``_w32``
    rows run the same mixed-precision math."""
    return {
        "rmsnorm_fwd": rms_ref,
        "rmsnorm_fwd_w32": rms_ref,
        "rmsnorm_bwd": rms_bwd_ref,
        "rmsnorm_bwd_w32": rms_bwd_ref,
        "layernorm_fwd": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        "layernorm_fwd_w32": lambda x, w, b: F.layer_norm(x.float(), (x.shape[-1],), w, b, 1e-5).to(x.dtype),
        "layernorm_bwd": ln_bwd_ref,
        "layernorm_bwd_w32": lambda x, w, b, dy, mean, rstd: ln_bwd_ref(
            x, w.to(x.dtype), b.to(x.dtype), dy, mean, rstd
        ),
        "softmax_fwd": lambda x: torch.softmax(x, -1),
        "softmax_bwd": lambda dy, y: torch._softmax_backward_data(dy, y, -1, dy.dtype),
        "cross_entropy_fwd": lambda x, t: F.cross_entropy(x.float(), t, reduction="none"),
        "cross_entropy_bwd": ce_bwd_ref,
    }


def ref_fns():
    """The reference library's entry points (``import quack`` must be the reference:
    only in the ``--ref-worker`` process)."""
    import importlib

    # the package re-exports functions under its submodules' names (quack.softmax is the
    # function after `import quack`): import the modules by their full names
    ce = importlib.import_module("quack.cross_entropy")
    rn = importlib.import_module("quack.rmsnorm")
    sm = importlib.import_module("quack.softmax")

    def ln_fwd(x, w, b):
        return rn.layernorm_fwd(x, w, b, eps=1e-5, return_rstd=True, return_mean=True)

    def ln_bwd(x, w, b, dy, mean, rstd):
        return rn.layernorm_bwd(x, w, dy, rstd, mean, has_bias=True)

    return {
        "rmsnorm_fwd": lambda x, w: rn.rmsnorm_fwd(x, w, eps=1e-6, store_rstd=True),
        "rmsnorm_fwd_w32": lambda x, w: rn.rmsnorm_fwd(x, w, eps=1e-6, store_rstd=True),
        "rmsnorm_bwd": lambda x, w, dy, rstd: rn.rmsnorm_bwd(x, w, dy, rstd),
        "rmsnorm_bwd_w32": lambda x, w, dy, rstd: rn.rmsnorm_bwd(x, w, dy, rstd),
        "layernorm_fwd": ln_fwd,
        "layernorm_fwd_w32": ln_fwd,
        "layernorm_bwd": ln_bwd,
        "layernorm_bwd_w32": ln_bwd,
        "softmax_fwd": sm.softmax_fwd,
        "softmax_bwd": sm.softmax_bwd,
        "cross_entropy_fwd": lambda x, t: ce.cross_entropy_fwd(x, t, return_lse=True),
        "cross_entropy_bwd": lambda x, t, dl, lse: ce.cross_entropy_bwd(x, t, dl, lse),
    }


def rnd(m, n, dt):
    return torch.randn(m, n, device="cuda", dtype=dt)


# ----------------------------------------------------------------------------- fair timing
# (pure logic: tests/kernels/test_bench_fair.py)


def median_of_medians(meds):
    """The figure of one column: the median of its per-allocation medians (the mean of the
    two middle ones for an even count); None when nothing was measured."""
    vals = sorted(v for v in meds if v is not None)
    if not vals:
        return None
    h = len(vals) // 2
    return vals[h] if len(vals) % 2 else (vals[h - 1] + vals[h]) / 2


def interleave_order(cols, k):
    """The columns' timing order on allocation ``k``: rotated by k, so that no column is
    always timed first (right after the inputs are written) or last."""
    cols = list(cols)
    if not cols:
        return cols
    k %= len(cols)
    return cols[k:] + cols[:k]


def best_peer_ratio(res, peers=("ref", "eager", "compile")):
    """best peer µs / ours µs (> 1: ours is faster), or None without both."""
    ours = res.get("ours")
    times = [res[k][0] for k in peers if res.get(k)]
    if not ours or not times:
        return None
    return min(times) / ours[0]


def seed_of(m, n, k):
    """The inputs' seed of allocation k of shape (m, n): the same in this process and in the
    reference worker."""
    return m * 1000003 + n + 7919 * k


def make_sets(setup, m, n, allocs, prep=None):
    """``allocs`` input sets of one op x shape, allocated side by side (all alive at once, so
    each lands elsewhere in device memory)."""
    sets = []
    for k in range(allocs):
        torch.manual_seed(seed_of(m, n, k))
        a = setup(m, n)
        sets.append(prep(*a) if prep else a)
    return sets


def first_call(f, a):
    """None or the error text: the first call (compile / load) outside the timing."""
    try:
        f(*a)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - a failing column must not cost the others
        return f"{type(e).__name__}: {str(e)[:200]}"


def time_fn(f, a, reps):
    """(µs, None) or (None, error text): the first call outside the timing (compile / load)."""
    err = first_call(f, a)
    if err:
        return None, err
    return bench(lambda: f(*a), reps=reps), None


def _fp32_affine(x, w, b, *rest):
    return (x, w.float(), b.float(), *rest)


# The reference's LayerNorm takes fp32 weight / bias only ("Weight must be float32"): its
# plain LayerNorm rows run with the weights cast to fp32 before the timing (compare them
# with our _w32 rows too).
REF_PREP = {"layernorm_fwd": _fp32_affine, "layernorm_bwd": _fp32_affine}


# ----------------------------------------------------------------------------- reference worker


def ref_worker(args, dt):
    """The reference library's column, served to the main process one allocation at a time
    (this process has the reference's install dir first on the path: its import name is
    ``quack`` too). Requests are JSON lines on stdin, replies ``@@``-prefixed JSON lines on
    stdout: {"cmd": "setup", "op", "m", "n", "allocs"} builds the input sets and makes the
    first call -> {"error"}; {"cmd": "time", "k"} -> {"us"} or {"error"}; {"cmd": "free"};
    EOF or {"cmd": "quit"} ends it."""
    sys.path.insert(0, args.ref)
    import quack

    def reply(**kw):
        sys.stdout.write("@@" + json.dumps(kw) + "\n")
        sys.stdout.flush()

    if not os.path.abspath(quack.__file__).startswith(os.path.abspath(args.ref)):
        reply(error=f"'quack' resolves to {quack.__file__}, not the reference in {args.ref}")
        return
    setups, fns = make_setups(dt), ref_fns()
    reply(ready=True)
    sets, fn = [], None
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.get("cmd")
        try:
            if cmd == "setup":
                sets, fn = [], fns[req["op"]]
                torch.cuda.empty_cache()
                setup = setups[req["op"]][0]
                sets = make_sets(setup, req["m"], req["n"], req["allocs"], REF_PREP.get(req["op"]))
                reply(error=first_call(fn, sets[0]))
            elif cmd == "time":
                a = sets[req["k"]]
                reply(us=bench(lambda: fn(*a), reps=req["reps"]))
            elif cmd == "free":
                sets = []
                torch.cuda.empty_cache()
                reply(ok=True)
            else:
                break
        except Exception as e:  # noqa: BLE001 - report, keep serving
            sets = [] if isinstance(e, torch.cuda.OutOfMemoryError) else sets
            torch.cuda.empty_cache()
            reply(error=f"{type(e).__name__}: {str(e)[:200]}")


class RefClient:
    """The ``--ref-worker`` subprocess, asked for the reference's time on allocation k
    between our columns' timings (so it runs under the same conditions, interleaved). Every
    reply is awaited with a deadline: the worker's total time is bounded by ``timeout_s``;
    a late or dead worker ends the reference column, not the benchmark."""

    def __init__(self, args, timeout_s):
        import queue
        import subprocess
        import tempfile
        import threading

        self.deadline = time.time() + timeout_s
        self.errlog = tempfile.NamedTemporaryFile("w+", suffix=".ref.log", delete=False)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--ref-worker",
            "--ref",
            args.ref,
            "--dtype",
            args.dtype,
        ]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([args.ref, os.environ.get("PYTHONPATH", "")]))
        self.p = subprocess.Popen(
            cmd,
            env=env,
            cwd=tempfile.gettempdir(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errlog,
            text=True,
        )
        self.q: queue.Queue = queue.Queue()

        def pump():
            for line in self.p.stdout:
                if line.startswith("@@"):
                    self.q.put(json.loads(line[2:]))
            self.q.put(None)  # EOF: the worker ended

        threading.Thread(target=pump, daemon=True).start()
        self.alive = True
        r = self._await()
        if r is None or not r.get("ready"):
            self.close(f"reference worker did not start: {r}")

    def _await(self):
        import queue

        try:
            return self.q.get(timeout=max(0.1, self.deadline - time.time()))
        except queue.Empty:
            return None

    def ask(self, **req):
        """The worker's reply (a dict), or None (and the column ends) when it is dead / late."""
        if not self.alive:
            return None
        try:
            self.p.stdin.write(json.dumps(req) + "\n")
            self.p.stdin.flush()
        except OSError:
            self.close("reference worker: gone")
            return None
        r = self._await()
        if r is None:
            self.close(
                f"reference worker: no reply to {req.get('cmd')!r} (it ended, or --ref-timeout ran out)"
            )
        return r

    def close(self, why=None):
        """End the worker: EOF on its stdin (it returns), or, after a failure (``why``), at
        once (a late worker may be stuck in a kernel or an import)."""
        if why:
            self.errlog.seek(0)
            print(f"{why}; its stderr tail: {self.errlog.read()[-800:]}", flush=True)
        self.alive = False
        if self.p.poll() is None:
            try:
                self.p.stdin.close()
            except OSError:
                pass
            try:
                self.p.wait(timeout=1 if why else 10)
            except Exception:  # noqa: BLE001 - still running: end it
                self.p.kill()
                self.p.wait(timeout=10)


# ----------------------------------------------------------------------------- main


def measure(name, m, n, setup, cols, ref, args):
    """One op x shape: {col: (median of medians µs, per-allocation medians)} and errors.
    ``cols``: column -> function (ours / eager / compile); ``ref``: a RefClient or None."""
    sets = make_sets(setup, m, n, args.allocs)
    meds = {c: [] for c in cols}
    errors = {}
    for c, f in list(cols.items()):
        err = first_call(f, sets[0])
        if err:
            errors[c] = err
            del cols[c], meds[c]
    use_ref = ref is not None and ref.alive
    if use_ref:
        r = ref.ask(cmd="setup", op=name, m=m, n=n, allocs=args.allocs)
        if r is None or r.get("error"):
            errors["ref"] = (r or {}).get("error") or "no reply"
            use_ref = False
            if r is not None:
                ref.ask(cmd="free")
        else:
            meds["ref"] = []
    order = list(cols) + (["ref"] if use_ref else [])
    for k in range(args.allocs):
        for c in interleave_order(order, k):
            if c == "ref":
                r = ref.ask(cmd="time", k=k, reps=args.reps)
                meds["ref"].append(r.get("us") if r else None)
                if r and r.get("error"):
                    errors["ref"] = r["error"]
            else:
                a = sets[k]
                meds[c].append(bench(lambda f=cols[c], a=a: f(*a), reps=args.reps))
    if use_ref:
        ref.ask(cmd="free")
    del sets
    return {c: (median_of_medians(v), v) for c, v in meds.items()}, errors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--ops",
        default="rmsnorm_fwd,softmax_fwd,cross_entropy_fwd,layernorm_fwd,rmsnorm_bwd,softmax_bwd,cross_entropy_bwd",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", default=",".join(f"{m}x{n}" for m, n in DEFAULT_SHAPES))
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument(
        "--compile-ops",
        default="rmsnorm_fwd,softmax_fwd,cross_entropy_fwd,layernorm_fwd,rmsnorm_bwd,layernorm_bwd",
        help="ops that get a torch.compile column",
    )
    ap.add_argument("--no-eager", action="store_true", help="skip the torch eager column")
    ap.add_argument("--ref", default=None, help="directory holding the reference library (quack 0.6.4)")
    ap.add_argument("--ref-ops", default=None, help="ops that get a reference column (default: all of --ops)")
    ap.add_argument(
        "--ref-timeout", type=int, default=900, help="seconds the reference worker may take in all"
    )
    ap.add_argument("--ref-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=30, help="timed calls per allocation (their median)")
    ap.add_argument("--allocs", type=int, default=3, help="input allocations per op x shape (K)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dt = getattr(torch, args.dtype)
    if args.ref_worker:
        return ref_worker(args, dt)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ops = args.ops.split(",")
    ref_ops = set(args.ref_ops.split(",") if args.ref_ops else ops) if args.ref else set()
    ref = RefClient(args, args.ref_timeout) if ref_ops else None
    setups, ours_all, eager_all = make_setups(dt), ours_fns(), eager_fns()
    rows = []
    print(
        f"device: {torch.cuda.get_device_name()}  dtype: {args.dtype}  (µs / TB/s: median over "
        f"{args.allocs} allocations of the median of {args.reps})"
    )
    cols = ("ours", "ref", "eager", "compile")
    heads = ("ours", "reference", "torch eager", "torch.compile")
    print(f"{'op':<18} {'M x N':>14} " + " ".join(f"{h:>17}" for h in heads) + "  ours vs best peer")
    # The reference worker ends with the run, also on an error or Ctrl-C: a worker stuck in
    # a kernel would otherwise outlive it.
    try:
        for name in ops:
            setup, nbytes = setups[name]
            fns = {"ours": ours_all[name]}
            if not args.no_eager:
                fns["eager"] = eager_all[name]
            if not args.no_compile and name in args.compile_ops.split(","):
                fns["compile"] = torch.compile(eager_all[name], dynamic=False)
            for m, n in shapes:
                try:
                    t0 = time.time()
                    got, errors = measure(
                        name, m, n, setup, dict(fns), ref if name in ref_ops else None, args
                    )
                    res = {"op": name, "m": m, "n": n, "wall_s": time.time() - t0, "allocs": args.allocs}
                    b = nbytes(m, n)
                    for col, (us, meds) in got.items():
                        res[col] = (us, b / us / 1e6) if us else None
                        res.setdefault("medians", {})[col] = meds
                    for col, err in errors.items():
                        print(f"  {col} failed: {err}")
                    res["vs_best_peer"] = best_peer_ratio(res)
                    rows.append(res)

                    def cell(k):
                        v = res.get(k)
                        return f"{v[0]:9.0f} / {v[1]:4.2f}" if v else f"{'-':>16}"

                    sp = f"{res['vs_best_peer']:.3f}x" if res["vs_best_peer"] else ""
                    print(
                        f"{name:<18} {f'{m}x{n}':>14} "
                        + " ".join(f"{cell(k):>17}" for k in cols)
                        + f"  {sp}",
                        flush=True,
                    )
                except torch.cuda.OutOfMemoryError:
                    print(f"{name:<18} {f'{m}x{n}':>14}  OOM")
                torch.cuda.empty_cache()
                if args.json:  # after every row: a run stopped by its time limit keeps what it measured
                    with open(args.json + ".tmp", "w") as f:
                        json.dump(rows, f, indent=1)
                    os.replace(args.json + ".tmp", args.json)
    finally:
        if ref is not None:
            ref.close()


if __name__ == "__main__":
    main()
