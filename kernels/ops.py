"""Python side of the op library `torch.ops.kernels`: loads it, registers the fake (meta) implementations and
autograd, and offers the functions the models call.

Ops (schemas in kernels/ops.cpp):
  leaky_relu(x, negative_slope) -> y
  leaky_relu_(x, negative_slope) -> ()                       in place
  leaky_relu_backward(grad_output, saved, negative_slope, scale) -> grad_input
  gemm_scale_leaky_relu(x, weight, bias, multiplier, negative_slope, return_mask) -> (y, mask)

Autograd of leaky_relu is registered in C++ (kernels/ops.cpp, for its per-call overhead); the rest here.
"""

import torch

from .loader import load_library
from .sources import read_sources

# ---- leaky_relu -------------------------------------------------------------------------------------------------

def _leaky_relu_fake(x, negative_slope):
    return torch.empty_like(x)


def _leaky_relu_inplace_fake(x, negative_slope):
    return None


def _leaky_relu_backward_fake(grad_output, saved, negative_slope, scale):
    return torch.empty_like(grad_output)


class _LeakyReLUInplace(torch.autograd.Function):
    """In-place LeakyReLU under autograd: saves the output, whose sign test equals the input's when slope >= 0."""

    @staticmethod
    def forward(ctx, x, negative_slope):
        torch.ops.kernels.leaky_relu_(x, negative_slope)
        ctx.mark_dirty(x)
        ctx.negative_slope = negative_slope
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return torch.ops.kernels.leaky_relu_backward(grad, y, ctx.negative_slope, 1.0), None


def leaky_relu(x, negative_slope=0.01, inplace=False):
    """F.leaky_relu(x, negative_slope, inplace) on the project's kernels; same results, bit for bit."""
    if not inplace:
        return torch.ops.kernels.leaky_relu.default(x, negative_slope)
    if torch.is_grad_enabled() and x.requires_grad:
        if negative_slope < 0:
            raise ValueError("leaky_relu(inplace=True) cannot be differentiated with a negative slope "
                             f"({negative_slope}): the output no longer tells the input's sign; use inplace=False")
        return _LeakyReLUInplace.apply(x, negative_slope)
    torch.ops.kernels.leaky_relu_.default(x, negative_slope)
    return x


# ---- gemm_scale_leaky_relu --------------------------------------------------------------------------------------

def _gemm_scale_leaky_relu_fake(x, weight, bias, multiplier, negative_slope, return_mask):
    torch._check(x.shape[-1] == weight.shape[1], lambda: "x's last dimension must equal weight.shape[1]")
    y = x.new_empty((*x.shape[:-1], weight.shape[0]))
    mask = x.new_empty(y.shape if return_mask else (0,), dtype=torch.bool)
    return y, mask


def _gemm_setup_context(ctx, inputs, output):
    x, weight, bias, multiplier, negative_slope, return_mask = inputs
    y, mask = output
    if negative_slope < 0 and not return_mask:
        raise ValueError("gemm_scale_leaky_relu: with a negative slope the backward needs return_mask=True "
                         "(the output's sign no longer tells the pre-activation's)")
    ctx.multiplier = multiplier
    ctx.negative_slope = negative_slope
    # With slope >= 0 the output has the pre-activation's sign test, so the output itself serves; else the mask.
    ctx.save_for_backward(x, weight, mask if return_mask else y)


def _gemm_backward(ctx, grad_y, grad_mask):
    x, weight, saved = ctx.saved_tensors
    grad_pre = torch.ops.kernels.leaky_relu_backward(grad_y, saved, ctx.negative_slope, ctx.multiplier)
    grad_pre = grad_pre.reshape(-1, weight.shape[0])
    grad_x = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = grad_pre.mm(weight).reshape(x.shape)
    if ctx.needs_input_grad[1]:
        grad_weight = grad_pre.t().mm(x.reshape(-1, weight.shape[1]))
    if ctx.needs_input_grad[2]:
        grad_bias = grad_pre.sum(0)
    return grad_x, grad_weight, grad_bias, None, None, None


def gemm_scale_leaky_relu(x, weight, bias=None, multiplier=1.0, negative_slope=0.01):
    """leaky_relu((x @ weight.T + bias) * multiplier, negative_slope) for x of shape (..., in_features)."""
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    y, _ = torch.ops.kernels.gemm_scale_leaky_relu.default(
        x, weight, bias, multiplier, negative_slope, needs_grad and negative_slope < 0)
    return y


def _register_fake_and_autograd():
    torch.library.register_fake("kernels::leaky_relu", _leaky_relu_fake)
    torch.library.register_fake("kernels::leaky_relu_", _leaky_relu_inplace_fake)
    torch.library.register_fake("kernels::leaky_relu_backward", _leaky_relu_backward_fake)
    torch.library.register_fake("kernels::gemm_scale_leaky_relu", _gemm_scale_leaky_relu_fake)
    torch.library.register_autograd("kernels::gemm_scale_leaky_relu", _gemm_backward,
                                    setup_context=_gemm_setup_context)


# Registered once per process: a second execution of this module (a reload) finds the library loaded and skips it.
if load_library(read_sources()):
    _register_fake_and_autograd()
