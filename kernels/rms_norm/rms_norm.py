"""The RMSNorm family's Python side: fakes and batching rules of its ops, and rms_norm().

Ops (schemas in rms_norm.cpp), over x's last dimension:
  rms_norm(x, weight, eps) -> weight * (x * rsqrt(mean(x^2) + eps)), x * rsqrt(...) rounded to x's dtype first
      (transformers' LlamaRMSNorm for a weight of x's dtype); the mean of squares summed in double, the reciprocal
      square root rounded to float (double for float64) once.
  rms_norm_backward(grad_y, x, weight, eps) -> (grad_x, grad_weight), each summed in double and rounded once.
Autograd of both ops is C++ (rms_norm_autograd.cpp): the backward kernels for a first-order backward, ATen's formulas
(rms_norm_op.h) for higher orders and forward mode.
"""

import torch

from kernels import loader
from kernels.checks import check_float_tensor, check_like_x, check_same, eps_value

loader.load_library()

def _check_inputs(op, x, weight):
    # The C++ checks' messages, for meta tensors and tracing (the fakes stand in for the C++ ops there).
    for name, t in (("x", x), ("weight", weight)):
        check_float_tensor(op, name, t)
    check_same(op, "weight", weight, "x", x)
    torch._check(x.dim() >= 1,
                 lambda: f"kernels.{op}: x must have at least 1 dimension (..., normalized), got a scalar")
    torch._check(weight.dim() == 1 and weight.shape[0] == x.shape[-1],
                 lambda: f"kernels.{op}: weight must have shape [{x.shape[-1]}] (x's last dimension), got "
                         f"{list(weight.shape)}")


def _rms_norm_fake(x, weight, eps):
    _check_inputs("rms_norm", x, weight)
    return x.new_empty(x.shape)


def _rms_norm_backward_fake(grad_y, x, weight, eps):
    _check_inputs("rms_norm_backward", x, weight)
    check_like_x("rms_norm_backward", "grad_y", grad_y, x)
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def rms_norm(x, weight, eps=1e-6):
    """weight * (x * rsqrt(mean(x^2, -1) + eps)) over x's last dimension, as transformers' LlamaRMSNorm computes it
    for a weight of x's dtype, in one sweep over memory forward and one backward (CUDA float32, float16, bfloat16 rows
    of up to 8192 elements; ATen's ops otherwise), at least as accurate: the mean of squares is summed in double.
    eps None is F.rms_norm's default, the machine epsilon of x's compute type (float32's for float16 and bfloat16)."""
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"kernels.rms_norm: x and weight must be torch.Tensors, got {type(x).__name__} and "
                        f"{type(weight).__name__}")
    if eps is None:
        # ATen's default is its opmath type's epsilon: float64's for float64, float32's for every other float.
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        eps = torch.finfo(compute).eps if x.is_floating_point() else 0.0  # not a float x: the op's dtype error
    return torch.ops.kernels.rms_norm.default(x, weight, eps_value("rms_norm", eps))


def _reciprocal_rms(x, eps):
    """r over x's last dimension (kept), as the kernels compute it: the mean of squares in double, r rounded to x's
    compute type (float, double for double) once."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.double().square().mean(-1, keepdim=True).add(eps).rsqrt().to(compute)


def _formula(x, weight, eps):
    """rms_norm in plain ops (the batching rules' path where the weight is batched)."""
    r = _reciprocal_rms(x, eps)
    return weight * (x.to(r.dtype) * r).to(x.dtype)


# ---- torch.func.vmap -------------------------------------------------------------------------------------------------
# rms_norm acts on the last dimension: a batched x takes the op with its batch first where the weight is shared;
# otherwise, and for the backward (whose grad_weight sums over every row), the formulas in plain ops.

def _batch_first(info, t, dim):
    return t.movedim(dim, 0) if dim is not None else t.expand(info.batch_size, *t.shape)


def _member_weights(info, weight, x):
    """The batch-first weight (batch, columns) shaped to broadcast over x's rows (batch, ..., columns)."""
    return weight.reshape(info.batch_size, *([1] * (x.dim() - 2)), weight.shape[-1])


def _rms_norm_vmap(info, in_dims, x, weight, eps):
    x_dim, weight_dim = in_dims[0], in_dims[1]  # (eps has one too)
    if weight_dim is None:
        return torch.ops.kernels.rms_norm(x.movedim(x_dim, 0), weight, eps), 0
    x = _batch_first(info, x, x_dim)
    return _formula(x, _member_weights(info, weight.movedim(weight_dim, 0), x), eps), 0


def _rms_norm_backward_vmap(info, in_dims, grad_y, x, weight, eps):
    # The backward's closed form in plain ops (no autograd inside a transform), grad_weight summed over each batch
    # member's rows.
    grad_y, x, weight = (_batch_first(info, t, d) for t, d in zip((grad_y, x, weight), in_dims))
    r = _reciprocal_rms(x, eps)
    r64, x64, g64 = r.double(), x.double(), grad_y.double()
    gw = g64 * _member_weights(info, weight, x).double()
    grad_x = (r64 * (gw - x64 * r64.square() * (gw * x64).mean(-1, keepdim=True))).to(x.dtype)
    h = (x.to(r.dtype) * r).to(x.dtype).double()
    grad_weight = (g64 * h).reshape(info.batch_size, -1, x.shape[-1]).sum(1).to(weight.dtype)
    return (grad_x, grad_weight), (0, 0)


def _register_fakes_and_batching_rules():
    torch.library.register_fake("kernels::rms_norm", _rms_norm_fake)
    torch.library.register_fake("kernels::rms_norm_backward", _rms_norm_backward_fake)
    torch.library.register_vmap("kernels::rms_norm", _rms_norm_vmap)
    torch.library.register_vmap("kernels::rms_norm_backward", _rms_norm_backward_vmap)


loader.register_once("rms_norm", _register_fakes_and_batching_rules)
