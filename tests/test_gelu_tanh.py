"""GELU with the tanh approximation (minGPT's NewGELU): the op, its gradient and the function against a float64
evaluation of the formula and against eager's formula, on CPU and CUDA. The precision contract: float32 error against
float64 no larger than eager's formula's, and allclose(1e-4) to it; float16 and bfloat16 at most 2x eager's error;
float64 allclose(1e-10) to the float64 formula."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import FLOAT_DTYPES, poison_allocator, requires_cuda
from kernels.functional import gelu_tanh
from kernels.nn import GELUTanh
from kernels.precision import ALLCLOSE_TOLERANCE, ERROR_RATIO_LIMIT, relative_error


def new_gelu(x):
    """minGPT's NewGELU, op for op: the reference (eager in x's dtype, or float64)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def float64_gradient(x, grad):
    """grad * d new_gelu / dx in float64 autograd."""
    x64 = x.detach().double().requires_grad_(True)
    (g,) = torch.autograd.grad(new_gelu(x64), x64, grad.double())
    return g


def eager_gradient(x, grad):
    leaf = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(new_gelu(leaf), leaf, grad)
    return g


def randn(*shape, seed=0, dtype=torch.float32, device="cpu", scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def make_views(device, dtype):
    """Contiguous, empty, size-1, odd, 4-D, strided, transposed, offset (unaligned) and expanded inputs."""
    base = randn(64, 70, seed=1, dtype=dtype, device=device, scale=3.0)
    return {
        "contiguous": randn(32, 96, seed=2, dtype=dtype, device=device, scale=3.0),
        "empty": randn(0, 5, dtype=dtype, device=device),
        "size1": randn(1, seed=3, dtype=dtype, device=device),
        "odd": randn(100_003, seed=4, dtype=dtype, device=device, scale=3.0),
        "4d": randn(2, 3, 5, 7, seed=5, dtype=dtype, device=device),
        "strided": base[:, ::3],
        "transposed": base.t(),
        "offset1d": randn(4099, seed=6, dtype=dtype, device=device, scale=3.0)[1:],
        "offset2d": randn(33 * 65, seed=7, dtype=dtype, device=device).view(33, 65)[1:, 3:],
        "expanded": randn(1, 9, seed=8, dtype=dtype, device=device).expand(6, 9),
    }


SMALL_TENSOR_ELEMENTS = 256


def check_accuracy(got, eager, reference64, dtype, what):
    """got against the float64 reference: no more error than eager's (x ERROR_RATIO_LIMIT); allclose to eager in
    float32, and to the float64 reference rounded to dtype in the others (eager rounds each of its ops in float16 or
    bfloat16; this library rounds once). A tensor of a few elements gets one rounding's slack: there a norm-wise
    error is one element's luck, not a measure of the method."""
    ours, theirs = relative_error(got, reference64), relative_error(eager, reference64)
    slack = torch.finfo(dtype).eps / 2 if got.numel() <= SMALL_TENSOR_ELEMENTS else 0.0
    assert ours <= ERROR_RATIO_LIMIT[dtype] * theirs + slack + (1e-15 if dtype == torch.float64 else 0.0), \
        f"{what}: error against float64 {ours:.3g}, eager's {theirs:.3g}"
    tol = ALLCLOSE_TOLERANCE[dtype]
    reference = eager if dtype == torch.float32 else reference64.to(dtype)
    torch.testing.assert_close(got, reference, atol=tol, rtol=tol, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_forward_on_every_layout(device, dtype):
    for name, x in make_views(device, dtype).items():
        x_before = x.clone()
        poison_allocator(x.shape, dtype, device)
        y = gelu_tanh(x)
        eager = new_gelu(x)
        assert y.shape == x.shape and y.dtype == dtype and y.device == x.device, name
        assert y.stride() == eager.stride() or y.numel() <= 1, name
        assert not y.isnan().any(), f"{name}: an element was not written"
        check_accuracy(y, eager, new_gelu(x.double()), dtype, name)
        assert torch.equal(x, x_before), f"{name}: the input was modified"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_backward_on_every_layout(device, dtype):
    for seed, (name, x) in enumerate(make_views(device, dtype).items()):
        grad = randn(*x.shape, seed=100 + seed, dtype=dtype, device=device)
        leaf = x.detach().clone().requires_grad_(True)
        poison_allocator(x.shape, dtype, device)
        (g,) = torch.autograd.grad(gelu_tanh(leaf), leaf, grad)
        assert g.shape == x.shape and g.dtype == dtype, name
        assert not g.isnan().any(), f"{name}: an element was not written"
        check_accuracy(g, eager_gradient(x, grad), float64_gradient(x, grad), dtype, name)


# The precision contract's inputs: randn * 3 (both signs, the MLP activation's range) and a range that reaches far into
# the negative side, where 1 + tanh(u) cancels in the formula.
PRECISION_INPUTS = {
    "randn*3": lambda device: randn(1 << 20, seed=11, device=device, scale=3.0),
    "randn": lambda device: randn(1 << 20, seed=12, device=device),
    "-20..20": lambda device: torch.linspace(-20, 20, (1 << 20) + 3, device=device),
    "-8..0": lambda device: torch.linspace(-8, 0, 1 << 18, device=device),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inputs", PRECISION_INPUTS)
def test_precision_contract(device, dtype, inputs):
    x = PRECISION_INPUTS[inputs](device).to(dtype)
    grad = randn(x.numel(), seed=13, device=device, dtype=dtype)
    check_accuracy(gelu_tanh(x), new_gelu(x), new_gelu(x.double()), dtype, f"forward {inputs}")
    leaf = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(gelu_tanh(leaf), leaf, grad)
    check_accuracy(g, eager_gradient(x, grad), float64_gradient(x, grad), dtype, f"backward {inputs}")
    if dtype == torch.float32:  # the same function as PyTorch's own tanh GELU
        torch.testing.assert_close(gelu_tanh(x), F.gelu(x, approximate="tanh"), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_non_finite_and_special_values(device, dtype):
    """The formula's results: +inf -> +inf, -inf -> NaN (0.5 * -inf * 0), NaN -> NaN, -0.0 -> -0.0, and large finite
    values (x^3 overflows in float32) -> x or -0.0. Repeated so that both the vector body and the tail see them."""
    special = [float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-30, -1e-30, 3.0, -3.0, 30.0, -30.0]
    if dtype in (torch.float32, torch.float64):
        special += [1e20, -1e20, 3e38, -3e38]
    x = torch.tensor(special * 37, dtype=dtype, device=device)
    for view in (x, x[1:]):
        y, expected = gelu_tanh(view), new_gelu(view.double()).to(dtype)
        torch.testing.assert_close(y, expected, atol=0, rtol=1e-2, equal_nan=True)
        assert torch.equal(y.isnan(), expected.isnan()) and torch.equal(y.isinf(), expected.isinf())
        assert torch.equal(torch.signbit(y[y == 0]), torch.signbit(expected[y == 0]))
        assert torch.equal(y.isnan(), new_gelu(view).isnan())  # eager's formula in dtype: the same NaNs


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gradient_at_non_finite_values(device, dtype):
    """x = +-inf or NaN: NaN, as autograd of the formula gives (eager's and float64's); large finite x, where eager's
    float32 autograd overflows x^2 into NaN: the float64 formula's gradient (grad or 0). grad_output infinite or NaN:
    grad_output times the derivative."""
    xs = [float("inf"), float("-inf"), float("nan"), 30.0, -30.0, 0.0, 0.5, -0.5, 2.0, -2.0]
    if dtype in (torch.float32, torch.float64):
        xs += [1e20, -1e20]
    x = torch.tensor(xs * 19, dtype=dtype, device=device)
    grad = randn(x.numel(), seed=21, dtype=dtype, device=device)
    got = torch.ops.kernels.gelu_tanh_backward(grad, x)
    expected = float64_gradient(x, grad).to(dtype)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-2, equal_nan=True)

    x = torch.tensor([0.0, 0.3, 0.6, 1.0, 2.0, -0.3, -0.6, -0.75, -1.0, -2.0] * 19, dtype=dtype, device=device)
    for value in (float("inf"), float("-inf"), float("nan")):
        grad = torch.full_like(x, value)
        got = torch.ops.kernels.gelu_tanh_backward(grad, x)
        derivative = float64_gradient(x, torch.ones_like(x))
        torch.testing.assert_close(got, (grad.double() * derivative).to(dtype), equal_nan=True)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_backward_op_on_every_layout(device, dtype):
    """gelu_tanh_backward called directly with grad_output and x in different layouts (one transposed, one at an
    offset): the same as in one layout."""
    x = randn(40, 30, seed=31, dtype=dtype, device=device, scale=3.0)
    grad = randn(30, 40, seed=32, dtype=dtype, device=device).t()
    expected = torch.ops.kernels.gelu_tanh_backward(grad.contiguous(), x)
    torch.testing.assert_close(torch.ops.kernels.gelu_tanh_backward(grad, x), expected, atol=0, rtol=0)
    offset = randn(1201, seed=33, dtype=dtype, device=device)[1:].view(40, 30)
    torch.testing.assert_close(torch.ops.kernels.gelu_tanh_backward(grad, offset),
                               torch.ops.kernels.gelu_tanh_backward(grad.contiguous(), offset.contiguous()),
                               atol=0, rtol=0)


def test_module_and_function_are_the_op(device):
    x = randn(7, 33, seed=41, device=device)
    y = torch.ops.kernels.gelu_tanh(x)
    assert torch.equal(gelu_tanh(x), y) and torch.equal(GELUTanh()(x), y)


def test_graph_recorded_exactly_when_eager_records_one(device):
    for grad_mode in (True, False):
        for requires_grad in (True, False):
            x = torch.randn(6, 5, device=device, requires_grad=requires_grad)
            with torch.set_grad_enabled(grad_mode):
                y, y_ref = gelu_tanh(x), new_gelu(x)
            assert y.requires_grad == y_ref.requires_grad
            assert (y.grad_fn is None) == (y_ref.grad_fn is None)
    x = torch.randn(6, 5, device=device, requires_grad=True)
    assert gelu_tanh(x).grad_fn.name() == "kernels::GeluTanhBackward"
    g = torch.ops.kernels.gelu_tanh_backward(torch.randn(6, 5, device=device), x)
    assert g.grad_fn.name() == "kernels::GeluTanhBackwardBackward"


def test_gradcheck_float64(device):
    x = randn(17, 9, seed=51, dtype=torch.float64, device=device, scale=2.0).requires_grad_(True)
    assert torch.autograd.gradcheck(gelu_tanh, (x,))
    assert torch.autograd.gradgradcheck(gelu_tanh, (x,))
    grad = randn(17, 9, seed=52, dtype=torch.float64, device=device).requires_grad_(True)
    assert torch.autograd.gradcheck(torch.ops.kernels.gelu_tanh_backward, (grad, x))
    assert torch.autograd.gradgradcheck(torch.ops.kernels.gelu_tanh_backward, (grad, x))
    assert torch.autograd.gradcheck(gelu_tanh, (x,), check_forward_ad=True, check_backward_ad=False)
    assert torch.autograd.gradcheck(torch.ops.kernels.gelu_tanh_backward, (grad, x), check_forward_ad=True,
                                    check_backward_ad=False)


def test_higher_orders_against_float64_formula(device):
    """Second and third derivatives through the C++ nodes against the float64 formula's."""
    x = randn(300, seed=61, dtype=torch.float64, device=device, scale=3.0)
    orders = []
    for fn in (gelu_tanh, new_gelu):
        leaf = x.clone().requires_grad_(True)
        value, found = fn(leaf).sum(), []
        for _ in range(3):
            (value,) = torch.autograd.grad(value, leaf, create_graph=True)
            found.append(value.detach())
            value = value.sum()
        orders.append(found)
    for got, expected in zip(*orders):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-9)


def test_forward_mode_ad(device):
    import torch.autograd.forward_ad as fwAD

    x, tangent = randn(30, 7, seed=71, device=device, scale=3.0), randn(30, 7, seed=72, device=device)
    with fwAD.dual_level():
        y = fwAD.unpack_dual(gelu_tanh(fwAD.make_dual(x, tangent)))
    check_accuracy(y.tangent, eager_gradient(x, tangent), float64_gradient(x, tangent), torch.float32, "tangent")
    _, jvp = torch.func.jvp(gelu_tanh, (x,), (tangent,))
    torch.testing.assert_close(jvp, y.tangent, atol=0, rtol=0)


def test_torch_func_transforms(device):
    x = randn(30, 7, seed=81, device=device, scale=3.0)
    cotangent = randn(30, 7, seed=82, device=device)
    grad = torch.func.grad(lambda t: (gelu_tanh(t) * cotangent).sum())(x)
    torch.testing.assert_close(grad, float64_gradient(x, cotangent).float(), atol=1e-6, rtol=1e-5)
    batched = torch.func.vmap(gelu_tanh)(x)
    torch.testing.assert_close(batched, gelu_tanh(x), atol=0, rtol=0)
    per_row = torch.func.vmap(torch.func.grad(lambda t: gelu_tanh(t).sum()))(x)
    torch.testing.assert_close(per_row, torch.ops.kernels.gelu_tanh_backward(torch.ones_like(x), x), atol=0, rtol=0)


def test_graph_node_keeps_autograd_rules(device):
    """A write to x after the forward makes the backward raise; saved-tensor hooks see x; a second backward raises."""
    leaf = torch.randn(8, 9, device=device, requires_grad=True)
    base = leaf * 1.0
    y = gelu_tanh(base)
    base.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = gelu_tanh(leaf)
    assert len(packed) == 1 and torch.equal(packed[0], leaf)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()


def test_opcheck(device):
    x = torch.randn(7, 33, device=device)
    for requires_grad in (False, True):
        torch.library.opcheck(torch.ops.kernels.gelu_tanh.default, (x.clone().requires_grad_(requires_grad),))
        torch.library.opcheck(torch.ops.kernels.gelu_tanh_backward.default,
                              (torch.randn_like(x).requires_grad_(requires_grad), x))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(64, 129), GELUTanh()).to(device), fullgraph=True)
    x = torch.randn(32, 64, device=device, requires_grad=True)
    y = model(x)
    grad = torch.randn_like(y)
    (g,) = torch.autograd.grad(y, x, grad)
    x_ref = x.detach().clone().requires_grad_(True)
    linear = model._orig_mod[0]
    y_ref = gelu_tanh(linear(x_ref))
    (g_ref,) = torch.autograd.grad(y_ref, x_ref, grad)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint8])
