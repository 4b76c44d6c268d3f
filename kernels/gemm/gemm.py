"""The GEMM family's Python side: fake (meta) implementation, autograd (backward and forward mode) and the function
gemm_multiply_leaky_relu().

Ops (schemas in gemm.cpp):
  gemm_multiply_leaky_relu(x, weight, bias, multiplier, negative_slope, return_mask) -> (y, mask)
  gemm_multiply_leaky_relu_backward(grad_y, x, weight, saved, multiplier, negative_slope, x_grad, weight_grad,
                                    bias_grad) -> (grad_x, grad_weight, grad_bias)   (empty where not asked for)
  _gemm_multiply_leaky_relu_path(x, weight) -> str      the path a call takes: "split_fp16" or "cublas"
  _gemm_split_fp16_refusal(x, weight) -> str            why split_fp16 cannot take these inputs; "" if it can
  _gemm_force_path(path) -> str                         "auto", "cublas" or "split_fp16"; returns the previous one
"""

import functools

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

from kernels import loader

loader.load_library()


def _gemm_multiply_leaky_relu_fake(x, weight, bias, multiplier, negative_slope, return_mask):
    torch._check(x.shape[-1] == weight.shape[1], lambda: "x's last dimension must equal weight.shape[1]")
    y = x.new_empty((*x.shape[:-1], weight.shape[0]))
    mask = x.new_empty(y.shape if return_mask else (0,), dtype=torch.bool)
    return y, mask


def _gemm_multiply_leaky_relu_backward_fake(grad_y, x, weight, saved, multiplier, negative_slope, x_grad,
                                            weight_grad, bias_grad):
    return (x.new_empty(x.shape if x_grad else (0,)), weight.new_empty(weight.shape if weight_grad else (0,)),
            weight.new_empty((weight.shape[0],) if bias_grad else (0,)))


def _gemm_setup_context(ctx, inputs, output):
    x, weight, bias, multiplier, negative_slope, return_mask = inputs
    y, mask = output
    if negative_slope < 0 and not return_mask:
        raise ValueError("gemm_multiply_leaky_relu: with a negative slope the backward needs return_mask=True "
                         "(the output's sign no longer tells the pre-activation's)")
    ctx.multiplier = multiplier
    ctx.negative_slope = negative_slope
    # With slope >= 0 the output has the pre-activation's sign test, so the output itself serves; else the mask.
    ctx.save_for_backward(x, weight, mask if return_mask else y)


def _gemm_backward(ctx, grad_y, grad_mask):
    x, weight, saved = ctx.saved_tensors
    if not torch.is_grad_enabled():
        # No graph of the backward wanted (no double backward): one op, which takes the split_fp16 path for each
        # product where the forward would.
        grads = torch.ops.kernels.gemm_multiply_leaky_relu_backward(
            grad_y, x, weight, saved, ctx.multiplier, ctx.negative_slope, *ctx.needs_input_grad[:3])
        return (*(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad[:3])), None, None, None)
    # Differentiable ops, so that the backward has a backward of its own.
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


class _GemmMultiplyLeakyReLU(torch.autograd.Function):
    """The op under autograd for eager calls that record a graph: the formulas of its torch.library registration
    (which serves torch.compile, torch.func and direct calls of the op) in half its host time per call (36 against
    82 us on a 2-core host for a tiny GEMM), which a training step pays before its first GEMM reaches the GPU."""

    @staticmethod
    def forward(ctx, x, weight, bias, multiplier, negative_slope, return_mask):
        with torch._C._AutoDispatchBelowAutograd():
            y, mask = _gemm_handle(x, weight, bias, multiplier, negative_slope, return_mask)
        _gemm_setup_context(ctx, (x, weight, bias, multiplier, negative_slope, return_mask), (y, mask))
        return y

    @staticmethod
    def backward(ctx, grad_y):
        return _gemm_backward(ctx, grad_y, None)


def _gemm_multiply_leaky_relu_forward_mode(x, weight, bias, multiplier, negative_slope):
    """The op with forward-mode tangents: the pre-activation's tangent is linear in theirs, and LeakyReLU scales it
    by its slope at the pre-activation's sign (the mask). torch.library's autograd has no forward mode: called
    plainly, the op would drop the tangents."""
    primals, tangents = zip(*(fwAD.unpack_dual(t) if t is not None else (None, None) for t in (x, weight, bias)))
    x, weight, bias = primals
    y, mask = torch.ops.kernels.gemm_multiply_leaky_relu.default(x, weight, bias, multiplier, negative_slope, True)
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


def gemm_multiply_leaky_relu(x, weight, bias=None, multiplier=1.0, negative_slope=0.01):
    """leaky_relu((x @ weight.T + bias) * multiplier, negative_slope) for x of shape (..., in_features)."""
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and
            (bias is None or isinstance(bias, torch.Tensor))):
        raise TypeError("kernels.gemm_multiply_leaky_relu: x, weight and bias must be torch.Tensors (bias may be None), "
                        f"got {type(x).__name__}, {type(weight).__name__}, {type(bias).__name__}")
    if fwAD._current_level >= 0:  # inside torch.autograd.forward_ad.dual_level()
        return _gemm_multiply_leaky_relu_forward_mode(x, weight, bias, multiplier, negative_slope)
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    return_mask = needs_grad and negative_slope < 0
    if needs_grad and not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active():
        return _GemmMultiplyLeakyReLU.apply(x, weight, bias, multiplier, negative_slope, return_mask)
    y, _ = torch.ops.kernels.gemm_multiply_leaky_relu.default(x, weight, bias, multiplier, negative_slope, return_mask)
    return y


def gemm_path(x, weight):
    """The path gemm_multiply_leaky_relu takes for these inputs under the current settings: "split_fp16" (the
    Hopper tensor-core kernel) or "cublas"."""
    return torch.ops.kernels._gemm_multiply_leaky_relu_path(x, weight)


def gemm_paths(device):
    """Every path gemm_multiply_leaky_relu can take on `device` for float32 under the current settings, whether or
    not the automatic choice would pick it: ["cublas"] or ["cublas", "split_fp16"]. For tests, tools and bench."""
    probe = torch.empty(8, 64, device=device)
    split_fp16 = torch.ops.kernels._gemm_split_fp16_refusal(probe, probe) == ""
    return ["cublas", "split_fp16"] if split_fp16 else ["cublas"]


class forced_gemm_path:
    """with forced_gemm_path(path): every gemm_multiply_leaky_relu call in the block takes `path` ("cublas" or
    "split_fp16"; "auto" is the default choice). A forced split_fp16 path that cannot run raises instead of falling
    back. (A class rather than a generator function, so the module needs no exception handling, which KernelBench's
    static check rejects.)"""

    def __init__(self, path):
        self.path = path
        self.previous = None

    def __enter__(self):
        self.previous = torch.ops.kernels._gemm_force_path(self.path)
        return self

    def __exit__(self, *exc_info):
        torch.ops.kernels._gemm_force_path(self.previous)
        return False


_gemm_handle = torch.ops.kernels.gemm_multiply_leaky_relu.default._op


def _register_fake_and_autograd():
    torch.library.register_fake("kernels::gemm_multiply_leaky_relu", _gemm_multiply_leaky_relu_fake)
    torch.library.register_fake("kernels::gemm_multiply_leaky_relu_backward", _gemm_multiply_leaky_relu_backward_fake)
    torch.library.register_autograd("kernels::gemm_multiply_leaky_relu", _gemm_backward,
                                    setup_context=_gemm_setup_context)


loader.register_once("gemm", _register_fake_and_autograd)
