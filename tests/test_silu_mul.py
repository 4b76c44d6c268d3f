"""The SwiGLU gate silu(gate) * up: the op against eager's `F.silu(gate) * up` in the same dtype and in float64,
forward and backward, on CPU and CUDA; both kernel paths (16-byte packs and single elements), views, non-finite
values, autograd to higher orders, forward mode, vmap, torch.compile and bad input. The precision contract: float32
error against float64 no larger than eager's and allclose(1e-4) to it; float16 and bfloat16 within 2x eager's."""

import pytest
import torch
import torch.nn.functional as F

import conftest
from conftest import assert_graph_replay_matches_eager, poison_allocator, requires_cuda
from kernels.functional import silu_mul
from kernels.precision import ALLCLOSE_TOLERANCE, gradient_atol

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = {"one element": (1,), "2-D": (64, 96), "odd": (7, 1001), "the LLaMA MLP's rows": (512, 5632),
          "large": (1 << 20,)}


def eager(gate, up):
    return F.silu(gate) * up


def randn(shape, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)


def check_accuracy(got, expected, reference64, dtype, what, atol=None):
    # In float64 the op computes eager's formula in float64: within 1e-15 of it.
    conftest.check_accuracy(got, expected, reference64, dtype, what, atol, float64_error=1e-15)


def gradients(fn, gate, up, grad, dtype):
    g, u = (t.detach().to(dtype).requires_grad_(True) for t in (gate, up))
    return torch.autograd.grad(fn(g, u), (g, u), grad.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_forward_and_backward_match_eager(device, dtype, shape):
    gate, up = randn(shape, dtype, device, scale=3.0), randn(shape, dtype, device, seed=1)
    grad = randn(shape, dtype, device, seed=2)
    before = gate.clone(), up.clone()
    poison_allocator(shape, dtype, device)
    y = silu_mul(gate, up)
    assert y.shape == gate.shape and y.dtype == dtype and not y.isnan().any()
    check_accuracy(y, eager(gate, up), eager(gate.double(), up.double()), dtype, "forward")
    assert torch.equal(gate, before[0]) and torch.equal(up, before[1])
    ours, theirs, exact = (gradients(fn, gate, up, grad, t) for fn, t in ((silu_mul, dtype), (eager, dtype),
                                                                         (eager, torch.float64)))
    for name, got, expected, reference in zip(("grad_gate", "grad_up"), ours, theirs, exact):
        assert got.dtype == dtype and not got.isnan().any(), name
        check_accuracy(got, expected, reference, dtype, name, atol=gradient_atol(expected, ALLCLOSE_TOLERANCE[dtype]))


def test_views(device):
    """A transposed gate, a strided up, an offset (unaligned) pair: eager's values."""
    base = randn((96, 130), torch.float32, device, scale=3.0)
    other = randn((96, 130), torch.float32, device, seed=3)
    cases = {"transposed": (base.t(), other.t()), "strided": (base[:, ::2], other[:, ::2]),
             "offset": (base.reshape(-1)[1:4001], other.reshape(-1)[1:4001]), "mixed": (base.t(), other.t() * 1.0)}
    for name, (gate, up) in cases.items():
        torch.testing.assert_close(silu_mul(gate, up), eager(gate, up), atol=1e-6, rtol=1e-6, msg=name)
        grad = randn(gate.shape, torch.float32, device, seed=4)
        for got, expected in zip(gradients(silu_mul, gate, up, grad, torch.float32),
                                 gradients(eager, gate, up, grad, torch.float32)):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=name)


def test_non_finite_and_extreme_values_give_the_float64_result(device):
    """Inf, NaN, signed zeros and gates far out on both sides, against every up: eager's formula in float64, rounded
    to float32. That is eager's float32 result but where float32's exp(-gate) overflows (gate below about -88): there
    eager's silu is -0 where the float64 one is a subnormal float, so times an infinite up eager gives NaN and this
    library the infinity float64 gives (as the gelu_tanh family follows float64 where eager's float32 overflows)."""
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e30, -1e30, 100.0, -100.0, -90.0],
                           device=device)
    gate = special.repeat_interleave(len(special))
    up = special.repeat(len(special))
    torch.testing.assert_close(silu_mul(gate, up), eager(gate.double(), up.double()).float(), equal_nan=True)
    finite_exp = gate > -80
    torch.testing.assert_close(silu_mul(gate, up)[finite_exp], eager(gate, up)[finite_exp], equal_nan=True)
    grad = torch.ones_like(gate)
    for got, expected in zip(gradients(silu_mul, gate, up, grad, torch.float32),
                             gradients(eager, gate, up, grad, torch.float64)):
        torch.testing.assert_close(got, expected.float(), equal_nan=True)


