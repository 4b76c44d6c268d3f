"""The rotary embedding of LLaMA-style attention: the op against eager's `q * cos + rotate_half(q) * sin` (transformers'
apply_rotary_pos_emb) in the same dtype and in float64, forward and backward, on CPU and CUDA; q as the projections'
transposed view, grouped kv heads, angles of one batch or of each, non-finite values, autograd to higher orders and to
the angles, forward mode, vmap, torch.compile and bad input. The precision contract: float32 error against float64 no
larger than eager's and allclose(1e-4) to it; float16 and bfloat16 within 2x eager's."""

import pytest
import torch

from conftest import (assert_graph_replay_matches_eager, check_accuracy, cuda_kernels_launched, poison_allocator,
                      requires_cuda)
from kernels.functional import rotary_embedding
from kernels.precision import ALLCLOSE_TOLERANCE, gradient_atol

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# name: (batch, q heads, k heads, tokens, head dim, the angles' batch)
SHAPES = {"LLaMA's heads": (2, 8, 8, 64, 128, 2), "grouped kv heads": (2, 8, 2, 33, 64, 2),
          "angles of one batch": (3, 4, 4, 17, 32, 1), "one token": (1, 4, 1, 1, 16, 1),
          "odd rows, head dim 256": (1, 3, 1, 5, 256, 1), "many rows": (4, 16, 4, 256, 128, 4)}


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def operands(shape, dtype, device, seed=0):
    """q and k as LLaMA's attention makes them (its projections' outputs viewed as heads, transposed), and the
    angles of positions 0.. as LlamaRotaryEmbedding makes them (each half the same)."""
    batch, q_heads, k_heads, tokens, dim, angle_batch = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, q_heads, dim, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(batch, tokens, k_heads, dim, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    positions = torch.arange(tokens, dtype=torch.float64) + torch.arange(angle_batch, dtype=torch.float64)[:, None]
    angles = positions[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return q, k, angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def same_layout(a, b):
    """The same strides along every dim of more than one element (a size-1 dim's stride is arbitrary)."""
    return all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def gradients(fn, q, k, cos, sin, grads, dtype):
    q, k = (t.detach().to(dtype).requires_grad_(True) for t in (q, k))
    outputs = fn(q, k, cos.to(dtype), sin.to(dtype))
    return torch.autograd.grad(outputs, (q, k), [g.to(dtype) for g in grads])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_forward_and_backward_match_eager(device, dtype, shape):
    q, k, cos, sin = operands(shape, dtype, device)
    before = [t.clone() for t in (q, k, cos, sin)]
    poison_allocator(q.shape, dtype, device)
    q_embed, k_embed = rotary_embedding(q, k, cos, sin)
    expected, exact = eager(q, k, cos, sin), eager(q.double(), k.double(), cos.double(), sin.double())
    for name, got, theirs, reference, operand in zip(("q_embed", "k_embed"), (q_embed, k_embed), expected, exact,
                                                     (q, k)):
        # laid out as eager's element-wise ops lay it out: as the operand (the projections' transposed view)
        assert got.shape == operand.shape and got.dtype == dtype and same_layout(got, theirs), name
        check_accuracy(got, theirs, reference, dtype, name)
    assert all(torch.equal(t, b) for t, b in zip((q, k, cos, sin), before))
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(t.shape, generator=g).to(device) for t in (q, k)]
    ours, theirs, exact = (gradients(fn, q, k, cos, sin, grads, t)
                           for fn, t in ((rotary_embedding, dtype), (eager, dtype), (eager, torch.float64)))
    for name, got, expected, reference in zip(("grad_q", "grad_k"), ours, theirs, exact):
        assert got.dtype == dtype and not got.isnan().any(), name
        check_accuracy(got, expected, reference, dtype, name, atol=gradient_atol(expected, ALLCLOSE_TOLERANCE[dtype]))


def test_contiguous_and_odd_strides(device):
    """q contiguous, k a slice of a wider tensor, q an expanded view, the angles expanded over the batch, cos and sin
    of different strides: the same results, laid out as empty_like lays out the operands."""
    q, k, cos, sin = operands((2, 4, 4, 9, 16, 1), torch.float32, device)
    wide = torch.randn(2, 6, 9, 16, device=device)
    k = wide[:, 1:5]
    cos_b, sin_b = cos.expand(2, 9, 16), sin.expand(2, 9, 16)
    expanded = torch.randn(2, 1, 9, 16, device=device).expand(2, 4, 9, 16)
    for args in ((q.contiguous(), k, cos, sin), (q, k, cos_b, sin_b), (q, k.contiguous(), cos_b.contiguous(), sin_b),
                 (expanded, k, cos.transpose(1, 2).contiguous().transpose(1, 2), sin)):
        for got, expected, operand in zip(rotary_embedding(*args), eager(*args), args):
            torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
            assert same_layout(got, torch.empty_like(operand))


def test_non_finite_values_give_eager_non_finite_outputs(device):
    q, k, cos, sin = operands((1, 2, 2, 5, 8, 1), torch.float32, device)
    q[0, 0, 1, 2], q[0, 1, 3, 5], k[0, 1, 4, 0] = float("inf"), float("nan"), float("-inf")
    for got, expected in zip(rotary_embedding(q, k, cos, sin), eager(q, k, cos, sin)):
        assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.isinf(), expected.isinf())
        finite = expected.isfinite()
        torch.testing.assert_close(got[finite], expected[finite], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got[got.isinf()], expected[got.isinf()])


