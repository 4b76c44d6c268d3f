"""gemm_gelu: gelu(x @ weight.T + bias) in one op, the GELU in the split GEMM's epilogue. Each kernel variant (the
Hopper kernel's TMA and plain stores, w split ahead or kept, w transposed, the product computed transposed, K split;
the sm_80 kernel) against eager's two ops and float64, with randn and rand inputs and non-finite
values; its autograd (one node, whose backward op makes the GELU's gradient in grad_x's row split, against its two
steps and float64); the patched MLPs of real architectures; the CPU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from conftest import HAS_CUDA, cuda_kernels_launched, poison_allocator, requires_cuda
from gemm_helpers import SPLIT_KERNELS
from kernels.functional import gemm_gelu, gemm_multiply_leaky_relu, gelu_tanh
from kernels.gemm.gemm import STREAM_K, FusedLinear, forced_gemm_path, forced_k_slices
from kernels.precision import SPLIT_FP16_ERROR_FLOOR, allclose, gradient_atol, relative_error

APPROXIMATIONS = ["none", "tanh"]
PATHS = ["cublas", *SPLIT_KERNELS]


def operands(m, k, n, kind="randn", device="cuda", seed=0):
    g = torch.Generator().manual_seed(seed)
    draw = torch.rand if kind == "rand" else torch.randn
    x = draw(m, k, generator=g)
    w = draw(n, k, generator=g) / k ** 0.5
    b = draw(n, generator=g)
    return x.to(device), w.to(device), b.to(device)


def unfused(x, w, b, approximate):
    """The layers gemm_gelu stands for, in eager PyTorch: nn.Linear, then nn.GELU(approximate)."""
    return F.gelu(F.linear(x, w, b), approximate=approximate)


def check(x, w, b, approximate, path, **options):
    """gemm_gelu on `path`: bit for bit the library's product on that path followed by the activation eager's layer
    applies (F.gelu; gelu_tanh() for "tanh"), so the epilogue's GELU and its wiring (bias, layouts, K slices, stores)
    are exact; and within the contract against eager's two ops (allclose; an error against float64 no larger than
    theirs, or than the split's floor where a test forces it on a product below its range)."""
    poison_allocator((*x.shape[:-1], w.shape[0]), x.dtype, x.device)
    with torch.no_grad(), forced_gemm_path(path):
        y = gemm_gelu(x, w, b, approximate, **options)
        product = gemm_multiply_leaky_relu(x, w, b, 1.0, 1.0)
    two_ops = F.gelu(product) if approximate == "none" else gelu_tanh(product)
    torch.testing.assert_close(y, two_ops, rtol=0, atol=0, equal_nan=True)
    eager = unfused(x, w, b, approximate)
    y64 = unfused(x.double(), w.double(), None if b is None else b.double(), approximate)
    assert y.shape == eager.shape and y.dtype == eager.dtype
    assert allclose(y, eager), (y - eager).abs().nan_to_num().max()
    # The bound: eager's product through the same activation formula ("tanh" is gelu_tanh()'s, whose own tests hold
    # it to eager's formulas over whole tensors; on a few dozen outputs either may be the closer one).
    bound = relative_error(eager if approximate == "none" else gelu_tanh(F.linear(x, w, b)), y64)
    floor = SPLIT_FP16_ERROR_FLOOR if path in SPLIT_KERNELS else 0.0
    assert relative_error(y, y64) <= max(bound, floor), (relative_error(y, y64), bound)
    return y


# (m, k, n): what each takes on split_fp16 (gemm_products.cpp; a GELU's w is split by a pass ahead of the kernel).
SHAPES = {
    "a few tiles": (300, 136, 200),
    "2048 rows or more": (2100, 264, 520),
    "computed transposed": (2000, 520, 40),
    "plain stores (n % 4 = 3)": (300, 136, 203),
    "one row": (1, 72, 40),
}


