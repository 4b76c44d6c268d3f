"""The GELU (tanh approximation) family's Python side: fake (meta) implementations, batching rules, the function
gelu_tanh() and the layer GELUTanh.

Ops (schemas in gelu_tanh.cpp):
  gelu_tanh(x) -> y                                  0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  gelu_tanh_backward(grad_output, x) -> grad_input   grad_output * d gelu_tanh(x) / dx

The autograd of both ops is C++ (gelu_tanh_autograd.cpp): reverse mode to any order, and forward mode.
"""

import torch

from kernels import loader
from kernels.checks import check_float_tensor, check_same

loader.load_library()


# The fakes make the C++ ops' checks (gelu_tanh.cpp): they are also the ops' Meta kernels, picked where any tensor is
# on meta, so mixed devices raise there too.
def _gelu_tanh_fake(x):
    check_float_tensor("gelu_tanh", "x", x)
    return torch.empty_like(x)


def _gelu_tanh_backward_fake(grad_output, x):
    check_float_tensor("gelu_tanh_backward", "grad_output", grad_output)
    check_same("gelu_tanh_backward", "x", x, "grad_output", grad_output)
    torch._check(x.shape == grad_output.shape, lambda: "kernels.gelu_tanh_backward: grad_output has shape "
                 f"{list(grad_output.shape)} but x has shape {list(x.shape)}")
    return torch.empty_like(grad_output)


def gelu_tanh(x):
    """minGPT's NewGELU, 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), in one sweep over memory (backward too),
    computed in float (double for float64) and rounded once."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"kernels.gelu_tanh: x must be a torch.Tensor, got {type(x).__name__}")
    return torch.ops.kernels.gelu_tanh.default(x)


class GELUTanh(torch.nn.Module):
    """nn.GELU(approximate="tanh") (minGPT's NewGELU) on gelu_tanh()."""

    def forward(self, x):
        return gelu_tanh(x)


# ---- torch.func.vmap: element-wise, so the ops apply to the batched tensors as they are ----------------------------

def _gelu_tanh_vmap(info, in_dims, x):
    return torch.ops.kernels.gelu_tanh(x), in_dims[0]


def _gelu_tanh_backward_vmap(info, in_dims, grad_output, x):
    # Both operands with the batch first (one of them may have none: a broadcast view).
    grad_output, x = (t.movedim(d, 0) if d is not None else t.expand(info.batch_size, *t.shape)
                      for t, d in zip((grad_output, x), in_dims))
    return torch.ops.kernels.gelu_tanh_backward(grad_output, x), 0


def _register_fakes_and_batching_rules():
    torch.library.register_fake("kernels::gelu_tanh", _gelu_tanh_fake)
    torch.library.register_fake("kernels::gelu_tanh_backward", _gelu_tanh_backward_fake)
    torch.library.register_vmap("kernels::gelu_tanh", _gelu_tanh_vmap)
    torch.library.register_vmap("kernels::gelu_tanh_backward", _gelu_tanh_backward_vmap)


loader.register_once("gelu_tanh", _register_fakes_and_batching_rules)
