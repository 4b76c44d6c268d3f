"""Attention: the op against float64 and against eager's F.scaled_dot_product_attention (error no larger than
eager fp32's, allclose at 1e-4), forward, logsumexp and gradients, on CPU and CUDA; the split kernels and the plain
kernel (forced, and for heads holding non-finite or out-of-range values), the mma.sync kernel forced where Hopper
runs wgmma's, grouped kv heads, the fp32_gemm route, torch.compile and bad input."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import patching
from conftest import cuda_kernels_launched, poison_allocator, requires_cuda
from kernels.attention.attention import _reference
from kernels.functional import attention
from kernels.precision import ERROR_RATIO_LIMIT, allclose, relative_error

# (batch, heads, kv heads, query rows, key rows, head dim)
SHAPES = {
    "BERT-like": (2, 16, 16, 512, 512, 64),
    "ViT rows (197)": (4, 12, 12, 197, 197, 64),
    "odd rows, more keys": (2, 4, 4, 37, 45, 64),
    "more queries than keys": (1, 2, 2, 130, 70, 64),
    "600 keys": (1, 4, 4, 64, 600, 64),
    "head dim 128": (2, 8, 8, 256, 256, 128),
    "grouped kv heads": (2, 8, 2, 100, 100, 64),
    "one row": (3, 2, 2, 1, 1, 64),
    # the keys' last tile at the short step's bound (16 keys) and one past it
    "16 keys past a tile": (2, 4, 4, 96, 80, 64),
    "17 keys past a tile": (2, 4, 4, 96, 81, 64),
}


def operands(shape, device, seed=0, kind="randn"):
    batch, heads, kv_heads, rows, keys, dim = shape
    g = torch.Generator().manual_seed(seed)
    make = torch.randn if kind == "randn" else torch.rand
    q = make(batch, heads, rows, dim, generator=g)
    k = make(batch, kv_heads, keys, dim, generator=g)
    v = make(batch, kv_heads, keys, dim, generator=g)
    return [t.to(device) for t in (q, k, v)]


def eager(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def exact(q, k, v, causal):
    return _reference(q.double(), k.double(), v.double(), causal, 1.0 / math.sqrt(q.shape[-1]))


@contextlib.contextmanager
def forced(switch):
    """The kernel choice a _attention_force_* op sets (plain: every head on the plain kernel; mma_sync: the split
    kernel's products on mma.sync, the sm_80 kernel, where Hopper runs wgmma's by default), for the block."""
    previous = switch(True)
    try:
        yield
    finally:
        switch(previous)


@pytest.mark.parametrize("kind", ["randn", "rand"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_forward_against_float64(device, name, causal, kind):
    shape = SHAPES[name]
    if device == "cpu" and shape[3] * shape[4] * shape[1] > 2 ** 22:
        pytest.skip("CPU: the ATen path at a smaller size")
    q, k, v = operands(shape, device, kind=kind)
    poison_allocator((shape[0], shape[3], shape[1], shape[5]), torch.float32, device)
    y = attention(q, k, v, causal)
    assert y.shape == q.shape[:3] + v.shape[3:] and y.dtype == torch.float32
    reference, y64 = eager(q, k, v, causal), exact(q, k, v, causal)
    assert not y.isnan().any()
    assert allclose(y, reference)
    assert relative_error(y, y64) <= relative_error(reference, y64)


@requires_cuda
def test_operands_at_any_offset_and_stride():
    """q, k and v as views at an odd offset with rows 66 floats apart give the bits of their contiguous copies."""
    q, k, v = operands(SHAPES["ViT rows (197)"], "cuda", seed=12)
    wide = [torch.zeros(*t.shape[:3], 66, device="cuda") for t in (q, k, v)]
    views = []
    for t, storage in zip((q, k, v), wide):
        storage[..., 1:65] = t
        views.append(storage[..., 1:65])
    assert views[2].data_ptr() % 16 != 0
    for causal in (False, True):
        assert torch.equal(attention(*views, causal), attention(q, k, v, causal))


@requires_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_logsumexp(causal):
    q, k, v = operands(SHAPES["odd rows, more keys"], "cuda", seed=1)
    _, lse = torch.ops.kernels.attention(q, k, v, causal, 0.125)
    scores = (q.double() @ k.double().transpose(-2, -1)) * 0.125
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device="cuda").triu(1), -math.inf)
    expected = scores.logsumexp(-1)
    assert lse.shape == (2, 4, 64)
    torch.testing.assert_close(lse[..., :37].double(), expected, atol=1e-6, rtol=1e-6)


@requires_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", ["default", "efficient", "math"])
def test_calls_the_kernels_do_not_take_run_eagers_own(causal, dtype, backend):
    """On CUDA, calls the split kernels do not take (head dim 128, float16) run eager's own attention, as its
    dispatcher chooses under the caller's sdpa_kernel: the output bit for bit eager's, the logsumexp in the query's
    dtype within its rounding of float64's, and where eager's call is the memory-efficient kernel, that kernel's own."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (t.to(dtype) for t in operands(SHAPES["head dim 128"], "cuda", seed=3))
    chosen = {"default": contextlib.nullcontext(), "efficient": sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION),
              "math": sdpa_kernel(SDPBackend.MATH)}[backend]
    with chosen:
        out, lse = torch.ops.kernels.attention(q, k, v, causal, 0.125)
        reference = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.125)
    assert torch.equal(out, reference)
    assert out.stride() == (256 * 8 * 128, 128, 8 * 128, 1)  # (batch, rows, heads, head dim) in memory
    scores = (q.double() @ k.double().transpose(-2, -1)) * 0.125
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device="cuda").triu(1), -math.inf)
    assert lse.dtype == dtype and lse.shape == (2, 8, 256)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=tolerance, rtol=tolerance)
    if backend == "efficient" or (backend == "default" and dtype == torch.float32):
        efficient_lse = torch.ops.aten._efficient_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, None, None, None, 0.0, int(causal),
            True, scale=0.125)[1]
        assert torch.equal(lse, efficient_lse.to(dtype))


