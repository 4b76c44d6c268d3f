"""RMSNorm: the op against LlamaRMSNorm's formula in the same dtype (eager) and in float64, forward and backward, on
CPU and CUDA; every row layout the kernels take and the rows they leave to ATen, views, non-finite and huge values,
autograd to higher orders, forward mode, vmap, torch.compile and bad input. The precision contract: float32 error
against float64 no larger than eager's and allclose(1e-4) to it; float16 and bfloat16 within 2x eager's error."""

import pytest
import torch

from conftest import assert_graph_replay_matches_eager, check_accuracy, poison_allocator, requires_cuda
from kernels.functional import rms_norm
from kernels.precision import ALLCLOSE_TOLERANCE, gradient_atol, relative_error
from memory_helpers import cpu_peak_above_inputs, cuda_peak_above_inputs, float64_blocks_allowance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6

# Rows of every kernel configuration on CUDA (16-byte packs 1 to 8 a thread, single elements where the columns do not
# fill packs) and beyond (ATen's formula): (shape of x).
SHAPES = {
    "one row of 8": (1, 8),
    "2-D, 64": (4, 64),
    "3-D, 1000": (3, 5, 1000),
    "odd columns 1030": (7, 1030),
    "odd columns 13": (9, 13),
    "2048": (64, 2048),
    "4096": (16, 4096),
    "8192": (5, 8192),
    "8200 (ATen)": (3, 8200),
    "2051 single elements (ATen)": (3, 2051),
    "many rows": (3000, 256),
}


def llama_rms_norm(x, weight, eps=EPS):
    """transformers' LlamaRMSNorm.forward, op for op (weight of x's dtype): eager, or float64."""
    input_dtype = x.dtype
    h = x.to(torch.float32) if x.dtype != torch.float64 else x
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def randn(shape, dtype, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)


def weight_for(columns, dtype, device, seed=1):
    return randn((columns,), dtype, device, seed) * 0.5 + 1.0  # both signs possible, around 1 as trained norms are


def gradients(fn, x, weight, grad, dtype):
    x_leaf = x.detach().to(dtype).requires_grad_(True)
    weight_leaf = weight.detach().to(dtype).requires_grad_(True)
    return torch.autograd.grad(fn(x_leaf, weight_leaf), (x_leaf, weight_leaf), grad.to(dtype))


