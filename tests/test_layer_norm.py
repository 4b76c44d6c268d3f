"""LayerNorm: the op against F.layer_norm in the same dtype (eager) and in float64, forward and backward, on CPU and
CUDA; every row layout the kernels take and the rows they leave to ATen, views, non-finite and huge values, autograd
to higher orders, forward mode, vmap, torch.compile and bad input. The precision contract: float32 error against
float64 no larger than eager's and allclose(1e-4) to it; float16 and bfloat16 within 2x eager's error."""

import pytest
import torch
import torch.nn.functional as F

import conftest
from conftest import assert_graph_replay_matches_eager, poison_allocator, requires_cuda
from kernels.functional import add_layer_norm, layer_norm
from kernels.precision import ALLCLOSE_TOLERANCE, gradient_atol, relative_error
from memory_helpers import cpu_peak_above_inputs, cuda_peak_above_inputs, float64_blocks_allowance

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5

# Rows of every kernel configuration on CUDA (16-byte packs 1 to 4 a thread, single elements where the columns do not
# fill packs) and beyond (ATen's formula): (shape of x).
SHAPES = {
    "one row of 8": (1, 8),
    "2-D, 64": (4, 64),
    "3-D, 1000": (3, 5, 1000),
    "odd columns 1030": (7, 1030),
    "odd columns 13": (9, 13),
    "768": (50, 768),
    "2048": (64, 2048),
    "4096": (16, 4096),
    "4104 (ATen)": (3, 4104),
    "2051 single elements (ATen)": (3, 2051),
    "many rows": (3000, 256),
    "many rows of 768": (2600, 768),
    "many rows of 4096": (600, 4096),
}


def eager_layer_norm(x, weight, bias, eps=EPS):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def randn(shape, dtype, device, seed=0, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + shift).to(device=device, dtype=dtype)


def parameters_for(columns, dtype, device, seed=1):
    """A weight around 1 and a bias around 0, both signs possible, as trained norms have."""
    return randn((columns,), dtype, device, seed) * 0.5 + 1.0, randn((columns,), dtype, device, seed + 1) * 0.5


def check_accuracy(got, expected, reference64, dtype, what, atol=None):
    # In float16 and bfloat16 against the float64 result in got's dtype: eager's own parameter gradients there, summed
    # in the narrow type on the CPU, are not a fair target.
    conftest.check_accuracy(got, expected, reference64, dtype, what, atol, narrow_close_to_exact=True)


def gradients(fn, x, weight, bias, grad, dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, weight, bias)]
    return torch.autograd.grad(fn(*leaves), leaves, grad.to(dtype))


# ---- forward and backward against eager -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_forward_matches_eager(device, dtype, shape):
    x = randn(shape, dtype, device, scale=3.0, shift=1.5)  # rows off zero: the mean matters
    weight, bias = parameters_for(shape[-1], dtype, device)
    x_before = x.clone()
    poison_allocator(shape, dtype, device)
    y = layer_norm(x, weight, bias, EPS)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    assert not y.isnan().any(), "an element was not written"
    check_accuracy(y, eager_layer_norm(x, weight, bias),
                   eager_layer_norm(x.double(), weight.double(), bias.double()), dtype, "forward")
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_backward_matches_eager(device, dtype, shape):
    x = randn(shape, dtype, device, scale=3.0, shift=1.5)
    weight, bias = parameters_for(shape[-1], dtype, device)
    grad = randn(shape, dtype, device, seed=2)
    poison_allocator(shape, dtype, device)
    ours = gradients(layer_norm, x, weight, bias, grad, dtype)
    eager = gradients(eager_layer_norm, x, weight, bias, grad, dtype)
    exact = gradients(eager_layer_norm, x, weight, bias, grad, torch.float64)
    for name, got, expected, reference in zip(("grad_x", "grad_weight", "grad_bias"), ours, eager, exact):
        assert got.dtype == dtype and got.shape == expected.shape, name
        assert not got.isnan().any(), f"{name}: an element was not written"
        check_accuracy(got, expected, reference, dtype, name, atol=gradient_atol(expected, ALLCLOSE_TOLERANCE[dtype]))


# ---- add_layer_norm: a residual add and the norm after it -------------------------------------------------------

def eager_add_layer_norm(x, residual, weight, bias, eps=EPS):
    total = x + residual
    return total, eager_layer_norm(total, weight, bias, eps)