@requires_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["odd rows, more keys", "head dim 128", "grouped kv heads"])
def test_plain_kernel_forced(name, causal):
    q, k, v = operands(SHAPES[name], "cuda", seed=2)
    with forced(torch.ops.kernels._attention_force_plain):
        y = attention(q, k, v, causal)
    reference, y64 = eager(q, k, v, causal), exact(q, k, v, causal)
    assert allclose(y, reference)
    assert relative_error(y, y64) <= 2 * relative_error(reference, y64)


@requires_cuda
@pytest.mark.parametrize("kind", ["randn", "rand"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["BERT-like", "ViT rows (197)", "600 keys", "grouped kv heads",
                                  "16 keys past a tile"])
def test_mma_sync_kernel_forced(name, causal, kind):
    """The mma.sync kernel, forced (on Hopper the default kernel's products run on wgmma): the same products in the
    same order, so no more error than eager's against float64, and within a few roundings of the default kernel."""
    q, k, v = operands(SHAPES[name], "cuda", seed=3, kind=kind)
    with forced(torch.ops.kernels._attention_force_mma_sync):
        y, lse = torch.ops.kernels.attention(q, k, v, causal, 1.0 / math.sqrt(q.shape[-1]))
    y_default, lse_default = torch.ops.kernels.attention(q, k, v, causal, 1.0 / math.sqrt(q.shape[-1]))
    reference, y64 = eager(q, k, v, causal), exact(q, k, v, causal)
    assert allclose(y, reference)
    assert relative_error(y, y64) <= relative_error(reference, y64)
    torch.testing.assert_close(y, y_default, atol=1e-6, rtol=1e-5)
    rows = q.shape[2]
    torch.testing.assert_close(lse[..., :rows], lse_default[..., :rows], atol=1e-6, rtol=1e-6)


@requires_cuda
@pytest.mark.parametrize("shape, short_last_tile", [("BERT-like", "false"), ("ViT rows (197)", "true"),
                                                    ("16 keys past a tile", "true"), ("17 keys past a tile", "false")])
def test_hopper_runs_the_wgmma_kernel(shape, short_last_tile):
    """On sm_90 the split kernel's products run on wgmma (attention_split_kernel<64, true, ...>), and on mma.sync where
    forced: a build without the kernel's sm_90a code would fall back unseen by the tests of results. Key counts whose
    last tile holds 1-16 keys run the short last step's instance (<..., true>), others the kernel without it."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel runs on sm_90 only")
    q, k, v = operands(SHAPES[shape], "cuda")

    def split_kernels():
        _, names = cuda_kernels_launched(lambda: attention(q, k, v))
        return [name for name in names if "attention_split_kernel" in name]

    default = split_kernels()
    with forced(torch.ops.kernels._attention_force_mma_sync):
        mma_sync = split_kernels()
    assert default and all(f"<64, true, {short_last_tile}>" in name for name in default), default
    assert mma_sync and all(f"<64, false, {short_last_tile}>" in name for name in mma_sync), mma_sync


@requires_cuda
def test_large_scores():
    """Scores near 1e8 (q and k within the split's range): the softmax is one-hot, each row's largest probability
    exactly 1, whose split times 2^13 fp16 holds; no NaN, and no more error than eager's."""
    q, k, v = operands((2, 4, 4, 96, 96, 64), "cuda", seed=13)
    q, k = q * 1e4, k * 1e4
    y = attention(q, k, v)
    reference, y64 = eager(q, k, v, False), exact(q, k, v, False)
    assert y.isfinite().all()
    assert relative_error(y, y64) <= relative_error(reference, y64) + 1e-7


@requires_cuda
@pytest.mark.parametrize("scaling", ["wide rows", "out of range"])
def test_scaled_rows(scaling):
    # Rows of q and k and columns of v at magnitudes from 2^-30 to 2^30 (the split's powers of two), or one row past
    # 2^40 (its head on the plain kernel): error against float64 no larger than eager's.
    q, k, v = operands((2, 4, 4, 96, 96, 64), "cuda", seed=3)
    g = torch.Generator().manual_seed(4)
    for t, dim in ((q, 2), (k, 2), (v, 3)):
        exponents = torch.randint(-30, 31, (t.shape[dim],), generator=g).float()
        shape = [1] * 4
        shape[dim] = -1
        t.mul_(torch.exp2(exponents).view(shape).cuda())
    if scaling == "out of range":
        q[1, 2, 5] *= 2.0 ** 60
        v[0, 1, :, 7] *= 2.0 ** -45
    q /= 2 ** 15  # the scores' magnitudes stay where softmax is not one-hot everywhere
    y = attention(q, k, v)
    reference, y64 = eager(q, k, v, False), exact(q, k, v, False)
    assert not y.isnan().any()
    assert relative_error(y, y64) <= relative_error(reference, y64) * 1.0 + 1e-7


@requires_cuda
@pytest.mark.parametrize("where", ["q NaN", "k Inf", "v NaN", "v -Inf", "q Inf"])
def test_non_finite(where):
    q, k, v = operands((2, 4, 4, 70, 70, 64), "cuda", seed=5)
    target, value = {"q NaN": (q, math.nan), "k Inf": (k, math.inf), "v NaN": (v, math.nan), "v -Inf": (v, -math.inf),
                     "q Inf": (q, math.inf)}[where]
    target[1, 2, 17, 9] = value
    y = attention(q, k, v)
    reference = _reference(q, k, v, False, 0.125)  # IEEE arithmetic in fp32, eager's math
    assert torch.equal(y.isnan(), reference.isnan())
    assert torch.equal(y.isinf(), reference.isinf())
    finite = reference.isfinite()
    torch.testing.assert_close(y[finite], reference[finite], atol=1e-5, rtol=1e-5)
    # The other heads stay on the split kernels: bit for bit as without the non-finite value elsewhere.
    assert y[0].isfinite().all()
    if where.startswith("q"):
        # A query row the split cannot take sends its own tile of 64 rows to the plain path, not its head's others.
        clean = operands((2, 4, 4, 70, 70, 64), "cuda", seed=5)
        assert torch.equal(y[1, 2, 64:], attention(*clean)[1, 2, 64:])


@requires_cuda
@pytest.mark.parametrize("where", ["k", "v"])
def test_a_flagged_call_leaves_no_flag_for_the_next(where):
    """Every call writes each kv head's flag afresh (v's pass; no memset): after a call whose k or v holds a value the
    split cannot take, the same shape's clean call runs every head on the split path again, bit for bit as before."""
    shape = (2, 4, 4, 70, 70, 64)
    clean = operands(shape, "cuda", seed=5)
    before = attention(*clean)
    with forced(torch.ops.kernels._attention_force_plain):
        plain = attention(*clean)
    # every head of the clean call on the split path: none of them has the plain path's bits
    assert all(not torch.equal(before[b, h], plain[b, h]) for b in range(shape[0]) for h in range(shape[1]))
    flagged = [t.clone() for t in clean]
    flagged[1 if where == "k" else 2][1, 2, 17, 9] = math.nan
    attention(*flagged)
    assert torch.equal(attention(*clean), before)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["odd rows, more keys", "head dim 128", "grouped kv heads"])
def test_gradients(device, name, causal):
    q, k, v = (t.requires_grad_() for t in operands(SHAPES[name], device, seed=6))
    grad = torch.randn(q.shape[:3] + v.shape[3:], generator=torch.Generator().manual_seed(7)).to(device)
    ours = torch.autograd.grad(attention(q, k, v, causal), (q, k, v), grad)
    theirs = torch.autograd.grad(eager(q, k, v, causal), (q, k, v), grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    exact_grads = torch.autograd.grad(exact(q64, k64, v64, causal), (q64, k64, v64), grad.double())
    for a, b, e in zip(ours, theirs, exact_grads):
        assert allclose(a, b)
        assert relative_error(a, e) <= 1.1 * relative_error(b, e) + 1e-7
    if device == "cuda" and name != "grouped kv heads" and q.shape[-1] == 64:  # eager's own backward, bit for bit
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_higher_orders_forward_mode_and_torch_func(device, causal):
    """As the formula in eager's ops (eager's fused attention raises for each): a double backward, forward-mode
    tangents and torch.func's transforms, in float64."""
    q, k, v = (t.double() for t in operands((1, 2, 2, 5, 6, 16), device, seed=9))
    scale = 1.0 / math.sqrt(q.shape[-1])
    ours = lambda *a: attention(*a, causal)  # noqa: E731
    formula = lambda *a: _reference(*a, causal, scale)  # noqa: E731
    assert torch.autograd.gradgradcheck(ours, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_()))
    # One tensor in two or three slots: its gradient once, under create_graph too.
    for args in (lambda x: (x, x, x), lambda x: (q.detach(), x, x)):
        got, expected = (torch.autograd.grad(f(*args(k))[..., :3].square().sum(), k, create_graph=True)[0]
                         for f in (ours, formula))
        torch.testing.assert_close(got, expected)
    q, k, v = (t.detach() for t in (q, k, v))
    tangent = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(10)).to(device)
    got, expected = (torch.func.jvp(lambda t: f(t, k, v), (q,), (tangent,))[1] for f in (ours, formula))
    torch.testing.assert_close(got, expected)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, tangent)
        got = torch.autograd.forward_ad.unpack_dual(ours(dual, k, v)).tangent
    torch.testing.assert_close(got, expected)
    loss = lambda f: lambda t: (f(t, k, v) ** 2).sum()  # noqa: E731
    for transform in (torch.func.grad, torch.func.hessian):
        torch.testing.assert_close(transform(loss(ours))(q[..., :2, :]), transform(loss(formula))(q[..., :2, :]))