# ---- forward and backward against eager -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_forward_matches_eager(device, dtype, shape):
    x, weight = randn(shape, dtype, device, scale=3.0), weight_for(shape[-1], dtype, device)
    x_before = x.clone()
    poison_allocator(shape, dtype, device)
    y = rms_norm(x, weight, EPS)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    assert not y.isnan().any(), "an element was not written"
    check_accuracy(y, llama_rms_norm(x, weight), llama_rms_norm(x.double(), weight.double()), dtype, "forward")
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_backward_matches_eager(device, dtype, shape):
    x, weight = randn(shape, dtype, device, scale=3.0), weight_for(shape[-1], dtype, device)
    grad = randn(shape, dtype, device, seed=2)
    poison_allocator(shape, dtype, device)
    ours = gradients(rms_norm, x, weight, grad, dtype)
    eager = gradients(llama_rms_norm, x, weight, grad, dtype)
    exact = gradients(llama_rms_norm, x, weight, grad, torch.float64)
    for name, got, expected, reference in zip(("grad_x", "grad_weight"), ours, eager, exact):
        assert got.dtype == dtype and got.shape == expected.shape, name
        assert not got.isnan().any(), f"{name}: an element was not written"
        check_accuracy(got, expected, reference, dtype, name, atol=gradient_atol(expected, ALLCLOSE_TOLERANCE[dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_and_layouts(device, dtype):
    """Rows of a transposed, strided or offset x (unaligned), and a strided weight: eager's values."""
    base = randn((96, 130), dtype, device, scale=2.0)
    weight_base = weight_for(2 * 64, dtype, device)
    cases = {
        "transposed": (base.t()[:, :64], weight_base[:64]),
        "strided rows": (base[::2, :128], weight_base),
        "offset by one element": (base.reshape(-1)[1:1 + 40 * 64].view(40, 64), weight_base[:64]),
        "strided weight": (base[:, :64], weight_base[::2]),
        "expanded x": (base[:1, :128].expand(7, 128), weight_base),
    }
    for name, (x, weight) in cases.items():
        check_accuracy(rms_norm(x, weight, EPS), llama_rms_norm(x, weight), llama_rms_norm(x.double(),
                       weight.double()), dtype, name)
        grad = randn(x.shape, dtype, device, seed=3)
        for got, expected in zip(gradients(rms_norm, x, weight, grad, dtype),
                                 gradients(llama_rms_norm, x, weight, grad, dtype)):
            tol = ALLCLOSE_TOLERANCE[dtype]
            torch.testing.assert_close(got, expected, atol=gradient_atol(expected, tol), rtol=tol, msg=name)


def test_eps_as_eager_takes_it(device):
    """None is F.rms_norm's default (x's machine epsilon); a one-element tensor or a bool is a number, as there."""
    x, weight = randn((3, 64), torch.float32, device, scale=1e-3), weight_for(64, torch.float32, device)
    for eps, value in ((None, torch.finfo(torch.float32).eps), (torch.tensor(1e-5), 1e-5), (True, 1.0)):
        check_accuracy(rms_norm(x, weight, eps), llama_rms_norm(x, weight, value),
                       llama_rms_norm(x.double(), weight.double(), value), torch.float32, repr(eps))


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_eps_none_is_eagers_default(device, dtype):
    """eps None is F.rms_norm's default: the machine epsilon of x's compute type (float32's for float16 and bfloat16,
    whose own epsilon would swamp the mean of squares of small rows)."""
    x, weight = randn((4, 64), dtype, device, scale=1e-2), weight_for(64, dtype, device)
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    expected = torch.nn.functional.rms_norm(x, (64,), weight)
    torch.testing.assert_close(expected, torch.nn.functional.rms_norm(x, (64,), weight, eps), atol=0, rtol=0)
    check_accuracy(rms_norm(x, weight, None), llama_rms_norm(x, weight, eps),
                   llama_rms_norm(x.double(), weight.double(), eps), dtype, "eps None")


def test_empty_inputs(device):
    for shape in ((0, 16), (2, 0, 8), (3, 0)):  # no rows, and no features (the weight's gradient empty too)
        x = torch.randn(shape, device=device, requires_grad=True)
        weight = torch.ones(shape[-1], device=device).requires_grad_()
        y = rms_norm(x, weight)
        assert y.shape == x.shape
        y.sum().backward()
        assert x.grad.shape == x.shape and torch.equal(weight.grad, torch.zeros_like(weight))


def test_non_finite_values_give_eagers_result(device):
    """A row with an Inf or a NaN: eager's NaN and zeros, forward and backward."""
    x = randn((4, 256), torch.float32, device)
    x[1, 7], x[2, 100] = float("inf"), float("nan")
    weight = weight_for(256, torch.float32, device)
    torch.testing.assert_close(rms_norm(x, weight), llama_rms_norm(x, weight), equal_nan=True)
    grad = randn(x.shape, torch.float32, device, seed=4)
    got, expected = gradients(rms_norm, x, weight, grad, torch.float32), gradients(llama_rms_norm, x, weight, grad,
                                                                                 torch.float32)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, equal_nan=True, atol=gradient_atol(b.nan_to_num()), rtol=1e-5)


def test_huge_values_are_normalized(device):
    """Rows near float32's largest values: the squares, summed in double, do not overflow where eager's do (eager
    gives zeros), so the result is the float64 formula's."""
    x = randn((8, 512), torch.float32, device) * 1e30
    weight = weight_for(512, torch.float32, device)
    y = rms_norm(x, weight)
    assert relative_error(y, llama_rms_norm(x.double(), weight.double())) < 1e-6
    assert llama_rms_norm(x, weight).abs().max() == 0  # eager's x.pow(2) overflows to inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rows_in_many_blocks_match_eager(device, dtype):
    """Rows past the kernels' 8192 columns, more of them than one block of the ATen formulas' path takes (on either
    device): eager's values, forward and backward (the blocks' weight sums added before one rounding)."""
    shape = (600, 8200)
    x, weight = randn(shape, dtype, device, scale=3.0), weight_for(shape[-1], dtype, device)
    grad = randn(shape, dtype, device, seed=2)
    check_accuracy(rms_norm(x, weight, EPS), llama_rms_norm(x, weight), llama_rms_norm(x.double(), weight.double()),
                   dtype, "forward")
    exact = gradients(llama_rms_norm, x, weight, grad, torch.float64)
    for name, got, expected, reference in zip(("grad_x", "grad_weight"), gradients(rms_norm, x, weight, grad, dtype),
                                              gradients(llama_rms_norm, x, weight, grad, dtype), exact):
        check_accuracy(got, expected, reference, dtype, name, atol=gradient_atol(expected, ALLCLOSE_TOLERANCE[dtype]))


# One call of rms_norm or of its backward op on float32 inputs (rows x columns), for the peak memory.
CPU_PEAK_SETUP = """
from kernels.functional import rms_norm
rows, columns, backward = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "backward"
x, grad, weight = torch.randn(rows, columns), torch.randn(rows, columns), torch.randn(columns)
def call(n):
    return torch.ops.kernels.rms_norm_backward(grad[:n], x[:n], weight, 1e-6) if backward else rms_norm(x[:n], weight)
"""


def peak_above_inputs(device, rows, columns, backward):
    if device == "cpu":
        return cpu_peak_above_inputs(CPU_PEAK_SETUP, rows, rows, columns, "backward" if backward else "forward")
    x, grad = randn((rows, columns), torch.float32, device), randn((rows, columns), torch.float32, device, seed=2)
    weight = weight_for(columns, torch.float32, device)
    return cuda_peak_above_inputs(
        lambda: torch.ops.kernels.rms_norm_backward(grad, x, weight, EPS) if backward else rms_norm(x, weight))


@pytest.mark.slow
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_aten_formulas_take_no_whole_float64_copies(device, backward):
    """The ATen formulas' path (every CPU call; CUDA rows past 8192 columns) peaks at its results plus one block of
    rows' float64 temporaries, not at several float64 tensors of x's size (eager's F.rms_norm takes its result and one
    float32 temporary of that size)."""
    rows, columns = (4096, 4096) if device == "cpu" else (4096, 16384)
    results = rows * columns * 4 + columns * 4 * backward
    allowance = float64_blocks_allowance(device)
    peak = peak_above_inputs(device, rows, columns, backward)
    assert results <= peak <= results + allowance, f"peak {peak / 2**20:.0f} MiB, results {results / 2**20:.0f} MiB"


# ---- autograd, transforms, compile ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(3, 8), (2, 3, 5)])
def test_gradcheck_float64(device, shape):
    """First and second order and forward mode, of the op and of its backward op (the ATen formulas)."""
    x = torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(shape[-1], dtype=torch.float64, device=device, requires_grad=True)
    fn = lambda a, w: rms_norm(a, w, 0.1)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, weight), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(fn, (x, weight))
    grad = torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
    backward = lambda g, a, w: torch.ops.kernels.rms_norm_backward(g, a, w, 0.1)  # noqa: E731
    assert torch.autograd.gradcheck(backward, (grad, x, weight), check_forward_ad=True)


def test_double_backward_and_forward_mode_match_eager(device):
    x, weight = randn((6, 64), torch.float32, device), weight_for(64, torch.float32, device)
    cotangent, tangent = randn(x.shape, torch.float32, device, 5), randn(x.shape, torch.float32, device, 6)
    results = []
    for fn in (rms_norm, llama_rms_norm):
        leaf, w = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        g, gw = torch.autograd.grad((fn(leaf, w) * cotangent).sum(), (leaf, w), create_graph=True)
        gg = torch.autograd.grad((g * g).sum() + (gw * gw).sum(), (leaf, w))
        _, jvp = torch.func.jvp(lambda a: fn(a, weight), (x,), (tangent,))
        results.append((g.detach(), gw.detach(), *gg, jvp))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=1e-4)


