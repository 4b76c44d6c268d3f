"""The backward on the split paths: each product as accurate as eager's, below the automatic range, the graph of the
backward; split-K for grad_W's products (small outputs over long reductions: as accurate as eager, the same bits
every run, forced on tails); and a training loop that tracks eager's loss curve."""

import pytest
import torch
import torch.nn.functional as F

from conftest import cuda_kernels_launched, poison_allocator
from kernels.precision import SPLIT_FP16_ERROR_FLOOR, allclose, relative_error
from kernels.functional import gemm_multiply_leaky_relu
from kernels.gemm.gemm import STREAM_K, forced_gemm_path, forced_k_slices, gemm_path
from model_new import GemmMultiplyLeakyReLUModelNew
from reference import GemmMultiplyLeakyReLUModel
from gemm_helpers import (SPLIT_KERNELS, automatic_split_path, make_pair, over_split_paths, slow_problem_shape,
                          special_inputs)


def float64_gradients(x, weight, grad_y, positive, multiplier, slope):
    """The layer's gradients in float64 on the same inputs, through the branch mask `positive` of the forward being
    judged: a pre-activation within rounding of zero takes either branch, and each flip changes that gradient entry
    by the slope's factor, which would hide the backward products' own error (kernels/gemm/NOTES.md)."""
    grad_pre = (grad_y.double() * torch.where(positive, 1.0, slope).double() * multiplier).reshape(-1, weight.shape[0])
    x2 = x.reshape(-1, x.shape[-1]).double()
    return (grad_pre @ weight.double()).reshape(x.shape), grad_pre.t() @ x2, grad_pre.sum(0)


