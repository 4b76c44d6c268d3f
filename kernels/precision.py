"""The precision contract in one place: the error metric and the one tolerance table, for tests and bench.py."""

import contextlib

import torch

# allclose(atol=tol, rtol=tol) against the reference model in the same dtype: KernelBench's tolerances.
ALLCLOSE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 1e-2, torch.bfloat16: 1e-2}

# How large our error against a float64 reference may be, as a multiple of eager PyTorch's error on the same
# inputs: float32 (and float64) at least as accurate as eager; float16 and bfloat16 within 2x.
ERROR_RATIO_LIMIT = {torch.float32: 1.0, torch.float64: 1.0, torch.float16: 2.0, torch.bfloat16: 2.0}

# The split_fp16 GEMM holds each fp32 operand as two fp16 numbers (about 22 bits), so its error has a floor that does
# not shrink with K: where a test forces it outside the automatic range (gemm_path.cpp), max(eager's error, this floor).
SPLIT_FP16_ERROR_FLOOR = 2.0 ** -21

# cublas_bf16x9 forced on a GPU without the emulation runs cuBLAS's IEEE kernels, which sum in another order than
# at::linear's: their error may exceed eager's slightly (measured: kernels/gemm/NOTES.md).
CUBLAS_BF16X9_ERROR_RATIO_LIMIT = 1.1


def gradient_atol(expected: torch.Tensor, tol: float = ALLCLOSE_TOLERANCE[torch.float32]) -> float:
    """allclose's atol for a float32 gradient against eager's: tol times the gradient's largest magnitude (at least
    tol). A gradient summed over a batch carries eager's own absolute rounding error at every element, near-zero ones
    too, which a fixed atol would hold against us."""
    return tol * max(1.0, float(expected.abs().max())) if expected.numel() else tol


def relative_error(y: torch.Tensor, y64: torch.Tensor, chunk: int = 1 << 26) -> float:
    """||y - y64|| / ||y64|| in float64 over the finite reference entries; inf if y differs from y64 in which
    entries are NaN or infinite (a NaN or Inf error is never small). Works through `chunk` elements at a time, so
    that tensors of billions of elements need only a few float64 temporaries of that size."""
    if y.shape != y64.shape:
        return float("inf")
    y, y64 = y.reshape(-1), y64.reshape(-1)
    diff_squares = norm_squares = 0.0
    for start in range(0, y.numel(), chunk):
        part, reference = y[start:start + chunk].double(), y64[start:start + chunk].double()
        finite = torch.isfinite(reference)
        if not torch.equal(finite, torch.isfinite(part)) or not torch.equal(part[~finite].nan_to_num(),
                                                                              reference[~finite].nan_to_num()):
            return float("inf")
        diff_squares += torch.linalg.vector_norm(part[finite] - reference[finite]).item() ** 2
        norm_squares += torch.linalg.vector_norm(reference[finite]).item() ** 2
    diff, norm = diff_squares ** 0.5, norm_squares ** 0.5
    return diff / norm if norm > 0 else diff


def allclose(y: torch.Tensor, reference: torch.Tensor) -> bool:
    tol = ALLCLOSE_TOLERANCE[reference.dtype]
    return y.shape == reference.shape and y.dtype == reference.dtype and torch.allclose(
        y, reference, atol=tol, rtol=tol, equal_nan=True)


@contextlib.contextmanager
def matmul_precision(precision):
    """Runs the block under torch.set_float32_matmul_precision(precision), then restores the previous setting."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
