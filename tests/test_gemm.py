"""The GEMM family (gemm_multiply_leaky_relu): ModelNew against the reference model (same seed, same weights) on CPU
and CUDA: results, layouts, non-finite values, TF32, autograd (gradients, gradcheck, forward mode), opcheck,
torch.compile and bad inputs. The split paths' tests are in test_gemm_split.py, test_gemm_weight_split.py and
test_gemm_backward.py; the path choice's in test_gemm_paths.py."""

import pytest
import torch

from conftest import requires_cuda
from kernels.precision import ALLCLOSE_TOLERANCE, matmul_precision, relative_error
from kernels.functional import gemm_multiply_leaky_relu
from model_new import GemmMultiplyLeakyReLUModelNew
from gemm_helpers import check_against_reference, float64_reference, make_pair


def test_same_seed_gives_same_weights_and_state_dict_round_trip():
    reference, new = make_pair(64, 48, 2.0, 0.1, "cpu")
    for (name, p), (name_ref, p_ref) in zip(new.state_dict().items(), reference.state_dict().items()):
        assert name == name_ref and torch.equal(p, p_ref)
    other = GemmMultiplyLeakyReLUModelNew(64, 48, 2.0, 0.1)
    other.load_state_dict(reference.state_dict(), strict=True)
    reference.load_state_dict(other.state_dict(), strict=True)


