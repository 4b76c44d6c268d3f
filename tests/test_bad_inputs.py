"""Every bad input tried on the public functions, one test per row of docs/bad_inputs.md: each gets the error the
table names (never a crash, a hang or a silently wrong result), and the unusual but valid ones get PyTorch's result."""

import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import HAS_CUDA
from kernels.functional import (attention, gelu_tanh, gemm_multiply_leaky_relu, layer_norm, leaky_relu, rms_norm,
                                rotary_embedding, silu_mul)


def ints(*shape):
    return torch.ones(*shape, dtype=torch.int64)


# name: (call, exception type, message pattern). The names are the rows of docs/bad_inputs.md.
ERRORS = {
    "leaky_relu: integer tensor": (lambda: leaky_relu(ints(4)), RuntimeError,
                                   r"x must be a float32, float64, float16 or bfloat16 tensor, got torch.int64"),
    "leaky_relu: bool tensor": (lambda: leaky_relu(torch.ones(4, dtype=torch.bool)), RuntimeError, r"got torch.bool"),
    "leaky_relu: complex tensor": (lambda: leaky_relu(torch.ones(4, dtype=torch.complex64)), RuntimeError,
                                   r"got torch.complex64"),
    "leaky_relu: not a tensor": (lambda: leaky_relu([1.0, -1.0]), TypeError, r"x must be a torch.Tensor, got list"),
    "leaky_relu: inplace on a leaf that requires grad": (
        lambda: leaky_relu(torch.randn(4, requires_grad=True), 0.1, inplace=True), RuntimeError,
        r"a leaf Variable that requires grad"),
    "leaky_relu: inplace, differentiated, negative slope": (
        lambda: leaky_relu(torch.randn(4, requires_grad=True) * 1.0, -0.1, inplace=True), ValueError,
        r"cannot be differentiated with a negative slope \(-0\.1\)"),
    "gelu_tanh: integer tensor": (
        lambda: gelu_tanh(ints(4)), RuntimeError,
        r"kernels.gelu_tanh: x must be a float32, float64, float16 or bfloat16 tensor, got torch.int64"),
    "gelu_tanh: not a tensor": (lambda: gelu_tanh([1.0, -1.0]), TypeError, r"x must be a torch.Tensor, got list"),
    "gelu_tanh_backward: grad_output and x of different dtypes": (
        lambda: torch.ops.kernels.gelu_tanh_backward(torch.randn(4), torch.randn(4, dtype=torch.float64)),
        RuntimeError,
        r"expected x and grad_output to have the same dtype, got x torch.float64 and grad_output torch.float32"),
    "rms_norm: integer tensor": (
        lambda: rms_norm(ints(2, 4), ints(4)), RuntimeError,
        r"kernels.rms_norm: x must be a float32, float64, float16 or bfloat16 tensor, got torch.int64"),
    "rms_norm: weight of another length": (
        lambda: rms_norm(torch.randn(2, 4), torch.ones(3)), RuntimeError,
        r"kernels.rms_norm: weight must have shape \[4\] \(x's last dimension\), got \[3\]"),
    "rms_norm: x and weight of different dtypes": (
        lambda: rms_norm(torch.randn(2, 4), torch.ones(4, dtype=torch.float64)), RuntimeError,
        r"expected weight and x to have the same dtype, got weight torch.float64 and x torch.float32"),
    "rms_norm: not tensors": (lambda: rms_norm([1.0], torch.ones(1)), TypeError,
                              r"x and weight must be torch.Tensors, got list and Tensor"),
    "rms_norm: eps a string": (lambda: rms_norm(torch.randn(2, 4), torch.ones(4), "1e-6"), TypeError,
                               r"kernels.rms_norm: eps must be a number, got str"),
    "layer_norm: integer tensor": (
        lambda: layer_norm(ints(2, 4), ints(4), ints(4)), RuntimeError,
        r"kernels.layer_norm: x must be a float32, float64, float16 or bfloat16 tensor, got torch.int64"),
    "layer_norm: bias of another length": (
        lambda: layer_norm(torch.randn(2, 4), torch.ones(4), torch.zeros(3)), RuntimeError,
        r"kernels.layer_norm: bias must have shape \[4\] \(x's last dimension\), got \[3\]"),
    "layer_norm: x and weight of different dtypes": (
        lambda: layer_norm(torch.randn(2, 4), torch.ones(4, dtype=torch.float64), torch.zeros(4)), RuntimeError,
        r"expected weight and x to have the same dtype, got weight torch.float64 and x torch.float32"),
    "layer_norm: eps None": (lambda: layer_norm(torch.randn(2, 4), torch.ones(4), torch.zeros(4), None), TypeError,
                             r"kernels.layer_norm: eps must be a number, got NoneType"),
    "layer_norm: no bias": (lambda: layer_norm(torch.randn(2, 4), torch.ones(4), None), TypeError,
                            r"kernels.layer_norm: bias must be a torch.Tensor, got NoneType"),
    "silu_mul: integer tensors": (
        lambda: silu_mul(ints(4), ints(4)), RuntimeError,
        r"kernels.silu_mul: gate must be a float32, float64, float16 or bfloat16 tensor, got torch.int64"),
    "silu_mul: gate and up of different shapes": (
        lambda: silu_mul(torch.randn(2, 4), torch.randn(2, 5)), RuntimeError,
        r"kernels.silu_mul: up has shape \[2, 5\] but gate has shape \[2, 4\]"),
    "silu_mul: gate and up of different dtypes": (
        lambda: silu_mul(torch.randn(4), torch.randn(4, dtype=torch.float64)), RuntimeError,
        r"expected up and gate to have the same dtype, got up torch.float64 and gate torch.float32"),
    "rotary_embedding: integer tensors": (
        lambda: rotary_embedding(ints(1, 2, 3, 4), ints(1, 2, 3, 4), ints(1, 3, 4), ints(1, 3, 4)), RuntimeError,
        r"kernels.rotary_embedding: q must be a float32, float64, float16 or bfloat16 tensor, got torch.int64"),
    "rotary_embedding: an odd head dim": (
        lambda: rotary_embedding(torch.randn(1, 2, 3, 5), torch.randn(1, 2, 3, 5), torch.randn(1, 3, 5),
                                 torch.randn(1, 3, 5)), RuntimeError,
        r"kernels.rotary_embedding: the head dim must be even \(its halves are rotated together\), got 5"),
    "rotary_embedding: angles of another length": (
        lambda: rotary_embedding(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 4, 4),
                                 torch.randn(1, 4, 4)), RuntimeError,
        r"kernels.rotary_embedding: cos and sin must both be \(batch or 1, tokens, head dim\) = \(1 or 1, 3, 4\), "
        r"got \[1, 4, 4\] and \[1, 4, 4\]"),
    "gemm: integer tensors": (lambda: gemm_multiply_leaky_relu(ints(2, 4), ints(3, 4)), RuntimeError,
                              r"x must be a float32, float64, float16 or bfloat16 tensor, got torch.int64"),
    "gemm: x and weight of different dtypes": (
        lambda: gemm_multiply_leaky_relu(torch.randn(2, 4), torch.randn(3, 4, dtype=torch.float64)), RuntimeError,
        r"expected weight and x to have the same dtype, got weight torch.float64 and x torch.float32"),
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
    "attention: query not 4-D": (lambda: attention(torch.randn(4, 8, 64), torch.randn(1, 4, 8, 64),
                                                   torch.randn(1, 4, 8, 64)), RuntimeError,
                                 r"query, key and value must have 4 dimensions \(batch, heads, rows, head dim\)"),
    "attention: heads not a multiple of key's": (
        lambda: attention(torch.randn(1, 3, 8, 64), torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64)),
        RuntimeError, r"query has 3 heads, which must be a multiple of key's 2"),
    "attention: key and value of different shapes": (
        lambda: attention(torch.randn(1, 4, 8, 64), torch.randn(1, 4, 8, 64), torch.randn(1, 4, 9, 64)),
        RuntimeError, r"key and value must have the same shape, got \[1, 4, 8, 64\] and \[1, 4, 9, 64\]"),
}