def test_meta_and_mixed_devices_autocast_and_no_head_dim(device):
    """The op's checks hold on the meta device and for tensors on two devices (no tensor of garbage); under autocast
    eager's call and dtype; a head dim of 0 is eager's call (an empty output, or its error)."""
    q = torch.randn(1, 2, 4, 8, device=device)
    meta = torch.randn(1, 2, 4, 8, device="meta")
    for args in ((q, meta, meta), (meta, q, q)):
        with pytest.raises(RuntimeError, match="kernels.attention: expected .* on the same device"):
            attention(*args)
    for args, message in (((meta, meta[..., :4], meta[..., :4]), "same batch and head dim"),
                          ((meta, meta.int(), meta), "must be a float32"),
                          ((meta, meta[:, :0], meta[:, :0]), "multiple of"),
                          ((meta[0], meta[0], meta[0]), "4 dimensions")):
        with pytest.raises(RuntimeError, match=message):
            attention(*args)
    assert attention(meta, meta, meta).shape == meta.shape
    dtype = torch.bfloat16
    with torch.autocast(device, dtype=dtype):
        got, expected = attention(q, q, q), F.scaled_dot_product_attention(q, q, q)
    assert got.dtype == expected.dtype == dtype and torch.equal(got, expected)
    empty = torch.randn(1, 2, 4, 0, device=device)
    outcomes = []
    for function in (attention, F.scaled_dot_product_attention):  # eager's empty output, or its error on this device
        try:
            outcomes.append(function(empty, empty, empty).shape)
        except RuntimeError as error:
            outcomes.append(type(error))
    assert outcomes[0] == outcomes[1]


