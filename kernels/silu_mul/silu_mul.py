"""The SwiGLU gate family's Python side: fakes and batching rules of its ops, and silu_mul().

Ops (schemas in silu_mul.cpp):
  silu_mul(gate, up) -> silu(gate) * up (LLaMA's MLP: act_fn(gate_proj(x)) * up_proj(x)), gate and up of one shape
      and dtype, computed in double and rounded once.
  silu_mul_backward(grad_y, gate, up) -> (grad_gate, grad_up), the same way.
Autograd of both ops is C++ (silu_mul_autograd.cpp): the backward kernel for a first-order backward, ATen's formulas
(silu_mul_op.h) for higher orders and forward mode.
"""

import torch

from kernels import loader
from kernels.checks import check_float_tensor, check_same

loader.load_library()

def _check_operands(op, gate, *others):
    # The C++ checks' messages, for meta tensors and tracing (the fakes stand in for the C++ ops there).
    check_float_tensor(op, "gate", gate)
    for name, t in others:
        check_same(op, name, t, "gate", gate)
        torch._check(t.shape == gate.shape, lambda: f"kernels.{op}: {name} has shape {list(t.shape)} but gate has "
                                                    f"shape {list(gate.shape)}")


def _silu_mul_fake(gate, up):
    _check_operands("silu_mul", gate, ("up", up))
    return gate.new_empty(gate.shape)


def _silu_mul_backward_fake(grad_y, gate, up):
    _check_operands("silu_mul_backward", gate, ("up", up), ("grad_y", grad_y))
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def silu_mul(gate, up):
    """silu(gate) * up, as `F.silu(gate) * up` (LLaMA's, Mistral's and Qwen2's MLP gate), in one sweep over memory
    forward and backward, computed in double and rounded once; gate and up of one shape and dtype."""
    if not isinstance(gate, torch.Tensor) or not isinstance(up, torch.Tensor):
        raise TypeError(f"kernels.silu_mul: gate and up must be torch.Tensors, got {type(gate).__name__} and "
                        f"{type(up).__name__}")
    return torch.ops.kernels.silu_mul.default(gate, up)


# ---- torch.func.vmap: element-wise, so the ops apply to the batched tensors with the batch first --------------------

def _front(info, tensors, in_dims):
    return [t.movedim(d, 0) if d is not None else t.expand(info.batch_size, *t.shape) for t, d in zip(tensors, in_dims)]


def _silu_mul_vmap(info, in_dims, gate, up):
    return torch.ops.kernels.silu_mul(*_front(info, (gate, up), in_dims)), 0


def _silu_mul_backward_vmap(info, in_dims, grad_y, gate, up):
    return torch.ops.kernels.silu_mul_backward(*_front(info, (grad_y, gate, up), in_dims)), (0, 0)


def _register_fakes_and_batching_rules():
    torch.library.register_fake("kernels::silu_mul", _silu_mul_fake)
    torch.library.register_fake("kernels::silu_mul_backward", _silu_mul_backward_fake)
    torch.library.register_vmap("kernels::silu_mul", _silu_mul_vmap)
    torch.library.register_vmap("kernels::silu_mul_backward", _silu_mul_backward_vmap)


loader.register_once("silu_mul", _register_fakes_and_batching_rules)