def test_empty(device):
    gate = torch.randn(0, 8, device=device, requires_grad=True)
    y = silu_mul(gate, torch.randn(0, 8, device=device))
    y.sum().backward()
    assert y.shape == (0, 8) and gate.grad.shape == (0, 8)


@pytest.mark.parametrize("shape", [(3, 8), (2, 3, 5)])
def test_gradcheck_float64(device, shape):
    gate, up = (torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(silu_mul, (gate, up), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(silu_mul, (gate, up))
    grad = torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(torch.ops.kernels.silu_mul_backward, (grad, gate, up), check_forward_ad=True)


def test_double_backward_and_forward_mode_match_eager(device):
    gate, up = randn((6, 64), torch.float32, device, scale=2.0), randn((6, 64), torch.float32, device, 1)
    cotangent, tangent = randn(gate.shape, torch.float32, device, 5), randn(gate.shape, torch.float32, device, 6)
    results = []
    for fn in (silu_mul, eager):
        g, u = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
        grad_gate, grad_up = torch.autograd.grad((fn(g, u) * cotangent).sum(), (g, u), create_graph=True)
        second = torch.autograd.grad((grad_gate * grad_gate).sum() + (grad_up * grad_up).sum(), (g, u))
        _, jvp = torch.func.jvp(lambda a: fn(a, up), (gate,), (tangent,))
        results.append((grad_gate.detach(), grad_up.detach(), *second, jvp))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=1e-5)


def test_graph_node(device):
    gate = torch.randn(3, 16, device=device, requires_grad=True)
    up = torch.randn(3, 16, device=device)
    assert silu_mul(gate, up).grad_fn.name() == "kernels::SiluMulBackward"
    with torch.no_grad():
        assert silu_mul(gate, up).grad_fn is None


def test_frozen_gate_keeps_no_up(device):
    """As eager's act_fn(gate) * up: with gate frozen, up is not kept (its in-place edit passes) and grad_up is eager's,
    in every order."""
    gate, up = randn((6, 64), torch.float64, device, scale=2.0), randn((6, 64), torch.float64, device, 1)
    leaf = up.clone().requires_grad_(True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.untyped_storage().data_ptr()) or t,
                                                  lambda t: t):
        y = silu_mul(gate, leaf)
    assert leaf.untyped_storage().data_ptr() not in kept
    hidden = leaf * 1.0
    y = silu_mul(gate, hidden)
    with torch.no_grad():
        hidden.add_(1.0)
    grad = randn(y.shape, torch.float64, device, 3)
    (got,) = torch.autograd.grad(y, leaf, grad)
    torch.testing.assert_close(got, grad * eager(gate, torch.ones_like(up)))
    assert torch.autograd.gradgradcheck(lambda u: silu_mul(gate, u), (leaf,))


def test_vmap(device):
    gate = randn((4, 3, 32), torch.float32, device)
    up_rows, up_samples = randn((4, 32), torch.float32, device, 1), randn((3, 32), torch.float32, device, 2)
    got = torch.func.vmap(silu_mul, in_dims=(1, None))(gate, up_rows)
    torch.testing.assert_close(got, eager(gate.movedim(1, 0), up_rows), atol=1e-6, rtol=1e-6)
    per_sample = torch.func.vmap(torch.func.grad(lambda g, u: silu_mul(g, u).square().sum()), in_dims=(0, None))
    expected = torch.func.vmap(torch.func.grad(lambda g, u: eager(g, u).square().sum()), in_dims=(0, None))
    torch.testing.assert_close(per_sample(gate, up_samples), expected(gate, up_samples), atol=1e-5, rtol=1e-5)


