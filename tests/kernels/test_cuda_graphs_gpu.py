"""GPU tier: quack's ops inside CUDA graphs, as the servers that run them use them (vLLM and
SGLang capture their decode steps; ``torch.cuda.make_graphed_callables`` and
torch.compile's "reduce-overhead" mode do the same for training steps). A captured op must
launch on the capturing stream, synchronise nothing with the host and allocate only from
the graph's pool; a replay over new inputs must give the eager call's bits. A kernel left
out of the graph (launched on another stream, or only at capture) would leave the replay's
outputs at the captured inputs' values, which the second set of inputs catches.

The configurations are the eager tests' (tests/kernels/_requests.py maps these tests to
their keys, all in manifests/tests.toml)."""

import copy

import pytest
import test_gemm_gpu  # its ODD shape and STREAM_K configurations
from _fixtures import poison_allocations  # noqa: F401  (a fixture, used by name)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ODD = test_gemm_gpu.ODD[1:]  # M, N, K: tails in all three
# test_gemm_gpu.STREAM_K's 256 x 128 twin (cluster tiles of 256 x 256) on SK_MNK: 8 x 9 = 72
# cluster tiles for the H200's 66 resident clusters, less than two waves, so every tile is in
# the stream-K region and cut along K (_gemm_plan.stream_k_tiles): the workspace, the flags'
# memset and the fix-up all in the graph. (On ODD the grid would be its 20 tiles, one wave,
# and no tile cut.)
_TM, _TN, _CM, _CN, _SW = test_gemm_gpu.STREAM_K[1]
SK = dict(tile_m=_TM, tile_n=_TN, cluster_m=_CM, cluster_n=_CN, schedule="coop", swizzle=_SW, raster_m=True)
SK_MNK = (2048, 2304, 256)


