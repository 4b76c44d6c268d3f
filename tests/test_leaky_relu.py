"""LeakyReLU: the op and ModelNew against the reference model (F.leaky_relu), bit for bit, on CPU and CUDA."""

import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import FLOAT_DTYPES, assert_bitwise_equal, poison_allocator, requires_cuda
from model_new import LeakyReLUModelNew
from reference import LeakyReLUModel

SLOPES = [0.01, 0.0, -0.5, 2.5]

# The two ways in: ModelNew (through the Python function leaky_relu()) and the op called directly. Both reach the op's
# C++ Autograd kernel; each must give eager's gradients.
ENTRY_POINTS = {
    "ModelNew": lambda slope: LeakyReLUModelNew(slope),
    "op": lambda slope: lambda x: torch.ops.kernels.leaky_relu(x, slope),
}


def make_views(device, dtype):
    """Contiguous, empty, size-1, odd, 3-D+, non-contiguous, transposed and misaligned (offset) inputs."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    base = randn(64, 70)
    return {
        "contiguous": randn(32, 96),
        "empty": randn(0, 5),
        "size1": randn(1),
        "odd": randn(100_003),
        "4d": randn(2, 3, 5, 7),
        "strided": base[:, ::3],
        "transposed": base.t(),
        "offset1d": randn(4099)[1:],
        "offset2d": randn(33 * 65).view(33, 65)[1:, 3:],
        "expanded": randn(1, 9).expand(6, 9),
    }


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("slope", SLOPES)
def test_forward_matches_reference(device, dtype, slope):
    for name, x in make_views(device, dtype).items():
        x_before = x.clone()
        poison_allocator(x.shape, dtype, device)
        y = LeakyReLUModelNew(slope)(x)
        reference = LeakyReLUModel(slope)(x)
        assert_bitwise_equal(y, reference)
        assert y.stride() == reference.stride() or y.numel() <= 1, name
        assert torch.equal(x, x_before), f"{name}: the input was modified"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("slope", SLOPES)
def test_special_values(device, dtype, slope):
    special = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-30, -1e-30, 1e-45, -1e-45, 3.0, -3.0]
    # Repeated to cover both the vectorized body and the scalar tail of each thread's tile.
    x = torch.tensor(special * 101, dtype=dtype, device=device)
    for view in (x, x[1:]):
        assert_bitwise_equal(LeakyReLUModelNew(slope)(view), F.leaky_relu(view, slope))


def expected_cpu_loops_isa():
    """The build of the CPU loops that CPU calls should take here, or None where this cannot tell: "avx2" on an x86-64
    CPU with AVX2, FMA and F16C, where ATen runs its vectorized kernels (not held to its generic ones by
    ATEN_CPU_CAPABILITY=default) and g++ built the library (the AVX2 build is GCC's target pragma), else "generic"."""
    if platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return "generic"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = set(f.read().split())
        compiler = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    return "avx2" if {"avx2", "fma", "f16c"} <= flags and "clang" not in compiler.lower() else "generic"


def check_cpu_loops():
    """Every CPU loop (forward, the multiply epilogue with and without its mask, backward from the input or from a
    mask, with and without a multiplier) against eager or a reference computed the loops' way: in float (double for
    double) with one rounding at the end. Lengths that are not a whole number of vectors, both signs, and the
    special values. First, that the loops' build is the one this CPU and ATen's setting call for (both builds give
    the same bits, so only the choice tells them apart)."""
    expected = expected_cpu_loops_isa()
    if expected is not None:
        assert torch.ops.kernels._leaky_relu_cpu_loops_isa() == expected
    g = torch.Generator().manual_seed(1)
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-30, -1e-30, 3.0, -3.0])
    for dtype in FLOAT_DTYPES:
        opmath = torch.float64 if dtype == torch.float64 else torch.float32
        for n in (1, 15, 17, 1000, 40_000):
            x = torch.cat([special, torch.randn(n, generator=g)]).to(dtype)
            grad = torch.randn(x.numel(), generator=g).to(dtype)
            for slope in (0.01, -0.5, 2.5):
                assert_bitwise_equal(torch.ops.kernels.leaky_relu(x, slope), F.leaky_relu(x, slope))
                assert_bitwise_equal(torch.ops.kernels.leaky_relu_backward(grad, x, slope, 1.0),
                                     torch.ops.aten.leaky_relu_backward(grad, x, slope, False))
                for multiplier in (1.0, -1.5):
                    product = x.to(opmath) * multiplier
                    y = x.clone()
                    mask = torch.ops.kernels.multiply_leaky_relu_(y, multiplier, slope, True)
                    assert_bitwise_equal(y, F.leaky_relu(product, slope).to(dtype))
                    assert torch.equal(mask, product > 0)
                    y = x.clone()
                    torch.ops.kernels.multiply_leaky_relu_(y, multiplier, slope, False)
                    assert_bitwise_equal(y, F.leaky_relu(product, slope).to(dtype))
                    g32 = grad.to(opmath)
                    expected = (torch.where(mask, g32, g32 * slope) * multiplier).to(dtype)
                    assert_bitwise_equal(torch.ops.kernels.leaky_relu_backward(grad, mask, slope, multiplier), expected)