@requires_cuda
def test_fp32_gemm_routes_sdpa():
    q, k, v = operands((1, 4, 4, 512, 512, 64), "cuda", seed=8)
    long = operands((1, 2, 2, 2048, 2048, 64), "cuda", seed=9)
    short = operands((2, 4, 4, patching._ATTENTION_MIN_KEYS - 1, patching._ATTENTION_MIN_KEYS - 1, 64), "cuda",
                     seed=10)
    few_causal = operands((1, 4, 4, 512, patching._CAUSAL_ATTENTION_MIN_KEYS - 1, 64), "cuda", seed=11)
    mask = torch.ones(512, 512, dtype=torch.bool, device="cuda").tril()
    with kernels.fp32_gemm():
        routed = F.scaled_dot_product_attention(q, k, v)
        causal = F.scaled_dot_product_attention(*long, is_causal=True, scale=0.3)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # a mask: eager's
        few_keys = F.scaled_dot_product_attention(*short)  # too few keys: eager's
        short_causal = F.scaled_dot_product_attention(*few_causal, is_causal=True)  # too few keys when causal: eager's
    torch.testing.assert_close(routed, attention(q, k, v), atol=0, rtol=0)
    torch.testing.assert_close(causal, attention(*long, True, 0.3), atol=0, rtol=0)
    torch.testing.assert_close(masked, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=0, rtol=0)
    torch.testing.assert_close(few_keys, F.scaled_dot_product_attention(*short), atol=0, rtol=0)
    torch.testing.assert_close(short_causal, F.scaled_dot_product_attention(*few_causal, is_causal=True), atol=0,
                               rtol=0)
    # A call that computes a gradient stays eager's (outputs bit for bit).
    q.requires_grad_()
    with kernels.fp32_gemm():
        trained = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(trained, F.scaled_dot_product_attention(q, k, v), atol=0, rtol=0)


