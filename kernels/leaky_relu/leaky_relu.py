"""The LeakyReLU family's Python side: fakes of its ops and the function leaky_relu(). Ops (schemas in leaky_relu.cpp):
  leaky_relu(x, negative_slope) -> y;  leaky_relu_(x, negative_slope) -> () in place
  multiply_leaky_relu_(x, multiplier, negative_slope, return_mask) -> mask: x = leaky_relu(x * multiplier) in place,
      the GEMM family's epilogue on its cuBLAS path
  leaky_relu_backward(grad_output, saved, negative_slope, multiplier) -> grad_input
  _leaky_relu_cpu_loops_isa() -> "avx2" or "generic": the build of the CPU loops that CPU calls take
Autograd is C++ (leaky_relu_autograd.cpp): reverse mode to any order and forward mode; the in-place ops bump the
version and rebase history as ATen's do.
"""

import torch

from kernels import loader
from kernels.checks import check_float_tensor

loader.load_library()

# ---- leaky_relu -------------------------------------------------------------------------------------------------

def _check_float(op, x):
    """The op's dtype check, made by its fake: under tracing and on the meta device."""
    check_float_tensor(op, "x", x)


def _leaky_relu_fake(x, negative_slope):
    _check_float("leaky_relu", x)
    return torch.empty_like(x)


def _leaky_relu_inplace_fake(x, negative_slope):
    _check_float("leaky_relu_", x)
    return None


def _multiply_leaky_relu_inplace_fake(x, multiplier, negative_slope, return_mask):
    _check_float("multiply_leaky_relu_", x)
    return x.new_empty(x.shape if return_mask else (0,), dtype=torch.bool)


def _leaky_relu_backward_fake(grad_output, saved, negative_slope, multiplier):
    # Also the op's Meta kernel, picked where either tensor is on meta: mixed devices raise, as eager's.
    torch._prims_common.check_same_device(grad_output, saved, allow_cpu_scalar_tensors=False)
    return torch.empty_like(grad_output)


def leaky_relu(x, negative_slope=0.01, inplace=False):
    """F.leaky_relu(x, negative_slope, inplace) on the project's kernels; same results, bit for bit."""
    # The common call first, on the fewest and cheapest tests (host time decides a small call): a plain tensor takes
    # the op through its C++ handle, which is all that OpOverload.__call__ does, one Python frame less.
    # The op's C++ Autograd kernel records the graph where one is needed. Dynamo traces the OpOverload only, so under
    # torch.compile the op goes below; tensor subclasses take it too.
    if not inplace and type(x) is torch.Tensor and not _is_compiling():
        return _leaky_relu_handle(x, negative_slope)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"kernels.leaky_relu: x must be a torch.Tensor, got {type(x).__name__}")
    if inplace:
        torch.ops.kernels.leaky_relu_.default(x, negative_slope)
        return x
    return torch.ops.kernels.leaky_relu.default(x, negative_slope)


_leaky_relu_handle = torch.ops.kernels.leaky_relu.default._op
_is_compiling = torch.compiler.is_compiling  # Dynamo knows the function itself, whatever its name here


# ---- torch.func.vmap -------------------------------------------------------------------------------------------------
# Batching rules: element-wise ops apply to the batched tensor as they are (in_dims gives each tensor's batch
# dimension, None where it has none; a rule returns the outputs and theirs). The in-place ops have no fallback
# (vmap's generic one does not take in-place ops).

def _leaky_relu_vmap(info, in_dims, x, negative_slope):
    return torch.ops.kernels.leaky_relu(x, negative_slope), in_dims[0]


def _leaky_relu_inplace_vmap(info, in_dims, x, negative_slope):
    torch.ops.kernels.leaky_relu_(x, negative_slope)
    return None, None


def _multiply_leaky_relu_inplace_vmap(info, in_dims, x, multiplier, negative_slope, return_mask):
    mask = torch.ops.kernels.multiply_leaky_relu_(x, multiplier, negative_slope, return_mask)
    return mask, in_dims[0] if return_mask else None


def _leaky_relu_backward_vmap(info, in_dims, grad_output, saved, negative_slope, multiplier):
    # Both operands with the batch first (one of them may have none: a broadcast view).
    grad_output, saved = (t.movedim(d, 0) if d is not None else t.expand(info.batch_size, *t.shape)
                          for t, d in zip((grad_output, saved), in_dims))
    return torch.ops.kernels.leaky_relu_backward(grad_output, saved, negative_slope, multiplier), 0


def _register_fakes_and_batching_rules():
    torch.library.register_fake("kernels::leaky_relu", _leaky_relu_fake)
    torch.library.register_fake("kernels::leaky_relu_", _leaky_relu_inplace_fake)
    torch.library.register_fake("kernels::multiply_leaky_relu_", _multiply_leaky_relu_inplace_fake)
    torch.library.register_fake("kernels::leaky_relu_backward", _leaky_relu_backward_fake)
    torch.library.register_vmap("kernels::leaky_relu", _leaky_relu_vmap)
    torch.library.register_vmap("kernels::leaky_relu_", _leaky_relu_inplace_vmap)
    torch.library.register_vmap("kernels::multiply_leaky_relu_", _multiply_leaky_relu_inplace_vmap)
    torch.library.register_vmap("kernels::leaky_relu_backward", _leaky_relu_backward_vmap)


loader.register_once("leaky_relu", _register_fakes_and_batching_rules)