def test_graph_node(device):
    x = torch.randn(3, 16, device=device, requires_grad=True)
    weight = torch.ones(16, device=device)
    assert rms_norm(x, weight).grad_fn.name() == "kernels::RmsNormBackward"
    with torch.no_grad():
        assert rms_norm(x, weight).grad_fn is None
    assert rms_norm(x.detach(), weight).grad_fn is None


def test_vmap(device):
    x, weight = randn((4, 3, 32), torch.float32, device), weight_for(32, torch.float32, device)
    weights = torch.stack([weight_for(32, torch.float32, device, seed) for seed in range(3)])
    got = torch.func.vmap(lambda a: rms_norm(a, weight), in_dims=1)(x)
    torch.testing.assert_close(got, llama_rms_norm(x.movedim(1, 0), weight), atol=1e-6, rtol=1e-6)
    got = torch.func.vmap(rms_norm, in_dims=(1, 0))(x, weights)
    torch.testing.assert_close(got, llama_rms_norm(x.movedim(1, 0), weights[:, None]), atol=1e-6, rtol=1e-6)
    # per-sample weight gradients (torch.func.grad records the backward's graph: the ATen formulas)
    per_sample = torch.func.vmap(torch.func.grad(lambda w, a: rms_norm(a, w).square().sum()), in_dims=(None, 0))
    expected = torch.func.vmap(torch.func.grad(lambda w, a: llama_rms_norm(a, w).square().sum()), in_dims=(None, 0))
    torch.testing.assert_close(per_sample(weight, x), expected(weight, x), atol=1e-4, rtol=1e-4)
    # the backward op batched: its rule, each member's grad_weight over its own rows
    grads = randn((3, 4, 32), torch.float32, device, seed=9)
    backward = lambda g, a: torch.ops.kernels.rms_norm_backward(g, a, weight, EPS)  # noqa: E731
    got_x, got_weight = torch.func.vmap(backward, in_dims=(1, 1))(grads.movedim(0, 1), x)
    for i in range(x.shape[1]):
        expected_x, expected_weight = torch.ops.kernels.rms_norm_backward(grads[i], x[:, i], weight, EPS)
        torch.testing.assert_close(got_x[i], expected_x, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_weight[i], expected_weight, atol=1e-5, rtol=1e-5)