@pytest.mark.parametrize("shape", [(2, 4, 2, 0, 16, 2), (0, 4, 2, 3, 16, 1), (2, 0, 2, 3, 16, 2), (2, 4, 0, 3, 16, 2)],
                         ids=["no tokens", "no batch", "no q heads", "no k heads"])
def test_empty(device, shape):
    q, k, cos, sin = operands(shape, torch.float32, device)
    q_embed, k_embed = rotary_embedding(q, k, cos, sin)
    assert q_embed.shape == q.shape and k_embed.shape == k.shape
    for got, expected in zip((q_embed, k_embed), eager(q, k, cos, sin)):
        torch.testing.assert_close(got, expected)


def test_gradcheck_float64(device):
    """Of q and k, and of the angles too (eager's formulas then), in reverse mode to the second order and forward
    mode; the backward op itself likewise."""
    q, k, cos, sin = operands((2, 3, 1, 4, 8, 2), torch.float64, device)
    q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: rotary_embedding(a, b, cos, sin), (q, k), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: rotary_embedding(a, b, cos, sin), (q, k))
    c, s = cos.clone().requires_grad_(True), sin.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(rotary_embedding, (q, k, c, s), check_forward_ad=True)
    grads = [torch.randn_like(t, requires_grad=True) for t in (q, k)]
    assert torch.autograd.gradcheck(torch.ops.kernels.rotary_embedding_backward, (*grads, cos, sin),
                                    check_forward_ad=True)


def test_double_backward_forward_mode_and_angle_gradients_match_eager(device):
    q, k, cos, sin = operands((2, 4, 2, 6, 16, 2), torch.float32, device)
    tangent = torch.randn_like(q)
    results = []
    for fn in (rotary_embedding, eager):
        # The map is linear in q and k: its gradient's own gradient is taken with respect to the cotangents.
        cotangents = [torch.randn(t.shape, device=device, generator=torch.Generator(device).manual_seed(i),
                                  requires_grad=True) for i, t in enumerate((q, k))]
        a, b = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)
        c, s = cos.clone().requires_grad_(True), sin.clone().requires_grad_(True)
        outputs = fn(a, b, cos, sin)
        first = torch.autograd.grad(sum((o * g).sum() for o, g in zip(outputs, cotangents)), (a, b), create_graph=True)
        second = torch.autograd.grad(sum((f * f).sum() for f in first), cotangents)
        _, jvp = torch.func.jvp(lambda x: fn(x, k, cos, sin)[0], (q,), (tangent,))
        angle_grads = torch.autograd.grad(sum(o.square().sum() for o in fn(a, b, c, s)), (c, s))
        results.append((*(f.detach() for f in first), *second, jvp, *angle_grads))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, atol=gradient_atol(expected), rtol=1e-5)