SHAPES = {  # name: (batch shape, in_features, out_features)
    "square": ((64,), 128, 128),
    "m1": ((1,), 96, 80),
    "odd": ((33,), 65, 17),
    "3d": ((3, 5), 40, 24),
    "1d": ((), 40, 24),
    "empty": ((0,), 32, 16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(device, dtype, shape):
    batch, in_features, out_features = SHAPES[shape]
    reference, new = make_pair(in_features, out_features, 2.0, 0.1, device, dtype)
    x = torch.randn(*batch, in_features, device=device, dtype=dtype)
    check_against_reference(reference, new, x)


@pytest.mark.parametrize("multiplier,slope", [(-1.5, 0.1), (2.0, -0.3), (-0.5, -2.0), (1.0, 0.0), (3.0, 1.7)])
def test_signs_of_multiplier_and_slope(device, multiplier, slope):
    reference, new = make_pair(72, 56, multiplier, slope, device)
    check_against_reference(reference, new, torch.randn(40, 72, device=device))


def test_non_contiguous_and_offset_inputs(device):
    reference, new = make_pair(48, 40, 2.0, 0.1, device)
    base = torch.randn(100, 130, device=device)
    for x in (base[:, 1:49], base.t()[:48].t()[:60], base.view(-1)[3:3 + 37 * 48].view(37, 48),
              torch.randn(48, 20, device=device).t()):
        x_before = x.clone()
        check_against_reference(reference, new, x)
        assert torch.equal(x, x_before)


def test_nan_and_inf_propagate_like_the_reference(device):
    reference, new = make_pair(32, 24, 2.0, 0.1, device)
    x = torch.randn(6, 32, device=device)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, 7] = float("-inf")
    y, y_ref = check_against_reference(reference, new, x)
    assert torch.equal(y.isnan(), y_ref.isnan()) and torch.equal(y.isinf(), y_ref.isinf())


def test_without_bias(device):
    torch.manual_seed(1)
    x, weight = torch.randn(9, 20, device=device), torch.randn(12, 20, device=device)
    expected = torch.nn.functional.leaky_relu((x @ weight.t()) * -2.0, 0.2)
    torch.testing.assert_close(gemm_multiply_leaky_relu(x, weight, None, -2.0, 0.2), expected)


@requires_cuda
def test_tf32_follows_the_user_setting():
    reference, new = make_pair(1024, 512, 2.0, 0.1, "cuda")
    x = torch.randn(256, 1024, device="cuda")
    y64 = float64_reference(reference, x)
    with torch.no_grad():
        ieee = relative_error(new(x), y64)
        with matmul_precision("high"):
            tf32, tf32_eager = relative_error(new(x), y64), relative_error(reference(x), y64)
    assert ieee < 1e-5 < tf32  # TF32 used only when allowed...
    assert tf32 <= 2 * tf32_eager  # ...and then as PyTorch uses it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("multiplier,slope", [(2.0, 0.1), (-1.5, -0.3), (0.5, 0.0)])
def test_gradients_match_reference(device, dtype, multiplier, slope):
    reference, new = make_pair(40, 24, multiplier, slope, device, dtype)
    x = torch.randn(3, 11, 40, device=device, dtype=dtype)
    grad = torch.randn(3, 11, 24, device=device, dtype=dtype)
    x_new, x_ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    new(x_new).backward(grad)
    reference(x_ref).backward(grad)
    tol = 1e-5 if dtype == torch.float32 else 1e-12 if dtype == torch.float64 else ALLCLOSE_TOLERANCE[dtype] * 4
    torch.testing.assert_close(x_new.grad, x_ref.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(new.gemm.weight.grad, reference.gemm.weight.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(new.gemm.bias.grad, reference.gemm.bias.grad, atol=tol, rtol=tol)


@pytest.mark.parametrize("slope", [0.1, -0.4])
def test_gradcheck_float64(device, slope):
    _, new = make_pair(7, 5, -1.5, slope, device, torch.float64)
    x = torch.randn(4, 7, dtype=torch.float64, device=device, requires_grad=True)
    weight, bias = new.gemm.weight, new.gemm.bias
    assert torch.autograd.gradcheck(lambda a, w, b: gemm_multiply_leaky_relu(a, w, b, -1.5, slope), (x, weight, bias))
    assert torch.autograd.gradgradcheck(lambda a, w, b: gemm_multiply_leaky_relu(a, w, b, -1.5, slope),
                                        (x, weight, bias))


@pytest.mark.parametrize("slope", [0.1, -0.4])
def test_forward_mode_ad(device, slope):
    """Tangents on x, weight and bias, one at a time and together, against eager's forward mode in float64."""
    import torch.autograd.forward_ad as fwAD

    reference, new = make_pair(7, 5, -1.5, slope, device, torch.float64)
    primals = (torch.randn(4, 7, dtype=torch.float64, device=device), new.gemm.weight.detach(),
               new.gemm.bias.detach())
    tangents = [torch.randn_like(p) for p in primals]
    for which in ([0], [1], [2], [0, 1, 2]):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(p, t) if i in which else p for i, (p, t) in enumerate(zip(primals, tangents))]
            y = fwAD.unpack_dual(gemm_multiply_leaky_relu(*duals, -1.5, slope))
            y_ref = fwAD.unpack_dual(torch.nn.functional.leaky_relu(
                torch.nn.functional.linear(*duals) * -1.5, slope))
        torch.testing.assert_close(y.primal, y_ref.primal)
        torch.testing.assert_close(y.tangent, y_ref.tangent)
    x, weight, bias = primals
    _, y_tangent = torch.func.jvp(lambda a: gemm_multiply_leaky_relu(a, weight, bias, -1.5, slope), (x,),
                                  (tangents[0],))
    _, y_ref_tangent = torch.func.jvp(lambda a: reference(a), (x,), (tangents[0],))
    torch.testing.assert_close(y_tangent, y_ref_tangent)


@pytest.mark.parametrize("slope", [0.1, -0.4])
def test_op_called_directly_differentiates_and_asks_for_its_mask(device, slope):
    """The op's C++ Autograd kernel records its node (named as such) whatever the caller asked: called with
    return_mask=False and a negative slope, it asks the kernel for the mask the backward needs and returns the empty
    mask that was asked for. torch.func.grad goes through the same node."""
    reference, new = make_pair(7, 5, -1.5, slope, device, torch.float64)
    params, params_ref = [new.gemm.weight, new.gemm.bias], [reference.gemm.weight, reference.gemm.bias]
    x = torch.randn(4, 7, dtype=torch.float64, device=device, requires_grad=True)
    y, mask = torch.ops.kernels.gemm_multiply_leaky_relu(x, *params, -1.5, slope, False)
    assert mask.numel() == 0 and y.grad_fn.name() == "kernels::GemmMultiplyLeakyReLUBackward"
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *params], grad)
    x_ref = x.detach().requires_grad_(True)
    expected = torch.autograd.grad(reference(x_ref), [x_ref, *params_ref], grad)
    for ours, eager in zip(got, expected):
        torch.testing.assert_close(ours, eager)
    weight, bias = (p.detach() for p in params)
    grad_x = torch.func.grad(lambda a: (gemm_multiply_leaky_relu(a, weight, bias, -1.5, slope) * grad).sum())(x.detach())
    torch.testing.assert_close(grad_x, expected[0])


