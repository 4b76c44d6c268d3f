"""Drop-in replacements for the reference models (reference.py), running on the op library `torch.ops.kernels`.

Same constructors, same parameters and state_dict keys, same results; MODEL_NEW maps each problem's short name to
its class.
"""

import torch
import torch.nn as nn

from kernels.functional import gemm_multiply_leaky_relu, leaky_relu


class LeakyReLUModelNew(nn.Module):
    """nn.LeakyReLU's interface (negative_slope, inplace); forward and backward on the project's kernels."""

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False):
        super().__init__()
        self.negative_slope = negative_slope
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return leaky_relu(x, self.negative_slope, self.inplace)

    def extra_repr(self) -> str:
        return f"negative_slope={self.negative_slope}{', inplace=True' if self.inplace else ''}"


class GemmMultiplyLeakyReLUModelNew(nn.Module):
    """leaky_relu((x @ W^T + b) * multiplier, negative_slope) in one call of kernels::gemm_multiply_leaky_relu
    (kernels/gemm/gemm.cpp says which path a call takes and why).

    `self.gemm` is created first and is the same nn.Linear as the reference's, so a model built after the same
    seed has the same weights, and state_dicts load both ways.
    """

    def __init__(self, in_features, out_features, multiplier, negative_slope):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier = multiplier
        self.negative_slope = negative_slope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm_multiply_leaky_relu(x, self.gemm.weight, self.gemm.bias, self.multiplier, self.negative_slope)


MODEL_NEW = {
    "leaky_relu": LeakyReLUModelNew,
    "gemm_multiply_leaky_relu": GemmMultiplyLeakyReLUModelNew,
}
