"""Kernels at run time: the object loader and the jit lookup through the cache tiers."""