def test_opcheck(device):
    """Contiguous and transposed inputs (the fakes' layout is the results' whatever the path), with and without
    gradients; float64 takes the ATen formulas on either device."""
    for dtype in (torch.float32, torch.float64):
        weight = torch.randn(48, device=device, dtype=dtype)
        for x in (torch.randn(5, 48, device=device, dtype=dtype), torch.randn(48, 5, device=device, dtype=dtype).t()):
            for requires_grad in (False, True):
                torch.library.opcheck(torch.ops.kernels.rms_norm.default,
                                      (x.clone().requires_grad_(requires_grad),
                                       weight.clone().requires_grad_(requires_grad), EPS))
            grad = torch.randn_like(x).t().contiguous().t()  # the other layout than x's
            torch.library.opcheck(torch.ops.kernels.rms_norm_backward.default, (grad, x, weight, EPS))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()

    def block(x, weight, proj):
        return rms_norm(x, weight) @ proj

    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(4, 9, 64, device=device, requires_grad=True)
    weight = torch.randn(64, device=device, requires_grad=True)
    proj = torch.randn(64, 32, device=device)
    grad = torch.randn(4, 9, 32, device=device)
    y = compiled(x, weight, proj)
    y_eager = llama_rms_norm(x, weight) @ proj
    torch.testing.assert_close(y, y_eager, atol=1e-4, rtol=1e-4)
    for got, expected in zip(torch.autograd.grad(y, (x, weight), grad),
                             torch.autograd.grad(y_eager, (x, weight), grad)):
        torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=1e-4)


