"""The GEMM family's path choice: the automatic choice's table by architecture, forced paths, the split path taken
where the table says, and cublas_bf16x9 (cuBLAS's FP32 emulation, Blackwell's path; run forced wherever cuBLAS 12.9+
is loaded)."""

import copy

import pytest
import torch

from conftest import HAS_CUDA, requires_cuda
from kernels.precision import CUBLAS_BF16X9_ERROR_RATIO_LIMIT, matmul_precision, relative_error
from kernels.functional import gemm_multiply_leaky_relu
from kernels.gemm.gemm import SPLIT_PATHS, forced_gemm_path, gemm_path
from model_new import GemmMultiplyLeakyReLUModelNew
from reference import GemmMultiplyLeakyReLUModel
from gemm_helpers import SPLIT_KERNELS, automatic_split_path


def test_split_path_table_by_architecture():
    """The automatic choice's table (gemm_path.cpp): the sm_80 kernel on the A100 class and Orin, the wgmma kernel on
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


def test_split_rule_regions():
    """split_pays_off's two regions, as gemm.py's mirror of it reads them (no GPU needed): K >= 1024 from 2^20
    outputs, K >= 256 from 2^22, both output sides >= 128; K of 512-1023 below 2^22 outputs stays on cuBLAS, where a
    split call's host time outweighs what it saves on the GPU (the Swin models' 490 x 768 -> 3072)."""
    from kernels.gemm.gemm import split_may_pay

    assert split_may_pay(1024, 1024, 1024) and split_may_pay(256, 4096, 1024)
    assert not split_may_pay(490, 3072, 768) and not split_may_pay(7840, 192, 768)
    assert not split_may_pay(1024, 1024, 1020)
    assert split_may_pay(4096, 1024, 768) and split_may_pay(2048, 2048, 256)
    assert not split_may_pay(2048, 2048, 252) and not split_may_pay(127, 16384, 1024)


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
    # Below the measured range (gemm_path.cpp's split_pays_off) cuBLAS is the more accurate or the faster one...
    assert gemm_path(x[:, :508], weight[:, :508].contiguous()) == "cublas"  # K under 1024 at 2^20 outputs
    medium = torch.randn(4096, 768, device="cuda")
    assert gemm_path(medium[:1024], weight[:, :768].contiguous()) == "cublas"  # K of 768: cuBLAS below 2^22 outputs
    assert gemm_path(medium, weight[:, :768].contiguous()) == "split_fp16"  # ...and the split from 2^22 on
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
