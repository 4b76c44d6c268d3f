"""The causal softmax family's Python side: fakes and batching rules of its ops, and causal_softmax().
Ops (schemas in causal_softmax.cpp):
  causal_softmax(scores, scale) -> softmax(scores * scale, dim=-1) with column j of query row i masked (-inf) where
      j > i + (Tk - Tq) over the last two dimensions (Tq rows, Tk columns; j > i when square). Masked outputs are 0;
      where Tk < Tq the first Tq - Tk rows are all masked and NaN, as in eager.
  causal_softmax_backward(grad_output, output, scale) -> scale * output * (grad_output - sum(grad_output * output,
      -1)) on unmasked entries, 0 * scale on masked ones (grad_output there is not read).
Autograd of both ops is C++ (causal_softmax_autograd.cpp): reverse mode to any order and forward mode.
"""

import weakref

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


_MASK_VERDICT = "_causal_mask_verdict"  # the attribute of the owner that keeps causal_mask_verdict's verdict


def causal_mask_verdict(owner, mask, keep=True):
    """Whether `mask` is a (1, 1, S, S) tensor nonzero exactly on and below its diagonal: the causal mask, as
    `masked_fill(mask == 0, -inf)` applies it, so causal_softmax computes what that formula computes. The check reads
    the mask back to the host; its verdict is kept in owner.__dict__ (keep) for that tensor (a weak reference), its
    version and its data, so a change made through PyTorch is seen, and the owner's __getstate__ drops it
    (without_mask_verdict). False, not checked, for an inference tensor (no version counter) and, where no verdict is
    kept, in a CUDA graph's capture or where torch.cuda.set_sync_debug_mode flags syncs."""
    if mask.is_inference():
        return False
    seen = owner.__dict__.get(_MASK_VERDICT)  # (weak reference, version, data pointer, verdict)
    if keep and seen is not None and seen[0]() is mask and seen[1] == mask._version and seen[2] == mask.data_ptr():
        return seen[3]
    if mask.is_cuda and (torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode() != 0):
        return False
    size = mask.shape[-1]
    causal = mask.shape == (1, 1, size, size) and bool(torch.equal(
        mask[0, 0] != 0, torch.ones(size, size, dtype=torch.bool, device=mask.device).tril()))
    owner.__dict__[_MASK_VERDICT] = (weakref.ref(mask), mask._version, mask.data_ptr(), causal)
    return causal


def without_mask_verdict(state):
    """An owner's state for pickling and copying (__getstate__) without causal_mask_verdict's verdict: a copy's mask
    counts its own writes."""
    state = dict(state)
    state.pop(_MASK_VERDICT, None)
    return state


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