@pytest.mark.slow
def test_cpu_loops():
    check_cpu_loops()


@pytest.mark.slow
def test_cpu_loops_generic_build():
    """The CPU loops have a generic build beside the AVX2 one, taken where the CPU lacks AVX2 or ATen's own kernels
    are held to their generic build (ATEN_CPU_CAPABILITY=default, as here); it must give the same results."""
    code = "import kernels.functional, test_leaky_relu; test_leaky_relu.check_cpu_loops()"
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default",
           "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_inplace(device, dtype):
    for name, x in make_views(device, dtype).items():
        if name == "expanded":
            continue
        reference = F.leaky_relu(x, 0.2)
        out = LeakyReLUModelNew(0.2, inplace=True)(x)
        assert out is x, name
        assert_bitwise_equal(x, reference)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("multiplier,slope", [(2.0, 0.1), (-1.5, -0.3), (1.0, 0.01), (0.0, 0.2)])
def test_multiply_leaky_relu_in_place_and_its_mask(device, dtype, multiplier, slope):
    """The GEMM family's epilogue: x = leaky_relu(x * multiplier) in place, mask = x * multiplier > 0. The
    arithmetic is in float (double for double) with one rounding at the end, so it is bitwise eager's two ops in
    float32 and float64, and within eager's double rounding in float16 and bfloat16."""
    for name, x in make_views(device, dtype).items():
        if name == "expanded":
            continue
        product = x * multiplier
        mask = torch.ops.kernels.multiply_leaky_relu_(x, multiplier, slope, True)
        if dtype in (torch.float32, torch.float64):
            assert_bitwise_equal(x, F.leaky_relu(product, slope))
        else:
            torch.testing.assert_close(x, F.leaky_relu(product, slope))
        assert mask.dtype == torch.bool and torch.equal(mask, product > 0), name
        assert torch.ops.kernels.multiply_leaky_relu_(x, multiplier, slope, False).numel() == 0


def test_inplace_on_overlapping_memory_is_an_error(device):
    x = torch.randn(1, 9, device=device).expand(6, 9)
    with pytest.raises(RuntimeError, match="share memory"):
        LeakyReLUModelNew(0.2, inplace=True)(x)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("slope", SLOPES)
def test_gradient_matches_reference(device, dtype, slope, entry):
    for name, x in make_views(device, dtype).items():
        x = x.detach().clone().requires_grad_(True)
        x_ref = x.detach().clone().requires_grad_(True)
        grad = torch.randn_like(x)
        (y,) = torch.autograd.grad(ENTRY_POINTS[entry](slope)(x), x, grad)
        (y_ref,) = torch.autograd.grad(LeakyReLUModel(slope)(x_ref), x_ref, grad)
        assert_bitwise_equal(y, y_ref)


def test_gradient_with_transposed_grad(device):
    """grad_output and the saved input in different memory layouts."""
    x = torch.randn(40, 30, device=device).t().requires_grad_(True)
    grad = torch.randn(30, 40, device=device)
    (g,) = torch.autograd.grad(LeakyReLUModelNew(-0.3)(x), x, grad)
    (g_ref,) = torch.autograd.grad(F.leaky_relu(x, -0.3), x, grad)
    assert_bitwise_equal(g, g_ref)


