"""Every bad input tried on the public functions, one test per row of docs/bad_inputs.md: each gets the error the
table names (never a crash, a hang or a silently wrong result), and the unusual but valid ones get PyTorch's result."""

import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_CUDA
from kernels.functional import gemm_multiply_leaky_relu, leaky_relu


def ints(*shape):
    return torch.ones(*shape, dtype=torch.int64)


# name: (call, exception type, message pattern). The names are the rows of docs/bad_inputs.md.
ERRORS = {
    "leaky_relu: integer tensor": (lambda: leaky_relu(ints(4)), RuntimeError,
                                   r"x must be a float32, float64, float16 or bfloat16 tensor, got Long"),
    "leaky_relu: bool tensor": (lambda: leaky_relu(torch.ones(4, dtype=torch.bool)), RuntimeError, r"got Bool"),
    "leaky_relu: complex tensor": (lambda: leaky_relu(torch.ones(4, dtype=torch.complex64)), RuntimeError,
                                   r"got ComplexFloat"),
    "leaky_relu: not a tensor": (lambda: leaky_relu([1.0, -1.0]), TypeError, r"x must be a torch.Tensor, got list"),
    "leaky_relu: inplace on a leaf that requires grad": (
        lambda: leaky_relu(torch.randn(4, requires_grad=True), 0.1, inplace=True), RuntimeError,
        r"a leaf Variable that requires grad"),
    "leaky_relu: inplace, differentiated, negative slope": (
        lambda: leaky_relu(torch.randn(4, requires_grad=True) * 1.0, -0.1, inplace=True), ValueError,
        r"cannot be differentiated with a negative slope \(-0\.1\)"),
    "gemm: integer tensors": (lambda: gemm_multiply_leaky_relu(ints(2, 4), ints(3, 4)), RuntimeError,
                              r"x must be a float32, float64, float16 or bfloat16 tensor, got Long"),
    "gemm: x and weight of different dtypes": (
        lambda: gemm_multiply_leaky_relu(torch.randn(2, 4), torch.randn(3, 4, dtype=torch.float64)), RuntimeError,
        r"expected weight and x to have the same dtype, got weight Double and x Float"),
    "gemm: bias of another dtype": (
        lambda: gemm_multiply_leaky_relu(torch.randn(2, 4), torch.randn(3, 4), torch.randn(3, dtype=torch.float64)),
        RuntimeError, r"expected bias and x to have the same dtype"),
    "gemm: weight 1-D": (lambda: gemm_multiply_leaky_relu(torch.randn(2, 4), torch.randn(4)), RuntimeError,
                         r"weight must be 2-D \(out_features, in_features\), got shape \[4\]"),
    "gemm: weight 3-D": (lambda: gemm_multiply_leaky_relu(torch.randn(2, 4), torch.randn(3, 4, 1)), RuntimeError,
                         r"weight must be 2-D"),
    "gemm: x a scalar": (lambda: gemm_multiply_leaky_relu(torch.tensor(1.0), torch.randn(3, 4)), RuntimeError,
                         r"x must have at least 1 dimension"),
    "gemm: x's last dimension is not in_features": (
        lambda: gemm_multiply_leaky_relu(torch.randn(2, 5), torch.randn(3, 4)), RuntimeError,
        r"x's last dimension is 5 but in_features is 4"),
    "gemm: bias of the wrong length": (
        lambda: gemm_multiply_leaky_relu(torch.randn(2, 4), torch.randn(3, 4), torch.randn(4)), RuntimeError,
        r"bias must have shape \[out_features\] = \[3\], got \[4\]"),
    "gemm: bias 2-D": (lambda: gemm_multiply_leaky_relu(torch.randn(2, 4), torch.randn(3, 4), torch.randn(1, 3)),
                       RuntimeError, r"bias must have shape \[out_features\]"),
    "gemm: not tensors": (lambda: gemm_multiply_leaky_relu([[1.0]], torch.randn(3, 1)), TypeError,
                          r"x, weight and bias must be torch.Tensors"),
    "gemm: requires_grad on an integer tensor": (lambda: ints(3, 4).requires_grad_(), RuntimeError,
                                                 r"only Tensors of floating point dtype can require gradients"),
}

CUDA_ERRORS = {
    "gemm: x on CUDA, weight on the CPU": (
        lambda: gemm_multiply_leaky_relu(torch.randn(2, 4, device="cuda"), torch.randn(3, 4)), RuntimeError,
        r"same device"),
    "gemm: bias on the CPU, x and weight on CUDA": (
        lambda: gemm_multiply_leaky_relu(torch.randn(2, 4, device="cuda"), torch.randn(3, 4, device="cuda"),
                                         torch.randn(3)), RuntimeError, r"same device"),
}


@pytest.mark.parametrize("name", ERRORS)
def test_bad_input_is_a_clear_error(name):
    call, error, pattern = ERRORS[name]
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", CUDA_ERRORS)
def test_bad_cuda_input_is_a_clear_error(name):
    call, error, pattern = CUDA_ERRORS[name]
    with pytest.raises(error, match=pattern):
        call()


def eager_gemm(x, weight, bias, multiplier, slope):
    return F.leaky_relu(F.linear(x, weight, bias) * multiplier, slope)


# Unusual but valid: PyTorch's result.
@pytest.mark.parametrize("slope", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_slope_gives_pytorchs_result(slope):
    x = torch.randn(64)
    torch.testing.assert_close(leaky_relu(x, slope), F.leaky_relu(x, slope), equal_nan=True)
    weight = torch.randn(5, 64)
    torch.testing.assert_close(gemm_multiply_leaky_relu(x.view(1, 64), weight, None, 2.0, slope),
                               eager_gemm(x.view(1, 64), weight, None, 2.0, slope), equal_nan=True)


@pytest.mark.parametrize("multiplier", [float("nan"), float("inf"), 0.0])
def test_unusual_multiplier_gives_pytorchs_result(multiplier):
    x, weight = torch.randn(3, 8), torch.randn(5, 8)
    torch.testing.assert_close(gemm_multiply_leaky_relu(x, weight, None, multiplier, 0.1),
                               eager_gemm(x, weight, None, multiplier, 0.1), equal_nan=True)


def test_meta_tensors_give_pytorchs_shape_and_device():
    x = torch.empty(2, 4, device="meta")
    assert leaky_relu(x).device.type == "meta" and leaky_relu(x).shape == (2, 4)
    y = gemm_multiply_leaky_relu(x, torch.randn(3, 4))
    expected = eager_gemm(x, torch.randn(3, 4), None, 1.0, 0.01)
    assert y.device == expected.device and y.shape == expected.shape and y.dtype == expected.dtype


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_x_with_a_meta_weight_does_what_eager_does():
    """PyTorch accepts it too: a result of eager's shape on x's device, its values undefined (meta has no data)."""
    x, weight = torch.randn(2, 4, device="cuda"), torch.empty(3, 4, device="meta")
    y, expected = gemm_multiply_leaky_relu(x, weight, None, 2.0, 0.1), eager_gemm(x, weight, None, 2.0, 0.1)
    assert y.device == expected.device and y.shape == expected.shape and y.dtype == expected.dtype
