"""The GEMM family (gemm_multiply_leaky_relu): ModelNew against the reference model (same seed, same weights) on CPU
and CUDA, on every path: cuBLAS and the split fp16 tensor-core kernels (split_fp16 on Hopper, split_fp16_sm80 on any
GPU from sm_80 on; every split test runs on each that the GPU can run)."""

import copy
import os
import subprocess
import sys

import pytest
import torch

import torch.nn.functional as F

from conftest import HAS_CUDA, NVCC, poison_allocator, requires_cuda, requires_nvcc
from kernels.precision import (ALLCLOSE_TOLERANCE, CUBLAS_BF16X9_ERROR_RATIO_LIMIT, ERROR_RATIO_LIMIT,
                               SPLIT_FP16_ERROR_FLOOR, allclose, matmul_precision, relative_error)
from kernels.functional import gemm_multiply_leaky_relu
from kernels.gemm.gemm import (KEPT_SPLIT_MIN_PRODUCTS, SPLIT_PATHS, FusedLinear, forced_gemm_path, gemm_path,
                               gemm_paths)
from model_new import GemmMultiplyLeakyReLUModelNew
from reference import GemmMultiplyLeakyReLUModel


def make_pair(in_features, out_features, multiplier, slope, device, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    reference = GemmMultiplyLeakyReLUModel(in_features, out_features, multiplier, slope)
    torch.manual_seed(seed)
    new = GemmMultiplyLeakyReLUModelNew(in_features, out_features, multiplier, slope)
    return reference.to(device, dtype), new.to(device, dtype)


def float64_reference(reference, x):
    """The reference model evaluated in float64 on the same (rounded) inputs and weights."""
    with torch.no_grad():
        return copy.deepcopy(reference).double()(x.double())



def check_against_reference(reference, new, x):
    """allclose against eager in x's dtype, and an error vs float64 within the contract's multiple of eager's."""
    poison_allocator((*x.shape[:-1], new.gemm.out_features), x.dtype, x.device)
    with torch.no_grad():
        y = new(x)
        y_ref = reference(x)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert allclose(y, y_ref), (y - y_ref).abs().max()
    if x.dtype != torch.float64 and y.numel():
        y64 = float64_reference(reference, x)
        ours, eager = relative_error(y, y64), relative_error(y_ref, y64)
        assert ours <= ERROR_RATIO_LIMIT[x.dtype] * eager, (ours, eager)
    return y, y_ref


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


# ---- the split paths: fp32 accuracy from fp16 tensor cores --------------------------------------------------------

SPLIT_KERNELS = [p for p in gemm_paths("cuda") if p in SPLIT_PATHS] if HAS_CUDA else []
# Parametrizes a test over every split path this GPU runs (none without a GPU of sm_80 or newer: one skipped case).
over_split_paths = pytest.mark.parametrize(
    "path", SPLIT_KERNELS or [pytest.param(None, marks=pytest.mark.skip(reason="needs a GPU of sm_80 or newer"))])


def automatic_split_path():
    """The split path the automatic choice takes on this GPU (gemm.cpp's table), or None."""
    if not HAS_CUDA:
        return None
    major, minor = torch.cuda.get_device_capability()
    path = torch.ops.kernels._gemm_fp32_path_for_capability(10 * major + minor)
    return path if path in SPLIT_KERNELS else None


def test_split_path_table_by_architecture():
    """The automatic choice's table (gemm.cpp): the sm_80 kernel on the A100 class and Orin, the wgmma kernel on
    Hopper, cuBLAS's FP32 emulation on datacenter Blackwell, and cuBLAS's SGEMM where fp16 or bf16 products cannot
    beat one fp32 product by much (sm_86, sm_89, sm_120)."""
    capabilities = (70, 75, 80, 86, 87, 89, 90, 100, 103, 120)
    table = {c: torch.ops.kernels._gemm_fp32_path_for_capability(c) for c in capabilities}
    assert table == {70: "cublas", 75: "cublas", 80: "split_fp16_sm80", 86: "cublas", 87: "split_fp16_sm80",
                     89: "cublas", 90: "split_fp16", 100: "cublas_bf16x9", 103: "cublas_bf16x9", 120: "cublas"}


def test_forcing_an_unknown_path_is_a_clear_error():
    with pytest.raises(RuntimeError, match="unknown path 'split_fp32'"):
        with forced_gemm_path("split_fp32"):
            pass
    with pytest.raises(RuntimeError, match="not a fast float32 path"):
        torch.ops.kernels._gemm_path_refusal(torch.ones(2, 4), torch.ones(2, 4), "cublas")


@requires_cuda
def test_split_path_is_taken_by_default_where_the_table_says():
    x, weight = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    for path in SPLIT_PATHS:
        if path not in SPLIT_KERNELS:
            with pytest.raises(RuntimeError, match=f"{path} path was forced but cannot run"):
                with forced_gemm_path(path):
                    gemm_multiply_leaky_relu(x, weight)
    if torch.cuda.get_device_capability() != (9, 0):
        assert gemm_path(x, weight) == (automatic_split_path() or "cublas")
        return
    assert gemm_path(x, weight) == "split_fp16"
    with forced_gemm_path("split_fp16_sm80"):
        assert gemm_path(x, weight) == "split_fp16_sm80"
    assert gemm_path(x.view(2, 512, 1024), weight) == "split_fp16"  # rows counted over the leading dims
    assert gemm_path(x.double(), weight.double()) == "cublas"
    assert gemm_path(x[:, :1013], weight[:, :1013]) == "cublas"  # rows of 1013 floats: no 16-byte TMA strides
    # Below the measured range (gemm.cpp's split_pays_off) cuBLAS is the more accurate or the faster one...
    assert gemm_path(x[:, :508], weight[:, :508].contiguous()) == "cublas"  # K under 512 at 2^20 outputs
    short = torch.randn(2048, 256, device="cuda")
    assert gemm_path(short, short) == "split_fp16"  # K of 256 from 2^22 outputs on
    assert gemm_path(short[:, :252], short[:, :252].contiguous()) == "cublas"
    assert gemm_path(x[:1023], weight) == "cublas"  # fewer than 2^20 outputs
    assert gemm_path(x, weight[:1023]) == "cublas"
    wide = torch.randn(4096, 1024, device="cuda")
    assert gemm_path(x[:256], wide) == "split_fp16"  # 2^20 outputs from a small batch
    assert gemm_path(x[:127], torch.randn(16384, 1024, device="cuda")) == "cublas"  # under one tile of rows
    with forced_gemm_path("split_fp16"):  # ...but forcing it still works there
        assert gemm_path(x[:8, :64], weight[:8, :64].contiguous()) == "split_fp16"
    with matmul_precision("high"):
        assert gemm_path(x, weight) == "cublas"  # TF32 allowed: cuBLAS's TF32 is faster
    with forced_gemm_path("cublas"):
        assert gemm_path(x, weight) == "cublas"
    assert gemm_path(x, weight) == "split_fp16"


def special_inputs(kind, m, k, seed=0):
    """x of shape (m, k) drawn as `kind`: the distributions that break a scaled fp16 split if it is done wrong."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if kind == "rand":
        x = torch.rand(m, k, generator=g)
    elif kind == "rows_times_1e30":
        x[::2] *= 1e30
    elif kind == "rows_times_1e-30":
        x[::2] *= 1e-30
    elif kind == "wide_range_rows":  # magnitudes from 1e-20 to 1e20 within each row
        x *= torch.pow(10.0, torch.empty(m, k).uniform_(-20, 20, generator=g))
    elif kind == "zero_rows":
        x[::3] = 0
    elif kind == "subnormal_rows":
        x[::2] *= 1e-40
    return x


# Shapes the automatic choice sends to the split path: there it must be at least as accurate as eager fp32.
def slow_problem_shape(shapes):
    """The names of `shapes` as parameters, the problem's own size marked slow."""
    return [pytest.param(name, marks=pytest.mark.slow) if name == "problem" else name for name in shapes]


SPLIT_SHAPES = {  # name: (m, k, n)
    "problem": (1024, 8192, 8192),
    "tails": (1153, 1048, 1031),  # M, N, K not multiples of the tiles; K not a multiple of the promotion interval
    "k_one_promotion_past": (1031, 1096, 1030),
    "small_batch": (256, 1032, 4100),  # 2^20 outputs from 256 rows, with tails
    "tall_narrow": (8200, 1032, 136),  # m k > n k + m n: split_fp16 computes it transposed; tails
}

# Shapes below that range, where cuBLAS is the default: the split path, forced, must still be right, within
# max(eager's error, the split's floor).
FORCED_SPLIT_SHAPES = {
    "m1_k8_n7": (1, 8, 7),
    "small_tails": (200, 520, 300),
    "k_not_a_promotion_multiple": (129, 392, 136),
    "tall": (3000, 64, 72),
    "tall_narrow_tails": (2000, 520, 40),  # computed transposed on split_fp16
}


def at_row_scale(y, y64):
    """y divided by the root mean square of each row of the float64 result: the scale at which allclose(1e-4) means
    for rows of size 1e30 or 1e-30 what it means for rows of size 1 (at 1e30 the absolute 1e-4 is nothing, and
    elementwise 1e-4 fails wherever cancellation leaves an entry small, for eager against float64 too)."""
    finite = y64.nan_to_num(0.0, 0.0, 0.0)
    return y / finite.square().mean(-1, keepdim=True).sqrt().clamp_min(1e-300)


def check_split(x, weight, bias, multiplier=2.0, slope=0.1, path="split_fp16", forced=False, row_scale=False):
    """Split path `path` against eager fp32 and float64: allclose(1e-4) (at row scale if asked), the same non-finite
    pattern, and an error <= eager's (forced below the automatic choice's range: <= max(eager's, the split's
    floor)). Within the range, where `path` is this GPU's automatic choice, the automatic choice must take it."""
    poison_allocator((*x.shape[:-1], weight.shape[0]), torch.float32, "cuda")
    if not forced and path == automatic_split_path():
        assert gemm_path(x, weight) == path
    with torch.no_grad(), forced_gemm_path(path):
        assert gemm_path(x, weight) == path
        y = gemm_multiply_leaky_relu(x, weight, bias, multiplier, slope)
    y_eager = F.leaky_relu(F.linear(x, weight, bias) * multiplier, slope)
    y64 = F.leaky_relu(F.linear(x.double(), weight.double(), bias.double()) * multiplier, slope)
    assert torch.equal(y.isnan(), y_eager.isnan()) and torch.equal(y.isinf(), y_eager.isinf())
    if row_scale:
        y_scaled, y_eager_scaled = at_row_scale(y.double(), y64).float(), at_row_scale(y_eager.double(), y64).float()
        assert allclose(y_scaled, y_eager_scaled), (y_scaled - y_eager_scaled).abs().max()
    else:
        assert allclose(y, y_eager), (y - y_eager).abs().nan_to_num().max()
    ours, eager = relative_error(y, y64), relative_error(y_eager, y64)
    assert ours <= (max(eager, SPLIT_FP16_ERROR_FLOOR) if forced else eager), (ours, eager)
    return ours, eager


@over_split_paths
@pytest.mark.parametrize("kind", ["randn", "rand"])
@pytest.mark.parametrize("shape", slow_problem_shape(SPLIT_SHAPES))
def test_split_path_more_accurate_than_eager_fp32(shape, kind, path):
    m, k, n = SPLIT_SHAPES[shape]
    _, new = make_pair(k, n, 2.0, 0.1, "cuda")
    x = special_inputs(kind, m, k).cuda()
    ours, eager = check_split(x, new.gemm.weight.detach(), new.gemm.bias.detach(), path=path)
    if shape == "problem":
        assert ours <= 0.5 * eager, (ours, eager)


@over_split_paths
@pytest.mark.parametrize("shape", FORCED_SPLIT_SHAPES)
def test_split_path_forced_below_its_range(shape, path):
    m, k, n = FORCED_SPLIT_SHAPES[shape]
    _, new = make_pair(k, n, 2.0, 0.1, "cuda")
    x = special_inputs("randn", m, k).cuda()
    check_split(x, new.gemm.weight.detach(), new.gemm.bias.detach(), path=path, forced=True)


@over_split_paths
def test_split_path_forced_on_empty_products(path):
    """Nothing to compute: the forced path gives eager's empty output, or the bias's epilogue where K is 0."""
    weight, bias = torch.randn(16, 64, device="cuda"), torch.randn(16, device="cuda")
    with forced_gemm_path(path):
        assert gemm_multiply_leaky_relu(torch.empty(0, 64, device="cuda"), weight, bias, 2.0, 0.1).shape == (0, 16)
        assert gemm_multiply_leaky_relu(torch.randn(5, 64, device="cuda"), weight[:0], bias[:0]).shape == (5, 0)
        y = gemm_multiply_leaky_relu(torch.empty(5, 0, device="cuda"), torch.empty(16, 0, device="cuda"), bias, 2.0,
                                     0.1)
    torch.testing.assert_close(y, F.leaky_relu(bias * 2.0, 0.1).expand(5, 16))


@over_split_paths
@pytest.mark.parametrize("kind", ["rand", "rows_times_1e30", "rows_times_1e-30", "wide_range_rows", "zero_rows",
                                  "subnormal_rows"])
@pytest.mark.parametrize("operand", ["x", "weight"])
def test_split_path_on_hard_inputs(kind, operand, path):
    m, k, n = 1024, 1040, 1032
    _, new = make_pair(k, n, 2.0, 0.1, "cuda")
    x, weight = special_inputs("randn", m, k, seed=1).cuda(), new.gemm.weight.detach()
    if operand == "x":
        x = special_inputs(kind, m, k, seed=2).cuda()
    else:
        weight = special_inputs(kind, n, k, seed=3).cuda() / k ** 0.5
    check_split(x, weight, new.gemm.bias.detach(), multiplier=-1.5, slope=-0.2, path=path,
                row_scale=kind in ("rows_times_1e30", "rows_times_1e-30", "wide_range_rows"))


# A host program over split_numerics.cuh's unscaling: for every x row exponent the split makes ([-114, 162]), some
# beyond it up to the factors' border (252), and kNonFiniteRow (0 for every finite total, as ldexpf gives), and finite
# totals of every sign, binade and mantissa (random bit patterns over all binades, zeros, subnormals, the binades
# around 2^(e - 252) where the first multiply stops being exact), unscale(total, e) must be ldexpf(total, -e) bit for
# bit: the kernels' two multiplies per output replace a branch to ldexpf.
UNSCALE_CHECK = r"""
#include "gemm/split_numerics.cuh"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

static std::uint32_t bits(float v) {
  std::uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

static float from_bits(std::uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

int main() {
  using kernels::gemm::unscale;
  std::mt19937 random(0);
  std::vector<int> exponents;
  for (int e = -114; e <= 162; ++e) exponents.push_back(e);
  for (int e : {200, 251, 252, kernels::gemm::kNonFiniteRow}) exponents.push_back(e);
  long checked = 0, wrong = 0;
  for (int e : exponents) {
    std::vector<float> totals = {0.0f, -0.0f, from_bits(1), from_bits(0x80000001u), 1.0f, -3.5f, 1e30f, -1e-30f};
    for (int binade = -150; binade <= 127; ++binade)  // around the border 2^(e - 252) and everywhere else
      for (int i = 0; i < 8; ++i) totals.push_back(std::ldexp(1.0f + (random() % 8388608) / 8388608.0f, binade));
    for (int i = 0; i < 20000; ++i) {
      const std::uint32_t b = random();
      totals.push_back(from_bits((b & 0x807fffffu) | ((b >> 8) % 255) << 23));  // subnormals .. 2^127
    }
    for (float total : totals) {
      for (float signed_total : {total, -total}) {
        const float ours = unscale(signed_total, e), expected = std::ldexp(signed_total, -e);
        ++checked;
        if (bits(ours) != bits(expected) && wrong++ < 5)
          std::printf("e %d total %a: unscale %a, ldexpf %a\n", e, signed_total, ours, expected);
      }
    }
  }
  std::printf("checked %ld, wrong %ld\n", checked, wrong);
  return wrong == 0 ? 0 : 1;
}
"""


@requires_nvcc
@pytest.mark.slow
def test_unscale_is_ldexpf_bit_for_bit_host_program(tmp_path):
    from kernels import loader

    source = tmp_path / "unscale_check.cu"
    source.write_text(UNSCALE_CHECK)
    program = tmp_path / "unscale_check"
    built = subprocess.run([NVCC, "-std=c++17", "-O2", "-I", loader.SOURCE_ROOT, str(source), "-o", str(program)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-4000:]
    result = subprocess.run([str(program)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "wrong 0" in result.stdout


@over_split_paths
@pytest.mark.parametrize("rows,features", [(24, 40), (600, 24)])  # the second computed transposed on split_fp16
def test_split_path_propagates_nan_and_inf_like_eager(path, rows, features):
    _, new = make_pair(264, features, 2.0, 0.1, "cuda")
    weight, bias = new.gemm.weight.detach().clone(), new.gemm.bias.detach()
    x = torch.randn(rows, 264, device="cuda")
    x[1, 3], x[2, 5], x[3, 7] = float("nan"), float("inf"), float("-inf")
    weight[4, 9], weight[5, 11] = float("inf"), float("nan")
    weight[6, :] = 0.25  # exactly representable: lo = 0, where inf * 0 must not turn into NaN
    x[7, :] = 0.5
    x[8, 17], x[9, 9] = float("inf"), float("-inf")  # meets the inf of weight row 4 in column 9
    x[10, :] = float("inf")  # a whole row: every output of it is inf or, where weight is 0, NaN
    check_split(x, weight, bias, path=path, forced=True)


@over_split_paths
def test_split_path_non_finite_rows_beyond_the_listed_positions(path):
    """Rows with more non-finite values than the fix-up kernel lists, meeting non-finite rows of the other operand."""
    k = 2056
    _, new = make_pair(k, 1032, 2.0, 0.1, "cuda")
    weight, bias = new.gemm.weight.detach().clone(), new.gemm.bias.detach()
    x = torch.randn(1030, k, device="cuda")
    x[0, :] = float("inf")
    x[1, ::2] = float("-inf")
    x[2, 5::3] = float("nan")
    weight[3, 1::2] = float("-inf")  # output (1, 3): infinities from both operands, of both signs
    weight[4, :] = float("inf")
    weight[5, 7] = 0.0
    x[6, 7] = float("inf")  # inf * 0 = NaN
    check_split(x, weight, bias, path=path)


@over_split_paths
@pytest.mark.parametrize("rows,features", [(5, 72), (200, 24)])  # the second computed transposed on split_fp16
def test_split_path_mask_and_views(path, rows, features):
    """The mask the backward uses with a negative slope, batched leading dims, and an input view at an offset."""
    _, new = make_pair(136, features, -1.5, -0.3, "cuda")
    weight, bias = new.gemm.weight.detach(), new.gemm.bias.detach()
    base = torch.randn(3 * rows * 136 + 3, device="cuda")
    x = base[3:].view(3, rows, 136)  # 12 bytes off 16-byte alignment: the path copies it
    check_split(x, weight, bias, -1.5, -0.3, path=path, forced=True)
    with forced_gemm_path(path):
        y, mask = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, -1.5, -0.3, True)
    pre = F.linear(x, weight, bias) * -1.5
    agree = (mask == (pre > 0)) | (pre.abs() < 1e-4)  # rounding may flip the sign test right at zero
    assert mask.shape == y.shape and bool(agree.all())


@pytest.mark.skipif("split_fp16" not in SPLIT_KERNELS, reason="needs the Hopper split kernel")
@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")  # torch's notice, once per process
@pytest.mark.parametrize("m,k,n,transposed", [(8200, 1032, 136, True), (2000, 520, 40, True), (1024, 1032, 1040, False),
                                              (1030, 1024, 1030, False)])
def test_split_fp16_computes_tall_narrow_products_transposed(m, k, n, transposed):
    """Where x has more elements than w and the output together (m k > n k + m n), split_fp16 computes y^T = w x^T
    and writes y through the transposed epilogue's kernel; elsewhere it does not. The results are checked by the
    shape tests above; this checks which way each shape goes."""
    x, weight, bias = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"), torch.randn(n, device="cuda")
    with forced_gemm_path("split_fp16"), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        gemm_multiply_leaky_relu(x, weight, bias, 2.0, 0.1)
        torch.cuda.synchronize()
    kernels = [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    assert any("split_gemm_kernel" in name for name in kernels), kernels
    assert any("transposed_epilogue_kernel" in name for name in kernels) == transposed, kernels


# The Hopper kernel's two epilogues, run in processes of their own (the kernel reads KERNELS_GEMM_PLAIN_STORES once
# per process): each case's forward with the mask, the forward from a weight split made beforehand where one is kept,
# and the three gradients, saved for the test to compare.
EPILOGUE_CASES = {  # name: (m, k, n)
    "tails": (300, 1040, 520),  # rows and columns past the tiles' ends; rows down to 2^-120 (unscale's two factors)
    "kept_split": (1100, 4000, 1060),  # the forward from w's split made beforehand (the presplit kernel)
    "w_split_ahead": (1000, 520, 2056),  # grad_W from a split made beforehand (grad_pre^T has 2056 rows)
    # K of one chunk and of two, on 320 tiles: two or three tiles per CTA, so that a CTA's stages are reused across
    # tiles within a few chunks.
    "one_chunk": (2048, 64, 2560),
    "two_chunks": (2048, 128, 2560),
    # grad_W of 1000 x 520 (40 tiles) over 4096 rows: K split (split_gemm_k_slices), the partials by either epilogue.
    "split_k": (4096, 520, 1000),
}

EPILOGUE_CASES_SCRIPT = r"""
import ast
import sys
import torch
from kernels.gemm.gemm import forced_gemm_path

cases = ast.literal_eval(sys.argv[2])  # EPILOGUE_CASES
results = {}
for name, (m, k, n) in cases.items():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"), torch.randn(n, device="cuda")
    x[::7] *= 1e-36
    x[5, 7] = float("inf")  # a row the fix-up rewrites after the epilogue
    with forced_gemm_path("split_fp16"), torch.no_grad():
        y, mask = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, -1.5, -0.2, True)
        split = torch.ops.kernels.gemm_weight_split(x, weight)
        y_kept, mask_kept = torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, bias, -1.5, -0.2, True, split)
        grad_y = torch.randn_like(y)
        grads = torch.ops.kernels.gemm_multiply_leaky_relu_backward(grad_y, x, weight, mask, -1.5, -0.2, True, True,
                                                                    True)
    # The kept split's results are the in-register split's, bit for bit (whichever epilogue).
    assert torch.equal(y.view(torch.int32), y_kept.view(torch.int32)) and torch.equal(mask, mask_kept), name
    results[name] = [t.cpu() for t in (y, mask, y_kept, mask_kept, *grads)] + [len(split)]
torch.save(results, sys.argv[1])
"""


@pytest.mark.skipif("split_fp16" not in SPLIT_KERNELS, reason="needs the Hopper split kernel")
@pytest.mark.slow
def test_split_fp16_epilogue_by_tma_and_by_plain_stores_agree_bit_for_bit(tmp_path):
    """The Hopper kernel's TMA epilogue (outputs made in the staging buffer, then TMA stores) and its plain-stores
    epilogue (KERNELS_GEMM_PLAIN_STORES=1, what the sanitizer's initcheck runs) give the same outputs, masks and
    gradients bit for bit: forward, the forward from a kept split, grad_x and grad_W, on shapes with tails and with
    K of one and two chunks."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = {}
    for plain in ("0", "1"):
        out = tmp_path / f"plain_{plain}.pt"
        done = subprocess.run([sys.executable, "-c", EPILOGUE_CASES_SCRIPT, str(out), repr(EPILOGUE_CASES)],
                              cwd=root, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, KERNELS_GEMM_PLAIN_STORES=plain))
        assert done.returncode == 0, done.stderr[-3000:]
        runs[plain] = torch.load(out)
    for name, by_tma in runs["0"].items():
        by_plain = runs["1"][name]
        assert by_tma[-1] == by_plain[-1], (name, by_tma[-1])
        # Which cases read a split of w made ahead (the presplit kernel) and which split w in registers.
        assert (by_tma[-1] > 0) == kept_split_expected("split_fp16", *EPILOGUE_CASES[name]), (name, by_tma[-1])
        for i, (a, b) in enumerate(zip(by_tma[:-1], by_plain[:-1])):
            if a.dtype == torch.float32:
                a, b = a.view(torch.int32), b.view(torch.int32)  # NaN payloads too
            assert a.shape == b.shape and torch.equal(a, b), (name, i)
        y = by_tma[0]
        assert bool(y.isinf().any()) or bool(y.isnan().any()), name  # the fix-up's rows are in the comparison


WEIGHT_CHANGE_PATHS = ["auto", *SPLIT_KERNELS]


@pytest.mark.parametrize("path", WEIGHT_CHANGE_PATHS)
@pytest.mark.parametrize("change", ["in_place", "data_copy", "new_parameter", "load_state_dict", "optimizer_step",
                                    "to", "bf16_round_trip"])
def test_weight_changes_show_in_the_next_call(device, change, path):
    if device == "cpu" and path != "auto":
        pytest.skip("the split path is CUDA only")
    # The split path at a size in its range, where its error is held to eager's and the weight's split is kept.
    features, rows = (2048, 2048) if path in SPLIT_PATHS else (64, 16)
    reference, new = make_pair(features, features - 16, 2.0, 0.1, device)
    x = torch.randn(rows, features, device=device)
    with forced_gemm_path(path):
        check_weight_change(reference, new, x, change)


def check_weight_change(reference, new, x, change):
    """After calls that leave the weight's split kept (FusedLinear, under no_grad from the second call on), the weight
    changes in one of the ways users change weights; the next calls must see it."""
    with torch.no_grad():
        for _ in range(3):
            new(x)  # anything kept from these calls would show
    if change == "in_place":
        with torch.no_grad():
            new.gemm.weight.mul_(-0.5)
    elif change == "data_copy":  # new values at nn.Linear's scale, 1 / sqrt(in_features)
        new.gemm.weight.data.copy_(torch.randn_like(new.gemm.weight) * x.shape[-1] ** -0.5)
        # A change through .data is one PyTorch's version counter does not count: FusedLinear's documented step.
        new.gemm.clear_weight_split()
    elif change == "new_parameter":
        new.gemm.weight = torch.nn.Parameter(torch.randn_like(new.gemm.weight) * x.shape[-1] ** -0.5)
    elif change == "load_state_dict":
        new.load_state_dict({k: torch.randn_like(v) * x.shape[-1] ** -0.5 for k, v in new.state_dict().items()})
    elif change == "optimizer_step":
        optimizer = torch.optim.SGD(new.parameters(), lr=0.5)
        new(x).square().mean().backward()
        optimizer.step()
    elif change == "bf16_round_trip":  # new data, the same Parameter and version counter (module._apply)
        new.to(torch.bfloat16).to(torch.float32)
    elif change == "to":
        new.to(torch.float64).to(torch.float32)
        with torch.no_grad():
            new.gemm.weight.add_(x.shape[-1] ** -0.5)
    reference.load_state_dict(new.state_dict())
    for _ in range(3):  # the first call after the change, the one that splits the weight ahead, one that reads it
        check_against_reference(reference, new, x)


# ---- the weight's split kept between calls (FusedLinear) -----------------------------------------------------------

def kept_split_expected(path, m, k, n):
    """Whether the forward of an (m x k) x on `path` with an (n x k) weight reads a split of the weight made ahead
    (gemm.cpp: gemm_weight_split; from KEPT_SPLIT_MIN_PRODUCTS multiply-adds on)."""
    return m * n * k >= KEPT_SPLIT_MIN_PRODUCTS and (
        path == "split_fp16_sm80" or (path == "split_fp16" and n % 4 == 0 and not m * k > n * k + m * n))


KEPT_SPLIT_SHAPES = {  # name: (m, k, n)
    "problem": (1024, 8192, 8192),
    "tails": (1153, 4104, 1032),  # M, N not multiples of the tiles, K not of the chunk
    "n_tail": (1100, 4000, 1060),  # N not a multiple of the tile, K of half a chunk
    "n_odd": (1030, 4104, 1031),  # N % 4 != 0: the Hopper kernel keeps no split (TMA's 16-byte rows of exponents)
    "tall_narrow": (16400, 2056, 264),  # computed transposed on split_fp16: no split of the weight ahead
    "small": (1024, 1024, 1024),  # under 2^32 multiply-adds: none kept (the call's time is the host's)
}


@over_split_paths
@pytest.mark.parametrize("weights", ["randn", "non_finite_rows", "rows_times_1e-30"])
@pytest.mark.parametrize("shape", slow_problem_shape(KEPT_SPLIT_SHAPES))
def test_kept_weight_split_gives_the_same_results_bit_for_bit(shape, weights, path):
    m, k, n = KEPT_SPLIT_SHAPES[shape]
    torch.manual_seed(0)
    linear = FusedLinear(k, n).cuda()
    with torch.no_grad():
        if weights == "non_finite_rows":
            linear.weight[3, 5], linear.weight[n - 1, k - 1] = float("inf"), float("nan")
            linear.weight[n // 2, 0] = -float("inf")
        elif weights == "rows_times_1e-30":
            linear.weight[::3] *= 1e-30
    x = torch.randn(m, k, device="cuda")
    outputs = []
    with torch.no_grad(), forced_gemm_path(path):
        for _ in range(3):  # the weight seen, then split ahead and kept, then the kept split read
            poison_allocator((m, n), torch.float32, "cuda")
            outputs.append(linear(x, multiplier=2.0, negative_slope=0.1))
        expected = kept_split_expected(path, m, k, n)
        assert (linear._weight_split is not None) == expected
        y_eager = F.leaky_relu(F.linear(x, linear.weight, linear.bias) * 2.0, 0.1)
        # The op with the mask too, with and without the kept split.
        split = torch.ops.kernels.gemm_weight_split(x, linear.weight)
        assert bool(split) == expected
        y_mask = torch.ops.kernels.gemm_multiply_leaky_relu(x, linear.weight, linear.bias, 2.0, -0.3, True)
        y_mask_kept = torch.ops.kernels.gemm_multiply_leaky_relu(x, linear.weight, linear.bias, 2.0, -0.3, True, split)
    for y in outputs[1:]:
        assert torch.equal(y.view(torch.int32), outputs[0].view(torch.int32))  # NaN payloads too
    assert torch.equal(y_mask[0].view(torch.int32), y_mask_kept[0].view(torch.int32))
    assert torch.equal(y_mask[1], y_mask_kept[1])
    assert torch.equal(outputs[0].isnan(), y_eager.isnan()) and torch.equal(outputs[0].isinf(), y_eager.isinf())


@over_split_paths
def test_weight_split_of_another_weight_or_stream_is_not_used(path):
    """The op checks the split's stamp on every use: a split of another weight, of the same weight before an in-place
    change, or made on another stream is not read (the results are those of a call without it)."""
    m, k, n = 1024, 1024, 4096
    torch.manual_seed(0)
    x, weight, other = (torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda"),
                        torch.randn(n, k, device="cuda"))
    op = torch.ops.kernels.gemm_multiply_leaky_relu
    with torch.no_grad(), forced_gemm_path(path):
        expected = op(x, weight, None, 2.0, 0.1, False)[0]
        own = torch.ops.kernels.gemm_weight_split(x, weight)
        assert own  # a split is made here, so the cases below are not vacuous
        assert torch.equal(op(x, weight, None, 2.0, 0.1, False, own)[0], expected)
        assert torch.equal(op(x, weight, None, 2.0, 0.1, False, torch.ops.kernels.gemm_weight_split(x, other))[0],
                           expected)
        before = torch.ops.kernels.gemm_weight_split(x, weight)
        weight.mul_(-1.0)
        assert torch.equal(op(x, weight, None, 2.0, 0.1, False, before)[0], op(x, weight, None, 2.0, 0.1, False)[0])
        weight.mul_(-1.0)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            on_side = torch.ops.kernels.gemm_weight_split(x, weight)
        side.synchronize()
        on_side[0].zero_()  # read, it would change the output
        assert torch.equal(op(x, weight, None, 2.0, 0.1, False, on_side)[0], expected)
        # The op does read a split that matches (made after the changes above): zeroed hi halves change the output.
        fresh = torch.ops.kernels.gemm_weight_split(x, weight)
        fresh[0].zero_()
        assert not torch.equal(op(x, weight, None, 2.0, 0.1, False, fresh)[0], expected)


def test_weight_split_is_kept_only_where_autograd_does_not_record_the_weight(device):
    torch.manual_seed(0)
    linear = FusedLinear(2048, 2048).to(device)
    x = torch.randn(1024, 2048, device=device)  # in the automatic choice's range, 2^32 multiply-adds: kept
    kept_here = device == "cuda" and automatic_split_path() is not None
    for _ in range(3):
        linear(x)  # training the weight: nothing kept
    assert linear._weight_split is None
    with torch.no_grad():
        for _ in range(3):
            linear(x)
    assert (linear._weight_split is not None) == kept_here
    linear(x).sum().backward()  # a call that trains the weight drops it
    assert linear._weight_split is None
    linear.weight.requires_grad_(False)  # a frozen weight (fine-tuning around it) keeps it, grad mode or not
    for _ in range(3):
        linear(x)
    assert (linear._weight_split is not None) == kept_here
    linear.clear_weight_split()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16):  # the op casts the weight: none kept
        for _ in range(3):
            linear(x)
    assert linear._weight_split is None
    linear.cache_weight_split = False
    linear(x)
    assert linear._weight_split is None and linear._weight_split_key is None
    copy.deepcopy(linear)  # copies and pickles hold no split


def test_weight_split_list_not_from_gemm_weight_split_is_a_clear_error(device):
    x, weight = torch.randn(4, 8, device=device), torch.randn(6, 8, device=device)
    with pytest.raises(RuntimeError, match="weight_split must be a list that kernels.gemm_weight_split returned"):
        torch.ops.kernels.gemm_multiply_leaky_relu(x, weight, None, 1.0, 1.0, False, [x])


# ---- the backward on the split path --------------------------------------------------------------------------------

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


# ---- split-K: plain products of small outputs over long reductions (grad_W's) ----------------------------------------

requires_hopper_split = pytest.mark.skipif("split_fp16" not in SPLIT_KERNELS, reason="needs the Hopper split kernel")


def weight_gradient(grad_pre, x, n):
    """grad_W = grad_pre^T x (n x k) through the backward op on the forced split_fp16 path (the identity epilogue:
    grad_pre is grad_y)."""
    weight, empty = torch.empty(n, x.shape[1], device="cuda"), torch.empty(0, device="cuda")
    with forced_gemm_path("split_fp16"):
        return torch.ops.kernels.gemm_multiply_leaky_relu_backward(grad_pre, x, weight, empty, 1.0, 1.0, False, True,
                                                                   False)[1]


class forced_k_slices:
    """with forced_k_slices(s): every plain split_fp16 product in the block splits K into at most s slices."""

    def __init__(self, slices):
        self.slices, self.previous = slices, None

    def __enter__(self):
        self.previous = torch.ops.kernels._gemm_force_k_slices(self.slices)

    def __exit__(self, *exc_info):
        torch.ops.kernels._gemm_force_k_slices(self.previous)
        return False


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
    assert torch.ops.kernels._gemm_k_slices(n, k, m) > 1  # split_gemm_k_slices splits K at these shapes
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
@pytest.mark.parametrize("slices", [2, 3, 7])
def test_split_k_forced_on_tails_and_on_each_kernel(slices):
    """Slices of K forced on plain products with tails (rows and columns past the tiles' ends, a last chunk in part,
    slices of unequal length, 7 slices of 16 chunks taken as 6 of 3): grad_W with w in registers (given transposed)
    and from x's split made ahead (the presplit kernel), and a plain forward with w in registers, each with a
    non-finite value in w's last slice of K (its row flagged by that slice alone). Each within max(eager's error, the
    split's floor) of float64, NaN and Inf where eager's are, and close to the product over all of K."""
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
            ours = weight_gradient(grad_pre, x, n)
        check_split_k(ours, whole, grad_pre.t().mm(x), grad_pre.double().t() @ x.double(), name)
    x, weight = torch.randn(300, 2056, device="cuda", generator=g), torch.randn(520, 2056, device="cuda", generator=g)
    weight[7, 2000] = float("inf")
    with torch.no_grad(), forced_gemm_path("split_fp16"):
        with forced_k_slices(1):
            whole = gemm_multiply_leaky_relu(x, weight, None, 1.0, 1.0)
        with forced_k_slices(slices):
            ours = gemm_multiply_leaky_relu(x, weight, None, 1.0, 1.0)
    check_split_k(ours, whole, F.linear(x, weight), F.linear(x.double(), weight.double()), "forward")


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


# ---- cublas_bf16x9: cuBLAS's FP32 emulation (Blackwell's path; run forced wherever cuBLAS 12.9+ is loaded) -------

def cublas_bf16x9_refusal():
    probe = torch.empty(8, 64, device="cuda")
    return torch.ops.kernels._gemm_path_refusal(probe, probe, "cublas_bf16x9")


requires_cublas_bf16x9 = pytest.mark.skipif(not HAS_CUDA or cublas_bf16x9_refusal() != "",
                                            reason="needs a GPU and a cuBLAS with FP32 emulation (12.9+)")


@requires_cublas_bf16x9
@pytest.mark.parametrize("x_shape,out_features,bias,layout", [
    ((1024,), 1024, True, "contiguous"), ((37,), 129, True, "contiguous"), ((1,), 7, True, "contiguous"),
    ((3, 5), 72, False, "contiguous"),
    ((40,), 136, True, "transposed"), ((40,), 136, True, "column_slice")])
def test_cublas_bf16x9_matches_eager(x_shape, out_features, bias, layout):
    """Forward and both gradients on the forced cublas_bf16x9 path against the reference: allclose 1e-4, and an
    error against float64 within eager's (cuBLAS's emulation, or its IEEE kernels where it chooses them, sum in
    another order than at::linear's kernel: 10% is the spread of two fp32 summation orders at these sizes). x as
    given, as a transposed view (cuBLAS reads it transposed), and as a slice of wider rows (a leading dimension
    longer than the row); one row, where the bias broadcast over the output is the bias itself."""
    in_features = 64 if x_shape == (3, 5) else x_shape[0] + 7
    torch.manual_seed(0)
    reference = GemmMultiplyLeakyReLUModel(in_features, out_features, -1.5, -0.2).cuda()
    if not bias:
        reference.gemm.bias = None
    new = GemmMultiplyLeakyReLUModelNew(in_features, out_features, -1.5, -0.2).cuda()
    if not bias:
        new.gemm.bias = None
    new.load_state_dict(reference.state_dict())
    if layout == "transposed":
        x = torch.randn(in_features, *x_shape, device="cuda").t()
    elif layout == "column_slice":
        x = torch.randn(*x_shape, in_features + 9, device="cuda")[..., 9:]
    else:
        x = torch.randn(*x_shape, in_features, device="cuda")
    x.requires_grad_(True)
    inputs = [t.detach().clone() for t in (x, *new.parameters())]
    with forced_gemm_path("cublas_bf16x9"):
        assert gemm_path(x, new.gemm.weight) == "cublas_bf16x9"
        y = new(x)
    for before, after in zip(inputs, (x, *new.parameters())):
        assert torch.equal(before, after), "an input changed"  # one row: y must not be the bias itself
    with forced_gemm_path("cublas_bf16x9"):
        grads = torch.autograd.grad(y.square().sum(), [x, *new.parameters()])
    y_ref = reference(x)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), [x, *reference.parameters()])
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    for got, expected in zip(grads, grads_ref):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        y64 = copy.deepcopy(reference).double()(x.double())
    assert relative_error(y, y64) <= CUBLAS_BF16X9_ERROR_RATIO_LIMIT * relative_error(y_ref, y64)


@requires_cublas_bf16x9
def test_cublas_bf16x9_refuses_what_it_cannot_take():
    x = torch.randn(16, 64, device="cuda")
    with forced_gemm_path("cublas_bf16x9"):
        with pytest.raises(RuntimeError, match="cublas_bf16x9 path was forced but cannot run: it computes float32"):
            gemm_multiply_leaky_relu(x.half(), x.half())
        with matmul_precision("high"), pytest.raises(RuntimeError, match="TF32 is allowed"):
            gemm_multiply_leaky_relu(x, x)
        # An empty product has nothing to compute: cuBLAS's path, as on the split paths.
        assert gemm_multiply_leaky_relu(x[:0], x).shape == (0, 16)
