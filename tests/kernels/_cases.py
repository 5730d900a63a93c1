"""Kernel test configurations shared by the CPU and GPU tiers (and mirrored in
manifests/tests.toml)."""

DTYPES = ("float32", "float16", "bfloat16")
# CPU tier: compile + export + load for sm_90a. One-warp, one-block and cluster paths.
CPU_NS = (1000, 16384, 65536)
# GPU tier grid.
GPU_MS = (1, 7, 1024, 32768)
GPU_NS = (256, 1000, 4096, 16384, 65536, 262144)

# kernel name -> list of extra compile params (variants) exercised by the tests
VARIANTS = {
    "rmsnorm_fwd": [
        dict(has_weight=True, has_bias=False, has_residual=False),
        dict(has_weight=False, has_bias=True, has_residual=True),
    ],
    "rmsnorm_bwd": [dict(has_weight=True), dict(has_weight=False)],
    "softmax_fwd": [dict()],
    "softmax_bwd": [dict()],
    "layernorm_fwd": [dict(has_weight=True, has_bias=True)],
    "layernorm_bwd": [dict(has_weight=True, has_bias=True)],
    "cross_entropy_fwd": [dict()],
    "cross_entropy_bwd": [dict()],
}

COMPILE_FNS = {
    "rmsnorm_fwd": ("quack_kernels.rmsnorm", "compile_rmsnorm_fwd"),
    "rmsnorm_bwd": ("quack_kernels.rmsnorm", "compile_rmsnorm_bwd"),
    "softmax_fwd": ("quack_kernels.softmax", "compile_softmax_fwd"),
    "softmax_bwd": ("quack_kernels.softmax", "compile_softmax_bwd"),
    "layernorm_fwd": ("quack_kernels.layernorm", "compile_layernorm_fwd"),
    "layernorm_bwd": ("quack_kernels.layernorm", "compile_layernorm_bwd"),
    "cross_entropy_fwd": ("quack_kernels.cross_entropy", "compile_cross_entropy_fwd"),
    "cross_entropy_bwd": ("quack_kernels.cross_entropy", "compile_cross_entropy_bwd"),
}


def cuda_rand(shape, dt, seed, shift=0.0):
    """Seeded normal values (+ ``shift``) on the GPU in dtype ``dt``, drawn in fp32."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, device="cuda", generator=g) + shift).to(dt)