def test_opcheck(device):
    """Contiguous and transposed operands (the fakes' layout is the results' whatever the path)."""
    for gate, up in ((torch.randn(5, 48, device=device), torch.randn(5, 48, device=device)),
                     (torch.randn(48, 5, device=device).t(), torch.randn(48, 5, device=device).t())):
        for requires_grad in (False, True):
            torch.library.opcheck(torch.ops.kernels.silu_mul.default, (gate.clone().requires_grad_(requires_grad),
                                                                       up.clone().requires_grad_(requires_grad)))
        torch.library.opcheck(torch.ops.kernels.silu_mul_backward.default, (torch.randn_like(gate), gate, up))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()

    def mlp(x, w_gate, w_up, w_down):
        return silu_mul(x @ w_gate, x @ w_up) @ w_down

    compiled = torch.compile(mlp, fullgraph=True)
    x = torch.randn(4, 9, 32, device=device, requires_grad=True)
    weights = [torch.randn(32, 48, device=device, requires_grad=True), torch.randn(32, 48, device=device),
               torch.randn(48, 32, device=device)]
    grad = torch.randn(4, 9, 32, device=device)
    y = compiled(x, *weights)
    y_eager = eager(x @ weights[0], x @ weights[1]) @ weights[2]
    torch.testing.assert_close(y, y_eager, atol=1e-4, rtol=1e-4)
    for got, expected in zip(torch.autograd.grad(y, (x, weights[0]), grad),
                             torch.autograd.grad(y_eager, (x, weights[0]), grad)):
        torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=1e-4)


@requires_cuda
def test_cuda_graph_replays_the_same_bits():
    gate = randn((512, 1024), torch.float32, "cuda", scale=2.0).requires_grad_(True)
    up = randn((512, 1024), torch.float32, "cuda", seed=1).requires_grad_(True)
    grad = randn((512, 1024), torch.float32, "cuda", seed=2)

    def step():
        y = silu_mul(gate, up)
        return (y, *torch.autograd.grad(y, (gate, up), grad))

    assert_graph_replay_matches_eager(
        step, lambda: gate.copy_(randn(gate.shape, torch.float32, "cuda", seed=11)))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_bad_dtype_is_a_clear_error(device, dtype):
    with pytest.raises(RuntimeError, match=r"gate must be a float32, float64, float16 or bfloat16 tensor, got"):
        silu_mul(torch.ones(4, device=device).to(dtype), torch.ones(4, device=device).to(dtype))


def test_bad_arguments_are_clear_errors(device):
    gate = torch.randn(3, 8, device=device)
    with pytest.raises(RuntimeError, match=r"up has shape \[3, 7\] but gate has shape \[3, 8\]"):
        silu_mul(gate, torch.randn(3, 7, device=device))
    with pytest.raises(RuntimeError, match=r"expected up and gate to have the same dtype"):
        silu_mul(gate, gate.double())
    with pytest.raises(RuntimeError, match=r"grad_y has shape \[3\] but gate has shape \[3, 8\]"):
        torch.ops.kernels.silu_mul_backward(torch.randn(3, device=device), gate, gate)
    with pytest.raises(TypeError, match="gate and up must be torch.Tensors"):
        silu_mul([1.0], torch.ones(1))


@requires_cuda
def test_mixed_devices_are_a_clear_error():
    with pytest.raises(RuntimeError, match="same device"):
        silu_mul(torch.randn(2, 8, device="cuda"), torch.ones(2, 8))


def test_meta_tensors_trace():
    gate = torch.empty(2, 3, 64, device="meta", dtype=torch.bfloat16)
    y = silu_mul(gate, gate)
    assert y.device.type == "meta" and y.shape == gate.shape and y.dtype == gate.dtype
    with pytest.raises(RuntimeError, match=r"up has shape"):
        silu_mul(gate, torch.empty(2, 3, 63, device="meta", dtype=torch.bfloat16))


@requires_cuda
def test_runs_on_the_current_stream():
    base = torch.randn(1024, 1024, device="cuda")
    up = torch.randn(1024, 1024, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # the input below is written only after this delay, on `stream`
        gate = base * 3.0
        y = silu_mul(gate, up)
        expected = eager(gate, up)
    stream.synchronize()
    torch.testing.assert_close(y, expected, atol=1e-6, rtol=1e-6)