# The in-place ways in, each against F.leaky_relu(inplace=True): ModelNew, the op, and the GEMM epilogue's op with
# a multiplier of 1 (the same LeakyReLU).
def _returning_x(write):
    """fn(x): write(x) (an in-place op), then x, as F.leaky_relu(inplace=True) returns it."""
    def fn(x):
        write(x)
        return x
    return fn


INPLACE_ENTRY_POINTS = {
    "ModelNew": lambda slope: LeakyReLUModelNew(slope, inplace=True),
    "op": lambda slope: _returning_x(lambda x: torch.ops.kernels.leaky_relu_(x, slope)),
    "multiply_op": lambda slope: _returning_x(lambda x: torch.ops.kernels.multiply_leaky_relu_(x, 1.0, slope, False)),
}


@pytest.mark.parametrize("entry", INPLACE_ENTRY_POINTS)
def test_inplace_gradient(device, entry):
    """As ATen's in-place ops: the gradient through x's new history (a view's base's too), x's version bumped with or
    without grad, and the same errors: a leaf that requires grad, and a negative slope (which only the out-of-place
    op can differentiate, its output no longer telling the input's sign; the GEMM's op keeps the mask instead)."""
    ours, eager = INPLACE_ENTRY_POINTS[entry](0.3), lambda t: F.leaky_relu(t, 0.3, inplace=True)
    leaf = torch.randn(50, 7, device=device, requires_grad=True)
    grad = torch.randn(50, 7, device=device)
    (g,) = torch.autograd.grad(ours(leaf * 1.5), leaf, grad)
    (g_ref,) = torch.autograd.grad(eager(leaf * 1.5), leaf, grad)
    assert_bitwise_equal(g, g_ref)

    gradients = []
    for fn in (ours, eager):  # in place on a view: through the base (CopySlices) and through the view itself
        base = leaf * 1.5
        view = fn(base[:, 2:5])
        assert base.grad_fn.name().endswith("CopySlices")
        gradients.append(torch.autograd.grad(base, leaf, grad, retain_graph=True)[0])
        gradients.append(torch.autograd.grad(view, leaf, grad[:, 2:5])[0])
    for got, expected in zip(gradients[:2], gradients[2:]):
        assert_bitwise_equal(got, expected)

    double = []  # double backward: the gradient depends on the saved output only through zeros, as eager's
    for fn in (ours, eager):
        (g,) = torch.autograd.grad(fn(leaf * 1.5), leaf, grad, create_graph=True)
        assert g.requires_grad
        double.append(torch.autograd.grad(g.sum(), leaf, allow_unused=True)[0])
    assert_bitwise_equal(*double)

    packed = []  # saved-tensor hooks get x itself, as eager's in-place ops pass their output
    x = leaf * 1.5
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        ours(x)
    assert len(packed) == 1 and packed[0] is x

    for grad_mode in (True, False):
        x = leaf.detach() * 1.0
        with torch.set_grad_enabled(grad_mode):
            version = x._version
            ours(x)
        assert x._version > version

    with pytest.raises(RuntimeError, match="leaf Variable"):
        ours(leaf)
    with pytest.raises(RuntimeError, match="view of a leaf Variable"):
        ours(leaf[:, :3])
    x = leaf * 1.5
    x_before = x.detach().clone()
    if entry == "multiply_op":
        negative = torch.ops.kernels.multiply_leaky_relu_(x, -2.0, -0.3, False)
        assert negative.numel() == 0
        (g,) = torch.autograd.grad(x, leaf, grad)
        (g_ref,) = torch.autograd.grad(F.leaky_relu(leaf * 1.5 * -2.0, -0.3), leaf, grad)
        assert_bitwise_equal(g, g_ref)
    else:
        with pytest.raises(ValueError, match="negative slope"):
            INPLACE_ENTRY_POINTS[entry](-0.3)(x)
        assert torch.equal(x.detach(), x_before)  # raised before writing x