@requires_cuda
@pytest.mark.slow
def test_torch_compile():
    q, k, v = operands(SHAPES["odd rows, more keys"], "cuda", seed=9)
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, True) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), attention(q, k, v, True) * 2, atol=0, rtol=0)


def test_empty_rows(device):
    q, k, v = operands((2, 4, 4, 0, 8, 64), device)
    assert attention(q, k, v).shape == (2, 4, 0, 64)


@pytest.mark.parametrize("shape", [(0, 4, 4, 8, 8, 64), (2, 0, 0, 8, 8, 64), (2, 0, 2, 8, 8, 64)],
                         ids=["no batch", "no heads", "no query heads"])
def test_empty_batch_and_heads(device, shape):
    """As eager's (enable_gqa): an empty output and gradients, and the op's fake agrees."""
    q, k, v = (t.requires_grad_() for t in operands(shape, device))
    # Eager's CPU kernel before torch 2.13 divides by the heads' count (a floating-point exception with none): there
    # the output's shape is checked against q's alone.
    eager_runs = not (device == "cpu" and shape[1] == 0 and torch.__version__ < (2, 13))
    for causal in (False, True):
        y = attention(q, k, v, causal)
        assert y.shape == q.shape and (not eager_runs or y.shape == eager(q, k, v, causal).shape)
        grads = torch.autograd.grad(y.sum(), (q, k, v))
        assert all(g.shape == t.shape and not g.any() for g, t in zip(grads, (q, k, v)))
    torch.library.opcheck(torch.ops.kernels.attention.default, (q, k, v, True, 0.125))