def gradients_and_errors(forward, x, weight, bias, grad_y, positive, multiplier, slope):
    """forward's gradients of x, weight and bias, and each one's error against float64 through `positive`."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weight, bias)]
    forward(*leaves).backward(grad_y)
    grads = [leaf.grad for leaf in leaves]
    references = float64_gradients(x, weight, grad_y, positive, multiplier, slope)
    return grads, [relative_error(g, r) for g, r in zip(grads, references)]


def check_split_backward(m, k, n, multiplier, slope, path, forced=False, kind="randn"):
    _, new = make_pair(k, n, multiplier, slope, "cuda")
    weight, bias = new.gemm.weight.detach(), new.gemm.bias.detach()
    x = special_inputs(kind, m, k, seed=4).cuda()
    grad_y = torch.randn(m, n, device="cuda")
    if not forced and path == automatic_split_path():
        assert gemm_path(x, weight) == path
    with forced_gemm_path(path), torch.no_grad():
        assert gemm_path(x, weight) == path
        _, ours_positive = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, multiplier, slope, True)
    with forced_gemm_path(path):
        ours, ours_errors = gradients_and_errors(
            lambda a, w, b: gemm_multiply_leaky_relu(a, w, b, multiplier, slope), x, weight, bias, grad_y,
            ours_positive, multiplier, slope)
    eager_positive = F.linear(x, weight, bias) * multiplier > 0
    eager, eager_errors = gradients_and_errors(
        lambda a, w, b: F.leaky_relu(F.linear(a, w, b) * multiplier, slope), x, weight, bias, grad_y,
        eager_positive, multiplier, slope)
    for name, got, expected, error, eager_error in zip(("x", "weight", "bias"), ours, eager, ours_errors,
                                                       eager_errors):
        # Against eager at allclose(1e-4) at the gradient's own scale (entries where the two forwards' masks differ
        # differ by the slope's factor, so they are left out), and as accurate as eager's against float64.
        same_branch = ours_positive == eager_positive
        keep = same_branch.all(-1) if name == "x" else same_branch.all(0)  # rows of x; features of weight, bias
        got, expected = got[keep], expected[keep]
        scale = expected.abs().max().clamp_min(1e-30)
        assert allclose(got / scale, expected / scale), (name, ((got - expected) / scale).abs().max())
        # grad_b too: its compensated column sums must beat eager's sum (they once lost to it, by adding 32 warps'
        # partial sums plainly).
        limit = max(eager_error, SPLIT_FP16_ERROR_FLOOR) if forced else eager_error
        assert error <= limit, (name, error, eager_error)
    return ours_errors, eager_errors


BACKWARD_SHAPES = {  # name: (m, k, n); each backward product's reduction (n for grad_x, m for grad_W) >= 1024
    "problem": (1024, 8192, 8192),
    "tails": (1156, 1048, 1036),  # multiples of 4 (the kernel's rows), not of the tiles or chunks
}


@over_split_paths
@pytest.mark.parametrize("multiplier,slope", [(2.0, 0.1), (-1.5, -0.2)])
@pytest.mark.parametrize("shape", slow_problem_shape(BACKWARD_SHAPES))
def test_split_backward_as_accurate_as_eager(shape, multiplier, slope, path):
    check_split_backward(*BACKWARD_SHAPES[shape], multiplier, slope, path)


FORCED_BACKWARD_SHAPES = {"m1_k8_n7": (1, 8, 7), "odd": (129, 392, 136), "rows_of_4": (132, 264, 72)}


@over_split_paths
@pytest.mark.parametrize("shape", FORCED_BACKWARD_SHAPES)
def test_split_backward_forced_below_its_range(shape, path):
    """Forced, each backward product takes the split path where the kernel takes its shape and cuBLAS elsewhere."""
    check_split_backward(*FORCED_BACKWARD_SHAPES[shape], -1.5, -0.2, path, forced=True)


@over_split_paths
def test_split_backward_is_taken_and_graph_of_the_backward_still_works(path):
    """The backward op runs where no graph of the backward is wanted; with create_graph the composite runs, so that
    double backward works."""
    _, new = make_pair(1024, 1024, 2.0, 0.1, "cuda")
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    with forced_gemm_path(path):
        y = new(x)
        grad_x, = torch.autograd.grad(y, x, torch.randn_like(y), create_graph=True)
        grad_x.square().sum().backward()  # through the composite backward
    assert new.gemm.weight.grad is not None and torch.isfinite(new.gemm.weight.grad).all()


requires_hopper_split = pytest.mark.skipif("split_fp16" not in SPLIT_KERNELS, reason="needs the Hopper split kernel")


def weight_gradient(grad_pre, x, n):
    """grad_W = grad_pre^T x (n x k) through the backward op on the forced split_fp16 path (the identity epilogue:
    grad_pre is grad_y)."""
    weight, empty = torch.empty(n, x.shape[1], device="cuda"), torch.empty(0, device="cuda")
    with forced_gemm_path("split_fp16"):
        return torch.ops.kernels.gemm_multiply_leaky_relu_backward(grad_pre, x, weight, empty, 1.0, 1.0, False, True,
                                                                   False)[1]


SPLIT_K_SHAPES = {  # name: (out_features n, in_features k, batch rows m): grad_W is n x k, its reduction m
    "1024x1024_m4096": (1024, 1024, 4096),
    "1024x1024_m8192": (1024, 1024, 8192),
    "768x3072_m12608": (768, 3072, 12608),
    "3072x768_m12608": (3072, 768, 12608),  # grad_pre^T has 3072 rows: x's split made ahead (the presplit kernel)
    "768x768_m12608": (768, 768, 12608),
}


@requires_hopper_split
@pytest.mark.parametrize("kind", ["randn", "rand", "non_finite"])
@pytest.mark.parametrize("shape", SPLIT_K_SHAPES)
def test_split_k_weight_gradient_as_accurate_as_eager_and_the_same_bits_every_run(shape, kind):
    """grad_W of layers whose weight has too few 128 x 128 tiles for the GPU, over batches of 4096-12608 rows: the
    split path splits K (the batch) over several CTAs and adds their partials in a fixed order. NaN and Inf where
    eager's are (non-finite values in rows of both operands, in the first and the last slices), the same bits on a
    second run, and against float64 as accurate as the product over all of K (within 10%) and as eager's on randn
    inputs; on rand inputs (all positive), whose sums eager rounds to under the split's floor, within
    max(eager's, the floor), as the unsplit product is."""
    n, k, m = SPLIT_K_SHAPES[shape]
    assert torch.ops.kernels._gemm_k_slices(n, k, m) != 1  # split_gemm_k_slices splits K at these shapes
    g = torch.Generator(device="cuda").manual_seed(5)
    draw = torch.rand if kind == "rand" else torch.randn
    grad_pre, x = draw(m, n, device="cuda", generator=g), draw(m, k, device="cuda", generator=g)
    if kind == "non_finite":
        x[9, 17], x[9, 33] = float("inf"), float("-inf")  # a row of x (a token) in the first slice...
        x[m - 2, 40] = float("nan")  # ...and one in the last
        grad_pre[m // 2, 3] = float("inf")
        grad_pre[m - 1, n - 1] = float("nan")
    poison_allocator((n, k), torch.float32, "cuda")
    ours, again = weight_gradient(grad_pre, x, n), weight_gradient(grad_pre, x, n)
    with forced_k_slices(1):
        whole = weight_gradient(grad_pre, x, n)
    eager = grad_pre.t().mm(x)
    assert torch.equal(ours.isnan(), eager.isnan()) and torch.equal(ours.isinf(), eager.isinf())
    assert torch.equal(ours.view(torch.int32), again.view(torch.int32))
    reference = grad_pre.double().t() @ x.double()
    errors = [relative_error(t, reference) for t in (ours, whole, eager)]
    ours_error, whole_error, eager_error = errors
    assert eager_error < float("inf") and ours_error <= 1.1 * whole_error, errors
    assert ours_error <= (eager_error if kind != "rand" else max(eager_error, SPLIT_FP16_ERROR_FLOOR)), errors


@requires_hopper_split
@pytest.mark.parametrize("slices", [2, 3, 7, STREAM_K])
def test_split_k_forced_on_tails_and_on_each_kernel(slices):
    """Slices of K forced on plain products with tails (rows and columns past the tiles' ends, a last chunk in part,
    slices of unequal length, 7 slices of 16 chunks taken as 6 of 3; stream-K's tiles cut into a head and shares of
    the rest, up to 10 parts a tile, or K whole where grad_W's 64 chunks of work are fewer than the multiprocessors):
    grad_W with w in registers (given transposed) and from x's split made ahead (the presplit kernel), and a plain
    forward with w in registers, each with a non-finite value in w's last slice of K (its row flagged by that slice
    alone). Each within max(eager's error, the split's floor) of float64, NaN and Inf where eager's are, close to the
    product over all of K, and the same bits on a second run."""
    g = torch.Generator(device="cuda").manual_seed(6)
    cases = {  # name: (product's operands, the product)
        "grad_w": (200, 136, 1000),  # (n, k, m) of grad_W, 16 chunks of the batch
        "grad_w_split_ahead": (2056, 520, 1000),
    }
    for name, (n, k, m) in cases.items():
        grad_pre, x = torch.randn(m, n, device="cuda", generator=g), torch.randn(m, k, device="cuda", generator=g)
        x[m - 3, 5] = float("inf")
        with forced_k_slices(1):
            whole = weight_gradient(grad_pre, x, n)
        with forced_k_slices(slices):
            ours, again = weight_gradient(grad_pre, x, n), weight_gradient(grad_pre, x, n)
        assert torch.equal(ours.view(torch.int32), again.view(torch.int32)), name
        check_split_k(ours, whole, grad_pre.t().mm(x), grad_pre.double().t() @ x.double(), name)
    x, weight = torch.randn(300, 2056, device="cuda", generator=g), torch.randn(520, 2056, device="cuda", generator=g)
    weight[7, 2000] = float("inf")
    with torch.no_grad(), forced_gemm_path("split_fp16"):
        with forced_k_slices(1):
            whole = gemm_multiply_leaky_relu(x, weight, None, 1.0, 1.0)
        with forced_k_slices(slices):
            ours = gemm_multiply_leaky_relu(x, weight, None, 1.0, 1.0)
            again = gemm_multiply_leaky_relu(x, weight, None, 1.0, 1.0)
    assert torch.equal(ours.view(torch.int32), again.view(torch.int32))
    check_split_k(ours, whole, F.linear(x, weight), F.linear(x.double(), weight.double()), "forward")


@requires_hopper_split
@pytest.mark.parametrize("slices", [0, 2, 3, STREAM_K])
def test_split_k_forward_applies_the_epilogue_to_the_sum(slices):
    """A forward with bias, multiplier and LeakyReLU (slopes 0.1 and 0, ReLU) whose K is split: the slices' plain
    partials summed, then the epilogue and the mask. Slices forced (2, 3, stream-K) or automatic (0: 128 rows, 16
    tiles over 64 chunks) on w in registers and on w's split made ahead (2100 rows; n = 1030 too: the scalar sum),
    each with an Inf in w's last slice of K. Each
    within max(eager's error, the split's floor) of float64, close to the product over all of K, NaN and Inf where
    eager's are, the mask where y > 0."""
    g = torch.Generator(device="cuda").manual_seed(7)
    cases = {"w_in_registers": (300, 520, 2056), "w_split_ahead": (2100, 260, 1040), "few_rows": (128, 2048, 4096),
             "w_split_ahead_odd_n": (2100, 1030, 1040)}  # the presplit kernel with n % 4 != 0: y by plain stores
    for name, (m, n, k) in cases.items():
        if slices == 0 and name != "few_rows":
            continue
        x, weight = torch.randn(m, k, device="cuda", generator=g), torch.randn(n, k, device="cuda", generator=g)
        bias = torch.randn(n, device="cuda", generator=g)
        weight[7, k - 40] = float("inf")
        if slices == 0:
            assert torch.ops.kernels._gemm_k_slices(m, n, k) != 1
        for slope in (0.1, 0.0):
            with torch.no_grad(), forced_gemm_path("split_fp16"):
                with forced_k_slices(1):
                    whole, _ = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, 2.0, slope, True)
                poison_allocator((m, n), torch.float32, "cuda")
                with forced_k_slices(slices):
                    ours, mask = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, 2.0, slope, True)
            eager = F.leaky_relu(F.linear(x, weight, bias) * 2.0, slope)
            reference = F.leaky_relu(F.linear(x.double(), weight.double(), bias.double()) * 2.0, slope)
            check_split_k(ours, whole, eager, reference, f"{name}, slope {slope}")
            if slope > 0:
                assert torch.equal(mask, ours > 0), name
            else:
                assert torch.equal(mask[ours != 0], (ours > 0)[ours != 0]), name


