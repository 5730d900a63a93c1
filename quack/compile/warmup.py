"""A throwaway compile that pays CuTe DSL's one-time set-up (3-4 s for the
first cute.compile in a process, then 0.2-0.3 s) in the forkserver, so that
every forked compile worker starts warm.

No `from __future__ import annotations` here: CuTe DSL evaluates the kernel's
annotations (cute.Tensor) in this module's globals, where `cute` is a local name;
as strings they raise NameError (the forkserver swallowed it: workers started cold)."""


def warm_up() -> None:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    @cute.kernel
    def _k(g: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < cute.size(g, mode=[0]):
            g[tidx] = g[tidx] + cutlass.Float32(1.0)

    @cute.jit
    def _launch(g: cute.Tensor, stream):
        _k(g).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    g = make_fake_tensor(cutlass.Float32, (cute.sym_int(),), stride=(1,))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    cute.compile(_launch, g, stream, options="--enable-tvm-ffi")