@requires_cuda
def test_same_bits_every_run():
    x, weight = randn((4096, 2048), torch.float32, "cuda"), weight_for(2048, torch.float32, "cuda")
    grad = randn(x.shape, torch.float32, "cuda", seed=7)
    first, second = (gradients(rms_norm, x, weight, grad, torch.float32) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@requires_cuda
def test_cuda_graph_replays_the_same_bits():
    """Forward and backward captured in a CUDA graph (the backward's workspace from the graph's pool): a replay on new
    inputs gives the eager calls' bits."""
    x = randn((512, 2048), torch.float32, "cuda", scale=2.0).requires_grad_(True)
    weight = weight_for(2048, torch.float32, "cuda").requires_grad_(True)
    grad = randn((512, 2048), torch.float32, "cuda", seed=3)

    def step():
        y = rms_norm(x, weight)
        return (y, *torch.autograd.grad(y, (x, weight), grad))

    assert_graph_replay_matches_eager(
        step, lambda: x.copy_(randn(x.shape, torch.float32, "cuda", seed=11)))


# ---- bad input ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_bad_dtype_is_a_clear_error(device, dtype):
    with pytest.raises(RuntimeError, match=r"x must be a float32, float64, float16 or bfloat16 tensor, got"):
        rms_norm(torch.ones(4, 4, device=device).to(dtype), torch.ones(4, device=device))


def test_bad_arguments_are_clear_errors(device):
    x = torch.randn(3, 8, device=device)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[8\] \(x's last dimension\), got \[7\]"):
        rms_norm(x, torch.ones(7, device=device))
    with pytest.raises(RuntimeError, match=r"expected weight and x to have the same dtype"):
        rms_norm(x, torch.ones(8, device=device, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"x must have at least 1 dimension"):
        rms_norm(torch.tensor(1.0, device=device), torch.ones(1, device=device))
    with pytest.raises(RuntimeError, match=r"grad_y has shape \[3, 9\] but x has shape \[3, 8\]"):
        torch.ops.kernels.rms_norm_backward(torch.randn(3, 9, device=device), x, torch.ones(8, device=device), EPS)
    with pytest.raises(TypeError, match="x and weight must be torch.Tensors"):
        rms_norm([1.0], torch.ones(1))


@requires_cuda
def test_mixed_devices_are_a_clear_error():
    with pytest.raises(RuntimeError, match="same device"):
        rms_norm(torch.randn(2, 8, device="cuda"), torch.ones(8))


def test_meta_tensors_trace():
    x, weight = torch.empty(2, 3, 64, device="meta", dtype=torch.bfloat16), torch.empty(64, device="meta",
                                                                                         dtype=torch.bfloat16)
    y = rms_norm(x, weight)
    assert y.device.type == "meta" and y.shape == x.shape and y.dtype == x.dtype
    with pytest.raises(RuntimeError, match=r"weight must have shape \[64\]"):
        rms_norm(x, torch.empty(63, device="meta", dtype=torch.bfloat16))


@requires_cuda
def test_runs_on_the_current_stream():
    base = torch.randn(512, 1024, device="cuda")
    weight = weight_for(1024, torch.float32, "cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # the input below is written only after this delay, on `stream`
        x = base * 3.0
        y = rms_norm(x, weight)
        expected = llama_rms_norm(x, weight)
    stream.synchronize()
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