@requires_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("kind", ["randn", "rand"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gemm_gelu_against_eager_and_float64(shape, kind, approximate, path):
    x, w, b = operands(*SHAPES[shape], kind)
    check(x, w, b, approximate, path)
    check(x, w, None, approximate, path)


@requires_cuda
@pytest.mark.skipif("split_fp16" not in SPLIT_KERNELS, reason="needs the Hopper split kernel")
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_gemm_gelu_with_k_split(approximate):
    x, w, b = operands(64, 4096, 128)  # the sum applies the GELU (its scalar kernel)
    for slices in (4, 1):
        with forced_k_slices(slices):
            check(x, w, b, approximate, "split_fp16")
    x, w, b = operands(256, 4096, 256)  # stream-K: 4 tiles over 64 chunks, 33 parts a tile
    with forced_k_slices(STREAM_K):
        check(x, w, b, approximate, "split_fp16")
        # 4 tiles over 16 chunks: fewer than the multiprocessors, so K stays whole (the GELU in the GEMM's epilogue)
        check(*operands(256, 1024, 256), approximate, "split_fp16")


@requires_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_gemm_gelu_transposed_weight_view(approximate, path):
    # transformers' Conv1D stores W as (in, out): its transposed view is read without a copy.
    x, w, b = operands(300, 136, 200)
    w_t = w.t().contiguous()
    check(x, w_t.t(), b, approximate, path)


@requires_cuda
@pytest.mark.parametrize("path", SPLIT_KERNELS or [pytest.param(None, marks=pytest.mark.skip("no split kernel"))])
def test_gemm_gelu_with_the_kept_weight_split(path):
    layer = FusedLinear(2048, 2048).cuda()
    x = torch.randn(1024, 2048, device="cuda")
    with torch.no_grad(), forced_gemm_path(path):
        first = layer.forward_gelu(x)
        second = layer.forward_gelu(x)  # the first call records the weight; the second makes its split and reads it
        assert layer._weight_split is not None
    assert torch.equal(first, second)
    check(x, layer.weight, layer.bias, "none", path)


@requires_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("rows,features", [(24, 40), (600, 24)])  # the second computed transposed on split_fp16
def test_gemm_gelu_propagates_nan_and_inf_like_eager(path, approximate, rows, features):
    x, w, b = operands(rows, features, 20)  # m k > n k + m n at 600 x 24 -> 20
    x[1, 3], x[4, 0], x[5, :] = float("inf"), float("nan"), -float("inf")
    w[7, 2] = -float("inf")
    check(x, w, b, approximate, path)


def test_gemm_gelu_on_the_cublas_path(device):
    x, w, b = operands(40, 72, 24, device=device)
    for approximate in APPROXIMATIONS:
        check(x, w, b, approximate, "cublas")


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_gemm_gelu_gradients_are_the_two_steps(approximate, device):
    paths = ["cublas", *SPLIT_KERNELS] if device == "cuda" else ["cublas"]
    for path in paths:
        x, w, b = (t.requires_grad_() for t in operands(300, 136, 200, device=device))
        with forced_gemm_path(path):
            y = gemm_gelu(x, w, b, approximate)
        grad = torch.randn_like(y)
        grads = torch.autograd.grad(y, (x, w, b), grad)
        x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
        expected = torch.autograd.grad(unfused(x2, w2, b2, approximate), (x2, w2, b2), grad)
        for got, want in zip(grads, expected):
            atol = gradient_atol(want)
            assert torch.allclose(got, want, atol=atol, rtol=1e-4), (path, (got - want).abs().max())


@requires_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gemm_gelu_training_forward_writes_its_pre_activation(shape, approximate, path):
    # The training forward's (y, pre): on split_fp16 with w's split made ahead and K whole, one kernel writes both
    # (TMA stores); elsewhere the product, then the activation. Either way the bits of gemm_gelu and of the product.
    x, w, b = operands(*SHAPES[shape])
    x[-1, 5], x[0, 0] = float("inf"), float("nan")  # the fix-up writes pre too
    # A transposed weight view (Conv1D's) where its kernel takes it: rows of w^T 16-byte aligned.
    for weight in (w, w.t().contiguous().t()) if w.shape[0] % 4 == 0 else (w,):
        poison_allocator((*x.shape[:-1], w.shape[0]), x.dtype, x.device)
        with torch.no_grad(), forced_gemm_path(path):
            y, pre = torch.ops.kernels._gemm_gelu_with_pre(x, weight, b, approximate)
            expected_y = gemm_gelu(x, weight, b, approximate)
            expected_pre = gemm_multiply_leaky_relu(x, weight, b, 1.0, 1.0)
        torch.testing.assert_close(y, expected_y, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(pre, expected_pre, rtol=0, atol=0, equal_nan=True)


def gelu_gradient(grad_y, pre, approximate):
    """The GELU's input gradient by the activation's own backward op, as the unfused layers' backward computes it."""
    if approximate == "tanh":
        return torch.ops.kernels.gelu_tanh_backward(grad_y, pre)
    return torch.ops.aten.gelu_backward(grad_y, pre, approximate="none")


def check_gelu_backward(x, w, b, grad_y, approximate, path):
    """gemm_gelu_backward on `path` against its two steps (the activation's backward op, then the product's gradients
    from it, on the same path: the same bits but for the GELU's derivative's last rounding) and against float64 within
    the contract: an error no larger than that of eager's layers (the tanh form: eager's product, then gelu_tanh, as
    check() bounds the forward), or than the split's floor."""
    with torch.no_grad(), forced_gemm_path(path):
        pre = gemm_multiply_leaky_relu(x, w, b, 1.0, 1.0)
        poison_allocator(x.shape, x.dtype, x.device)
        got = torch.ops.kernels.gemm_gelu_backward(grad_y, x, w, pre, approximate, True, True, b is not None)
        two_steps = torch.ops.kernels.gemm_multiply_leaky_relu_backward(
            gelu_gradient(grad_y, pre, approximate), x, w, pre.new_empty(0), 1.0, 1.0, True, True, b is not None)

    def layers(x, w, b):
        pre = F.linear(x, w, b)
        if approximate == "tanh" and pre.dtype == torch.float32:
            return gelu_tanh(pre)
        return F.gelu(pre, approximate=approximate)

    def gradients(dtype):
        inputs = [None if t is None else t.detach().to(dtype).requires_grad_() for t in (x, w, b)]
        return torch.autograd.grad(layers(*inputs), [t for t in inputs if t is not None], grad_y.to(dtype))

    floor = SPLIT_FP16_ERROR_FLOOR if path in SPLIT_KERNELS else 0.0
    for name, ours, steps, theirs, exact in zip(("grad_x", "grad_w", "grad_b"), got, two_steps,
                                                gradients(torch.float32), gradients(torch.float64)):
        scale = steps.nan_to_num(0.0, 0.0, 0.0).abs().max().item()
        torch.testing.assert_close(ours, steps, rtol=1e-5, atol=1e-6 * scale, equal_nan=True,
                                   msg=lambda m: f"{name} on {path}: {m}")
        if theirs.isfinite().all():
            assert relative_error(ours, exact) <= max(relative_error(theirs, exact), floor), (name, path)
    return got


# (m, k, n) of the layer whose GELU follows: its backward's grad_x reads grad_y's rows of n floats (x's split pass
# makes the GELU's gradient where they are held in registers: n % 4 == 0, n up to 16384; else the two steps).
BACKWARD_SHAPES = {
    "rows made in the split": (300, 136, 200),
    "2048 rows or more": (2100, 264, 520),
    "rows not a multiple of 4": (300, 136, 203),
    "rows past the registers": (160, 64, 16388),
}


@requires_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("shape", sorted(BACKWARD_SHAPES))
def test_gemm_gelu_backward_against_its_two_steps_and_float64(shape, approximate, path):
    m, k, n = BACKWARD_SHAPES[shape]
    x, w, b = operands(m, k, n)
    grad_y = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).cuda()
    check_gelu_backward(x, w, b, grad_y, approximate, path)
    # grad_y as autograd may hand it over: a view at an offset (the row split reads it where its rows stay 16-byte
    # aligned), an expanded scalar (the two steps take it).
    check_gelu_backward(x, w, None, torch.randn(m, n + 4, device="cuda")[:, 4:], approximate, path)
    check_gelu_backward(x, w, b, torch.ones((), device="cuda").expand(m, n), approximate, path)


@requires_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_gemm_gelu_backward_of_a_transposed_weight_view_and_non_finite_values(approximate, path):
    x, w, b = operands(300, 136, 200)
    grad_y = torch.randn(300, 200, device="cuda")
    check_gelu_backward(x, w.t().contiguous().t(), b, grad_y, approximate, path)  # Conv1D's (in, out) weight
    grad_y[3, 5], grad_y[7, :] = float("inf"), float("nan")
    x[11, 2] = -float("inf")  # a row of pre all infinite or NaN
    check_gelu_backward(x, w, b, grad_y, approximate, path)


@requires_cuda
@pytest.mark.parametrize("path", SPLIT_KERNELS or [pytest.param(None, marks=pytest.mark.skip("no split kernel"))])
def test_gemm_gelu_records_one_node_whose_backward_is_the_fused_op(path):
    x, w, b = (t.requires_grad_() for t in operands(300, 136, 200))
    with forced_gemm_path(path):
        y = gemm_gelu(x, w, b)
        assert y.grad_fn.name() == "kernels::GemmGeluBackward"
        grad = torch.randn_like(y)
        grads = torch.autograd.grad(y, (x, w, b), grad)
        with torch.no_grad():
            pre = gemm_multiply_leaky_relu(x, w, b, 1.0, 1.0)
            expected = torch.ops.kernels.gemm_gelu_backward(grad, x, w, pre, "none", True, True, True)
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)


@pytest.mark.skipif("split_fp16" not in SPLIT_KERNELS, reason="needs the Hopper split kernel")
@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")  # torch's notice, once per process
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_a_training_call_runs_no_gelu_pass_of_its_own(approximate):
    # On split_fp16 the forward's GEMM writes the GELU's input beside y and the backward's row split makes the GELU's
    # gradient: no GELU kernel runs apart, forward or backward (the two-step fallback would pass every other test).
    x, w, b = (t.requires_grad_() for t in operands(300, 136, 200))
    grad = torch.randn(300, 200, device="cuda")
    with forced_gemm_path("split_fp16"):
        _, kernels = cuda_kernels_launched(lambda: gemm_gelu(x, w, b, approximate).backward(grad))
    assert any("GeluBackwardRows" in name for name in kernels), kernels
    assert not any("gelu" in name.lower() and "GeluBackwardRows" not in name for name in kernels), kernels


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_gemm_gelu_gradients_of_every_order_and_forward_mode(approximate):
    # float64 on the CPU: the double backward gives the saved pre-activation the product's graph.
    x, w, b = (t.double().requires_grad_() for t in operands(5, 4, 3, device="cpu"))
    function = lambda *a: gemm_gelu(*a, approximate=approximate)
    assert torch.autograd.gradcheck(function, (x, w, b), check_batched_grad=True)
    assert torch.autograd.gradgradcheck(function, (x, w, b))
    # One operand frozen: the node keeps the other's operand only, and so does its double backward's product node.
    assert torch.autograd.gradgradcheck(lambda a, c: function(a, w.detach(), c), (x, b))
    assert torch.autograd.gradgradcheck(lambda v, c: function(x.detach(), v, c), (w, b))
    # torch.func's nested levels: each records the graph (the pre-activation's too), as for the unfused layers.
    for wrt, ours, eager in ((0, lambda t: function(t, w, b).sum(), lambda t: unfused(t, w, b, approximate).sum()),
                             (1, lambda t: function(x, t, b).sum(), lambda t: unfused(x, t, b, approximate).sum())):
        primal = (x, w)[wrt].detach()
        torch.testing.assert_close(torch.func.hessian(ours)(primal), torch.func.hessian(eager)(primal))
        torch.testing.assert_close(torch.func.jacrev(torch.func.jacrev(ours))(primal),
                                   torch.func.jacrev(torch.func.jacrev(eager))(primal))
    hessian = torch.autograd.functional.hessian(lambda t: function(t, w, b).sum(), x)
    expected = torch.autograd.functional.hessian(lambda t: unfused(t, w, b, approximate).sum(), x)
    torch.testing.assert_close(hessian, expected)
    # As eager: the bias edited in place between the forward and a backward that records a graph (nothing of it saved).
    y = gemm_gelu(x, w, b, approximate)
    with torch.no_grad():
        b.add_(1.0)
    (grad_x,) = torch.autograd.grad(y.sum(), (x,), create_graph=True)
    grad_x.sum().backward()
    assert torch.autograd.gradcheck(function, (x, w, b), check_forward_ad=True, check_backward_ad=False,
                                    check_undefined_grad=False, check_batched_grad=False)


def test_gemm_gelu_backward_bad_inputs(device):
    x, w, b = operands(4, 8, 6, device=device)
    grad, pre = torch.randn(4, 6, device=device), torch.randn(4, 6, device=device)
    backward = torch.ops.kernels.gemm_gelu_backward
    with pytest.raises(RuntimeError, match="grad_y must have the output's shape"):
        backward(grad[:, :5], x, w, pre, "none", True, True, True)
    with pytest.raises(RuntimeError, match="pre must have the output's shape"):
        backward(grad, x, w, pre[:3], "none", True, True, True)
    with pytest.raises(RuntimeError, match="approximate must be 'none' or 'tanh'"):
        backward(grad, x, w, pre, "exact", True, True, True)
    with pytest.raises(RuntimeError, match="gemm_gelu_backward.*pre"):
        backward(grad, x, w, pre.double(), "none", True, True, True)


def test_gemm_gelu_under_vmap_compile_and_autocast(device):
    x, w, b = operands(6, 16, 8, device=device)
    batched = torch.stack([x, 2 * x])
    assert torch.allclose(torch.func.vmap(lambda t: gemm_gelu(t, w, b))(batched), unfused(batched, w, b, "none"),
                          atol=1e-5, rtol=1e-5)
    compiled = torch.compile(lambda t: gemm_gelu(t, w, b, "tanh"), backend="aot_eager", fullgraph=True)
    assert torch.allclose(compiled(x), gemm_gelu(x, w, b, "tanh"))
    dtype = torch.bfloat16
    with torch.autocast(device, dtype=dtype):
        y, eager = gemm_gelu(x, w, b), unfused(x, w, b, "none")
    assert y.dtype == eager.dtype == dtype


@pytest.mark.parametrize("call,error", [
    (lambda x, w: gemm_gelu(x, w, None, "exact"), "approximate must be 'none' or 'tanh'"),
    (lambda x, w: torch.ops.kernels.gemm_gelu(x, w, None, "exact"), "approximate must be 'none' or 'tanh'"),
    (lambda x, w: gemm_gelu(x, w.double()), "weight"),
    (lambda x, w: gemm_gelu(x, w[:, :5]), "in_features"),
    (lambda x, w: gemm_gelu(x.tolist(), w), "must be torch.Tensors"),
])
def test_gemm_gelu_bad_inputs(call, error, device):
    x, w, _ = operands(4, 8, 6, device=device)
    with pytest.raises((RuntimeError, ValueError, TypeError), match=error):
        call(x, w)


# ---- patched MLPs ------------------------------------------------------------------------------------------------

def _count_forward_gelu(monkeypatch):
    calls = []
    original = FusedLinear.forward_gelu

    def counting(self, x, approximate="none"):
        calls.append(approximate)
        return original(self, x, approximate)

    monkeypatch.setattr(FusedLinear, "forward_gelu", counting)
    return calls


def test_patched_mlp_runs_its_first_layer_and_gelu_as_one_op(device, monkeypatch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=256, vocab_size=100)
    eager = transformers.BertModel(config).to(device).eval()
    patched = kernels.patch(transformers.BertModel(config).to(device).eval())
    patched.load_state_dict(eager.state_dict())
    calls = _count_forward_gelu(monkeypatch)
    ids = torch.randint(0, 100, (2, 16), device=device)
    with torch.no_grad():
        assert torch.allclose(patched(ids).last_hidden_state, eager(ids).last_hidden_state, atol=1e-5, rtol=1e-5)
    assert calls == ["none", "none"]
    # A hook on the activation sees its call: the MLP then runs its own forward.
    seen = []
    patched.encoder.layer[0].intermediate.intermediate_act_fn.register_forward_hook(lambda *args: seen.append(1))
    with torch.no_grad():
        patched(ids)
    assert seen == [1] and len(calls) == 3
    kernels.unpatch(patched)
    assert type(patched.encoder.layer[0].intermediate) is transformers.models.bert.modeling_bert.BertIntermediate


def test_gpt2_mlp_is_left_as_it_is(device):
    # GPT-2's "gelu_new" (the tanh form) stays two ops: fused, it costs the GEMM what the pass costs. Its MLP keeps its
    # own forward (no check a call would pay for), its Conv1D and NewGELU layers patched as before.
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0)
    patched = kernels.patch(transformers.GPT2Model(config).to(device))
    mlp = patched.h[0].mlp
    assert not kernels.is_patched(mlp) and kernels.is_patched(mlp.c_fc) and kernels.is_patched(mlp.act)


