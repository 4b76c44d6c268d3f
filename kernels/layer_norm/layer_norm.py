"""The LayerNorm family's Python side: fakes and batching rules of its ops, and layer_norm().

Ops (schemas in layer_norm.cpp), over x's last dimension:
  layer_norm(x, weight, bias, eps) -> (x - mean) / sqrt(var + eps) * weight + bias (nn.LayerNorm's formula, the
      variance biased); the mean, the variance (from the deviations from the mean) and each result in double, each
      result rounded to x's dtype once.
  add_layer_norm(x, residual, weight, bias, eps) -> (sum, y): sum = x + residual (rounded as torch.add rounds it),
      y = layer_norm(sum); a pre-norm block's residual add and the next norm in one sweep, whose backward adds the
      sum's own gradient to the norm's grad_x (no separate add of a residual's two gradients).
  layer_norm_backward(grad_y, x, weight, eps, grad_residual=None) -> (grad_x, grad_weight, grad_bias), each summed in
      double and rounded once; grad_residual, where given, added to grad_x before that rounding.
  _layer_norm_leaving_row_split(x, weight, bias, eps), _add_layer_norm_leaving_row_split(x, residual, weight, bias,
      eps): layer_norm and add_layer_norm for calls without a gradient to compute (a call that would record one
      raises), whose kernel also leaves y's row split for the GEMM whose x y is (kernels::_gemm_leave_row_split:
      float32 CUDA rows of a multiple of 4 elements; the same bits as the split the GEMM makes of y itself).
  _layer_norm_force_backward_shared_limit(bytes) -> previous: the most shared memory the backward's blocks may take
      (0: the device's); where a row layout's sums need more, the backward takes the ATen formulas (tests).
Autograd of both ops is C++ (layer_norm_autograd.cpp): the backward kernels for a first-order backward, ATen's formulas
(layer_norm_op.h) for higher orders and forward mode.
"""

import torch

from kernels import loader
from kernels.checks import check_float_tensor, check_like_x, check_same, eps_value

loader.load_library()

def _check_inputs(op, x, *parameters):
    # The C++ checks' messages, for meta tensors and tracing (the fakes stand in for the C++ ops there).
    check_float_tensor(op, "x", x)
    torch._check(x.dim() >= 1,
                 lambda: f"kernels.{op}: x must have at least 1 dimension (..., normalized), got a scalar")
    for name, t in zip(("weight", "bias"), parameters):
        check_float_tensor(op, name, t)
        check_same(op, name, t, "x", x)
        torch._check(t.dim() == 1 and t.shape[0] == x.shape[-1],
                     lambda: f"kernels.{op}: {name} must have shape [{x.shape[-1]}] (x's last dimension), got "
                             f"{list(t.shape)}")


def _layer_norm_fake_of(op):
    """The fake of layer_norm, or of `op` that computes as it does (its leaving form)."""
    def fake(x, weight, bias, eps):
        _check_inputs(op, x, weight, bias)
        return x.new_empty(x.shape)
    return fake


def _add_layer_norm_fake_of(op):
    """The fake of add_layer_norm, or of `op` that computes as it does (its leaving form)."""
    def fake(x, residual, weight, bias, eps):
        _check_inputs(op, x, weight, bias)
        check_like_x(op, "residual", residual, x, " (no broadcasting)")
        return x.new_empty(x.shape), x.new_empty(x.shape)
    return fake


def _layer_norm_backward_fake(grad_y, x, weight, eps, grad_residual=None):
    _check_inputs("layer_norm_backward", x, weight)
    check_like_x("layer_norm_backward", "grad_y", grad_y, x)
    if grad_residual is not None:
        check_like_x("layer_norm_backward", "grad_residual", grad_residual, x)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def layer_norm(x, weight, bias, eps=1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over x's last dimension, as nn.LayerNorm computes it (a weight and
    a bias of x's dtype), in one sweep over memory forward and one backward (CUDA float32, float16, bfloat16 rows of up
    to 4096 elements; ATen's ops otherwise), at least as accurate: the moments and each result are computed in
    double."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"kernels.layer_norm: {name} must be a torch.Tensor, got {type(t).__name__}")
    return torch.ops.kernels.layer_norm.default(x, weight, bias, eps_value("layer_norm", eps))


def add_layer_norm(x, residual, weight, bias, eps=1e-5):
    """(x + residual, layer_norm(x + residual, weight, bias, eps)) in one sweep over memory forward and one backward:
    a pre-norm transformer's residual add and the norm that follows it. x and residual have one shape and dtype (no
    broadcasting). The sum is rounded as torch.add rounds it; the gradient that reaches the sum from its own uses is
    added to the norm's input gradient in double before one rounding."""
    for name, t in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"kernels.add_layer_norm: {name} must be a torch.Tensor, got {type(t).__name__}")
    return torch.ops.kernels.add_layer_norm.default(x, residual, weight, bias, eps_value("add_layer_norm", eps))