ADD_SHAPES = {name: SHAPES[name] for name in ("2-D, 64", "odd columns 13", "768", "4096", "4104 (ATen)",
                                               "many rows of 768", "many rows of 4096")}


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", ADD_SHAPES.values(), ids=ADD_SHAPES.keys())
def test_add_layer_norm_matches_eager(device, dtype, shape):
    """The sum bit for bit eager's add, y as layer_norm of it; gradients with both outputs used (the sum's gradient
    added to the norm's grad_x in the kernel), with the norm's alone and with the sum's alone, against eager's and
    float64."""
    x = randn(shape, dtype, device, scale=3.0, shift=1.5)
    residual = randn(shape, dtype, device, seed=3)
    weight, bias = parameters_for(shape[-1], dtype, device)
    poison_allocator(shape, dtype, device)
    total, y = add_layer_norm(x, residual, weight, bias, EPS)
    expected_total, expected_y = eager_add_layer_norm(x, residual, weight, bias)
    assert torch.equal(total, expected_total)
    assert not y.isnan().any(), "an element was not written"
    check_accuracy(y, expected_y, eager_layer_norm(expected_total.double(), weight.double(), bias.double()), dtype,
                   "forward")
    grad_total, grad_y = randn(shape, dtype, device, seed=4), randn(shape, dtype, device, seed=2)
    for used in ("both", "y", "sum"):
        def loss(fn, *inputs):
            out_total, out_y = fn(*inputs)
            return {"both": (out_total * grad_total.to(out_total.dtype)).sum() + (out_y * grad_y.to(out_y.dtype)).sum(),
                    "y": (out_y * grad_y.to(out_y.dtype)).sum(),
                    "sum": (out_total * grad_total.to(out_total.dtype)).sum()}[used]

        def grads(fn, as_dtype):
            leaves = [t.detach().to(as_dtype).requires_grad_(True) for t in (x, residual, weight, bias)]
            return torch.autograd.grad(loss(fn, *leaves), leaves, allow_unused=True)

        ours = grads(add_layer_norm, dtype)
        eager, exact = grads(eager_add_layer_norm, dtype), grads(eager_add_layer_norm, torch.float64)
        assert torch.equal(ours[0], ours[1]), "x and the residual get the same gradient"
        for name, got, expected, reference in zip(("grad_x", "grad_residual", "grad_weight", "grad_bias"), ours,
                                                  eager, exact):
            if used == "sum" and name in ("grad_weight", "grad_bias"):
                assert got is None or not got.any(), name
                continue
            assert got.dtype == dtype and got.shape == expected.shape, name
            check_accuracy(got, expected, reference, dtype, f"{used}: {name}",
                           atol=gradient_atol(expected, ALLCLOSE_TOLERANCE[dtype]))


@pytest.mark.parametrize("offset", [0, 1])
def test_layer_norm_backward_adds_grad_residual(device, offset):
    """layer_norm_backward's grad_residual, given directly (aligned and at an element's offset: the staged and the
    unstaged kernels), is added to grad_x before its rounding: within one rounding of the float64 sum."""
    shape = (300, 768)
    x = randn(shape, torch.float32, device, scale=3.0, shift=1.5)
    weight, _ = parameters_for(768, torch.float32, device)
    grad = randn(shape, torch.float32, device, seed=2)
    other = randn((shape[0] * shape[1] + offset,), torch.float32, device, seed=5)[offset:].view(shape)
    plain = torch.ops.kernels.layer_norm_backward(grad, x, weight, EPS)
    added = torch.ops.kernels.layer_norm_backward(grad, x, weight, EPS, other)
    reference = torch.ops.kernels.layer_norm_backward(grad.double(), x.double(), weight.double(), EPS, other.double())
    torch.testing.assert_close(added[0], reference[0].float(), atol=1e-6, rtol=1e-6)
    assert relative_error(added[0], reference[0]) <= relative_error(plain[0] + other, reference[0])
    assert torch.equal(added[1], plain[1]) and torch.equal(added[2], plain[2])
    with pytest.raises(RuntimeError, match="grad_residual has shape"):
        torch.ops.kernels.layer_norm_backward(grad, x, weight, EPS, other[:10])


@requires_cuda
def test_grad_residual_added_apart_where_its_staged_row_does_not_fit():
    # 768 columns in groups of four rows: 72 KB of sums and staged rows without the residual's third row, 84 KB with
    # it. A limit between the two (a GPU whose blocks hold 99 KB, at 1024 columns) runs the kernels without it, then
    # the add: the two results' sum bit for bit.
    shape = (300, 768)
    x = randn(shape, torch.float32, "cuda", scale=3.0, shift=1.5)
    weight, _ = parameters_for(768, torch.float32, "cuda")
    grad, other = randn(shape, torch.float32, "cuda", seed=2), randn(shape, torch.float32, "cuda", seed=5)
    plain = torch.ops.kernels.layer_norm_backward(grad, x, weight, EPS)
    previous = torch.ops.kernels._layer_norm_force_backward_shared_limit(80000)
    try:
        added = torch.ops.kernels.layer_norm_backward(grad, x, weight, EPS, other)
    finally:
        torch.ops.kernels._layer_norm_force_backward_shared_limit(previous)
    assert torch.equal(added[0], plain[0] + other)
    assert torch.equal(added[1], plain[1]) and torch.equal(added[2], plain[2])


