"""Causal softmax: the op against attention's three eager steps (scale, the causal masked_fill, softmax) and against
the same steps in float64, forward and backward, on CPU and CUDA; views, non-finite values, autograd, torch.compile
and bad input."""

import math

import pytest
import torch

from conftest import poison_allocator, requires_cuda
from kernels.functional import causal_softmax
from kernels.precision import ERROR_RATIO_LIMIT, relative_error

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SCALE = 1.0 / math.sqrt(48)  # 1/sqrt(head_dim), not a power of two: the multiply rounds

# Exercise every kernel configuration on CUDA: a warp per row with 1 to 32 elements per thread, a block per row up
# to 8192 columns, the streamed long rows beyond; 16-byte packs where the columns allow, single elements otherwise.
SHAPES = {
    "T=1": (3, 1, 1),
    "2-D": (64, 64),
    "odd 3-D": (2, 37, 37),
    "4-D": (2, 3, 96, 96),
    "more keys than queries": (2, 2, 17, 40),
    "more queries than keys": (2, 40, 17),  # the first 23 rows are all masked: NaN, as eager
    "T=512": (2, 2, 512, 512),
    "T=1023": (1, 1023, 1023),
}
LONG_SHAPES = {  # CUDA only (the CPU path is ATen's own)
    "rows of 2048": (1, 2048, 2048),
    "rows of 4096": (1, 1, 4096, 4096),
    "rows of 8192": (1, 24, 8192),
    "rows of 8191": (1, 24, 8191),
    "rows of 10000 (streamed)": (1, 20, 10000),
    "rows of 12289 (streamed, single elements)": (1, 20, 12289),
    "square 9000 (streamed)": (1, 9000, 9000),
}


def masked_entries(rows, columns, device):
    """True where column j of query row i is masked: j > i + columns - rows."""
    return torch.ones(rows, columns, dtype=torch.bool, device=device).triu(columns - rows + 1)


def eager(scores, scale):
    """minGPT's attention steps in scores' dtype: scale, masked_fill(-inf), softmax."""
    att = scores * scale
    att = att.masked_fill(masked_entries(*scores.shape[-2:], scores.device), float("-inf"))
    return torch.softmax(att, dim=-1)


def randn(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(device=device, dtype=dtype)


def error_limit(dtype, eager_error, strict_error):
    """The most error against float64 a result may have, given eager's: float32 eager's (plus 2^-24 where not
    strict_error), float16 and bfloat16 ERROR_RATIO_LIMIT times eager's."""
    if dtype == torch.float32:
        return eager_error if strict_error else eager_error + 2.0 ** -24
    return ERROR_RATIO_LIMIT[dtype] * eager_error


def check_forward(scores, scale, strict_error=True):
    """Ours against eager in the same dtype, and both against float64. float32: allclose(1e-5) and an error no
    larger than eager's (strict_error; on a few thousand elements both errors are rounding noise, so there within
    2^-24 of eager's); float16 and bfloat16: allclose(1e-2) and ERROR_RATIO_LIMIT. Masked entries exactly 0."""
    poison_allocator(scores.shape, scores.dtype, scores.device)
    y = causal_softmax(scores, scale)
    expected = eager(scores, scale)
    y64 = eager(scores.double(), scale)
    assert y.shape == scores.shape and y.dtype == scores.dtype and y.is_contiguous()
    tol = 1e-5 if scores.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y, expected, atol=tol, rtol=tol, equal_nan=True)
    ours, theirs = relative_error(y, y64), relative_error(expected, y64)
    assert ours <= error_limit(scores.dtype, theirs, strict_error), \
        f"error against float64 {ours:.3g}, eager's {theirs:.3g}"
    mask = masked_entries(*scores.shape[-2:], scores.device).expand(scores.shape)
    finite_rows = torch.isfinite(y64).all(-1, keepdim=True).expand(scores.shape)
    assert (y[mask & finite_rows] == 0).all()
    return y


def check_backward(scores, scale, strict_error=True, seed=1):
    """The scores' gradient against eager autograd's and float64 autograd's: float32 allclose(1e-5) to eager and
    an error no larger than eager's (see check_forward); float16 and bfloat16 within ERROR_RATIO_LIMIT."""
    grad = randn(scores.shape, scores.dtype, scores.device, seed)
    gradients = []
    for fn, dtype in ((causal_softmax, scores.dtype), (eager, scores.dtype), (eager, torch.float64)):
        leaf = scores.detach().to(dtype).requires_grad_(True)
        (g,) = torch.autograd.grad(fn(leaf, scale), leaf, grad.to(dtype))
        gradients.append(g)
    ours, theirs, g64 = gradients
    assert ours.dtype == scores.dtype and ours.shape == scores.shape
    tol = 1e-5 if scores.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours, theirs, atol=tol * max(1.0, float(g64.abs().max())), rtol=tol, equal_nan=True)
    error, eager_error = relative_error(ours, g64), relative_error(theirs, g64)
    assert error <= error_limit(scores.dtype, eager_error, strict_error), \
        f"gradient error against float64 {error:.3g}, eager's {eager_error:.3g}"
    mask = masked_entries(*scores.shape[-2:], scores.device).expand(scores.shape)
    assert (ours[mask] == 0).all()