@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v: (q[0], k, v), "must have 4 dimensions"),
    (lambda q, k, v: (q, k, v[..., :32]), "same shape"),
    (lambda q, k, v: (q, k.double(), v), "same dtype"),
    (lambda q, k, v: (q.int(), k, v), "float32, float64, float16 or bfloat16"),
    (lambda q, k, v: (q[:, :3], k[:, :2], v[:, :2]), "must be a multiple of"),
])
def test_bad_input(bad, message):
    q, k, v = operands((2, 4, 4, 8, 8, 64), "cpu")
    with pytest.raises(RuntimeError, match=message):
        attention(*bad(q, k, v))


def test_bad_flags_are_type_errors():
    """As eager's F.scaled_dot_product_attention: is_causal a bool, scale a number or a one-element tensor."""
    q, k, v = operands((1, 2, 2, 4, 4, 64), "cpu")
    assert torch.equal(attention(q, k, v, scale=torch.tensor(0.5)), attention(q, k, v, scale=0.5))
    for kwargs, message in (({"is_causal": None}, "is_causal must be a bool, got NoneType"),
                            ({"is_causal": 1}, "is_causal must be a bool, got int"),
                            ({"scale": "0.5"}, "scale must be a number or None, got str"),
                            ({"scale": [0.5]}, "scale must be a number or None, got list")):
        with pytest.raises(TypeError, match=message):
            attention(q, k, v, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gradients_and_torch_func(device, dtype):
    """float16 and bfloat16: the gradients, and the output under torch.func's transforms (the formula in ATen's ops),
    within ERROR_RATIO_LIMIT of eager's error against float64."""
    q, k, v = operands((2, 4, 4, 64, 64, 32), device, seed=11)
    q, k, v = (t.mul(3).to(dtype) for t in (q, k, v))
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).to(device, dtype)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    y64 = exact(q64, k64, v64, True)
    exact_grads = torch.autograd.grad(y64, (q64, k64, v64), grad.double())

    def gradients(function):
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(function(*inputs, True), inputs, grad)

    for name, a, b, e in zip("qkv", gradients(attention), gradients(eager), exact_grads):
        assert a.dtype == dtype
        assert relative_error(a, e) <= ERROR_RATIO_LIMIT[dtype] * relative_error(b, e), name
    y = torch.func.vmap(lambda *t: attention(*t, True))(q, k, v)
    assert relative_error(y, y64) <= ERROR_RATIO_LIMIT[dtype] * relative_error(eager(q, k, v, True), y64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_vmap_over_the_batch(causal):
    """vmap over the batch: each call sees (heads, rows, head dim), its heads at dim -3 as eager's, grouped or not,
    with more queries than keys (rows a multiple of the keys: read as heads, they would repeat the keys)."""
    q, k, v = operands((2, 8, 4, 10, 5, 16), "cpu", seed=13)
    expected = eager(q, k, v, causal)
    torch.testing.assert_close(torch.func.vmap(lambda *t: attention(*t, causal))(q, k, v), expected)
    k, v = (t.repeat_interleave(2, 1) for t in (k, v))
    torch.testing.assert_close(torch.func.vmap(lambda *t: attention(*t, causal))(q, k, v), expected)
    with pytest.raises(RuntimeError, match="query has 8 heads, which must be a multiple of key's 3"):
        torch.func.vmap(lambda *t: attention(*t, causal))(q, k[:, :3], v[:, :3])