@pytest.mark.parametrize("op", ["leaky_relu", "identity", "gelu"])
def test_nodes_keep_an_operand_only_where_the_other_needs_its_gradient(device, op):
    """As eager's linear: x is kept only where the weight's gradient is wanted and the weight only where x's is, so a
    frozen layer's graph holds no activation; the gradients asked for are eager's, on every path."""
    from gemm_helpers import SPLIT_KERNELS
    from kernels.functional import gemm_gelu
    from kernels.gemm.gemm import forced_gemm_path
    calls = {"leaky_relu": (lambda *a: gemm_multiply_leaky_relu(*a, 2.0, -0.1),
                            lambda *a: torch.nn.functional.leaky_relu(torch.nn.functional.linear(*a) * 2.0, -0.1)),
             "identity": (lambda *a: gemm_multiply_leaky_relu(*a, 1.0, 1.0), torch.nn.functional.linear),
             "gelu": (gemm_gelu, lambda *a: torch.nn.functional.gelu(torch.nn.functional.linear(*a)))}
    ours, eager = calls[op]
    g = torch.Generator().manual_seed(0)
    x, weight, bias = (torch.randn(*shape, generator=g).to(device) for shape in ((2, 150, 136), (200, 136), (200,)))
    grad = torch.randn(2, 150, 200, generator=g).to(device)
    for path in ["cublas", *(SPLIT_KERNELS if device == "cuda" else [])]:
        for x_grad, weight_grad in ((True, False), (False, True), (True, True)):
            leaves = [x.clone().requires_grad_(x_grad), weight.clone().requires_grad_(weight_grad),
                      bias.clone().requires_grad_(True)]
            saved = []
            with forced_gemm_path(path), torch.autograd.graph.saved_tensors_hooks(
                    lambda t: saved.append(t.untyped_storage().data_ptr()) or t, lambda t: t):
                y = ours(*leaves)
            # Each at most once (saved-tensor hooks, offloading, see every save).
            assert saved.count(leaves[0].untyped_storage().data_ptr()) == weight_grad, (path, x_grad, weight_grad)
            assert saved.count(leaves[1].untyped_storage().data_ptr()) == x_grad, (path, x_grad, weight_grad)
            wanted = [t for t in leaves if t.requires_grad]
            with forced_gemm_path(path):
                got = torch.autograd.grad(y, wanted, grad)
            references = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
            expected = torch.autograd.grad(eager(*references), [t for t in references if t.requires_grad], grad)
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, atol=2e-3 * b.abs().max().item(), rtol=1e-4)
        # As eager: with the weight frozen, the input may be edited in place before the backward (nothing of it kept).
        source = x.clone().requires_grad_(True)
        hidden = source * 1.0
        with forced_gemm_path(path):
            y = ours(hidden, weight, bias)
            hidden.add_(1.0)
            (grad_source,) = torch.autograd.grad(y, (source,), grad)
        references = [source.detach().clone().requires_grad_(True), weight, bias]
        (expected,) = torch.autograd.grad(eager(references[0] * 1.0, weight, bias), (references[0],), grad)
        torch.testing.assert_close(grad_source, expected, atol=2e-3 * expected.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("slope", [0.0, 0.1, -0.4])
def test_output_edited_in_place_before_the_backward(device, slope):
    """A negative slope keeps the branch mask: an in-place op on y (a residual added in place) before the backward
    passes with eager's gradients. A slope >= 0 keeps y itself, as eager's ReLU keeps its output
    (kernels/gemm/NOTES.md): autograd's clear error, as there."""
    reference, new = make_pair(7, 5, 2.0, slope, device, torch.float64)
    x = torch.randn(4, 7, dtype=torch.float64, device=device)
    results = []
    for model in (new, reference):
        leaf = x.clone().requires_grad_(True)
        y = model(leaf)
        y.add_(1.0)
        if model is new and slope >= 0:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()
            return
        y.sum().backward()
        results.append([leaf.grad, model.gemm.weight.grad, model.gemm.bias.grad])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("batch", [(5,), (2, 3)])
def test_no_input_features_give_eagers_gradients(device, batch):
    """K = 0: y is the bias's broadcast, and the bias's gradient sums over every row, as eager's."""
    reference, new = make_pair(0, 6, 2.0, 0.1, device, torch.float64)
    x = torch.randn(*batch, 0, dtype=torch.float64, device=device)
    results = []
    for model in (new, reference):
        leaf = x.clone().requires_grad_(True)
        model(leaf).sum().backward()
        results.append([leaf.grad, model.gemm.weight.grad, model.gemm.bias.grad])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected)


