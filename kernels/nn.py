"""The library's layers under public names: kernels.nn.Linear is nn.Linear on the fp32-accurate fast GEMM
(kernels/gemm/gemm.py, FusedLinear)."""

from kernels.gemm.gemm import FusedLinear as Linear

__all__ = ["Linear"]