def test_graph_node_and_an_unused_output(device):
    q, k, cos, sin = operands((1, 4, 2, 3, 8, 1), torch.float32, device)
    q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    q_embed, k_embed = rotary_embedding(q, k, cos, sin)
    assert q_embed.grad_fn.name() == "kernels::RotaryEmbeddingBackward" and k_embed.grad_fn is q_embed.grad_fn
    for used in (0, 1):  # one output's gradient alone (k's with fewer heads than q's)
        outputs = rotary_embedding(q, k, cos, sin)
        grad = torch.randn_like(outputs[used])
        got = torch.autograd.grad(outputs[used], (q, k), grad, allow_unused=True)
        expected = torch.autograd.grad(eager(q, k, cos, sin)[used], (q, k), grad, allow_unused=True)
        torch.testing.assert_close(got[used], expected[used], atol=1e-6, rtol=1e-6)
        assert got[1 - used] is None and expected[1 - used] is None
    with torch.no_grad():
        assert rotary_embedding(q, k, cos, sin)[0].grad_fn is None


def test_vmap(device):
    q, k, cos, sin = operands((2, 4, 2, 5, 8, 2), torch.float32, device)
    samples = torch.stack([q, q * 2.0, q - 1.0])
    got_q, got_k = torch.func.vmap(rotary_embedding, in_dims=(0, None, None, None))(samples, k, cos, sin)
    for i, sample in enumerate(samples):
        expected_q, expected_k = eager(sample, k, cos, sin)
        torch.testing.assert_close(got_q[i], expected_q, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got_k[i], expected_k, atol=1e-6, rtol=1e-6)
    angles = torch.stack([cos, cos.flip(-1)])
    got = torch.func.vmap(lambda c: rotary_embedding(q, k, c, sin)[0])(angles)
    for i, c in enumerate(angles):
        torch.testing.assert_close(got[i], eager(q, k, c, sin)[0], atol=1e-6, rtol=1e-6)
    one_token = torch.stack([cos[:, :1], cos[:, :1]])  # what the op refuses, vmapped: the same error
    with pytest.raises(RuntimeError, match=r"cos and sin must both be"):
        torch.func.vmap(lambda c: rotary_embedding(q, k, c, c)[0])(one_token)


def test_opcheck(device):
    """The projections' transposed view and contiguous operands (the fakes' layout is the results' either way)."""
    q, k, cos, sin = operands((2, 4, 2, 5, 8, 2), torch.float32, device)
    for a, b in ((q, k), (q.contiguous(), k.contiguous())):
        for requires_grad in (False, True):
            torch.library.opcheck(torch.ops.kernels.rotary_embedding.default,
                                  (a.clone().requires_grad_(requires_grad), b.clone().requires_grad_(requires_grad),
                                   cos, sin))
        torch.library.opcheck(torch.ops.kernels.rotary_embedding_backward.default,
                              (torch.randn_like(a), torch.randn_like(b), cos, sin))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    q, k, cos, sin = operands((2, 4, 2, 7, 16, 2), torch.float32, device)

    def attention_scores(x, y):
        a, b = rotary_embedding(x * 1.5, y, cos, sin)
        return a @ b.repeat_interleave(2, dim=1).transpose(-1, -2)

    compiled = torch.compile(attention_scores, fullgraph=True)
    x, y = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    out = compiled(x, y)

    def eager_scores(x, y):
        a, b = eager(x * 1.5, y, cos, sin)
        return a @ b.repeat_interleave(2, dim=1).transpose(-1, -2)

    expected = eager_scores(x, y)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (x, y), grad), torch.autograd.grad(expected, (x, y), grad)):
        torch.testing.assert_close(got, want, atol=gradient_atol(want), rtol=1e-4)