def poison_free_memory_with_flags():
    """Leaves the caching allocator's free memory (large and small blocks) full of kNonFiniteRow, the value a
    flagged row's int32 holds: a flag that no pass zeroes and no kernel writes then flags its row, and the fix-up
    overwrites every output of that row."""
    torch.cuda.empty_cache()
    flag = 1 << 20  # gemm.h's kNonFiniteRow
    blocks = [torch.full((64 << 20,), flag, dtype=torch.int32, device="cuda")]  # 256 MiB: the large pool
    blocks += [torch.full((1 << 18,), flag, dtype=torch.int32, device="cuda") for _ in range(64)]  # 1 MiB each: small
    torch.cuda.synchronize()
    del blocks


@requires_hopper_split
def test_flags_later_kernels_only_set_start_at_zero():
    """x's row split and w's chunk split made by one launch write w's flags whole; the split of a transposed w made
    ahead and the slices of K that split w themselves set flags a memset zeroed. Run on memory full of the flag's
    value (poisoned allocator): each product as eager's within the split's tolerance, NaN and Inf where eager's
    are."""
    g = torch.Generator(device="cuda").manual_seed(8)
    empty = torch.empty(0, device="cuda")

    def forward(x, weight, slices=0):
        with torch.no_grad(), forced_gemm_path("split_fp16"), forced_k_slices(slices):
            return gemm_multiply_leaky_relu(x, weight, None, 1.0, 1.0)

    def grad_x(grad_y, weight):
        x = torch.empty(grad_y.shape[0], weight.shape[1], device="cuda")
        with forced_gemm_path("split_fp16"):
            return torch.ops.kernels.gemm_multiply_leaky_relu_backward(grad_y, x, weight, empty, 1.0, 1.0, True,
                                                                       False, False)[0]

    def grad_w(grad_pre, x, n, slices):
        with forced_k_slices(slices):
            return weight_gradient(grad_pre, x, n)

    def randn(*shape, inf_at=None):
        t = torch.randn(*shape, device="cuda", generator=g)
        if inf_at is not None:
            t[inf_at] = float("inf")
        return t

    x_ahead, w_ahead = randn(2100, 264), randn(520, 264, inf_at=(7, 100))  # w split with x's rows, one launch
    x_unaligned = randn(2100, 268)[:, 1:265]  # rows off 16 bytes: the one launch refused, w's pass then x's
    w_conv1d = randn(264, 520, inf_at=(100, 7))  # a transposed view: w split by columns ahead
    x_slices, w_slices = randn(300, 2056), randn(520, 2056, inf_at=(7, 2000))  # K split, w split in the kernel
    grad_y, w_back = randn(2100, 520), randn(520, 264, inf_at=(7, 100))  # grad_x: w^T split ahead
    grad_small, x_small = randn(1000, 200), randn(1000, 136, inf_at=(997, 5))  # grad_W, K split, w in the kernel
    grad_wide, x_wide = randn(1000, 2056), randn(1000, 520, inf_at=(997, 5))  # grad_W, w split ahead
    cases = {  # name: (our call, eager's product of the operands, the operands, memsets: the column split's counters,
        # the flags of K's slices and of a transposed w's split)
        "forward, w split with x": (lambda: forward(x_ahead, w_ahead), lambda x, w: x @ w.t(), (x_ahead, w_ahead), 0),
        "forward, w split before x": (lambda: forward(x_unaligned, w_ahead), lambda x, w: x @ w.t(),
                                      (x_unaligned, w_ahead), 0),
        "forward, transposed w split ahead": (lambda: forward(x_ahead, w_conv1d.t()), lambda x, w: x @ w,
                                              (x_ahead, w_conv1d), 1),
        "forward, K split": (lambda: forward(x_slices, w_slices, 2), lambda x, w: x @ w.t(), (x_slices, w_slices), 1),
        "grad_x, w^T split ahead": (lambda: grad_x(grad_y, w_back), lambda a, w: a @ w, (grad_y, w_back), 1),
        "grad_W, K split": (lambda: grad_w(grad_small, x_small, 200, 2), lambda a, x: a.t() @ x,
                            (grad_small, x_small), 2),
        "grad_W, w split ahead": (lambda: grad_w(grad_wide, x_wide, 2056, 2), lambda a, x: a.t() @ x,
                                  (grad_wide, x_wide), 2),
    }
    for name, (ours_of, product, operands, memsets) in cases.items():
        eager, reference = product(*operands), product(*(t.double() for t in operands))
        poison_free_memory_with_flags()
        ours, launched = cuda_kernels_launched(ours_of)
        assert sum("memset" in launch.lower() for launch in launched) == memsets, (name, launched)
        combined = any("split_rows_and_chunks_kernel" in launch for launch in launched)
        assert combined == (name == "forward, w split with x"), (name, launched)
        assert torch.equal(ours.isnan(), eager.isnan()) and torch.equal(ours.isinf(), eager.isinf()), name
        finite = torch.isfinite(eager)
        assert finite.sum() > 0.9 * finite.numel(), name  # one non-finite row or column of the output at most
        assert allclose(ours[finite], eager[finite]), name
        assert relative_error(ours, reference) <= max(relative_error(eager, reference), SPLIT_FP16_ERROR_FLOOR), name


