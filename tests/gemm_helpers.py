"""What the GEMM family's test files share: the model pair built after one seed, the check against the reference
and float64, the split paths this GPU runs (a parametrization over them), and the special inputs."""

import copy

import pytest
import torch

from conftest import HAS_CUDA, poison_allocator
from kernels.precision import ERROR_RATIO_LIMIT, allclose, relative_error
from kernels.gemm.gemm import KEPT_SPLIT_MIN_PRODUCTS, SPLIT_PATHS, gemm_paths
from model_new import GemmMultiplyLeakyReLUModelNew
from reference import GemmMultiplyLeakyReLUModel


def make_pair(in_features, out_features, multiplier, slope, device, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    reference = GemmMultiplyLeakyReLUModel(in_features, out_features, multiplier, slope)
    torch.manual_seed(seed)
    new = GemmMultiplyLeakyReLUModelNew(in_features, out_features, multiplier, slope)
    return reference.to(device, dtype), new.to(device, dtype)


def float64_reference(reference, x):
    """The reference model evaluated in float64 on the same (rounded) inputs and weights."""
    with torch.no_grad():
        return copy.deepcopy(reference).double()(x.double())


def check_against_reference(reference, new, x):
    """allclose against eager in x's dtype, and an error vs float64 within the contract's multiple of eager's."""
    poison_allocator((*x.shape[:-1], new.gemm.out_features), x.dtype, x.device)
    with torch.no_grad():
        y = new(x)
        y_ref = reference(x)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert allclose(y, y_ref), (y - y_ref).abs().max()
    if x.dtype != torch.float64 and y.numel():
        y64 = float64_reference(reference, x)
        ours, eager = relative_error(y, y64), relative_error(y_ref, y64)
        assert ours <= ERROR_RATIO_LIMIT[x.dtype] * eager, (ours, eager)
    return y, y_ref


SPLIT_KERNELS = [p for p in gemm_paths("cuda") if p in SPLIT_PATHS] if HAS_CUDA else []


# Parametrizes a test over every split path this GPU runs (none without a GPU of sm_80 or newer: one skipped case).
over_split_paths = pytest.mark.parametrize(
    "path", SPLIT_KERNELS or [pytest.param(None, marks=pytest.mark.skip(reason="needs a GPU of sm_80 or newer"))])


def automatic_split_path():
    """The split path the automatic choice takes on this GPU (gemm_path.cpp's table), or None."""
    if not HAS_CUDA:
        return None
    major, minor = torch.cuda.get_device_capability()
    path = torch.ops.kernels._gemm_fp32_path_for_capability(10 * major + minor)
    return path if path in SPLIT_KERNELS else None


def special_inputs(kind, m, k, seed=0):
    """x of shape (m, k) drawn as `kind`: the distributions that break a scaled fp16 split if it is done wrong."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if kind == "rand":
        x = torch.rand(m, k, generator=g)
    elif kind == "rows_times_1e30":
        x[::2] *= 1e30
    elif kind == "rows_times_1e-30":
        x[::2] *= 1e-30
    elif kind == "wide_range_rows":  # magnitudes from 1e-20 to 1e20 within each row
        x *= torch.pow(10.0, torch.empty(m, k).uniform_(-20, 20, generator=g))
    elif kind == "zero_rows":
        x[::3] = 0
    elif kind == "subnormal_rows":
        x[::2] *= 1e-40
    return x


# Shapes the automatic choice sends to the split path: there it must be at least as accurate as eager fp32.
def slow_problem_shape(shapes):
    """The names of `shapes` as parameters, the problem's own size marked slow."""
    return [pytest.param(name, marks=pytest.mark.slow) if name == "problem" else name for name in shapes]


def kept_split_expected(path, m, k, n):
    """Whether the forward of an (m x k) x on `path` with an (n x k) weight reads a split of the weight made ahead
    (gemm_weight_split.cpp; from KEPT_SPLIT_MIN_PRODUCTS multiply-adds on): its chunk split, or, where split_fp16
    computes the product transposed, its row split."""
    return m * n * k >= KEPT_SPLIT_MIN_PRODUCTS and path in ("split_fp16_sm80", "split_fp16")


def split_sweep_values(hi, lo, exponent, cols):
    """What a split sweep (torch.ops.kernels._gemm_split_sweep) holds: (hi + lo) 2^-e in float64, the first `cols`
    columns of each row it split, and the rest (the padding); exponent per row, or (chunk sweeps) per chunk of 64 and
    row at [chunk, row]."""
    value = hi.double() + lo.double()
    scale = exponent.double()
    if scale.dim() == 2:
        scale = scale[:, :hi.shape[0]].t().repeat_interleave(64, dim=1)
    else:
        scale = scale[:, None]
    return (value * torch.exp2(-scale))[:, :cols], value[:, cols:]
