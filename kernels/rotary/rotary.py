"""The rotary embedding family's Python side: fakes and batching rules of its ops, and rotary_embedding().

Ops (schemas in rotary.cpp):
  rotary_embedding(q, k, cos, sin) -> (q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin), cos and sin
      unsqueezed at dim 1 (transformers' apply_rotary_pos_emb, LLaMA's): q and k (batch, heads, tokens, head dim; k's
      heads may be fewer), cos and sin (batch or 1, tokens, head dim), the head dim even, all of one dtype; computed in
      double, then rounded to the dtype, the results laid out as q and k (empty_like).
  rotary_embedding_backward(grad_q_embed, grad_k_embed, cos, sin) -> (grad_q, grad_k), the same way.
  _rotary_force_generic(generic) -> previous: every CUDA call on the generic kernel (any strides), for tests.
Autograd of both ops is C++ (rotary_autograd.cpp): the backward kernel for a first-order backward, ATen's formulas
(rotary_op.h) for higher orders, forward mode and angles that need a gradient.
"""

import torch

from kernels import loader
from kernels.checks import check_float_tensor, check_same

loader.load_library()


def _check_operands(op, q_name, q, k_name, k, cos, sin):
    # The C++ checks' messages, for meta tensors and tracing (the fakes stand in for the C++ ops there).
    for name, t in ((q_name, q), (k_name, k), ("cos", cos), ("sin", sin)):
        check_float_tensor(op, name, t)
    check_same(op, k_name, k, q_name, q)
    check_same(op, "cos", cos, q_name, q)
    check_same(op, "sin", sin, q_name, q)
    torch._check(q.dim() == 4 and k.dim() == 4, lambda: f"kernels.{op}: {q_name} and {k_name} must be 4-D (batch, "
                                                        f"heads, tokens, head dim), got shapes {list(q.shape)} and "
                                                        f"{list(k.shape)}")
    torch._check(k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2] and k.shape[3] == q.shape[3],
                 lambda: f"kernels.{op}: {k_name} has shape {list(k.shape)} but {q_name} has shape {list(q.shape)} "
                         f"(batch, tokens and head dim must match)")
    torch._check(q.shape[3] % 2 == 0, lambda: f"kernels.{op}: the head dim must be even (its halves are rotated "
                                              f"together), got {q.shape[3]}")
    torch._check(cos.dim() == 3 and sin.shape == cos.shape and cos.shape[1] == q.shape[2]
                 and cos.shape[2] == q.shape[3] and (cos.shape[0] == 1 or cos.shape[0] == q.shape[0]),
                 lambda: f"kernels.{op}: cos and sin must both be (batch or 1, tokens, head dim) = ({q.shape[0]} or 1, "
                         f"{q.shape[2]}, {q.shape[3]}), got {list(cos.shape)} and {list(sin.shape)}")


def _rotary_embedding_fake(q, k, cos, sin):
    _check_operands("rotary_embedding", "q", q, "k", k, cos, sin)
    return torch.empty_like(q), torch.empty_like(k)


def _rotary_embedding_backward_fake(grad_q_embed, grad_k_embed, cos, sin):
    _check_operands("rotary_embedding_backward", "grad_q_embed", grad_q_embed, "grad_k_embed", grad_k_embed, cos, sin)
    return torch.empty_like(grad_q_embed), torch.empty_like(grad_k_embed)


def rotary_embedding(q, k, cos, sin):
    """(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin) with cos and sin unsqueezed at dim 1, as
    transformers' apply_rotary_pos_emb (LLaMA's, Mistral's, Qwen2's) computes it, in one sweep over q and k forward
    and backward, computed in double, then rounded to the dtype. q and k: (batch, heads, tokens, head dim), k's heads
    may be fewer; cos and sin: (batch or 1, tokens, head dim); the head dim even; one dtype. The results are laid out
    as q and k (torch.empty_like's layout, as eager's element-wise ops give)."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"kernels.rotary_embedding: {name} must be a torch.Tensor, got {type(t).__name__}")
    return torch.ops.kernels.rotary_embedding.default(q, k, cos, sin)


# ---- torch.func.vmap: the formulas on the batched tensors, the vmapped dim first -------------------------------------

def _rotate(x, cos, sin, transposed):
    # rotary_op.h's rotate_aten on tensors with any dims before (heads, tokens, dim), cos and sin's heads dim inserted;
    # the result contiguous (broadcast over the vmapped dim where only the angles carry it).
    half = x.shape[-1] // 2
    xd, c, s = x.double(), cos.double().unsqueeze(-3), sin.double().unsqueeze(-3)
    x1, x2, c1, c2, s1, s2 = xd[..., :half], xd[..., half:], c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    y1 = x1 * c1 + x2 * s2 if transposed else x1 * c1 - x2 * s1
    y2 = x2 * c2 - x1 * s1 if transposed else x2 * c2 + x1 * s2
    return torch.cat((y1, y2), -1).to(x.dtype).contiguous()


def _vmap_rule(transposed):
    def rule(info, in_dims, q, k, cos, sin):
        front = [t.movedim(d, 0) if d is not None else t for t, d in zip((q, k, cos, sin), in_dims)]
        # The op's checks on one sample's tensors (the formulas below would broadcast what the op refuses).
        names = ("grad_q_embed", "grad_k_embed") if transposed else ("q", "k")
        sample = [t[0] if d is not None else t for t, d in zip(front, in_dims)]
        _check_operands("rotary_embedding_backward" if transposed else "rotary_embedding", names[0], sample[0],
                        names[1], sample[1], sample[2], sample[3])
        q, k, cos, sin = front
        q_out, k_out = _rotate(q, cos, sin, transposed), _rotate(k, cos, sin, transposed)
        # Each result carries the vmapped dim where one of its operands did (broadcast to its front).
        return (q_out, k_out), tuple(0 if t.dim() > 4 else None for t in (q_out, k_out))
    return rule


def _register_fakes_and_batching_rules():
    torch.library.register_fake("kernels::rotary_embedding", _rotary_embedding_fake)
    torch.library.register_fake("kernels::rotary_embedding_backward", _rotary_embedding_backward_fake)
    torch.library.register_vmap("kernels::rotary_embedding", _vmap_rule(transposed=False))
    torch.library.register_vmap("kernels::rotary_embedding_backward", _vmap_rule(transposed=True))


loader.register_once("rotary", _register_fakes_and_batching_rules)
