"""Benchmark our CuTe DSL kernels against the reference library (QuACK), torch eager and
torch.compile on the GPU, side by side in one run.

    python benchmarks/bench_kernels.py [--ops rmsnorm_fwd,softmax_fwd,...] [--no-compile]
        [--dtype bfloat16] [--shapes 32768x4096,32768x16384,32768x65536,4096x262144]
        [--ref DIR] [--ref-ops OPS] [--json out.json]

Median kernel time over reps (CUDA events, L2 flushed before every rep by writing a
256 MiB buffer), effective bandwidth = bytes read + written / time (TB = 1e12 B).

``--ref DIR``: the reference library installed in DIR (``pip install --no-deps --target
DIR quack_kernels-0.6.4-py3-none-any.whl``). Its import name is ``quack``, like this
project's build system, so it runs in a subprocess (``--ref-worker``) with DIR first on
the path: same inputs (pure torch setups, same seed), same timing function; its figures
become the ``ref`` column of the table and the JSON.
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


def time_fn(f, a, reps):
    """(µs, None) or (None, error text): the first call outside the timing (compile / load)."""
    try:
        f(*a)
        torch.cuda.synchronize()
        return bench(lambda: f(*a), reps=reps), None
    except Exception as e:  # noqa: BLE001 - a failing column must not cost the others
        return None, f"{type(e).__name__}: {str(e)[:200]}"


def _fp32_affine(x, w, b, *rest):
    return (x, w.float(), b.float(), *rest)


# The reference's LayerNorm takes fp32 weight / bias only ("Weight must be float32"): its
# plain LayerNorm rows run with the weights cast to fp32 before the timing (compare them
# with our _w32 rows too).
REF_PREP = {"layernorm_fwd": _fp32_affine, "layernorm_bwd": _fp32_affine}


def ref_worker(args, dt, shapes, ops):
    """Time the reference library alone (this process has its install dir first on the
    path); one JSON row per op x shape to ``args.json``."""
    sys.path.insert(0, args.ref)
    import quack

    if not os.path.abspath(quack.__file__).startswith(os.path.abspath(args.ref)):
        raise SystemExit(
            f"--ref-worker: 'quack' resolves to {quack.__file__}, not the reference in {args.ref}"
        )
    setups, fns, rows = make_setups(dt), ref_fns(), []
    for name in ops:
        setup, nbytes = setups[name]
        for m, n in shapes:
            torch.manual_seed(m * 1000003 + n)
            a = REF_PREP.get(name, lambda *t: t)(*setup(m, n))
            us, err = time_fn(fns[name], a, args.reps)
            rows.append(
                dict(op=name, m=m, n=n, ref=(us, nbytes(m, n) / us / 1e6) if us else None, ref_error=err)
            )
            print(f"ref {name} {m}x{n}: {f'{us:.0f} us' if us else err}", flush=True)
            del a
            torch.cuda.empty_cache()
            # after every row: a timed-out worker still leaves what it measured
            with open(args.json + ".tmp", "w") as f:
                json.dump(rows, f)
            os.replace(args.json + ".tmp", args.json)


def run_ref(args, ops, timeout_s):
    """The reference's figures {(op, m, n): row} from a ``--ref-worker`` subprocess."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ref.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--ref-worker", "--ref", args.ref, "--json", out]
        cmd += [
            "--ops",
            ",".join(ops),
            "--dtype",
            args.dtype,
            "--shapes",
            args.shapes,
            "--reps",
            str(args.reps),
        ]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([args.ref, os.environ.get("PYTHONPATH", "")]))
        try:
            p = subprocess.run(cmd, env=env, cwd=d, timeout=timeout_s, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"reference worker failed (rc={p.returncode}): {(p.stderr or p.stdout)[-1500:]}")
        except subprocess.TimeoutExpired:
            print(f"reference worker: stopped after {timeout_s} s (rows measured so far are kept)")
        if not os.path.exists(out):
            return {}
        with open(out) as f:
            return {(r["op"], r["m"], r["n"]): r for r in json.load(f)}


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
    ap.add_argument("--ref-timeout", type=int, default=900)
    ap.add_argument("--ref-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dt = getattr(torch, args.dtype)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ops = args.ops.split(",")
    if args.ref_worker:
        return ref_worker(args, dt, shapes, ops)
    ref_rows = {}
    if args.ref:
        ref_ops = [o for o in (args.ref_ops.split(",") if args.ref_ops else ops) if o in ops]
        ref_rows = run_ref(args, ref_ops, args.ref_timeout)
    setups, ours_all, eager_all = make_setups(dt), ours_fns(), eager_fns()
    rows = []
    print(f"device: {torch.cuda.get_device_name()}  dtype: {args.dtype}  (µs / TB/s, median of {args.reps})")
    cols = ("ours", "ref", "eager", "compile")
    heads = ("ours", "reference", "torch eager", "torch.compile")
    print(f"{'op':<18} {'M x N':>14} " + " ".join(f"{h:>17}" for h in heads) + "  ours vs best peer")
    for name in ops:
        setup, nbytes = setups[name]
        ours, eager = ours_all[name], None if args.no_eager else eager_all[name]
        compiled = None
        if not args.no_compile and name in args.compile_ops.split(","):
            compiled = torch.compile(eager_all[name], dynamic=False)
        for m, n in shapes:
            try:
                torch.manual_seed(m * 1000003 + n)
                a = setup(m, n)
                t0 = time.time()
                ours(*a)
                torch.cuda.synchronize()
                res = {"op": name, "m": m, "n": n, "first_call_s": time.time() - t0}
                b = nbytes(m, n)
                for col, f in (("ours", ours), ("eager", eager), ("compile", compiled)):
                    if f is None:
                        continue
                    us, err = time_fn(f, a, args.reps)
                    res[col] = (us, b / us / 1e6) if us else None
                    if err:
                        print(f"  {col} failed: {err}")
                r = ref_rows.get((name, m, n))
                if r is not None:
                    res["ref"] = r["ref"]
                    if r.get("ref_error"):
                        print(f"  ref failed: {r['ref_error']}")
                rows.append(res)

                def cell(k):
                    v = res.get(k)
                    return f"{v[0]:9.0f} / {v[1]:4.2f}" if v else f"{'-':>16}"

                peers = [res[k][0] for k in ("ref", "eager", "compile") if res.get(k)]
                sp = f"{min(peers) / res['ours'][0]:.3f}x" if peers and res.get("ours") else ""
                res["vs_best_peer"] = min(peers) / res["ours"][0] if peers and res.get("ours") else None
                print(
                    f"{name:<18} {f'{m}x{n}':>14} " + " ".join(f"{cell(k):>17}" for k in cols) + f"  {sp}",
                    flush=True,
                )
                del a
                torch.cuda.empty_cache()
            except torch.cuda.OutOfMemoryError:
                print(f"{name:<18} {f'{m}x{n}':>14}  OOM")
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