def _normalized(x, eps):
    """(h, rstd): h = (x - mean) rstd over x's last dimension (rstd kept), in float64, as the kernels compute them."""
    x64 = x.double()
    deviation = x64 - x64.mean(-1, keepdim=True)
    rstd = deviation.square().mean(-1, keepdim=True).add(eps).rsqrt()
    return deviation * rstd, rstd


# ---- torch.func.vmap -------------------------------------------------------------------------------------------------
# layer_norm acts on the last dimension: a batched x takes the op with its batch first where the weight and bias are
# shared; otherwise, and for the backward (whose parameter gradients sum over every row), the formulas in plain ops.

def _batch_first(info, t, dim):
    return t.movedim(dim, 0) if dim is not None else t.expand(info.batch_size, *t.shape)


def _member_parameter(info, parameter, x):
    """A batch-first parameter (batch, columns) shaped to broadcast over x's rows (batch, ..., columns)."""
    return parameter.reshape(info.batch_size, *([1] * (x.dim() - 2)), parameter.shape[-1])


def _layer_norm_vmap(info, in_dims, x, weight, bias, eps):
    x_dim, weight_dim, bias_dim = in_dims[0], in_dims[1], in_dims[2]  # (eps has one too)
    if weight_dim is None and bias_dim is None:
        return torch.ops.kernels.layer_norm(x.movedim(x_dim, 0), weight, bias, eps), 0
    x = _batch_first(info, x, x_dim)
    weight, bias = (_member_parameter(info, _batch_first(info, t, d), x) for t, d in ((weight, weight_dim),
                                                                                      (bias, bias_dim)))
    return (_normalized(x, eps)[0] * weight.double() + bias.double()).to(x.dtype), 0


def _add_layer_norm_vmap(info, in_dims, x, residual, weight, bias, eps):
    x_dim, residual_dim = in_dims[0], in_dims[1]
    total = (_batch_first(info, x, x_dim) + _batch_first(info, residual, residual_dim)).to(x.dtype)
    y, y_dim = _layer_norm_vmap(info, (0, *in_dims[2:]), total, weight, bias, eps)
    return (total, y), (0, y_dim)


def _layer_norm_backward_vmap(info, in_dims, grad_y, x, weight, eps, grad_residual=None):
    # The backward's closed form in plain ops (no autograd inside a transform), the parameter gradients summed over
    # each batch member's rows.
    grad_y, x, weight = (_batch_first(info, t, d) for t, d in zip((grad_y, x, weight), in_dims))
    h, rstd = _normalized(x, eps)
    g64 = grad_y.double()
    gw = g64 * _member_parameter(info, weight, x).double()
    grad_x = rstd * (gw - gw.mean(-1, keepdim=True) - h * (gw * h).mean(-1, keepdim=True))
    if grad_residual is not None:
        grad_x = grad_x + _batch_first(info, grad_residual, in_dims[4]).double()
    grad_x = grad_x.to(x.dtype)
    rows = (info.batch_size, -1, x.shape[-1])
    grad_weight = (g64 * h).reshape(rows).sum(1).to(weight.dtype)
    grad_bias = g64.reshape(rows).sum(1).to(weight.dtype)
    return (grad_x, grad_weight, grad_bias), (0, 0, 0)


def _register_fakes_and_batching_rules():
    for op in ("layer_norm", "_layer_norm_leaving_row_split"):
        torch.library.register_fake(f"kernels::{op}", _layer_norm_fake_of(op))
    for op in ("add_layer_norm", "_add_layer_norm_leaving_row_split"):
        torch.library.register_fake(f"kernels::{op}", _add_layer_norm_fake_of(op))
    torch.library.register_fake("kernels::layer_norm_backward", _layer_norm_backward_fake)
    torch.library.register_vmap("kernels::layer_norm", _layer_norm_vmap)
    torch.library.register_vmap("kernels::add_layer_norm", _add_layer_norm_vmap)
    torch.library.register_vmap("kernels::layer_norm_backward", _layer_norm_backward_vmap)


loader.register_once("layer_norm", _register_fakes_and_batching_rules)
