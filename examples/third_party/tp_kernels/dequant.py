"""y = x * scale: an fp8 dequantize, one registered kernel with a tuple and an fp8 dtype
parameter, a compile function that receives the target arch, and a rule that refuses
every arch but SM90 (docs/writing-kernels.md, section 7)."""

from quack import jit_cache
from quack.params import DTYPES, FP8_DTYPES, Dtype, Int, Rule, Tuple

SM90 = ("sm_90", "sm_90a")


@jit_cache(
    "tp_dequant",
    params={
        "in_dtype": Dtype(choices=FP8_DTYPES + DTYPES),  # fp8 is opt-in
        "out_dtype": Dtype(),
        # (threads per CTA, elements per thread): one value, two integers
        "tile": Tuple(Int(choices=(64, 128, 256)), Int(choices=(1, 2, 4, 8))),
    },
    rules=[
        Rule("arch", "tp_dequant is SM90 only (sm_90, sm_90a)", lambda p: p["arch"] in SM90),
        Rule(
            "tile",
            "fp8 needs at least 2 elements per thread",
            lambda p: p["tile"][1] >= 2 or "8" not in p["in_dtype"],
        ),
    ],
)
def compile_tp_dequant(in_dtype: str, out_dtype: str = "float32", tile=(128, 4), arch: str = "sm_90a"):
    # `arch` is not a parameter: quack passes the target arch (it is in the key already).
    if arch not in SM90:  # the rule refuses it first; this guards a call of the bare function
        raise ValueError(f"tp_dequant is SM90 only, asked for {arch}")
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    # The helper package outside this one (preloaded: [build] preload in quack.toml).
    from tp_helpers.dequant import CUTLASS_DTYPES, dequant_vector

    threads, vec = tile
    in_dt, out_dt = CUTLASS_DTYPES[in_dtype], CUTLASS_DTYPES[out_dtype]

    @cute.kernel
    def kernel(gx: cute.Tensor, gy: cute.Tensor, scale: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * threads + tidx
        if row < cute.size(gx, mode=[0]):
            rx = cute.make_rmem_tensor(vec, in_dt)
            ry = cute.make_rmem_tensor(vec, out_dt)
            cute.autovec_copy(gx[row, None], rx)
            dequant_vector(rx, ry, scale)
            cute.autovec_copy(ry, gy[row, None])

    @cute.jit
    def launch(x: cute.Tensor, y: cute.Tensor, scale: cutlass.Float32, stream):
        rows = cute.size(x, mode=[0])
        kernel(x, y, scale).launch(
            grid=((rows + threads - 1) // threads, 1, 1), block=(threads, 1, 1), stream=stream
        )

    rows = cute.sym_int()
    x = make_fake_tensor(in_dt, (rows, vec), stride=(vec, 1))
    y = make_fake_tensor(out_dt, (rows, vec), stride=(vec, 1))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, x, y, cutlass.Float32(1.0), stream, options="--enable-tvm-ffi")


def tp_dequant(x, scale: float, out_dtype=None, tile=(128, 4)):
    """The torch-facing function: x (any shape, numel divisible by tile[1]) * scale."""
    import torch

    out_dtype = out_dtype or torch.float32
    fn = compile_tp_dequant(x.dtype, out_dtype, tuple(tile))  # torch dtypes are accepted
    vec = tile[1]
    x2 = x.reshape(-1, vec)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    fn(x2, y, scale)
    return y.reshape(x.shape)