def test_bad_dtype_is_a_clear_error(device, dtype):
    x = torch.ones(4, 4, device=device).to(dtype)
    with pytest.raises(RuntimeError, match=r"kernels.gelu_tanh: x must be a float32, float64, float16 or bfloat16"):
        gelu_tanh(x)
    with pytest.raises(RuntimeError, match=r"kernels.gelu_tanh_backward: grad_output must be a float32"):
        torch.ops.kernels.gelu_tanh_backward(x, x)


def test_bad_inputs_of_the_backward_are_clear_errors(device):
    x = torch.randn(4, 5, device=device)
    with pytest.raises(RuntimeError, match=r"expected x and grad_output to have the same dtype"):
        torch.ops.kernels.gelu_tanh_backward(x, x.double())
    with pytest.raises(RuntimeError, match=r"grad_output has shape \[4, 5\] but x has shape \[5, 4\]"):
        torch.ops.kernels.gelu_tanh_backward(x, x.t().contiguous())
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
        gelu_tanh([1.0, -1.0])


@requires_cuda
def test_mixed_devices_are_a_clear_error():
    x = torch.randn(4, 5)
    with pytest.raises(RuntimeError, match=r"same device"):
        torch.ops.kernels.gelu_tanh_backward(x.cuda(), x)
    with pytest.raises(RuntimeError, match=r"same device"):
        torch.ops.kernels.gelu_tanh_backward(x, x.cuda())


@requires_cuda
def test_runs_on_the_current_stream():
    base = torch.randn(1 << 20, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # the input below is written only after this delay, on `stream`
        x = base * 3.0
        y = gelu_tanh(x)
        expected = new_gelu(x)
    stream.synchronize()
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


@requires_cuda
def test_cuda_matches_the_cpu_loop():
    """Both devices evaluate one formula (gelu_tanh_math.h): within a few ulps (expf's), every dtype."""
    for dtype in FLOAT_DTYPES:
        x = randn(1 << 16, seed=91, dtype=dtype, scale=3.0)
        grad = randn(1 << 16, seed=92, dtype=dtype)
        tol = {torch.float32: 1e-6, torch.float64: 1e-14, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
        torch.testing.assert_close(gelu_tanh(x.cuda()).cpu(), gelu_tanh(x), atol=tol, rtol=tol)
        torch.testing.assert_close(torch.ops.kernels.gelu_tanh_backward(grad.cuda(), x.cuda()).cpu(),
                                   torch.ops.kernels.gelu_tanh_backward(grad, x), atol=tol, rtol=tol)