def _fill(tensors: dict, seed: int) -> None:
    """New values into the captured inputs, in place (a graph replays on its addresses)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name, t in tensors.items():
        if name == "target":  # class indices, some ignored (-100): the mean's count varies
            t.copy_(torch.randint(0, 1000, t.shape, generator=g, device="cuda"))
            t[torch.randint(0, t.numel(), (5,), generator=g, device="cuda")] = -100
        else:
            t.copy_(torch.randn(t.shape, generator=g, device="cuda").to(t.dtype))


def _inputs() -> dict:
    bf = torch.bfloat16
    m, n, k = ODD
    kw = dict(device="cuda")
    t = {
        "x": torch.empty(64, 4096, dtype=bf, **kw),
        "w": torch.empty(4096, dtype=bf, **kw),
        "logits": torch.empty(64, 1000, **kw),
        "target": torch.empty(64, dtype=torch.int64, **kw),
        "a": torch.empty(m, k, dtype=bf, **kw),
        "b": torch.empty(k, n, dtype=bf, **kw),
        "bias": torch.empty(n, dtype=bf, **kw),
        "a_sk": torch.empty(SK_MNK[0], SK_MNK[2], dtype=bf, **kw),
        "b_sk": torch.empty(SK_MNK[1], SK_MNK[2], dtype=bf, **kw),  # .t(): (K, N), unit stride along K
        # the family wrappers' forward + backward pairs (LayerNorm, softmax, cross-entropy)
        "xl": torch.empty(64, 1000, dtype=bf, **kw),
        "wl": torch.empty(1000, dtype=bf, **kw),
        "bl": torch.empty(1000, dtype=bf, **kw),
        "dyl": torch.empty(64, 1000, dtype=bf, **kw),
        "dys": torch.empty(64, 1000, **kw),
        "dloss": torch.empty(64, **kw),
    }
    _fill(t, 0)
    return t


@pytest.mark.usefixtures("poison_allocations")  # NaN-filled outputs: an unwritten element fails
def test_ops_replay_in_a_cuda_graph_with_the_eager_bits():
    from quack_kernels import ops
    from quack_kernels._configs import GemmConfig
    from quack_kernels.cross_entropy import cross_entropy_bwd, cross_entropy_fwd
    from quack_kernels.layernorm import layernorm_bwd, layernorm_fwd
    from quack_kernels.softmax import softmax_bwd, softmax_fwd

    from quack.tuning import use_config

    t = _inputs()
    sk = GemmConfig(stream_k=True, **SK)

    def sk_gemm():
        with use_config("gemm", sk):
            return ops.gemm(t["a_sk"], t["b_sk"].t())

    def layernorm_both():
        y, mean, rstd = layernorm_fwd(t["xl"], t["wl"], t["bl"], 1e-5)
        return (y, mean, rstd, *layernorm_bwd(t["xl"], t["wl"], t["dyl"], mean, rstd, t["bl"]))

    def softmax_both():
        y = softmax_fwd(t["logits"])
        return y, softmax_bwd(t["dys"], y)

    def cross_entropy_both():
        loss, lse = cross_entropy_fwd(t["logits"], t["target"], -100)
        return loss, lse, cross_entropy_bwd(t["logits"], t["target"], t["dloss"], lse, -100)

    calls = {
        "rmsnorm": lambda: ops.rmsnorm(t["x"], t["w"]),
        "softmax": lambda: ops.softmax(t["logits"]),
        "cross_entropy none": lambda: ops.cross_entropy(t["logits"], t["target"], reduction="none"),
        # the mean divides by the non-ignored count: a device reduction, no .item()
        "cross_entropy mean": lambda: ops.cross_entropy(t["logits"], t["target"]),
        "gemm": lambda: ops.gemm(t["a"], t["b"]),
        "gemm bias gelu": lambda: ops.gemm(t["a"], t["b"], bias=t["bias"], activation="gelu_tanh"),
        "gemm stream-K": sk_gemm,
        "layernorm fwd + bwd": layernorm_both,
        "softmax fwd + bwd": softmax_both,
        "cross_entropy fwd + bwd": cross_entropy_both,
    }

    def step():
        return {name: fn() for name, fn in calls.items()}

    # torch's recipe: a warm-up on a side stream first (here: every kernel loaded, the
    # configuration memos and the GEMM's stand-in tensors made before the capture)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    def outputs(out) -> tuple:
        return out if isinstance(out, tuple) else (out,)

    before = {name: [o.clone() for o in outputs(out)] for name, out in captured.items()}
    for seed in (1, 2):
        _fill(t, seed)
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for name in calls:
            for i, (got, want) in enumerate(zip(outputs(captured[name]), outputs(eager[name]), strict=True)):
                assert torch.equal(got, want), f"{name} [{i}]: the replay differs from the eager call"
                # new inputs, new outputs: the replay ran the op rather than keeping what it held
                assert not torch.equal(got, before[name][i]), f"{name} [{i}]: the replay left its output"
                before[name][i] = got.clone()


class _Block(torch.nn.Module):
    """RMSNorm and a GEMM with bias + gelu, each with its weights (the training tests' shapes)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator(device="cuda").manual_seed(7)
        m, n, k = ODD

        def param(*shape):
            return torch.nn.Parameter(torch.randn(shape, generator=g, device="cuda").bfloat16())

        self.w, self.b, self.bias = param(4096), param(k, n), param(n)

    def forward(self, x, a):
        from quack_kernels import ops

        return ops.rmsnorm(x, self.w), ops.gemm(a, self.b, bias=self.bias, activation="gelu_tanh")


def test_training_step_through_make_graphed_callables_matches_eager():
    """Forward and backward graphed (``make_graphed_callables``): the outputs, the inputs'
    gradients and the weights' gradients are the eager twin's, bit for bit, over two steps
    with new data each. The gradients are set to None before each step, as torch's recipe
    for graphed callables does (``zero_grad(set_to_none=True)``): a weight's .grad is the
    graph's own output buffer after the first step, which the next replay overwrites."""
    block = _Block()
    twin = copy.deepcopy(block)
    m, n, k = ODD
    t = _inputs()
    x, a = t["x"].requires_grad_(), t["a"].requires_grad_()
    graphed = torch.cuda.make_graphed_callables(block, (x, a))
    g = torch.Generator(device="cuda").manual_seed(3)
    for step in range(2):
        for p in (*block.parameters(), *twin.parameters()):
            p.grad = None
        args = [torch.randn(s.shape, generator=g, device="cuda").bfloat16().requires_grad_() for s in (x, a)]
        grads = [torch.randn(s, generator=g, device="cuda").bfloat16() for s in ((64, 4096), (m, n))]
        twin_args = [v.detach().clone().requires_grad_() for v in args]
        outs = graphed(*args)
        torch.autograd.backward(outs, grads)
        want = twin(*twin_args)
        torch.autograd.backward(want, grads)
        torch.cuda.synchronize()
        for name, got, ref in zip(("rmsnorm", "gemm"), outs, want):
            assert torch.equal(got, ref), f"step {step}: {name} output"
        for name, got, ref in zip(("dx", "da"), args, twin_args):
            assert torch.equal(got.grad, ref.grad), f"step {step}: {name}"
        for (name, p), q in zip(block.named_parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: d{name}"


def test_torch_compile_reduce_overhead_records_the_ops_in_its_cuda_graphs():
    """torch.compile(mode="reduce-overhead"), inductor's CUDA graph trees: the custom ops
    are recorded into its graphs, forward and backward, and every step (warm-up, recording,
    replays) gives the eager bits. Nothing is cut out of the graphs: inductor partitions a
    graph around an op it cannot capture (a CPU op in the same function makes two
    partitions, checked on the H200) or, failing that, skips the graph."""
    from quack_kernels import ops
    from torch._dynamo.utils import counters

    counters.clear()
    g = torch.Generator(device="cuda").manual_seed(11)
    w = torch.randn(4096, generator=g, device="cuda").bfloat16()
    wg, we = w.clone().requires_grad_(), w.clone().requires_grad_()
    step_fn = torch.compile(lambda x, w: ops.rmsnorm(x, w), mode="reduce-overhead")
    for step in range(4):
        x = torch.randn(64, 4096, generator=g, device="cuda").bfloat16()
        dy = torch.randn(64, 4096, generator=g, device="cuda").bfloat16()
        xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        wg.grad = we.grad = None
        got = step_fn(xg, wg)
        got.backward(dy)
        want = ops.rmsnorm(xe, we)
        want.backward(dy)
        torch.cuda.synchronize()
        assert torch.equal(got, want), f"step {step}: y"
        assert torch.equal(xg.grad, xe.grad) and torch.equal(wg.grad, we.grad), f"step {step}: gradients"
    seen = dict(counters["inductor"])
    assert seen.get("cudagraph_recorded_non_static_inputs", 0) > 0, f"no CUDA graph recorded: {seen}"
    assert seen.get("cudagraph_partitions", 0) == 0 and seen.get("cudagraph_skips", 0) == 0, seen