def large(shape):
    return math.prod(shape) >= 100_000


# ---- forward and backward against eager -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_forward_matches_eager(device, dtype, shape):
    if dtype == torch.float64:
        scores = randn(shape, dtype, device)
        torch.testing.assert_close(causal_softmax(scores, SCALE), eager(scores, SCALE), equal_nan=True)
        return
    check_forward(randn(shape, dtype, device), SCALE, strict_error=large(shape))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_backward_matches_eager(device, dtype, shape):
    check_backward(randn(shape, dtype, device), SCALE, strict_error=large(shape))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LONG_SHAPES.values(), ids=LONG_SHAPES.keys())
def test_long_rows(dtype, shape):
    scores = randn(shape, dtype, "cuda")
    check_forward(scores, SCALE)
    check_backward(scores, SCALE)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_block_shape(dtype):
    """44_MiniGPTBlock's scores, fewer batches: (8, 8, 512, 512)."""
    scores = randn((8, 8, 512, 512), dtype, "cuda")
    check_forward(scores, 1.0 / math.sqrt(96))
    check_backward(scores, 1.0 / math.sqrt(96))


def views(dtype, device):
    """Non-contiguous, transposed, expanded, and views at an offset (16-byte aligned, and not)."""
    base = randn((2, 3, 40, 80), dtype, device)
    flat = randn((2 * 3 * 40 * 40 + 8,), dtype, device)
    return {
        "strided": base[..., ::2],
        "sliced columns": base[..., :40, 20:60],
        "transposed batch": base[..., :40].transpose(0, 1),
        "expanded": randn((1, 40, 40), dtype, device).expand(3, 40, 40),
        "offset by 1": flat[1:1 + 2 * 3 * 40 * 40].view(2, 3, 40, 40),
        "offset by 16 bytes": flat[16 // flat.element_size():][:2 * 3 * 40 * 40].view(2, 3, 40, 40),
        "non-contiguous last dim": randn((40, 2, 40), dtype, device).transpose(0, 2),
        "empty": randn((0, 3, 5, 5), dtype, device),
        "empty rows": randn((2, 0, 7), dtype, device),
        "empty columns": randn((2, 3, 0), dtype, device),
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_views(device, dtype):
    for name, scores in views(dtype, device).items():
        before = scores.clone()
        if scores.numel() == 0:
            y = causal_softmax(scores, SCALE)
            assert y.shape == scores.shape and y.dtype == dtype, name
            continue
        check_forward(scores, SCALE, strict_error=False)
        check_backward(scores, SCALE, strict_error=False)
        assert torch.equal(scores, before), f"{name}: the input was modified"


# ---- non-finite values and unusual scales ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("columns", [37, 96, 2048, 10000])  # warp, block and streamed paths, single elements or packs
def test_non_finite_values_give_eagers_result(device, dtype, columns):
    """NaN, +inf and -inf at unmasked entries (a whole row of -inf too), values whose product with scale overflows,
    and non-finite values at masked entries (which must not matter): eager's result, NaN where eager has NaN."""
    rows = 12
    scores = randn((2, rows, columns), dtype, device)
    last = columns - 1
    offset = columns - rows  # row i sees columns 0 .. i + offset
    scores[0, 0, 0] = float("nan")
    scores[0, 1, 1] = float("inf")
    scores[0, 2, 2] = float("-inf")
    scores[0, 3, : 4 + offset] = float("-inf")  # every unmasked entry -inf
    if dtype != torch.float16:  # float16's largest times 16 overflows in float16 (eager) but not in float32 (ours)
        scores[0, 4, 3] = torch.finfo(dtype).max  # times 16 overflows to inf
        scores[0, 5, 3] = -torch.finfo(dtype).max
    scores[1, 0, 1 + offset:] = float("nan")  # masked entries only
    scores[1, 1, last] = float("inf")
    scores[1, 2, last] = float("-inf")
    for scale in (16.0, SCALE):
        y = causal_softmax(scores, scale)
        torch.testing.assert_close(y, eager(scores, scale), atol=1e-5 if dtype == torch.float32 else 1e-2,
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2, equal_nan=True)
    assert not y[1].isnan().any()


@pytest.mark.parametrize("scale", [0.0, -0.7, float("inf"), float("-inf"), float("nan"), 1e-30, 1e30])
def test_unusual_scales_give_eagers_result(device, scale):
    for columns in (29, 64, 3000):
        scores = randn((2, 5, columns), torch.float32, device)
        torch.testing.assert_close(causal_softmax(scores, scale), eager(scores, scale), atol=1e-5, rtol=1e-5,
                                   equal_nan=True)
        grad = randn((2, 5, columns), torch.float32, device, seed=3)
        leaf, eager_leaf = scores.clone().requires_grad_(True), scores.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(causal_softmax(leaf, scale), leaf, grad)
        (g_eager,) = torch.autograd.grad(eager(eager_leaf, scale), eager_leaf, grad)
        torch.testing.assert_close(g, g_eager, atol=1e-5, rtol=1e-5, equal_nan=True)


# ---- the backward op --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_op_against_its_formula(device, dtype):
    """scale * y * (dy - sum(dy * y)) on the unmasked entries, computed in float64; masked entries 0, whatever
    grad_output holds there (it is not read)."""
    for shape in ((3, 33, 33), (2, 9, 700), (1, 3000, 3000)):
        if device == "cpu" and shape[-1] > 1000:
            continue
        y = causal_softmax(randn(shape, dtype, device), SCALE)
        dy = randn(shape, dtype, device, seed=2)
        mask = masked_entries(*shape[-2:], device)
        dy_poisoned = dy.masked_fill(mask, float("nan"))
        got = torch.ops.kernels.causal_softmax_backward(dy_poisoned, y, -SCALE)
        y64, dy64 = y.double(), dy.double().masked_fill(mask, 0)
        expected = (-SCALE * y64 * (dy64 - (dy64 * y64).sum(-1, keepdim=True))).masked_fill(mask, 0)
        tol = 2e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
        assert (got[mask.expand(shape)] == 0).all()


# ---- autograd -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 6, 6), (5, 9), (3, 4)])
def test_gradcheck_float64(device, shape):
    """float64 (ATen's ops on either device): first and second order, forward mode, and the backward op's own
    gradients with respect to grad_output and output."""
    scores = torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
    fn = lambda s: causal_softmax(s, 0.7)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (scores,), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(fn, (scores,))
    y = causal_softmax(scores.detach(), 0.7).requires_grad_(True)
    dy = torch.randn(shape, dtype=torch.float64, device=device, requires_grad=True)
    backward = lambda d, out: torch.ops.kernels.causal_softmax_backward(d, out, 0.7)  # noqa: E731
    assert torch.autograd.gradcheck(backward, (dy, y), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(backward, (dy, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_double_backward_and_forward_mode_match_eager(device, dtype):
    scores = randn((2, 3, 20, 20), dtype, device)
    cotangent, tangent = randn(scores.shape, dtype, device, 5), randn(scores.shape, dtype, device, 6)
    results = []
    for fn in (causal_softmax, eager):
        leaf = scores.clone().requires_grad_(True)
        (g,) = torch.autograd.grad((fn(leaf, SCALE) * cotangent).sum(), leaf, create_graph=True)
        (gg,) = torch.autograd.grad((g * g).sum(), leaf)
        _, jvp = torch.func.jvp(lambda s: fn(s, SCALE), (scores,), (tangent,))
        # Forward over reverse in plain autograd: the backward reads the output with its tangent.
        corner = (slice(0, 1), slice(0, 1), slice(0, 4), slice(0, 4))
        hessian = torch.autograd.functional.hessian(lambda s: (fn(s, SCALE) * cotangent[corner]).sum(),
                                                    scores[corner], vectorize=True,
                                                    outer_jacobian_strategy="forward-mode")
        results.append((g.detach(), gg, jvp, hessian))
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)


def test_graph_node(device):
    """A named grad_fn, recorded only where a gradient can flow; the saved output's version checked."""
    scores = torch.randn(2, 5, 5, device=device, requires_grad=True)
    y = causal_softmax(scores, SCALE)
    assert y.grad_fn.name() == "kernels::CausalSoftmaxBackward"
    with torch.no_grad():
        assert causal_softmax(scores, SCALE).grad_fn is None
    assert causal_softmax(scores.detach(), SCALE).grad_fn is None
    z = torch.ops.kernels.causal_softmax_backward(y, y.detach(), SCALE)
    assert z.grad_fn.name() == "kernels::CausalSoftmaxBackwardBackward"
    y2 = causal_softmax(scores * 1.0, SCALE)
    y2.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y2.sum().backward()


def test_vmap(device):
    scores = randn((4, 3, 9, 9), torch.float32, device)
    got = torch.func.vmap(lambda s: causal_softmax(s, SCALE), in_dims=1)(scores)
    torch.testing.assert_close(got, eager(scores.movedim(1, 0), SCALE), atol=1e-6, rtol=1e-6)
    grads = torch.func.vmap(torch.func.grad(lambda s: causal_softmax(s, SCALE)[..., -1, 0].sum()))(scores)
    expected = torch.func.vmap(torch.func.grad(lambda s: eager(s, SCALE)[..., -1, 0].sum()))(scores)
    torch.testing.assert_close(grads, expected, atol=1e-6, rtol=1e-6)


def test_opcheck(device):
    scores = torch.randn(2, 7, 33, device=device)
    for requires_grad in (False, True):
        torch.library.opcheck(torch.ops.kernels.causal_softmax.default,
                              (scores.clone().requires_grad_(requires_grad), SCALE))
        y = causal_softmax(scores, SCALE)
        torch.library.opcheck(torch.ops.kernels.causal_softmax_backward.default,
                              (torch.randn_like(y).requires_grad_(requires_grad), y, SCALE))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    """The attention steps around the op, compiled whole: eager's results forward and backward."""
    torch._dynamo.reset()

    def attention(q, k, v):
        return causal_softmax(q @ k.transpose(-2, -1), 1.0 / math.sqrt(q.size(-1))) @ v

    def attention_eager(q, k, v):
        return eager(q @ k.transpose(-2, -1), 1.0 / math.sqrt(q.size(-1))) @ v

    compiled = torch.compile(attention, fullgraph=True)
    q, k, v = (torch.randn(2, 2, 33, 16, device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 2, 33, 16, device=device)
    y = compiled(q, k, v)
    grads = torch.autograd.grad(y, (q, k, v), grad)
    y_eager = attention_eager(q, k, v)
    grads_eager = torch.autograd.grad(y_eager, (q, k, v), grad)
    torch.testing.assert_close(y, y_eager, atol=1e-5, rtol=1e-5)
    for got, expected in zip(grads, grads_eager):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ---- bad input ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_bad_dtype_is_a_clear_error(device, dtype):
    with pytest.raises(RuntimeError, match=r"scores must be a float32, float64, float16 or bfloat16 tensor, got"):
        causal_softmax(torch.ones(4, 4, device=device).to(dtype), SCALE)


@pytest.mark.parametrize("shape", [(5,), ()])
def test_fewer_than_two_dimensions_is_a_clear_error(device, shape):
    with pytest.raises(RuntimeError, match=r"scores must have at least 2 dimensions \(\.\.\., query rows, key "
                                           r"columns\), got shape \[" + ", ".join(map(str, shape)) + r"\]"):
        causal_softmax(torch.randn(shape, device=device), SCALE)


def test_bad_backward_arguments_are_clear_errors(device):
    y = torch.randn(2, 4, 4, device=device)
    backward = torch.ops.kernels.causal_softmax_backward
    with pytest.raises(RuntimeError, match=r"grad_output has shape \[2, 4, 5\] but output has shape \[2, 4, 4\]"):
        backward(torch.randn(2, 4, 5, device=device), y, SCALE)
    with pytest.raises(RuntimeError, match=r"expected grad_output and output to have the same dtype"):
        backward(y.double(), y, SCALE)
    with pytest.raises(RuntimeError, match=r"output must have at least 2 dimensions"):
        backward(torch.randn(4, device=device), torch.randn(4, device=device), SCALE)


def test_not_a_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="scores must be a torch.Tensor, got list"):
        causal_softmax([[1.0]], SCALE)


@requires_cuda
def test_mixed_devices_are_a_clear_error():
    with pytest.raises(RuntimeError, match="same device"):
        torch.ops.kernels.causal_softmax_backward(torch.randn(2, 3, 3), torch.randn(2, 3, 3, device="cuda"), SCALE)


def test_meta_tensors_trace():
    scores = torch.empty(2, 3, 8, 8, device="meta", dtype=torch.bfloat16)
    y = causal_softmax(scores, SCALE)
    assert y.device.type == "meta" and y.shape == scores.shape and y.dtype == scores.dtype
    with pytest.raises(RuntimeError, match="at least 2 dimensions"):
        causal_softmax(torch.empty(8, device="meta"), SCALE)


@requires_cuda
def test_runs_on_the_current_stream():
    base = torch.randn(4, 256, 256, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # the input below is written only after this delay, on `stream`
        scores = base * 3.0
        y = causal_softmax(scores, SCALE)
        expected = eager(scores, SCALE)
    stream.synchronize()
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
