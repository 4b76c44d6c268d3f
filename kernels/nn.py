"""The library's layers under public names: kernels.nn.Linear is nn.Linear on the fp32-accurate fast GEMM
(kernels/gemm/gemm.py, FusedLinear); kernels.nn.GELUTanh is nn.GELU(approximate="tanh") in one pass
(kernels/gelu_tanh/gelu_tanh.py)."""

from kernels.gelu_tanh.gelu_tanh import GELUTanh
from kernels.gemm.gemm import FusedLinear as Linear

__all__ = ["GELUTanh", "Linear"]
