"""The reference problems, exactly as KernelBench defines them (current sizes), addressable by short name.

Each problem is a Model class, get_inputs() (CPU tensors, as the harness draws them) and get_init_inputs().
KernelBench's inputs come from torch.rand, which is never negative; tests and bench.py also draw randn.
"""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn


class LeakyReLUModel(nn.Module):
    """KernelBench level 1, problem 20: a LeakyReLU activation."""

    def __init__(self, negative_slope: float = 0.01):
        super().__init__()
        self.negative_slope = negative_slope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.leaky_relu(x, negative_slope=self.negative_slope)


class GemmMultiplyLeakyReLUModel(nn.Module):
    """KernelBench level 2, problem 12: Linear, then a multiply by a scalar, then LeakyReLU."""

    def __init__(self, in_features, out_features, multiplier, negative_slope):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier = multiplier
        self.leaky_relu = nn.LeakyReLU(negative_slope)

    def forward(self, x):
        x = self.gemm(x)
        x = x * self.multiplier
        x = self.leaky_relu(x)
        return x


LEAKY_RELU_BATCH_SIZE = 4096
LEAKY_RELU_DIM = 393216  # 4096 x 393216 = 1,610,612,736 elements, 6.44 GB in float32

GEMM_BATCH_SIZE = 1024
GEMM_IN_FEATURES = 8192
GEMM_OUT_FEATURES = 8192
GEMM_MULTIPLIER = 2.0
GEMM_NEGATIVE_SLOPE = 0.1


def leaky_relu_get_inputs():
    return [torch.rand(LEAKY_RELU_BATCH_SIZE, LEAKY_RELU_DIM)]


def leaky_relu_get_init_inputs():
    return []


def gemm_multiply_leaky_relu_get_inputs():
    return [torch.rand(GEMM_BATCH_SIZE, GEMM_IN_FEATURES)]


def gemm_multiply_leaky_relu_get_init_inputs():
    return [GEMM_IN_FEATURES, GEMM_OUT_FEATURES, GEMM_MULTIPLIER, GEMM_NEGATIVE_SLOPE]


@dataclass(frozen=True)
class Problem:
    name: str
    model: type
    get_inputs: Callable[[], list]
    get_init_inputs: Callable[[], list]


PROBLEMS = {
    "leaky_relu": Problem("leaky_relu", LeakyReLUModel, leaky_relu_get_inputs, leaky_relu_get_init_inputs),
    "gemm_multiply_leaky_relu": Problem("gemm_multiply_leaky_relu", GemmMultiplyLeakyReLUModel,
                                        gemm_multiply_leaky_relu_get_inputs,
                                        gemm_multiply_leaky_relu_get_init_inputs),
}
