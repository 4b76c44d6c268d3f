"""The causal softmax family's Python side: fakes and batching rules of its ops, and causal_softmax().
Ops (schemas in causal_softmax.cpp):
  causal_softmax(scores, scale) -> softmax(scores * scale, dim=-1) with column j of query row i masked (-inf) where
      j > i + (Tk - Tq) over the last two dimensions (Tq rows, Tk columns; j > i when square). Masked outputs are 0;
      where Tk < Tq the first Tq - Tk rows are all masked and NaN, as in eager.
  causal_softmax_backward(grad_output, output, scale) -> scale * output * (grad_output - sum(grad_output * output,
      -1)) on unmasked entries, 0 * scale on masked ones (grad_output there is not read).
Autograd of both ops is C++ (causal_softmax_autograd.cpp): reverse mode to any order and forward mode.
"""

import torch

from kernels import loader
from kernels.checks import check_float_tensor, check_same

loader.load_library()

def _check_scores(op, name, t):
    # The C++ checks' messages, for meta tensors and tracing (the fakes stand in for the C++ ops there).
    check_float_tensor(op, name, t)
    torch._check(t.dim() >= 2, lambda: f"kernels.{op}: {name} must have at least 2 dimensions (..., query rows, key "
                                       f"columns), got shape {list(t.shape)}")


def _causal_softmax_fake(scores, scale):
    _check_scores("causal_softmax", "scores", scores)
    return scores.new_empty(scores.shape)


def _causal_softmax_backward_fake(grad_output, output, scale):
    _check_scores("causal_softmax_backward", "grad_output", grad_output)
    _check_scores("causal_softmax_backward", "output", output)
    check_same("causal_softmax_backward", "grad_output", grad_output, "output", output)
    torch._check(grad_output.shape == output.shape, lambda: "kernels.causal_softmax_backward: grad_output has shape "
                 f"{list(grad_output.shape)} but output has shape {list(output.shape)}")
    return output.new_empty(output.shape)


def causal_softmax(scores, scale):
    """softmax(scores * scale, dim=-1) under the causal mask (column j of query row i masked where j > i + Tk - Tq),
    as eager's `(scores * scale).masked_fill(~tril, -inf).softmax(-1)`, in one sweep over memory."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"kernels.causal_softmax: scores must be a torch.Tensor, got {type(scores).__name__}")
    return torch.ops.kernels.causal_softmax.default(scores, scale)


# ---- torch.func.vmap -------------------------------------------------------------------------------------------------
# The ops act on the last two dimensions, so the batch dimension goes first, as one more leading dimension.

def _causal_softmax_vmap(info, in_dims, scores, scale):
    return torch.ops.kernels.causal_softmax(scores.movedim(in_dims[0], 0), scale), 0


def _causal_softmax_backward_vmap(info, in_dims, grad_output, output, scale):
    grad_output, output = (t.movedim(d, 0) if d is not None else t.expand(info.batch_size, *t.shape)
                           for t, d in zip((grad_output, output), in_dims))
    return torch.ops.kernels.causal_softmax_backward(grad_output, output, scale), 0


def _register_fakes_and_batching_rules():
    torch.library.register_fake("kernels::causal_softmax", _causal_softmax_fake)
    torch.library.register_fake("kernels::causal_softmax_backward", _causal_softmax_backward_fake)
    torch.library.register_vmap("kernels::causal_softmax", _causal_softmax_vmap)
    torch.library.register_vmap("kernels::causal_softmax_backward", _causal_softmax_backward_vmap)


loader.register_once("causal_softmax", _register_fakes_and_batching_rules)
