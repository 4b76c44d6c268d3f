"""The attention family's Python side: the op's fake and autograd, and attention().

Op (schema in attention.cpp):
  attention(query, key, value, is_causal, scale) -> (output, logsumexp)
      softmax(query key^T * scale (causal mask from the top left), dim=-1) value, fp32-accurate on fp16 tensor cores
      for float32 CUDA tensors with head dim 64; logsumexp: each row's log-sum-exp of its scaled scores
      (batch, heads, rows rounded up to 32, the padding's values unspecified), as PyTorch's memory-efficient
      attention keeps it.
  _attention_force_plain(plain) -> previous: every head on the plain fp32 kernel (tests).
  _attention_force_mma_sync(mma_sync) -> previous: the split kernel's products on mma.sync (the sm_80 kernel) on
      Hopper too, where wgmma's run by default (tests).

The gradient: eager's (float32 CUDA with as many kv heads as heads: PyTorch's memory-efficient attention, its forward
recomputed for the output and logsumexp its backward reads), else, and wherever a graph of the backward is asked for,
the gradient of the same formula in ATen's ops (float16 and bfloat16 computed in float32); under torch.func's
transforms and with forward-mode tangents attention() is that formula itself (heads at dim -3, so that vmap's calls
without the batch dimension read them). fp32_gemm routes only calls that need no gradient.
"""

import math
import numbers

import torch
from torch.autograd import forward_ad

from kernels import loader
from kernels.checks import check_float_tensor, check_same

loader.load_library()

_ALIGN_LSE = 32  # the logsumexp rows' padding, PyTorch's memory-efficient attention's


