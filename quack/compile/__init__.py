"""Compiling kernels: the in-process builder, the compile-worker pool (with its preload and warm-up), autotuning."""