@requires_cuda
def test_cuda_graph_replays_the_same_bits():
    q, k, cos, sin = operands((2, 8, 2, 128, 64, 2), torch.float32, "cuda")
    q, k = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
    grads = [torch.randn(t.shape, device="cuda") for t in (q, k)]

    def step():
        outputs = rotary_embedding(q, k, cos, sin)
        return (*outputs, *torch.autograd.grad(outputs, (q, k), grads))

    assert_graph_replay_matches_eager(step, lambda: q.detach().copy_(torch.randn_like(q)))


def offset_view(t, offset):
    """t's values in a fresh buffer of t's layout (its strides; t's own storage offset is not kept) that starts
    `offset` elements into its storage (offset 1: rows off 16 bytes)."""
    storage = torch.empty(t.untyped_storage().nbytes() // t.element_size() + offset, device=t.device, dtype=t.dtype)
    view = storage.as_strided(t.shape, t.stride(), offset)
    return view.copy_(t)


# name: (operands' shape as in SHAPES, a change of layout). Which kernel takes each is packed_kernel_takes's rule.
PACKED_CASES = {
    "LLaMA's layout": ((2, 8, 8, 33, 128, 1), None),
    "grouped heads, 40 rows a token": ((2, 32, 8, 9, 128, 2), None),
    "head dim 80 (idle lanes)": ((2, 6, 2, 7, 80, 1), None),
    "head dim 72 (a half of 9 float32 packs, 4.5 of 2-byte types)": ((2, 3, 1, 5, 72, 1), None),
    "head dim 16 (many rows a pass)": ((3, 5, 3, 11, 16, 3), None),
    "head dim 256": ((1, 3, 1, 5, 256, 1), None),
    "no k heads": ((2, 4, 0, 9, 64, 1), None),
    "rows at a 16-byte offset": ((2, 4, 2, 9, 64, 1), "offset 16 bytes"),
    "rows off 16 bytes": ((2, 4, 2, 9, 64, 1), "offset 1"),
    "angles off 16 bytes": ((2, 4, 2, 9, 64, 1), "angles offset 1"),
    "k's rows 3 elements apart": ((2, 4, 2, 9, 64, 1), "k wider"),
    "strided head dim": ((2, 4, 2, 9, 64, 1), "strided"),
    "head dim of too many packs": ((1, 2, 2, 3, 1024, 1), None),
}


def packed_kernel_takes(dtype, dim, change):
    """The launcher's rule (rotary.cu, rotary_rows_fits) for these cases: halves of whole 16-byte packs, at most 32,
    and every row of every operand dense along the head dim and 16-byte aligned."""
    pack = 16 // torch.empty((), dtype=dtype).element_size()
    half = dim // 2
    return change in (None, "offset 16 bytes") and half % pack == 0 and half // pack <= 32


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PACKED_CASES.values(), ids=PACKED_CASES.keys())
def test_packed_and_generic_kernels_give_the_same_bits(dtype, case):
    """One arithmetic in both kernels: the packed one (rows dense along the head dim, 16-byte aligned: LLaMA's layout)
    and the generic one forced give the same bits forward and backward, where the launcher takes the packed one and
    where it sends the call to the generic one (each case's kernel checked by name); and the result matches eager's."""
    shape, change = case
    q, k, cos, sin = operands(shape, dtype, "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    grads = [torch.randn(t.shape, device="cuda", dtype=dtype, generator=g) for t in (q, k)]
    if change in ("offset 16 bytes", "offset 1"):
        offset = 16 // q.element_size() if change == "offset 16 bytes" else 1
        q, k, cos, sin, *grads = (offset_view(t, offset) for t in (q, k, cos, sin, *grads))
    elif change == "angles offset 1":
        cos, sin = (offset_view(t, 1) for t in (cos, sin))
    elif change == "k wider":
        k, grads[1] = (torch.cat((t, torch.full_like(t[..., :3], float("nan"))), dim=-1)[..., :-3]
                       for t in (k, grads[1]))
    elif change == "strided":
        q, k, *grads = (torch.stack((t, torch.full_like(t, float("nan"))), dim=-1)[..., 0] for t in (q, k, *grads))
    expected_kernel = "rotary_rows_kernel" if packed_kernel_takes(dtype, shape[4], change) else "rotary_kernel"
    results = []
    for generic in (False, True):
        previous = torch.ops.kernels._rotary_force_generic(generic)
        try:
            def run():
                poison_allocator(q.shape, dtype, "cuda")
                embedded = rotary_embedding(q, k, cos, sin)
                poison_allocator(q.shape, dtype, "cuda")
                return (*embedded, *torch.ops.kernels.rotary_embedding_backward(*grads, cos, sin))

            outputs, ran = cuda_kernels_launched(run)
        finally:
            torch.ops.kernels._rotary_force_generic(previous)
        kernel = "rotary_kernel" if generic else expected_kernel
        assert any(kernel + "<" in name for name in ran) and not any(
            other + "<" in name for name in ran for other in {"rotary_kernel", "rotary_rows_kernel"} - {kernel}), ran
        results.append(outputs)
    for name, packed, generic in zip(("q_embed", "k_embed", "grad_q", "grad_k"), *results):
        assert torch.equal(packed, generic), name
    exact = eager(q.double(), k.double(), cos.double(), sin.double())
    for name, got, theirs, reference in zip(("q_embed", "k_embed"), results[0], eager(q, k, cos, sin), exact):
        if got.numel():
            check_accuracy(got, theirs, reference, dtype, name)


@requires_cuda
def test_runs_on_the_current_stream():
    q, k, cos, sin = operands((2, 8, 8, 256, 128, 2), torch.float32, "cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # the input below is written only after this delay, on `stream`
        scaled = q * 3.0
        got = rotary_embedding(scaled, k, cos, sin)
        expected = eager(scaled, k, cos, sin)
    stream.synchronize()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_bad_dtype_is_a_clear_error(device, dtype):
    t = torch.ones(1, 2, 3, 4, device=device).to(dtype)
    with pytest.raises(RuntimeError, match=r"q must be a float32, float64, float16 or bfloat16 tensor, got"):
        rotary_embedding(t, t, t[0], t[0])


def test_bad_arguments_are_clear_errors(device):
    for target in (device, "meta"):
        q, k, cos, sin = (t.to(target) for t in operands((2, 4, 2, 5, 8, 2), torch.float32, "cpu"))
        cases = [
            ((q[0], k, cos, sin), r"q and k must be 4-D \(batch, heads, tokens, head dim\), got shapes \[4, 5, 8\]"),
            ((q, k[:1], cos, sin), r"k has shape \[1, 2, 5, 8\] but q has shape \[2, 4, 5, 8\] \(batch, tokens and "
                                   r"head dim must match\)"),
            ((q[..., :7], k[..., :7], cos[..., :7], sin[..., :7]), r"the head dim must be even .*got 7"),
            ((q, k, cos[:, :4], sin[:, :4]), r"cos and sin must both be \(batch or 1, tokens, head dim\) = \(2 or 1, "
                                             r"5, 8\), got \[2, 4, 8\] and \[2, 4, 8\]"),
            ((q, k, cos, sin[:1]), r"cos and sin must both be .* got \[2, 5, 8\] and \[1, 5, 8\]"),
            ((q, k.double(), cos, sin), r"expected k and q to have the same dtype, got k torch.float64 and q "
                                        r"torch.float32"),
        ]
        for args, message in cases:
            with pytest.raises(RuntimeError, match=message):
                rotary_embedding(*args)
        with pytest.raises(RuntimeError, match=r"grad_k_embed has shape"):
            torch.ops.kernels.rotary_embedding_backward(q, k[:1], cos, sin)
    with pytest.raises(TypeError, match="sin must be a torch.Tensor, got list"):
        rotary_embedding(q, k, cos, [1.0])


@requires_cuda
def test_mixed_devices_are_a_clear_error():
    q, k, cos, sin = operands((1, 2, 2, 3, 8, 1), torch.float32, "cuda")
    with pytest.raises(RuntimeError, match="expected cos and q on the same device"):
        rotary_embedding(q, k, cos.cpu(), sin)