@pytest.mark.parametrize("entry", INPLACE_ENTRY_POINTS)
def test_inplace_write_is_seen_by_a_backward_that_saved_x(device, entry):
    """exp saves its output; writing that output in place, with or without grad, makes its backward raise, as eager
    does (without the version bump, the backward silently used the overwritten values). And the op's own saved
    output: a later write through the base of the view it wrote makes its backward raise too."""
    for grad_mode in (True, False):
        leaf = torch.randn(6, 5, device=device, requires_grad=True)
        saved_by_exp = leaf.exp()
        with torch.set_grad_enabled(grad_mode):
            INPLACE_ENTRY_POINTS[entry](0.2)(saved_by_exp)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved_by_exp.sum().backward()
    leaf = torch.randn(6, 5, device=device, requires_grad=True)
    base = leaf * 1.5
    view = INPLACE_ENTRY_POINTS[entry](0.2)(base[1:])
    base.detach().neg_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        view.sum().backward()


@pytest.mark.parametrize("entry", INPLACE_ENTRY_POINTS)
def test_inplace_forward_mode_ad(device, entry):
    import torch.autograd.forward_ad as fwAD

    x, tangent = torch.randn(30, 7, device=device), torch.randn(30, 7, device=device)
    results = []
    for fn in (INPLACE_ENTRY_POINTS[entry](0.3), lambda t: F.leaky_relu(t, 0.3, inplace=True)):
        with fwAD.dual_level():
            dual = fwAD.make_dual(x.clone(), tangent.clone())
            fn(dual[2:])  # a view: its tangent is a view of the base's, written in place
            results.append(fwAD.unpack_dual(dual))
    assert_bitwise_equal(results[0].primal, results[1].primal)
    assert_bitwise_equal(results[0].tangent, results[1].tangent)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_graph_recorded_exactly_when_eager_records_one(device, entry):
    """The op skips the autograd node when no gradient can flow; it must record one whenever eager does."""
    for grad_mode in (True, False):
        for requires_grad in (True, False):
            x = torch.randn(6, 5, device=device, requires_grad=requires_grad)
            with torch.set_grad_enabled(grad_mode):
                y, y_ref = ENTRY_POINTS[entry](0.2)(x), F.leaky_relu(x, 0.2)
            assert y.requires_grad == y_ref.requires_grad
            assert (y.grad_fn is None) == (y_ref.grad_fn is None)
            assert_bitwise_equal(y.detach(), y_ref.detach())


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("slope", [0.01, -0.7])
def test_forward_mode_ad(device, slope, entry):
    import torch.autograd.forward_ad as fwAD

    x, tangent = torch.randn(30, 7, device=device), torch.randn(30, 7, device=device)
    for requires_grad in (False, True):
        primal = x.clone().requires_grad_(requires_grad)
        with fwAD.dual_level():
            y = fwAD.unpack_dual(ENTRY_POINTS[entry](slope)(fwAD.make_dual(primal, tangent)))
            y_ref = fwAD.unpack_dual(F.leaky_relu(fwAD.make_dual(primal, tangent), slope))
        assert_bitwise_equal(y.primal.detach(), y_ref.primal.detach())
        assert_bitwise_equal(y.tangent, y_ref.tangent)
    y, y_tangent = torch.func.jvp(ENTRY_POINTS[entry](slope), (x,), (tangent,))
    y_ref, y_ref_tangent = torch.func.jvp(lambda t: F.leaky_relu(t, slope), (x,), (tangent,))
    assert_bitwise_equal(y, y_ref)
    assert_bitwise_equal(y_tangent, y_ref_tangent)


