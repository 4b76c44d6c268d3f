"""Python side of the op library `torch.ops.kernels`: loads it, registers the fake (meta) implementations and
autograd, and offers the functions the models call.

Ops (schemas in kernels/ops.cpp):
  leaky_relu(x, negative_slope) -> y
  leaky_relu_(x, negative_slope) -> ()                       in place
  leaky_relu_backward(grad_output, saved, negative_slope, scale) -> grad_input
  gemm_scale_leaky_relu(x, weight, bias, multiplier, negative_slope, return_mask) -> (y, mask)
  _leaky_relu_with_grad(x, negative_slope) -> y              leaky_relu where a graph is recorded

leaky_relu's Autograd kernel is C++ (kernels/ops.cpp): where no gradient can flow it runs the kernel directly, for
the per-call overhead; else it calls _leaky_relu_with_grad, whose autograd formula is here like the others'.
"""

import functools

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from .loader import load_library
from .sources import read_sources

# ---- leaky_relu -------------------------------------------------------------------------------------------------

def _leaky_relu_fake(x, negative_slope):
    return torch.empty_like(x)


def _leaky_relu_inplace_fake(x, negative_slope):
    return None


def _leaky_relu_backward_fake(grad_output, saved, negative_slope, scale):
    return torch.empty_like(grad_output)


def _leaky_relu_setup_context(ctx, inputs, output):
    x, negative_slope = inputs
    ctx.negative_slope = negative_slope
    ctx.save_for_backward(x)


def _leaky_relu_grad(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.kernels.leaky_relu_backward(grad, x, ctx.negative_slope, 1.0), None


def _leaky_relu_backward_setup_context(ctx, inputs, output):
    grad_output, saved, negative_slope, scale = inputs
    ctx.negative_slope, ctx.scale = negative_slope, scale
    ctx.save_for_backward(saved)


def _leaky_relu_backward_grad(ctx, grad):
    """The backward is linear in grad_output, with the same slopes; `saved` only picks the branch (zero gradient)."""
    (saved,) = ctx.saved_tensors
    return torch.ops.kernels.leaky_relu_backward(grad, saved, ctx.negative_slope, ctx.scale), None, None, None


class _LeakyReLU(torch.autograd.Function):
    """LeakyReLU under autograd, for leaky_relu() below: the formulas of the op's own autograd path
    (kernels::_leaky_relu_with_grad through torch.library, which serves direct calls of torch.ops.kernels.leaky_relu,
    torch.compile and torch.func) in two thirds of its host time per call (tools/per_call.py). Forward mode too."""

    @staticmethod
    def forward(ctx, x, negative_slope):
        _leaky_relu_setup_context(ctx, (x, negative_slope), None)
        ctx.save_for_forward(x)
        return torch.ops.kernels.leaky_relu.default(x, negative_slope)

    backward = staticmethod(_leaky_relu_grad)

    @staticmethod
    def jvp(ctx, x_tangent, _):
        # The tangent map is the backward's: both scale by the slope at x's sign.
        return _leaky_relu_grad(ctx, x_tangent)[0]


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
        # torch.compile and torch.func take the op itself (they need a Function with setup_context, and Dynamo
        # takes none with a jvp), whose autograd path serves them.
        if (torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling()
                and not torch._C._are_functorch_transforms_active()):
            return _LeakyReLU.apply(x, negative_slope)
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


def _gemm_scale_leaky_relu_forward_mode(x, weight, bias, multiplier, negative_slope):
    """The op with forward-mode tangents: the pre-activation's tangent is linear in theirs, and LeakyReLU scales it
    by its slope at the pre-activation's sign (the mask). torch.library's autograd has no forward mode: called
    plainly, the op would drop the tangents."""
    primals, tangents = zip(*(fwAD.unpack_dual(t) if t is not None else (None, None) for t in (x, weight, bias)))
    x, weight, bias = primals
    y, mask = torch.ops.kernels.gemm_scale_leaky_relu.default(x, weight, bias, multiplier, negative_slope, True)
    x_t, weight_t, bias_t = tangents
    terms = []
    if x_t is not None:
        terms.append(F.linear(x_t, weight))
    if weight_t is not None:
        terms.append(F.linear(x, weight_t))
    if bias_t is not None:
        terms.append(bias_t.expand(y.shape))
    if not terms:
        return y
    pre_tangent = functools.reduce(torch.add, terms)
    return fwAD.make_dual(y, torch.ops.kernels.leaky_relu_backward(pre_tangent, mask, negative_slope, multiplier))


def gemm_scale_leaky_relu(x, weight, bias=None, multiplier=1.0, negative_slope=0.01):
    """leaky_relu((x @ weight.T + bias) * multiplier, negative_slope) for x of shape (..., in_features)."""
    if fwAD._current_level >= 0:  # inside torch.autograd.forward_ad.dual_level()
        return _gemm_scale_leaky_relu_forward_mode(x, weight, bias, multiplier, negative_slope)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    y, _ = torch.ops.kernels.gemm_scale_leaky_relu.default(
        x, weight, bias, multiplier, negative_slope, needs_grad and negative_slope < 0)
    return y


def _register_fake_and_autograd():
    torch.library.register_fake("kernels::leaky_relu", _leaky_relu_fake)
    torch.library.register_fake("kernels::_leaky_relu_with_grad", _leaky_relu_fake)
    torch.library.register_fake("kernels::leaky_relu_", _leaky_relu_inplace_fake)
    torch.library.register_fake("kernels::leaky_relu_backward", _leaky_relu_backward_fake)
    torch.library.register_autograd("kernels::_leaky_relu_with_grad", _leaky_relu_grad,
                                    setup_context=_leaky_relu_setup_context)
    torch.library.register_autograd("kernels::leaky_relu_backward", _leaky_relu_backward_grad,
                                    setup_context=_leaky_relu_backward_setup_context)
    torch.library.register_fake("kernels::gemm_scale_leaky_relu", _gemm_scale_leaky_relu_fake)
    torch.library.register_autograd("kernels::gemm_scale_leaky_relu", _gemm_backward,
                                    setup_context=_gemm_setup_context)


# Registered once per process: a second execution of this module (a reload) finds the library loaded and skips it.
if load_library(read_sources()):
    _register_fake_and_autograd()
