"""A tiny real CuTe DSL kernel for the cache's own tests: y = x * scale (+ 1 if bias)."""

from quack import jit_cache
from quack.params import Bool, Dtype, Int

COMPILES = []


@jit_cache("toy_scale", params={"dtype": Dtype(), "block": Int(min=32, max=1024), "bias": Bool()})
def toy_scale(dtype: str, block: int = 128, bias: bool = False):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    dt = {"float32": cutlass.Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[dtype]

    @cute.kernel
    def k(gx: cute.Tensor, gy: cute.Tensor, scale: cutlass.Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * block + tidx
        if i < cute.size(gx, mode=[0]):
            v = gx[i].to(cutlass.Float32) * scale
            if cutlass.const_expr(bias):
                v = v + cutlass.Float32(1.0)
            gy[i] = v.to(gy.element_type)

    @cute.jit
    def launch(x: cute.Tensor, y: cute.Tensor, scale: cutlass.Float32, stream):
        n = cute.size(x, mode=[0])
        k(x, y, scale).launch(grid=((n + block - 1) // block, 1, 1), block=(block, 1, 1), stream=stream)

    n = cute.sym_int()
    x = make_fake_tensor(dt, (n,), stride=(1,))
    y = make_fake_tensor(dt, (n,), stride=(1,))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    COMPILES.append((dtype, block, bias))
    return cute.compile(launch, x, y, cutlass.Float32(1.0), stream, options="--enable-tvm-ffi")


@jit_cache("toy_fail", params={"boom": Bool()})
def toy_fail(boom: bool = True):
    """Raises inside the compile function: the caller must see this text."""
    if boom:
        raise ValueError("toy_fail: boom requested")
    return toy_scale.compile_uncached("float32", 32, False)


@jit_cache("toy_badcopy", params={"dtype": Dtype()})
def toy_badcopy(dtype: str = "bfloat16"):
    """A real compiler error: an async global->shared copy atom aimed at global memory
    (CuTe's IR verifier rejects it, with ANSI-coloured diagnostics and generic advice)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    dt = {"float32": cutlass.Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[dtype]

    @cute.kernel
    def k(gx: cute.Tensor, gy: cute.Tensor):
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), dt, num_bits_per_copy=64)
        cute.copy(atom, gx, gy)

    @cute.jit
    def launch(x: cute.Tensor, y: cute.Tensor, stream):
        k(x, y).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    x = make_fake_tensor(dt, (4,), stride=(1,))
    y = make_fake_tensor(dt, (4,), stride=(1,))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, x, y, stream, options="--enable-tvm-ffi")


@jit_cache("toy_noffi", params={"block": Int(min=32, max=1024)})
def toy_noffi(block: int = 128):
    """toy_scale's kernel compiled without options="--enable-tvm-ffi" (a common slip)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    @cute.kernel
    def k(gx: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        gx[tidx] = gx[tidx] * cutlass.Float32(2.0)

    @cute.jit
    def launch(x: cute.Tensor):
        k(x).launch(grid=(1, 1, 1), block=(block, 1, 1))

    return cute.compile(launch, make_fake_tensor(cutlass.Float32, (block,), stride=(1,)))


@jit_cache("toy_local", params={"n": Int(min=1, max=4096)})
def toy_local(n: int = 512):
    """Each thread fills an array of ``n`` floats and reads back one element at an index
    known only at run time: ptxas keeps a small array in registers (a select chain) and a
    large one in local memory, a stack frame of at least 4 * n bytes (quack verify's
    resources report)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    @cute.kernel
    def k(gx: cute.Tensor, gy: cute.Tensor, sel: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        buf = cute.make_rmem_tensor((n,), cutlass.Float32)
        for i in cutlass.range_constexpr(n):
            buf[i] = gx[tidx * n + i]
        gy[tidx] = buf[(tidx + sel) % n]

    @cute.jit
    def launch(x: cute.Tensor, y: cute.Tensor, sel: cutlass.Int32, stream):
        k(x, y, sel).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    m = cute.sym_int()
    x = make_fake_tensor(cutlass.Float32, (m,), stride=(1,), assumed_align=16)
    y = make_fake_tensor(cutlass.Float32, (m,), stride=(1,), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(launch, x, y, 0, stream, options="--enable-tvm-ffi")
