"""quack's CuTe DSL kernels: one module per family; each registers its
compile functions with ``@quack.jit_cache``. Importing this package is cheap:
kernel modules import cutlass and torch only inside functions."""