@pytest.mark.parametrize("saved_kind", ["input", "mask"])
def test_backward_op_paths(device, saved_kind):
    """leaky_relu_backward goes straight to its kernel where no graph is recorded (no grad_fn), records one where
    grad_output requires grad (a double backward), and carries grad_output's forward-mode tangent; each equal to
    eager's leaky_relu_backward bit for bit."""
    import torch.autograd.forward_ad as fwAD

    x, grad, tangent = (torch.randn(30, 7, device=device) for _ in range(3))
    saved = x if saved_kind == "input" else x > 0
    expected = torch.ops.aten.leaky_relu_backward(grad, x, -0.3, False) * 2.0
    fast = torch.ops.kernels.leaky_relu_backward(grad, saved, -0.3, 2.0)
    assert fast.grad_fn is None
    assert_bitwise_equal(fast, expected)
    grad_leaf = grad.clone().requires_grad_(True)
    graphed = torch.ops.kernels.leaky_relu_backward(grad_leaf, saved, -0.3, 2.0)
    assert graphed.grad_fn is not None
    assert_bitwise_equal(graphed.detach(), expected)
    (second,) = torch.autograd.grad(graphed, grad_leaf, tangent)
    assert_bitwise_equal(second, torch.ops.aten.leaky_relu_backward(tangent, x, -0.3, False) * 2.0)
    with fwAD.dual_level():
        dual = fwAD.unpack_dual(torch.ops.kernels.leaky_relu_backward(fwAD.make_dual(grad, tangent), saved, -0.3, 2.0))
    assert_bitwise_equal(dual.primal, expected)
    assert_bitwise_equal(dual.tangent, torch.ops.aten.leaky_relu_backward(tangent, x, -0.3, False) * 2.0)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_torch_func_grad_and_vjp(device, entry):
    """torch.func's reverse-mode transforms go through the C++ node as autograd does: eager's gradients, second
    order too."""
    x, cotangent = torch.randn(30, 7, device=device), torch.randn(30, 7, device=device)
    ours, eager = ENTRY_POINTS[entry](-0.3), lambda t: F.leaky_relu(t, -0.3)
    assert_bitwise_equal(torch.func.grad(lambda t: (ours(t) * cotangent).sum())(x),
                         torch.func.grad(lambda t: (eager(t) * cotangent).sum())(x))
    second = torch.func.grad(lambda t: (torch.func.grad(lambda u: (ours(u) * u).sum())(t) * cotangent).sum())(x)
    second_ref = torch.func.grad(lambda t: (torch.func.grad(lambda u: (eager(u) * u).sum())(t) * cotangent).sum())(x)
    assert_bitwise_equal(second, second_ref)
    _, vjp = torch.func.vjp(ours, x)
    _, vjp_ref = torch.func.vjp(eager, x)
    assert_bitwise_equal(vjp(cotangent)[0], vjp_ref(cotangent)[0])


def test_graph_node_keeps_autograd_rules(device):
    """The C++ node behaves as eager's: a named grad_fn, an error where x was modified in place after the forward,
    saved-tensor hooks applied, the saved input freed after backward (a second backward is an error), third-order
    gradients, and a long chain of nodes freed without recursion."""
    x = torch.randn(8, 9, device=device, requires_grad=True)
    y = torch.ops.kernels.leaky_relu(x, 0.2)
    assert y.grad_fn.name() == "kernels::LeakyReLUBackward"
    z = torch.ops.kernels.leaky_relu_backward(y, x, 0.2, 1.0)
    assert z.grad_fn.name() == "kernels::LeakyReLUBackwardBackward"

    leaf = x.detach().clone().requires_grad_(True)
    base = leaf * 1.0
    y = torch.ops.kernels.leaky_relu(base, 0.2)
    base.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()

    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = torch.ops.kernels.leaky_relu(x, 0.2)
    assert len(packed) == 1 and torch.equal(packed[0], x)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()

    cotangent = torch.randn_like(x)
    orders, orders_ref = [], []
    for fn, out in ((lambda t: torch.ops.kernels.leaky_relu(t, -0.4), orders), (lambda t: F.leaky_relu(t, -0.4),
                                                                                 orders_ref)):
        leaf = x.detach().clone().requires_grad_(True)
        value = (fn(leaf) * leaf * leaf).sum()  # third derivative 6 f'(x): through every order of node
        for _ in range(3):
            (value,) = torch.autograd.grad(value, leaf, create_graph=True)
            out.append(value.detach())
            value = (value * cotangent).sum()
    for got, expected in zip(orders, orders_ref):
        assert_bitwise_equal(got, expected)

    chain = torch.randn(4, device=device, requires_grad=True)
    for _ in range(100_000):
        chain = torch.ops.kernels.leaky_relu(chain, 0.5)
    del chain  # 100,000 nodes: freed one by one, not by recursion (which would overflow the stack)


def test_backward_op_records_a_graph_where_only_saved_requires_grad(device):
    """As eager's leaky_relu_backward: the result requires grad if saved does, and saved's gradient is zero."""
    grad, saved = torch.randn(5, 6, device=device), torch.randn(5, 6, device=device, requires_grad=True)
    ours = torch.ops.kernels.leaky_relu_backward(grad, saved, 0.1, 1.0)
    eager = torch.ops.aten.leaky_relu_backward(grad, saved, 0.1, False)
    assert ours.requires_grad == eager.requires_grad
    (g,) = torch.autograd.grad(ours.sum(), saved, allow_unused=True, materialize_grads=True)
    (g_ref,) = torch.autograd.grad(eager.sum(), saved, allow_unused=True, materialize_grads=True)
    assert_bitwise_equal(g, g_ref)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("slope", [0.01, -0.7, 0.0])
