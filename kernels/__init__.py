"""quack's CuTe DSL kernels: one module per family; each registers its
compile functions with ``@quack.jit_cache``. Importing this package is cheap:
kernel modules import cutlass and torch only inside functions."""

# ``ops`` (the differentiable torch functions, torch.library custom ops) imports torch and
# registers no kernel: `quack build`'s scan of this package leaves it out.
QUACK_SCAN_SKIP = ("ops",)