def _attention_fake(query, key, value, is_causal, scale):
    # The op's own checks (attention.cpp, check_operands): this is also the meta device's kernel, which a call mixing
    # meta and real tensors reaches.
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_float_tensor("attention", name, t)
    for name, t in (("key", key), ("value", value)):
        check_same("attention", name, t, "query", query)
    torch._check(query.dim() == 4 and key.dim() == 4 and value.dim() == 4, lambda: "kernels.attention: query, key and "
                 f"value must have 4 dimensions (batch, heads, rows, head dim), got shapes {tuple(query.shape)}, "
                 f"{tuple(key.shape)} and {tuple(value.shape)}")
    torch._check(key.shape == value.shape, lambda: f"kernels.attention: key and value must have the same shape, got "
                 f"{tuple(key.shape)} and {tuple(value.shape)}")
    torch._check(query.shape[0] == key.shape[0] and query.shape[3] == key.shape[3], lambda: f"kernels.attention: "
                 f"query {tuple(query.shape)} and key {tuple(key.shape)} must have the same batch and head dim")
    _check_heads(query.shape[1], key.shape[1])
    batch, heads, rows, dim = query.shape
    out = query.new_empty((batch, rows, heads, dim)).permute(0, 2, 1, 3)
    lse = query.new_empty((batch, heads, (rows + _ALIGN_LSE - 1) // _ALIGN_LSE * _ALIGN_LSE))
    return out, lse


def _check_heads(heads, kv_heads):
    # No heads at all is an empty call, as eager's.
    torch._check(heads % kv_heads == 0 if kv_heads > 0 else heads == 0, lambda: f"kernels.attention: query has "
                 f"{heads} heads, which must be a multiple of key's {kv_heads}")


def _setup_context(ctx, inputs, output):
    query, key, value, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse)
    ctx.is_causal, ctx.scale = is_causal, scale


def _reference(query, key, value, is_causal, scale):
    """The formula in ATen's ops (kv heads repeated for their query heads). float16 and bfloat16 are computed in
    float32 and rounded once at the end, as eager's kernels accumulate: rounded at each step, the gradients lose
    several times eager's accuracy."""
    dtype = query.dtype
    if dtype in (torch.float16, torch.bfloat16):
        query, key, value = query.float(), key.float(), value.float()
    # Heads at dim -3, as eager's enable_gqa: under vmap each call sees the tensors without their batch dimension.
    group = query.shape[-3] // key.shape[-3] if query.dim() >= 3 and key.dim() >= 3 and key.shape[-3] > 0 else 1
    if group != 1:
        key, value = key.repeat_interleave(group, -3), value.repeat_interleave(group, -3)
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        rows, keys = scores.shape[-2:]
        mask = torch.ones(rows, keys, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return (scores.softmax(-1) @ value).to(dtype)


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse = ctx.saved_tensors
    needs = ctx.needs_input_grad[:3]
    if grad_out is None:
        return None, None, None, None, None
    # With a graph of the backward asked for (create_graph), the formula's gradient on the saved inputs themselves, so
    # that a double backward reaches them, as eager's math attention does.
    create_graph = torch.is_grad_enabled()
    if (not create_graph and query.is_cuda and query.dtype == torch.float32 and query.shape[1] == key.shape[1]
            and query.numel() > 0 and key.numel() > 0):
        # Eager's memory-efficient backward, in its (batch, rows, heads, head dim) layout, on the output and
        # logsumexp of its own forward, recomputed: it recomputes the probabilities from the logsumexp, which must
        # come from its own scores' arithmetic (this op's, more accurate, leave its gradients less so).
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        mask_type = 1 if ctx.is_causal else 0  # 1: causal from the top left
        out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
            q, k, v, None, None, None, query.shape[2], key.shape[2], 0.0, mask_type, True, scale=ctx.scale)
        grads = torch.ops.aten._efficient_attention_backward(
            grad_out.transpose(1, 2), q, k, v, None, out, None, None, query.shape[2], key.shape[2], lse, 0.0, seed,
            offset, mask_type, False, scale=ctx.scale)
        grad_q, grad_k, grad_v = (g.transpose(1, 2) for g in grads[:3])
    else:
        with torch.enable_grad():
            # Under create_graph each slot an alias of its own, so that an input passed twice (attention(x, x, x)) is
            # not given its whole gradient in each slot.
            inputs = [t.view_as(t) if create_graph else t.detach().requires_grad_(n)
                      for t, n in zip((query, key, value), needs)]
            recomputed = _reference(*inputs, ctx.is_causal, ctx.scale)
            wanted = [t for t, n in zip(inputs, needs) if n]
            found = iter(torch.autograd.grad(recomputed, wanted, grad_out, create_graph=create_graph))
            grad_q, grad_k, grad_v = (next(found) if n else None for n in needs)
    return (grad_q if needs[0] else None, grad_k if needs[1] else None, grad_v if needs[2] else None, None, None)


def attention(query, key, value, is_causal=False, scale=None):
    """F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale) without a mask or
    dropout, query (batch, heads, rows, head dim), key and value (batch, kv heads, key rows, head dim), heads a
    multiple of kv heads. Float32 CUDA tensors of head dim 64 take the fp32-accurate split kernels."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"kernels.attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"kernels.attention: is_causal must be a bool, got {type(is_causal).__name__}")
    # As eager's: a number or a one-element tensor (float() would take a string).
    if not (scale is None or isinstance(scale, numbers.Real)
            or (isinstance(scale, torch.Tensor) and scale.numel() == 1)):
        raise TypeError(f"kernels.attention: scale must be a number or None, got {type(scale).__name__}")
    if query.dim() > 0 and query.shape[-1] == 0:
        # No head dim: eager's own call, whose result (an empty output) or error on each device is the one to give.
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    # The devices autocast serves here (a constant set: torch.compile cannot trace is_autocast_available).
    if query.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(query.device.type):
        # Eager's own call, which autocast casts as its policy says (its result in the autocast dtype).
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=bool(is_causal), scale=float(scale),
            enable_gqa=query.dim() > 1 and key.dim() > 1 and query.shape[-3] != key.shape[-3])
    if _transformed(query, key, value):
        # torch.func's transforms and forward-mode tangents: the formula in ATen's ops, which carry them to any order.
        _check_transformed(query, key, value)
        return _reference(query, key, value, bool(is_causal), float(scale))
    return torch.ops.kernels.attention.default(query, key, value, bool(is_causal), float(scale))[0]


def _check_transformed(query, key, value):
    """The op's checks that hold for any number of dimensions (vmap's calls see fewer than the op's 4)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_float_tensor("attention", name, t)
    for name, t in (("key", key), ("value", value)):
        check_same("attention", name, t, "query", query)
    torch._check(key.shape == value.shape, lambda: f"kernels.attention: key and value must have the same shape, got "
                 f"{tuple(key.shape)} and {tuple(value.shape)}")
    if query.dim() >= 3 and key.dim() >= 3:
        _check_heads(query.shape[-3], key.shape[-3])


def _transformed(*tensors):
    """Whether a torch.func transform is active or a tensor carries a forward-mode tangent."""
    if torch._C._are_functorch_transforms_active():
        return True
    return forward_ad._current_level >= 0 and any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _register_fake_and_autograd():
    torch.library.register_fake("kernels::attention", _attention_fake)
    torch.library.register_autograd("kernels::attention", _backward, setup_context=_setup_context)


loader.register_once("attention", _register_fake_and_autograd)