class TimmStyleMlp(nn.Module):
    """timm's Mlp (timm/layers/mlp.py) as it is written, for machines without timm: patch() knows it by its forward's
    code."""

    def __init__(self, features, hidden, act_layer=nn.GELU):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.act = act_layer()
        self.drop1 = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden, features)
        self.drop2 = nn.Dropout(0.0)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


class NanoGPTStyleMlp(nn.Module):
    """nanoGPT's MLP (model.py) as it is written: patch() knows it by its forward's code."""

    def __init__(self, features, hidden, act_layer=nn.GELU):
        super().__init__()
        self.c_fc = nn.Linear(features, hidden)
        self.gelu = act_layer()
        self.c_proj = nn.Linear(hidden, features)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


@pytest.mark.parametrize("mlp_class", [TimmStyleMlp, NanoGPTStyleMlp])
@pytest.mark.parametrize("act_layer,fused", [(nn.GELU, True), (nn.ReLU, False)])
def test_mlp_fuses_its_gelu(mlp_class, act_layer, fused, device, monkeypatch):
    """timm's Mlp and nanoGPT's MLP: the first layer and its GELU (the erf form) one op, forward and training, with
    eager's results and gradients; another activation left as it is."""
    torch.manual_seed(0)
    eager = mlp_class(64, 256, act_layer).to(device)
    patched = kernels.patch(mlp_class(64, 256, act_layer).to(device))
    patched.load_state_dict(eager.state_dict())
    assert kernels.is_patched(patched)
    calls = _count_forward_gelu(monkeypatch)
    x = torch.randn(3, 10, 64, device=device)
    with torch.no_grad():
        torch.testing.assert_close(patched(x), eager(x))
    assert calls == (["none"] if fused else [])
    x.requires_grad_(True)  # a training call: gemm_gelu's node where fused, its gradients eager's
    x_eager = x.detach().clone().requires_grad_(True)
    grad = torch.randn(3, 10, 64, device=device)
    patched(x).backward(grad)
    eager(x_eager).backward(grad)
    torch.testing.assert_close(x.grad, x_eager.grad)
    for got, expected in zip(patched.parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, expected.grad)
    kernels.unpatch(patched)
    assert type(patched) is mlp_class


