"""The LeakyReLU family's Python side: fake (meta) implementations, autograd, and the function leaky_relu().

Ops (schemas in leaky_relu.cpp):
  leaky_relu(x, negative_slope) -> y
  leaky_relu_(x, negative_slope) -> ()                       in place
  multiply_leaky_relu_(x, multiplier, negative_slope, return_mask) -> mask
                                                             in place: x = leaky_relu(x * multiplier); the GEMM
                                                             family's epilogue on its cuBLAS path
  leaky_relu_backward(grad_output, saved, negative_slope, multiplier) -> grad_input
  _leaky_relu_with_grad(x, negative_slope) -> y              leaky_relu where a graph is recorded
  _leaky_relu_backward_with_grad(grad_output, saved, negative_slope, multiplier) -> grad_input
                                                             leaky_relu_backward where a graph is recorded

The Autograd kernels of leaky_relu and leaky_relu_backward are C++ (leaky_relu.cpp): where no gradient can flow
they run the kernel directly, for the per-call overhead; else they call the _with_grad op, whose autograd formula is
here like the others'.
"""

import torch

from kernels import loader

loader.load_library()

# ---- leaky_relu -------------------------------------------------------------------------------------------------

def _leaky_relu_fake(x, negative_slope):
    return torch.empty_like(x)


def _leaky_relu_inplace_fake(x, negative_slope):
    return None


def _multiply_leaky_relu_inplace_fake(x, multiplier, negative_slope, return_mask):
    return x.new_empty(x.shape if return_mask else (0,), dtype=torch.bool)


def _leaky_relu_backward_fake(grad_output, saved, negative_slope, multiplier):
    return torch.empty_like(grad_output)


def _leaky_relu_setup_context(ctx, inputs, output):
    x, negative_slope = inputs
    ctx.negative_slope = negative_slope
    ctx.save_for_backward(x)


def _leaky_relu_grad(ctx, grad):
    (x,) = ctx.saved_tensors
    return torch.ops.kernels.leaky_relu_backward(grad, x, ctx.negative_slope, 1.0), None


def _leaky_relu_backward_setup_context(ctx, inputs, output):
    grad_output, saved, negative_slope, multiplier = inputs
    ctx.negative_slope, ctx.multiplier = negative_slope, multiplier
    ctx.save_for_backward(saved)


def _leaky_relu_backward_grad(ctx, grad):
    """The backward is linear in grad_output, with the same slopes; `saved` only picks the branch (zero gradient)."""
    (saved,) = ctx.saved_tensors
    return torch.ops.kernels.leaky_relu_backward(grad, saved, ctx.negative_slope, ctx.multiplier), None, None, None


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
    # The inference call first, on the fewest and cheapest tests (host time decides a small call): a plain tensor
    # that needs no grad takes the op alone, whose C++ Autograd kernel runs the kernel. Called through its C++
    # handle, which is all that OpOverload.__call__ does, one Python frame less (~0.6 us); Dynamo traces the
    # OpOverload only, so under torch.compile the op goes below.
    if not inplace and type(x) is torch.Tensor and not x.requires_grad and not _is_compiling():
        return _leaky_relu_handle(x, negative_slope)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"kernels.leaky_relu: x must be a torch.Tensor, got {type(x).__name__}")
    if inplace:
        return _leaky_relu_inplace(x, negative_slope)
    # torch.compile and torch.func take the op too (they need a Function with setup_context, and Dynamo takes none
    # with a jvp), whose autograd path serves them.
    if (torch.is_grad_enabled() and x.requires_grad and not _is_compiling()
            and not torch._C._are_functorch_transforms_active()):
        return _LeakyReLU.apply(x, negative_slope)
    return torch.ops.kernels.leaky_relu.default(x, negative_slope)


def _leaky_relu_inplace(x, negative_slope):
    if torch.is_grad_enabled() and x.requires_grad:
        if negative_slope < 0:
            raise ValueError("leaky_relu(inplace=True) cannot be differentiated with a negative slope "
                             f"({negative_slope}): the output no longer tells the input's sign; use inplace=False")
        return _LeakyReLUInplace.apply(x, negative_slope)
    torch.ops.kernels.leaky_relu_.default(x, negative_slope)
    return x


_leaky_relu_handle = torch.ops.kernels.leaky_relu.default._op
_is_compiling = torch.compiler.is_compiling  # Dynamo knows the function itself, whatever its name here


def _register_fake_and_autograd():
    torch.library.register_fake("kernels::leaky_relu", _leaky_relu_fake)
    torch.library.register_fake("kernels::_leaky_relu_with_grad", _leaky_relu_fake)
    torch.library.register_fake("kernels::leaky_relu_", _leaky_relu_inplace_fake)
    torch.library.register_fake("kernels::multiply_leaky_relu_", _multiply_leaky_relu_inplace_fake)
    torch.library.register_fake("kernels::leaky_relu_backward", _leaky_relu_backward_fake)
    torch.library.register_fake("kernels::_leaky_relu_backward_with_grad", _leaky_relu_backward_fake)
    torch.library.register_autograd("kernels::_leaky_relu_with_grad", _leaky_relu_grad,
                                    setup_context=_leaky_relu_setup_context)
    torch.library.register_autograd("kernels::_leaky_relu_backward_with_grad", _leaky_relu_backward_grad,
                                    setup_context=_leaky_relu_backward_setup_context)


loader.register_once("leaky_relu", _register_fake_and_autograd)
