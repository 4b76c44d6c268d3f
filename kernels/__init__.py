"""Fused CUDA kernels for PyTorch, compiled just in time: the op library `torch.ops.kernels` and its functions.

Importing this package builds the library on first use (kernels/loader.py) and loads it.
"""

from .ops import gemm_scale_leaky_relu, leaky_relu

__all__ = ["gemm_scale_leaky_relu", "leaky_relu"]