def test_plain_gelus_only_are_fused():
    from kernels.patching import _is_plain_gelu

    assert _is_plain_gelu(nn.GELU())
    assert not _is_plain_gelu(nn.GELU(approximate="tanh"))
    assert not _is_plain_gelu(nn.ReLU())
    assert not _is_plain_gelu(F.gelu)

    class SubclassedGELU(nn.GELU):
        def forward(self, x):
            return super().forward(x) * 2

    assert not _is_plain_gelu(SubclassedGELU())
    hooked = nn.GELU()
    hooked.register_forward_hook(lambda *args: None)
    assert not _is_plain_gelu(hooked)
    transformers = pytest.importorskip("transformers")
    assert _is_plain_gelu(transformers.activations.GELUActivation())
    assert not _is_plain_gelu(transformers.activations.GELUActivation(use_gelu_python=True))
    assert not _is_plain_gelu(transformers.activations.NewGELUActivation())


@requires_cuda
@pytest.mark.skipif(not SPLIT_KERNELS, reason="needs a split kernel")
def test_patched_bert_mlp_on_the_split_path_within_the_contract(monkeypatch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=1024, num_hidden_layers=1, num_attention_heads=16,
                                     intermediate_size=4096, vocab_size=1000)
    eager = transformers.BertModel(config).cuda().eval()
    patched = kernels.patch(transformers.BertModel(config).cuda().eval())
    patched.load_state_dict(eager.state_dict())
    calls = _count_forward_gelu(monkeypatch)
    ids = torch.randint(0, 1000, (4, 512), device="cuda")
    with torch.no_grad():
        ours = patched(ids).last_hidden_state
        theirs = eager(ids).last_hidden_state
        y64 = eager.double()(ids).last_hidden_state
    assert calls == ["none"]
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    assert relative_error(ours, y64) <= relative_error(theirs, y64)