def test_gradcheck_float64(device, slope, entry):
    # Away from 0, where LeakyReLU has its kink and finite differences do not apply.
    x = torch.randn(17, 9, dtype=torch.float64, device=device)
    x = (x + 0.1 * x.sign()).requires_grad_(True)
    assert torch.autograd.gradcheck(ENTRY_POINTS[entry](slope), (x,))
    assert torch.autograd.gradgradcheck(ENTRY_POINTS[entry](slope), (x,))


def test_opcheck(device):
    x = torch.randn(7, 33, device=device)
    for requires_grad in (False, True):
        torch.library.opcheck(torch.ops.kernels.leaky_relu.default, (x.clone().requires_grad_(requires_grad), 0.1))
        torch.library.opcheck(torch.ops.kernels.leaky_relu_backward.default,
                              (torch.randn_like(x).requires_grad_(requires_grad), x, 0.1, 1.0))
        torch.library.opcheck(torch.ops.kernels.leaky_relu_backward.default,
                              (torch.randn_like(x).requires_grad_(requires_grad), x > 0, -0.1, 2.0))
    torch.library.opcheck(torch.ops.kernels.leaky_relu_.default, (x.clone(), 0.1))
    torch.library.opcheck(torch.ops.kernels.multiply_leaky_relu_.default, (x.clone(), -2.0, 0.1, True))
    torch.library.opcheck(torch.ops.kernels.multiply_leaky_relu_.default, (x.clone(), 3.0, -0.1, False))
    torch.library.opcheck(torch.ops.kernels.leaky_relu_backward.default, (torch.randn_like(x), x, 0.1, 1.0))
    torch.library.opcheck(torch.ops.kernels.leaky_relu_backward.default, (torch.randn_like(x), x > 0, -0.2, 2.0))


@pytest.mark.slow
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    model = torch.compile(LeakyReLUModelNew(0.05), fullgraph=True)
    x = torch.randn(64, 129, device=device, requires_grad=True)
    grad = torch.randn(64, 129, device=device)
    y = model(x)
    (g,) = torch.autograd.grad(y, x, grad)
    x_ref = x.detach().requires_grad_(True)
    y_ref = F.leaky_relu(x_ref, 0.05)
    (g_ref,) = torch.autograd.grad(y_ref, x_ref, grad)
    assert_bitwise_equal(y, y_ref)
    assert_bitwise_equal(g, g_ref)

    inplace = torch.compile(LeakyReLUModelNew(0.05, inplace=True), fullgraph=True)
    x2 = x.detach().clone()
    with torch.no_grad():
        inplace(x2)
    assert_bitwise_equal(x2, y_ref.detach())

    inplace_after_mul = torch.compile(lambda t: LeakyReLUModelNew(0.05, inplace=True)(t * 2.0), fullgraph=True)
    y = inplace_after_mul(x)
    (g,) = torch.autograd.grad(y, x, grad)
    (g_ref,) = torch.autograd.grad(F.leaky_relu(x * 2.0, 0.05, inplace=True), x, grad)
    assert_bitwise_equal(y.detach(), F.leaky_relu(x.detach() * 2.0, 0.05))
    assert_bitwise_equal(g, g_ref)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint8])
def test_bad_dtype_is_a_clear_error(device, dtype):
    x = torch.ones(4, 4, device=device).to(dtype)
    with pytest.raises(RuntimeError, match="must be a float32, float64, float16 or bfloat16 tensor"):
        LeakyReLUModelNew()(x)
    with pytest.raises(RuntimeError, match="must be a float32, float64, float16 or bfloat16 tensor"):
        LeakyReLUModelNew(inplace=True)(x)


@requires_cuda
def test_runs_on_the_current_stream():
    base = torch.randn(1 << 20, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # the input below is written only after this delay, on `stream`
        x = base * 3.0
        y = LeakyReLUModelNew(0.1)(x)
        expected = F.leaky_relu(x, 0.1)
    stream.synchronize()
    assert_bitwise_equal(y, expected)
