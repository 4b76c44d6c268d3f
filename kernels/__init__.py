"""Fused CUDA kernels for PyTorch, compiled just in time: the op library `torch.ops.kernels`, one kernel family per
folder (kernels/manifest.py lists them).

    from kernels.functional import leaky_relu, gemm_multiply_leaky_relu

Importing kernels.functional (or any family's module) builds the library on first use (kernels/loader.py) and
loads it. Importing this package alone builds nothing, so pure-Python helpers such as kernels.precision import
without a compiler.
"""
