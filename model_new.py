"""Drop-in replacements for the reference models (reference.py), running on the op library `torch.ops.kernels`.

Same constructors, same parameters and state_dict keys, same results; MODEL_NEW maps each problem's short name to
its class.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.functional import leaky_relu
from kernels.gemm.gemm import FusedLinear


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

    `self.gemm` is created first and is an nn.Linear (FusedLinear: the reference's nn.Linear, whose call can take
    the epilogue), so a model built after the same seed has the same weights, state_dicts load both ways, and what
    users attach to `gemm` (a tensor-parallel plan, FSDP2, hooks) applies, since the forward calls it.
    """

    def __init__(self, in_features, out_features, multiplier, negative_slope):
        super().__init__()
        self.gemm = FusedLinear(in_features, out_features)
        self.multiplier = multiplier
        self.negative_slope = negative_slope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, multiplier=self.multiplier, negative_slope=self.negative_slope)


class MLPModelNew(nn.Module):
    """reference.MLPModel with each hidden layer's Linear and ReLU in one GEMM call (the epilogue with slope 0) and
    the last Linear plain. `network` holds the reference's layers (FusedLinear is an nn.Linear), so weights,
    state_dict keys and hooks match; a negative pre-activation gives -0.0 where ReLU gives 0.0 (equal values)."""

    def __init__(self, input_size, layer_sizes, output_size):
        super().__init__()
        layers = []
        current_input_size = input_size
        for layer_size in layer_sizes:
            layers.append(FusedLinear(current_input_size, layer_size))
            layers.append(nn.ReLU())
            current_input_size = layer_size
        layers.append(FusedLinear(current_input_size, output_size))
        self.network = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = list(self.network)
        i = 0
        while i < len(layers):
            if type(layers[i]) is FusedLinear and i + 1 < len(layers) and type(layers[i + 1]) is nn.ReLU:
                x = layers[i](x, multiplier=1.0, negative_slope=0.0)
                i += 2
            else:
                x = layers[i](x)
                i += 1
        return x


MODEL_NEW = {
    "leaky_relu": LeakyReLUModelNew,
    "gemm_multiply_leaky_relu": GemmMultiplyLeakyReLUModelNew,
    "mlp": MLPModelNew,
    "shallow_wide_mlp": MLPModelNew,
}