CUDA_ERRORS = {
    "rms_norm: x on CUDA, weight on the CPU": (
        lambda: rms_norm(torch.randn(2, 4, device="cuda"), torch.ones(4)), RuntimeError, r"same device"),
    "layer_norm: x on CUDA, bias on the CPU": (
        lambda: layer_norm(torch.randn(2, 4, device="cuda"), torch.ones(4, device="cuda"), torch.zeros(4)),
        RuntimeError, r"same device"),
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
    weight, bias = torch.empty(3, 4, device="meta"), torch.empty(3, device="meta")
    y, expected = gemm_multiply_leaky_relu(x, weight, bias), eager_gemm(x, weight, bias, 1.0, 0.01)
    assert y.device == expected.device and y.shape == expected.shape and y.dtype == expected.dtype
    # The checks of the ops themselves hold on meta (and under tracing): their fakes make them.
    for call, message in ((lambda: leaky_relu(x.int()), "x must be a float32"),
                          (lambda: gemm_multiply_leaky_relu(x.int(), weight, bias), "x must be a float32"),
                          (lambda: gemm_multiply_leaky_relu(x, weight, bias[:2]), "bias must have shape"),
                          (lambda: gemm_multiply_leaky_relu(x, weight.double(), bias), "same dtype"),
                          (lambda: gemm_multiply_leaky_relu(x, weight[:, :3], bias), "in_features is 3")):
        with pytest.raises(RuntimeError, match=message):
            call()


# Bad arguments to each op, made on a device by make(device): its fake, which is also its Meta kernel, raises the C++
# op's message (kernels/checks.py mirrors kernels/common/torch_checks.h).
FAKE_CHECK_CALLS = {
    "leaky_relu dtype": lambda d: torch.ops.kernels.leaky_relu(torch.ones(3, dtype=torch.int32, device=d), 0.1),
    "gelu_tanh dtype": lambda d: torch.ops.kernels.gelu_tanh(torch.ones(3, dtype=torch.int32, device=d)),
    "gelu_tanh_backward dtype": lambda d: torch.ops.kernels.gelu_tanh_backward(
        torch.randn(3, device=d), torch.randn(3, dtype=torch.float64, device=d)),
    "gelu_tanh_backward shape": lambda d: torch.ops.kernels.gelu_tanh_backward(torch.randn(3, device=d),
                                                                               torch.randn(2, device=d)),
    "gemm dtype": lambda d: torch.ops.kernels.gemm_multiply_leaky_relu(
        torch.randn(2, 4, device=d), torch.randn(3, 4, device=d), torch.randn(3, dtype=torch.float64, device=d), 1.0,
        0.1, False),
    "causal_softmax dtype": lambda d: torch.ops.kernels.causal_softmax(torch.ones(2, 2, dtype=torch.int32, device=d),
                                                                       0.5),
    "causal_softmax_backward dtype": lambda d: torch.ops.kernels.causal_softmax_backward(
        torch.randn(2, 2, device=d), torch.randn(2, 2, dtype=torch.float64, device=d), 0.5),
    "rms_norm dtype": lambda d: torch.ops.kernels.rms_norm(torch.randn(2, 4, device=d),
                                                           torch.randn(4, dtype=torch.float64, device=d), 1e-6),
    "layer_norm dtype": lambda d: torch.ops.kernels.layer_norm(
        torch.randn(2, 4, device=d), torch.randn(4, device=d), torch.randn(4, dtype=torch.float64, device=d), 1e-5),
    "silu_mul dtype": lambda d: torch.ops.kernels.silu_mul(torch.randn(2, 4, device=d),
                                                           torch.randn(2, 4, dtype=torch.float64, device=d)),
    "rotary_embedding dtype": lambda d: torch.ops.kernels.rotary_embedding(
        torch.randn(1, 2, 3, 4, device=d), torch.randn(1, 2, 3, 4, device=d), torch.randn(1, 3, 4, device=d),
        torch.randn(1, 3, 4, dtype=torch.float64, device=d)),
    "rotary_embedding_backward shape": lambda d: torch.ops.kernels.rotary_embedding_backward(
        torch.randn(1, 2, 3, 4, device=d), torch.randn(2, 2, 3, 4, device=d), torch.randn(1, 3, 4, device=d),
        torch.randn(1, 3, 4, device=d)),
    "rms_norm_backward grad_y shape": lambda d: torch.ops.kernels.rms_norm_backward(
        torch.randn(3, 4, device=d), torch.randn(2, 4, device=d), torch.randn(4, device=d), 1e-6),
    "rms_norm_backward grad_y dtype": lambda d: torch.ops.kernels.rms_norm_backward(
        torch.randn(2, 4, dtype=torch.float64, device=d), torch.randn(2, 4, device=d), torch.randn(4, device=d), 1e-6),
    "add_layer_norm residual shape": lambda d: torch.ops.kernels.add_layer_norm(
        torch.randn(2, 4, device=d), torch.randn(1, 4, device=d), torch.randn(4, device=d), torch.randn(4, device=d),
        1e-5),
    "layer_norm_backward grad_residual dtype": lambda d: torch.ops.kernels.layer_norm_backward(
        torch.randn(2, 4, device=d), torch.randn(2, 4, device=d), torch.randn(4, device=d), 1e-5,
        torch.ones(2, 4, dtype=torch.int32, device=d)),
    "attention dtype": lambda d: torch.ops.kernels.attention(
        torch.randn(1, 2, 4, 8, device=d), torch.randn(1, 2, 4, 8, dtype=torch.float64, device=d),
        torch.randn(1, 2, 4, 8, device=d), False, 0.5),
}


@pytest.mark.parametrize("case", FAKE_CHECK_CALLS)
def test_fakes_raise_the_ops_messages(case):
    """On meta (the fakes) the same error as the C++ op's on the CPU, word for word."""
    messages = []
    for device in ("cpu", "meta"):
        with pytest.raises(RuntimeError, match="kernels[.]") as raised:
            FAKE_CHECK_CALLS[case](device)
        messages.append(str(raised.value).splitlines()[0])
    assert messages[0] == messages[1]


# Every op with more than one tensor argument, called with one of them on another device. (leaky_relu, leaky_relu_,
# multiply_leaky_relu_ and gelu_tanh take one tensor.) Where a tensor is on meta the dispatcher runs the op's Meta
# kernel whatever the others' device, so only a check there stops a CPU or CUDA result of uninitialized memory.
MIXED_DEVICE_OPS = {
    "gemm_multiply_leaky_relu": (
        ("x", "weight", "bias"),
        lambda d: torch.ops.kernels.gemm_multiply_leaky_relu(
            torch.randn(2, 4, device=d[0]), torch.randn(3, 4, device=d[1]), torch.randn(3, device=d[2]), 2.0, 0.1,
            False)),
    "gemm_multiply_leaky_relu_backward": (
        ("grad_y", "x", "weight", "saved"),
        lambda d: torch.ops.kernels.gemm_multiply_leaky_relu_backward(
            torch.randn(2, 3, device=d[0]), torch.randn(2, 4, device=d[1]), torch.randn(3, 4, device=d[2]),
            torch.randn(2, 3, device=d[3]), 2.0, 0.1, True, True, True)),
    "gelu_tanh_backward": (
        ("grad_output", "x"),
        lambda d: torch.ops.kernels.gelu_tanh_backward(torch.randn(5, device=d[0]), torch.randn(5, device=d[1]))),
    "rms_norm": (
        ("x", "weight"),
        lambda d: torch.ops.kernels.rms_norm(torch.randn(2, 4, device=d[0]), torch.randn(4, device=d[1]), 1e-6)),
    "rms_norm_backward": (
        ("grad_y", "x", "weight"),
        lambda d: torch.ops.kernels.rms_norm_backward(torch.randn(2, 4, device=d[0]), torch.randn(2, 4, device=d[1]),
                                                      torch.randn(4, device=d[2]), 1e-6)),
    "layer_norm": (
        ("x", "weight", "bias"),
        lambda d: torch.ops.kernels.layer_norm(torch.randn(2, 4, device=d[0]), torch.randn(4, device=d[1]),
                                               torch.randn(4, device=d[2]), 1e-5)),
    "layer_norm_backward": (
        ("grad_y", "x", "weight"),
        lambda d: torch.ops.kernels.layer_norm_backward(torch.randn(2, 4, device=d[0]), torch.randn(2, 4, device=d[1]),
                                                        torch.randn(4, device=d[2]), 1e-5)),
    "silu_mul": (
        ("gate", "up"),
        lambda d: torch.ops.kernels.silu_mul(torch.randn(2, 4, device=d[0]), torch.randn(2, 4, device=d[1]))),
    "silu_mul_backward": (
        ("grad_y", "gate", "up"),
        lambda d: torch.ops.kernels.silu_mul_backward(torch.randn(4, device=d[0]), torch.randn(4, device=d[1]),
                                                      torch.randn(4, device=d[2]))),
    "leaky_relu_backward": (
        ("grad_output", "saved"),
        lambda d: torch.ops.kernels.leaky_relu_backward(torch.randn(5, device=d[0]), torch.randn(5, device=d[1]),
                                                        0.1, 1.0)),
    "attention": (
        ("query", "key", "value"),
        lambda d: torch.ops.kernels.attention(*(torch.randn(1, 2, 4, 8, device=device) for device in d), False, 0.5)),
}
DEVICE_PAIRS = [(a, b) for a in ("cpu", "cuda", "meta") for b in ("cpu", "cuda", "meta") if a != b]


@pytest.mark.parametrize("op", MIXED_DEVICE_OPS)
@pytest.mark.parametrize("devices", DEVICE_PAIRS, ids=lambda p: "-".join(p))
def test_mixed_devices_raise(op, devices):
    """Each argument in turn on the second device, the rest on the first: a RuntimeError naming a device, as eager
    raises for F.linear with a bias (never a result)."""
    if "cuda" in devices and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    names, call = MIXED_DEVICE_OPS[op]
    for odd in range(len(names)):
        placed = [devices[1] if i == odd else devices[0] for i in range(len(names))]
        with pytest.raises(RuntimeError, match=r"device"):
            call(placed)


@pytest.mark.parametrize("weight_device", ["meta", "cpu"])
def test_model_on_meta_weights_raises_as_the_reference_does(weight_device):
    """Deferred initialization: a model built under torch.device("meta") and called with real data (or a real
    model with meta data) raises, as the reference model does, forward and backward."""
    from model_new import GemmMultiplyLeakyReLUModelNew
    from reference import GemmMultiplyLeakyReLUModel

    x_device = "cpu" if weight_device == "meta" else "meta"
    x = torch.randn(4, 8, device=x_device, requires_grad=x_device != "meta")
    for model_class in (GemmMultiplyLeakyReLUModel, GemmMultiplyLeakyReLUModelNew):
        with torch.device(weight_device):
            model = model_class(8, 6, 2.0, 0.1)
        with pytest.raises(RuntimeError, match=r"device"):
            model(x)


# Each problem's constructor arguments at a small size, and an input of the right shape for them.
SMALL_PROBLEMS = {
    "leaky_relu": ([0.1], (4, 8)),
    "gemm_multiply_leaky_relu": ([8, 6, 2.0, 0.1], (4, 8)),
    "mlp": ([8, [6, 5], 4], (4, 8)),
    "shallow_wide_mlp": ([8, [6], 4], (4, 8)),
    "mini_gpt_block": ([8, 2, 0.0, 0.0, 4], (2, 4, 8)),
}


@pytest.mark.parametrize("problem", SMALL_PROBLEMS)
def test_model_new_called_with_a_list_raises_a_type_error(problem):
    """A model called with a Python list instead of a tensor raises a TypeError, as the reference model does."""
    import reference
    from model_new import MODEL_NEW

    init, shape = SMALL_PROBLEMS[problem]
    for model in (reference.PROBLEMS[problem].model(*init), MODEL_NEW[problem](*init)):
        with pytest.raises(TypeError):
            model(torch.zeros(shape).tolist())


@pytest.mark.parametrize("problem", [p for p in SMALL_PROBLEMS if p != "leaky_relu"])
def test_model_new_called_with_the_wrong_dtype_raises_as_the_reference(problem):
    """float64 input to a float32 model: the reference raises a RuntimeError naming the dtypes, and so does ModelNew
    (an element-wise model takes any floating dtype, as its reference does)."""
    import reference
    from model_new import MODEL_NEW

    init, shape = SMALL_PROBLEMS[problem]
    x = torch.randn(shape, dtype=torch.float64)
    for model in (reference.PROBLEMS[problem].model(*init), MODEL_NEW[problem](*init)):
        with pytest.raises(RuntimeError, match=r"(?i)dtype|double|float"):
            model(x)


# ---- the messages' arguments ----------------------------------------------------------------------------------------

# Arguments of a TORCH_CHECK message that are strings: names of the ops and arguments the checks pass around.
STRING_NAMES = {"op", "name", "ref_name", "kOp", "what", "refusal", "path", "sweep", "approximate", "q_name",
                "k_name"}
STRING_CALLS = re.compile(r"(_str|to_string|toString|path_name|cudaGetErrorString|cublasGetStatusString)\(|\.str\(\)|"
                          r"scalar_type\(\)$")


def torch_check_arguments(text):
    """(line, argument) of every message argument of every TORCH_CHECK(condition, ...) in C++ `text`."""
    strings = re.compile(r'"(?:[^"\\]|\\.)*"')
    for match in re.finditer(r"\bTORCH_CHECK\(", text):
        depth, at, current, arguments = 1, match.end(), "", []
        while depth:
            literal = strings.match(text, at)
            if literal:
                current += literal.group(0)
                at = literal.end()
                continue
            c = text[at]
            depth += c in "([{"
            depth -= c in ")]}"
            if c == "," and depth == 1:
                arguments.append(current)
                current = ""
            elif depth:
                current += c
            at += 1
        arguments.append(current)
        line = text.count("\n", 0, match.start()) + 1
        for argument in arguments[1:]:
            yield line, strings.sub("", argument).strip()


def test_torch_check_messages_stream_no_numbers():
    """Numbers streamed into a TORCH_CHECK message (an int64_t, a double, a shape, a device) crashed the process in
    the GPU machine's build (a null num_put facet); the checks pass them as strings (kernels/common/torch_checks.h)."""
    root = pathlib.Path(__file__).resolve().parent.parent / "kernels"
    suspects = [f"{path.relative_to(root)}:{line}: {argument}"
                for path in sorted([*root.rglob("*.cpp"), *root.rglob("*.h")])
                for line, argument in torch_check_arguments(path.read_text())
                if argument and argument not in STRING_NAMES and not STRING_CALLS.search(argument)]
    assert not suspects, "TORCH_CHECK message arguments that may be numbers:\n" + "\n".join(suspects)