def check_split_k(ours, whole, eager, reference, name):
    assert torch.equal(ours.isnan(), eager.isnan()) and torch.equal(ours.isinf(), eager.isinf()), name
    finite = torch.isfinite(whole)
    scale = whole[finite].abs().max()
    assert torch.equal(finite, torch.isfinite(ours)) and allclose(ours[finite] / scale, whole[finite] / scale), name
    ours_error, eager_error = relative_error(ours, reference), relative_error(eager, reference)
    assert ours_error <= max(eager_error, SPLIT_FP16_ERROR_FLOOR), (name, ours_error, eager_error)


def train_losses(model, x, target, steps, lr):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64)


@over_split_paths
@pytest.mark.slow
def test_training_tracks_eager_loss_curve(path):
    """300 SGD steps of a 2-layer MLP of these modules at a size the split path takes (1024 wide, 1024 rows, its
    forward and both backward products on the split path) against the same MLP of the reference modules in float32
    and in float64 (same seed, same data). Our loss curve must stay as close to float64's as eager float32's does
    (within 2x its largest deviation, or 1e-5 relative)."""
    def mlp(layer):
        torch.manual_seed(0)
        return torch.nn.Sequential(layer(1024, 1024, 2.0, 0.1), layer(1024, 1024, 0.5, -0.2))

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1024, 1024, device="cuda", generator=g)
    target = torch.randn(1024, 1024, device="cuda", generator=g)
    ours = mlp(GemmMultiplyLeakyReLUModelNew).cuda()
    with forced_gemm_path(path):
        assert gemm_path(x, ours[0].gemm.weight) == path
        losses = train_losses(ours, x, target, 300, 2.0)
    eager = train_losses(mlp(GemmMultiplyLeakyReLUModel).cuda(), x, target, 300, 2.0)
    exact = train_losses(mlp(GemmMultiplyLeakyReLUModel).cuda().double(), x.double(), target.double(), 300, 2.0)
    assert exact[-1] < 0.9 * exact[0], "the loss must move for the comparison to mean anything"
    ours_deviation = ((losses - exact).abs() / exact).max().item()
    eager_deviation = ((eager - exact).abs() / exact).max().item()
    assert ours_deviation <= max(2 * eager_deviation, 1e-5), (ours_deviation, eager_deviation)