def test_linear_of_a_vector_weight_and_of_meta_tensors(device):
    """kernels.functional.linear: a 1-D weight is F.linear's vector product; a meta weight or bias with real x is the
    op's device error (F.linear can return an uninitialized tensor there)."""
    from kernels.functional import linear
    x, w = torch.randn(4, 8, device=device), torch.randn(8, device=device)
    torch.testing.assert_close(linear(x, w), torch.nn.functional.linear(x, w))
    for weight, bias in ((torch.randn(6, 8, device="meta"), torch.randn(6, device=device)),
                         (torch.randn(6, 8, device=device), torch.randn(6, device="meta")),
                         (torch.randn(6, 8, device="meta"), None)):
        with pytest.raises(RuntimeError, match="device"):
            linear(x, weight, bias)


def test_opcheck(device):
    x = torch.randn(6, 20, device=device)
    weight, bias = torch.randn(12, 20, device=device), torch.randn(12, device=device)
    op = torch.ops.kernels.gemm_multiply_leaky_relu.default
    for requires_grad in (False, True):
        args = [t.clone().requires_grad_(requires_grad) for t in (x, weight, bias)]
        torch.library.opcheck(op, (*args, 2.0, 0.1, False))
        torch.library.opcheck(op, (*args, -2.0, -0.1, True))
    torch.library.opcheck(op, (x, weight, None, 2.0, 0.1, False))


def test_backward_op_opcheck_and_bad_inputs(device):
    x, weight = torch.randn(6, 20, device=device), torch.randn(12, 20, device=device)
    grad_y = torch.randn(6, 12, device=device)
    saved = torch.randn(6, 12, device=device)
    op = torch.ops.kernels.gemm_multiply_leaky_relu_backward.default
    for needs in ((True, True, True), (True, False, False), (False, True, True)):
        torch.library.opcheck(op, (grad_y, x, weight, saved, 2.0, 0.1, *needs))
    grad_x, grad_weight, grad_bias = op(grad_y, x, weight, saved, 2.0, 0.1, False, True, False)
    assert grad_x.numel() == 0 and grad_weight.shape == weight.shape and grad_bias.numel() == 0
    with pytest.raises(RuntimeError, match="grad_y must have the output's shape"):
        op(grad_y[:, :11], x, weight, saved, 2.0, 0.1, True, True, True)
    with pytest.raises(RuntimeError, match="grad_y"):
        op(grad_y.double(), x, weight, saved, 2.0, 0.1, True, True, True)


@pytest.mark.slow
def test_torch_compile_fullgraph_forward_and_backward(device):
    torch._dynamo.reset()
    reference, new = make_pair(64, 32, 2.0, -0.2, device)
    compiled = torch.compile(new, fullgraph=True)
    x = torch.randn(16, 64, device=device)
    grad = torch.randn(16, 32, device=device)
    x_new, x_ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y = compiled(x_new)
    y.backward(grad)
    y_ref = reference(x_ref)
    y_ref.backward(grad)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x_new.grad, x_ref.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(new.gemm.weight.grad, reference.gemm.weight.grad, atol=1e-4, rtol=1e-4)


def test_bad_inputs_are_clear_errors(device):
    _, new = make_pair(16, 8, 2.0, 0.1, device)
    with pytest.raises(RuntimeError, match=r"x's last dimension is 15 but in_features is 16"):
        new(torch.randn(4, 15, device=device))
    with pytest.raises(RuntimeError, match="same dtype"):
        new(torch.randn(4, 16, device=device, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="must be a float32, float64, float16 or bfloat16 tensor"):
        new(torch.ones(4, 16, device=device, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="at least 1 dimension"):
        new(torch.tensor(1.0, device=device))
    with pytest.raises(RuntimeError, match="weight must be 2-D"):
        gemm_multiply_leaky_relu(torch.randn(4, 16, device=device), torch.randn(8, 16, 1, device=device))
    with pytest.raises(RuntimeError, match=r"bias must have shape \[out_features\]"):
        gemm_multiply_leaky_relu(torch.randn(4, 16, device=device), torch.randn(8, 16, device=device),
                              torch.randn(9, device=device))


@requires_cuda
def test_tensors_on_different_devices_are_a_clear_error():
    _, new = make_pair(16, 8, 2.0, 0.1, "cuda")
    with pytest.raises(RuntimeError, match="same device"):
        new(torch.randn(4, 16))