def test_add_layer_norm_gradcheck_and_errors(device):
    x, residual = (torch.randn(3, 8, device=device, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight, bias = (torch.randn(8, device=device, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda *a: add_layer_norm(*a, EPS), (x, residual, weight, bias))
    assert torch.autograd.gradgradcheck(lambda *a: add_layer_norm(*a, EPS), (x, residual, weight, bias))
    total, y = add_layer_norm(x, residual, weight, bias, EPS)
    assert total.grad_fn is y.grad_fn and "AddLayerNorm" in y.grad_fn.name()
    # As eager's x + residual: the sum requires grad only where x or the residual does; forward over reverse holds.
    x0, residual0 = x.detach(), residual.detach()
    total, y = add_layer_norm(x0, residual0, weight, bias, EPS)
    assert not total.requires_grad and "AddLayerNorm" in y.grad_fn.name()
    assert torch.autograd.gradgradcheck(lambda w, b: add_layer_norm(x0, residual0, w, b, EPS)[1], (weight, bias),
                                        check_fwd_over_rev=True)
    for args in ((x.float(), residual, weight, bias), (x, residual[:, :4], weight, bias)):
        with pytest.raises(RuntimeError, match="kernels.add_layer_norm: .*(dtype|shape)"):
            add_layer_norm(*args, EPS)
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        add_layer_norm(x, 1.0, weight, bias, EPS)
    for args in ((torch.randn(5, 48, device=device), torch.randn(5, 48, device=device)),
                 (torch.randn(48, 5, device=device).t(), torch.randn(5, 48, device=device))):
        w, b = torch.randn(48, device=device), torch.randn(48, device=device)
        torch.library.opcheck(torch.ops.kernels.add_layer_norm.default, (*args, w, b, EPS))
        grad = torch.randn(5, 48, device=device)
        torch.library.opcheck(torch.ops.kernels.layer_norm_backward.default, (grad, args[0], w, EPS, grad))


def test_add_layer_norm_vmap(device):
    x, residual = torch.randn(3, 4, 16, device=device), torch.randn(3, 4, 16, device=device)
    weight, bias = torch.randn(16, device=device), torch.randn(16, device=device)
    total, y = torch.func.vmap(lambda a, r: add_layer_norm(a, r, weight, bias, EPS))(x, residual)
    expected_total, expected_y = eager_add_layer_norm(x, residual, weight, bias)
    assert torch.equal(total, expected_total)
    torch.testing.assert_close(y, expected_y, atol=1e-5, rtol=1e-5)
    grads = torch.func.vmap(torch.func.grad(lambda a, r: add_layer_norm(a, r, weight, bias, EPS)[1].square().sum()))(
        x, residual)
    expected = torch.func.vmap(torch.func.grad(lambda a: eager_layer_norm(a, weight, bias).square().sum()))(
        x + residual)
    torch.testing.assert_close(grads, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rows_in_many_blocks_match_eager(device, dtype):
    """Rows past the kernels' 4096 columns, more of them than one block of the ATen formulas' path takes (on either
    device): eager's values for layer_norm, add_layer_norm and their gradients (the blocks' parameter sums added
    before one rounding; the sum's gradient added to each block's grad_x)."""
    shape = (1100, 4104)
    x, residual = randn(shape, dtype, device, scale=3.0, shift=1.5), randn(shape, dtype, device, seed=3)
    weight, bias = parameters_for(shape[-1], dtype, device)
    grad, grad_sum = randn(shape, dtype, device, seed=2), randn(shape, dtype, device, seed=4)
    x64, residual64, weight64, bias64 = (t.double() for t in (x, residual, weight, bias))
    check_accuracy(layer_norm(x, weight, bias, EPS), eager_layer_norm(x, weight, bias),
                   eager_layer_norm(x64, weight64, bias64), dtype, "forward")
    total, y = add_layer_norm(x, residual, weight, bias, EPS)
    assert torch.equal(total, x + residual)
    check_accuracy(y, eager_layer_norm(x + residual, weight, bias), eager_layer_norm(x64 + residual64, weight64,
                   bias64), dtype, "add_layer_norm")

    def add_then_norm(add, a, b, w, c):
        total, y = add(a, b, w, c)
        return (total * grad_sum.to(total.dtype)).sum() + (y * grad.to(y.dtype)).sum()

    names = ("grad_x", "grad_weight", "grad_bias")
    exact = gradients(eager_layer_norm, x, weight, bias, grad, torch.float64)
    for name, got, expected, reference in zip(names, gradients(layer_norm, x, weight, bias, grad, dtype),
                                              gradients(eager_layer_norm, x, weight, bias, grad, dtype), exact):
        check_accuracy(got, expected, reference, dtype, name, atol=gradient_atol(expected, ALLCLOSE_TOLERANCE[dtype]))
    results = []
    for add, leaf_dtype in ((add_layer_norm, dtype), (eager_add_layer_norm, dtype), (eager_add_layer_norm,
                                                                                     torch.float64)):
        leaves = [t.detach().to(leaf_dtype).requires_grad_(True) for t in (x, residual, weight, bias)]
        results.append(torch.autograd.grad(add_then_norm(add, *leaves), leaves))
    for name, got, expected, reference in zip(("grad_x", "grad_residual", "grad_weight", "grad_bias"), *results):
        check_accuracy(got, expected, reference, dtype, f"add_layer_norm {name}",
                       atol=gradient_atol(expected, ALLCLOSE_TOLERANCE[dtype]))


# One call of layer_norm, add_layer_norm or the backward op on float32 inputs (rows x columns), for the peak memory.
CPU_PEAK_SETUP = """
from kernels.functional import add_layer_norm, layer_norm
rows, columns, call_name = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
x, other = torch.randn(rows, columns), torch.randn(rows, columns)
weight, bias = torch.randn(columns), torch.randn(columns)
call = {"forward": lambda n: layer_norm(x[:n], weight, bias),
        "add": lambda n: add_layer_norm(x[:n], other[:n], weight, bias),
        "backward": lambda n: torch.ops.kernels.layer_norm_backward(other[:n], x[:n], weight, 1e-5)}[call_name]
"""


def peak_above_inputs(device, rows, columns, call_name):
    if device == "cpu":
        return cpu_peak_above_inputs(CPU_PEAK_SETUP, rows, rows, columns, call_name)
    x, other = randn((rows, columns), torch.float32, device), randn((rows, columns), torch.float32, device, seed=2)
    weight, bias = parameters_for(columns, torch.float32, device)
    calls = {"forward": lambda: layer_norm(x, weight, bias), "add": lambda: add_layer_norm(x, other, weight, bias),
             "backward": lambda: torch.ops.kernels.layer_norm_backward(other, x, weight, EPS)}
    return cuda_peak_above_inputs(calls[call_name])


@pytest.mark.slow
@pytest.mark.parametrize("call_name", ["forward", "add", "backward"])
def test_aten_formulas_take_no_whole_float64_copies(device, call_name):
    """The ATen formulas' path (every CPU call; CUDA rows past 4096 columns) peaks at its results plus one block of
    rows' float64 temporaries, not at several float64 tensors of x's size (eager's F.layer_norm takes its result
    alone)."""
    rows, columns = (4096, 4096) if device == "cpu" else (4096, 16384)
    results = rows * columns * 4 * (2 if call_name == "add" else 1) + columns * 8 * (call_name == "backward")
    allowance = float64_blocks_allowance(device)
    peak = peak_above_inputs(device, rows, columns, call_name)
    assert results <= peak <= results + allowance, f"peak {peak / 2**20:.0f} MiB, results {results / 2**20:.0f} MiB"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_and_layouts(device, dtype):
    """Rows of a transposed, strided or offset x (unaligned), and strided parameters: eager's values."""
    base = randn((96, 130), dtype, device, scale=2.0, shift=1.0)
    weight_base, bias_base = parameters_for(2 * 64, dtype, device)
    cases = {
        "transposed": (base.t()[:, :64], weight_base[:64], bias_base[:64]),
        "strided rows": (base[::2, :128], weight_base, bias_base),
        "offset by one element": (base.reshape(-1)[1:1 + 40 * 64].view(40, 64), weight_base[:64], bias_base[:64]),
        "strided parameters": (base[:, :64], weight_base[::2], bias_base[1::2]),
        "expanded x": (base[:1, :128].expand(7, 128), weight_base, bias_base),
    }
    for name, (x, weight, bias) in cases.items():
        check_accuracy(layer_norm(x, weight, bias, EPS), eager_layer_norm(x, weight, bias),
                       eager_layer_norm(x.double(), weight.double(), bias.double()), dtype, name)
        grad = randn(x.shape, dtype, device, seed=3)
        for got, expected in zip(gradients(layer_norm, x, weight, bias, grad, dtype),
                                 gradients(eager_layer_norm, x, weight, bias, grad, dtype)):
            tol = ALLCLOSE_TOLERANCE[dtype]
            torch.testing.assert_close(got, expected, atol=gradient_atol(expected, tol), rtol=tol, msg=name)


def test_empty_inputs(device):
    for shape in ((0, 16), (2, 0, 8), (3, 0)):  # no rows, and no features (the parameters' gradients empty too)
        x = torch.randn(shape, device=device, requires_grad=True)
        weight, bias = (torch.ones(shape[-1], device=device).requires_grad_(), torch.zeros(shape[-1], device=device)
                        .requires_grad_())
        y = layer_norm(x, weight, bias)
        assert y.shape == x.shape
        y.sum().backward()
        assert x.grad.shape == x.shape and weight.grad.shape == weight.shape
        assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(bias.grad, torch.zeros_like(bias))


def test_non_finite_values_give_eagers_result(device):
    """A row with an Inf or a NaN: eager's NaN row, forward and backward, and NaN in the parameters' gradients."""
    x = randn((4, 256), torch.float32, device)
    x[1, 7], x[2, 100] = float("inf"), float("nan")
    weight, bias = parameters_for(256, torch.float32, device)
    torch.testing.assert_close(layer_norm(x, weight, bias), eager_layer_norm(x, weight, bias), equal_nan=True)
    grad = randn(x.shape, torch.float32, device, seed=4)
    got = gradients(layer_norm, x, weight, bias, grad, torch.float32)
    expected = gradients(eager_layer_norm, x, weight, bias, grad, torch.float32)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, equal_nan=True, atol=gradient_atol(b.nan_to_num()), rtol=1e-5)


def test_huge_and_offset_values_are_normalized(device):
    """Rows near float32's largest values, and rows whose mean dwarfs their spread: the moments, in double from the
    deviations, keep the float64 formula's result."""
    weight, bias = parameters_for(512, torch.float32, device)
    for x in (randn((8, 512), torch.float32, device) * 1e30, randn((8, 512), torch.float32, device, shift=1e4)):
        y = layer_norm(x, weight, bias)
        reference = eager_layer_norm(x.double(), weight.double(), bias.double())
        assert relative_error(y, reference) <= max(relative_error(eager_layer_norm(x, weight, bias), reference), 1e-7)


# ---- autograd, transforms, compile ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(3, 8), (2, 3, 5)])
def test_gradcheck_float64(device, shape):
    """First and second order and forward mode, of the op and of its backward op (the ATen formulas)."""
    x = torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(shape[-1], dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.randn(shape[-1], dtype=torch.float64, device=device, requires_grad=True)
    fn = lambda a, w, b: layer_norm(a, w, b, 0.1)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, weight, bias), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(fn, (x, weight, bias))
    grad = torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
    backward = lambda g, a, w: torch.ops.kernels.layer_norm_backward(g, a, w, 0.1)  # noqa: E731
    assert torch.autograd.gradcheck(backward, (grad, x, weight), check_forward_ad=True)


def test_double_backward_and_forward_mode_match_eager(device):
    x = randn((6, 64), torch.float32, device, shift=0.5)
    weight, bias = parameters_for(64, torch.float32, device)
    cotangent, tangent = randn(x.shape, torch.float32, device, 5), randn(x.shape, torch.float32, device, 6)
    results = []
    for fn in (layer_norm, eager_layer_norm):
        leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
        grads = torch.autograd.grad((fn(*leaves) * cotangent).sum(), leaves, create_graph=True)
        second = torch.autograd.grad(sum((g * g).sum() for g in grads), leaves[:2])
        _, jvp = torch.func.jvp(lambda a: fn(a, weight, bias), (x,), (tangent,))
        results.append((*(g.detach() for g in grads), *second, jvp))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=1e-4)


def test_graph_node(device):
    x = torch.randn(3, 16, device=device, requires_grad=True)
    weight, bias = torch.ones(16, device=device), torch.zeros(16, device=device)
    assert layer_norm(x, weight, bias).grad_fn.name() == "kernels::LayerNormBackward"
    with torch.no_grad():
        assert layer_norm(x, weight, bias).grad_fn is None
    assert layer_norm(x.detach(), weight, bias).grad_fn is None


def test_vmap(device):
    x = randn((4, 3, 32), torch.float32, device, shift=0.5)
    weight, bias = parameters_for(32, torch.float32, device)
    stacked = [torch.stack(t) for t in zip(*(parameters_for(32, torch.float32, device, seed) for seed in range(3)))]
    got = torch.func.vmap(lambda a: layer_norm(a, weight, bias), in_dims=1)(x)
    torch.testing.assert_close(got, eager_layer_norm(x.movedim(1, 0), weight, bias), atol=1e-6, rtol=1e-6)
    got = torch.func.vmap(layer_norm, in_dims=(1, 0, 0))(x, *stacked)
    expected = torch.stack([eager_layer_norm(x[:, i], stacked[0][i], stacked[1][i]) for i in range(3)])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    # per-sample parameter gradients (torch.func.grad records the backward's graph: the ATen formulas)
    per_sample = torch.func.vmap(torch.func.grad(lambda w, a: layer_norm(a, w, bias).square().sum()),
                                 in_dims=(None, 0))
    expected = torch.func.vmap(torch.func.grad(lambda w, a: eager_layer_norm(a, w, bias).square().sum()),
                               in_dims=(None, 0))
    torch.testing.assert_close(per_sample(weight, x), expected(weight, x), atol=1e-4, rtol=1e-4)
    # the backward op batched: its rule, each member's parameter gradients over its own rows
    grads = randn((3, 4, 32), torch.float32, device, seed=9)
    backward = lambda g, a: torch.ops.kernels.layer_norm_backward(g, a, weight, EPS)  # noqa: E731
    got = torch.func.vmap(backward, in_dims=(1, 1))(grads.movedim(0, 1), x)
    for i in range(x.shape[1]):
        for a, b in zip((t[i] for t in got), torch.ops.kernels.layer_norm_backward(grads[i], x[:, i], weight, EPS)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_opcheck(device):
    """Contiguous and transposed inputs (the fakes' layout is the results' whatever the path), with and without
    gradients; float64 takes the ATen formulas on either device."""
    for dtype in (torch.float32, torch.float64):
        weight, bias = torch.randn(48, device=device, dtype=dtype), torch.randn(48, device=device, dtype=dtype)
        for x in (torch.randn(5, 48, device=device, dtype=dtype), torch.randn(48, 5, device=device, dtype=dtype).t()):
            for requires_grad in (False, True):
                torch.library.opcheck(torch.ops.kernels.layer_norm.default,
                                      (x.clone().requires_grad_(requires_grad),
                                       weight.clone().requires_grad_(requires_grad), bias, EPS))
            grad = torch.randn_like(x).t().contiguous().t()  # the other layout than x's
            torch.library.opcheck(torch.ops.kernels.layer_norm_backward.default, (grad, x, weight, EPS))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()

    def block(x, weight, bias, proj):
        return layer_norm(x, weight, bias) @ proj

    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(4, 9, 64, device=device, requires_grad=True)
    weight = torch.randn(64, device=device, requires_grad=True)
    bias = torch.randn(64, device=device, requires_grad=True)
    proj = torch.randn(64, 32, device=device)
    grad = torch.randn(4, 9, 32, device=device)
    y = compiled(x, weight, bias, proj)
    y_eager = eager_layer_norm(x, weight, bias) @ proj
    torch.testing.assert_close(y, y_eager, atol=1e-4, rtol=1e-4)
    for got, expected in zip(torch.autograd.grad(y, (x, weight, bias), grad),
                             torch.autograd.grad(y_eager, (x, weight, bias), grad)):
        torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=1e-4)


@requires_cuda
@pytest.mark.parametrize("shape", [(64, 768), (16, 4096), (9, 13)], ids=["768", "4096", "13"])
def test_backward_refused_for_shared_memory_takes_the_aten_formulas(shape):
    # A GPU whose blocks hold less shared memory than the rows' partial sums take (Turing: 64 KB in all) refuses the
    # backward before any launch; a limit forced below every layout's sums runs that refusal here.
    x = randn(shape, torch.float32, "cuda", scale=3.0, shift=1.5)
    weight, bias = parameters_for(shape[-1], torch.float32, "cuda")
    grad = randn(shape, torch.float32, "cuda", seed=2)
    previous = torch.ops.kernels._layer_norm_force_backward_shared_limit(16)
    try:
        ours = gradients(layer_norm, x, weight, bias, grad, torch.float32)
    finally:
        torch.ops.kernels._layer_norm_force_backward_shared_limit(previous)
    eager = gradients(eager_layer_norm, x, weight, bias, grad, torch.float32)
    exact = gradients(eager_layer_norm, x, weight, bias, grad, torch.float64)
    for name, got, expected, reference in zip(("grad_x", "grad_weight", "grad_bias"), ours, eager, exact):
        check_accuracy(got, expected, reference, torch.float32, name,
                       atol=gradient_atol(expected, ALLCLOSE_TOLERANCE[torch.float32]))
    with pytest.raises(RuntimeError, match="bytes must be >= 0"):
        torch.ops.kernels._layer_norm_force_backward_shared_limit(-1)


@requires_cuda
def test_same_bits_every_run():
    x = randn((4096, 1024), torch.float32, "cuda", shift=1.0)
    weight, bias = parameters_for(1024, torch.float32, "cuda")
    grad = randn(x.shape, torch.float32, "cuda", seed=7)
    first, second = (gradients(layer_norm, x, weight, bias, grad, torch.float32) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@requires_cuda
def test_cuda_graph_replays_the_same_bits():
    """Forward and backward captured in a CUDA graph (the backward's workspace from the graph's pool): a replay on new
    inputs gives the eager calls' bits."""
    x = randn((512, 1024), torch.float32, "cuda", scale=2.0).requires_grad_(True)
    weight, bias = (t.requires_grad_(True) for t in parameters_for(1024, torch.float32, "cuda"))
    grad = randn((512, 1024), torch.float32, "cuda", seed=3)

    def step():
        y = layer_norm(x, weight, bias)
        return (y, *torch.autograd.grad(y, (x, weight, bias), grad))

    assert_graph_replay_matches_eager(
        step, lambda: x.copy_(randn(x.shape, torch.float32, "cuda", seed=11)))


# ---- bad input ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_bad_dtype_is_a_clear_error(device, dtype):
    with pytest.raises(RuntimeError, match=r"x must be a float32, float64, float16 or bfloat16 tensor, got"):
        layer_norm(torch.ones(4, 4, device=device).to(dtype), torch.ones(4, device=device),
                   torch.zeros(4, device=device))


def test_bad_arguments_are_clear_errors(device):
    x = torch.randn(3, 8, device=device)
    ones, zeros = torch.ones(8, device=device), torch.zeros(8, device=device)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[8\] \(x's last dimension\), got \[7\]"):
        layer_norm(x, torch.ones(7, device=device), zeros)
    with pytest.raises(RuntimeError, match=r"bias must have shape \[8\] \(x's last dimension\), got \[2, 8\]"):
        layer_norm(x, ones, torch.zeros(2, 8, device=device))
    with pytest.raises(RuntimeError, match=r"expected weight and x to have the same dtype"):
        layer_norm(x, torch.ones(8, device=device, dtype=torch.float64), zeros)
    with pytest.raises(RuntimeError, match=r"x must have at least 1 dimension"):
        layer_norm(torch.tensor(1.0, device=device), torch.ones(1, device=device), torch.zeros(1, device=device))
    with pytest.raises(RuntimeError, match=r"grad_y has shape \[3, 9\] but x has shape \[3, 8\]"):
        torch.ops.kernels.layer_norm_backward(torch.randn(3, 9, device=device), x, ones, EPS)
    with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
        layer_norm(x, ones, None)


@requires_cuda
def test_mixed_devices_are_a_clear_error():
    with pytest.raises(RuntimeError, match="same device"):
        layer_norm(torch.randn(2, 8, device="cuda"), torch.ones(8, device="cuda"), torch.zeros(8))


def test_meta_tensors_trace():
    x = torch.empty(2, 3, 64, device="meta", dtype=torch.bfloat16)
    weight, bias = (torch.empty(64, device="meta", dtype=torch.bfloat16) for _ in range(2))
    y = layer_norm(x, weight, bias)
    assert y.device.type == "meta" and y.shape == x.shape and y.dtype == x.dtype
    with pytest.raises(RuntimeError, match=r"bias must have shape \[64\]"):
        layer_norm(x, weight, torch.empty(63, device="meta", dtype=torch.bfloat16))


@requires_cuda
def test_runs_on_the_current_stream():
    base = torch.randn(512, 1024, device="cuda")
    weight, bias = parameters_for(1024, torch.float32, "cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # the input below is written only after this delay, on `stream`
        x = base * 3.0
        y = layer_norm(x, weight, bias)
        expected = eager_layer_norm(x, weight, bias)
    stream.synchronize()
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


# ---- the leaving ops: y's row split left for the GEMM ----------------------------------------------------------------

def split_fp16_runs_here():
    from kernels.gemm.gemm import gemm_paths

    return torch.cuda.is_available() and "split_fp16" in gemm_paths("cuda")


@requires_cuda
@pytest.mark.parametrize("residual", [False, True], ids=["layer_norm", "add_layer_norm"])
@pytest.mark.parametrize("columns", [768, 1000, 52, 4096])
def test_leaving_ops_give_the_ops_results_and_the_gemms_own_split(residual, columns):
    """The leaving ops give layer_norm's (add_layer_norm's) results bit for bit, and the split they leave is the one the
    GEMM's row pass makes of y: the split_fp16 forward on y (which reads it) gives the same bits as on a copy of y
    (which it splits itself), with a row of NaN (the non-finite fix-up reads y) and rows split across the 1000 and 52
    columns' padding."""
    if not split_fp16_runs_here():
        pytest.skip("the split_fp16 path (Hopper) reads the left split")
    from kernels.gemm.gemm import forced_gemm_path, linear

    g = torch.Generator(device="cuda").manual_seed(columns)
    x = torch.randn(512, columns, device="cuda", generator=g) * 2 + 0.5
    x[7, 3] = float("inf")  # its row of y is NaN
    other = torch.randn(512, columns, device="cuda", generator=g)
    weight = torch.randn(columns, device="cuda", generator=g) * 0.5 + 1
    bias = torch.randn(columns, device="cuda", generator=g) * 0.5
    w = torch.randn(1024, columns, device="cuda", generator=g) / columns ** 0.5
    b = torch.randn(1024, device="cuda", generator=g)
    with torch.no_grad(), forced_gemm_path("split_fp16"):
        if residual:
            expected = add_layer_norm(x, other, weight, bias, EPS)
            got = torch.ops.kernels._add_layer_norm_leaving_row_split(x, other, weight, bias, EPS)
            assert torch.equal(got[0], expected[0])
            y, y_expected = got[1], expected[1]
        else:
            y_expected = layer_norm(x, weight, bias, EPS)
            y = torch.ops.kernels._layer_norm_leaving_row_split(x, weight, bias, EPS)
        torch.testing.assert_close(y, y_expected, rtol=0, atol=0, equal_nan=True)
        from_left_split = linear(y, w, b)
        from_own_split = linear(y.clone(), w, b)
    torch.testing.assert_close(from_left_split, from_own_split, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(from_left_split[7]).all() and torch.isfinite(from_left_split[8]).all()


@requires_cuda
def test_a_left_split_is_read_only_for_its_tensor_unchanged():
    """The GEMM reads a left split once (a split of zeros left for y gives the bias alone), but not once y has been
    changed through PyTorch (its version counter), nor for another tensor at all."""
    if not split_fp16_runs_here():
        pytest.skip("the split_fp16 path (Hopper) reads the left split")
    from kernels.gemm.gemm import forced_gemm_path, linear

    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(256, 768, device="cuda", generator=g)
    w = torch.randn(512, 768, device="cuda", generator=g)
    b = torch.randn(512, device="cuda", generator=g)
    length = 768  # split_row_length(768): whole chunks of 64
    zeros = [torch.zeros(256, length, device="cuda", dtype=torch.float16) for _ in range(2)]
    exponent = torch.zeros(256, device="cuda", dtype=torch.int32)
    with torch.no_grad(), forced_gemm_path("split_fp16"):
        correct = linear(y.clone(), w, b)
        torch.ops.kernels._gemm_leave_row_split(y, zeros[0], zeros[1], exponent)
        y.add_(0.0)  # the same values, a new version: not read
        assert torch.equal(linear(y, w, b), correct)
        torch.ops.kernels._gemm_leave_row_split(y, zeros[0], zeros[1], exponent)
        assert torch.equal(linear(y.clone(), w, b), correct)  # another tensor: its own split
        assert torch.equal(linear(y, w, b), b.expand(256, 512))  # read: its zeros
        assert torch.equal(linear(y, w, b), correct)  # read once


def test_leaving_ops_refuse_calls_with_a_gradient_or_a_tangent(device):
    """The leaving ops compute neither a gradient nor a forward-mode tangent: a call that would record one raises
    rather than drop it."""
    import torch.autograd.forward_ad as fwAD

    x = torch.randn(4, 64, device=device)
    weight, bias = torch.ones(64, device=device), torch.zeros(64, device=device)
    with pytest.raises(RuntimeError, match="computes no gradient"):
        torch.ops.kernels._layer_norm_leaving_row_split(x, weight.clone().requires_grad_(True), bias, EPS)
    with torch.no_grad(), fwAD.dual_level(), pytest.raises(RuntimeError, match="computes no gradient"):
        torch.ops.kernels._add_layer_norm_leaving_row_split(fwAD.make_dual(x, torch.randn_like(x)), x, weight, bias,
                                                            EPS)
    with torch.no_grad():
        torch.testing.assert_close(torch.ops.kernels._layer_norm_leaving_row_split(x, weight, bias, EPS),
                                   layer_norm(x, weight, bias, EPS), rtol=0, atol=0)
