"""Argument checks the families' Python sides share: the C++ ops' checks (kernels/common/torch_checks.h) for their
fakes (under tracing and on the meta device the fakes stand in for the C++ ops, so they raise the same messages), and
the functions' number arguments. Plain functions of torch alone: the export copies them into a candidate beside the
families' modules."""

import numbers

import torch


def check_float_tensor(op, name, t):
    """torch_checks.h's check_float_tensor: t of a dtype the kernels take."""
    torch._check(t.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16),
                 lambda: f"kernels.{op}: {name} must be a float32, float64, float16 or bfloat16 tensor, got {t.dtype}")


def check_same(op, name, t, ref_name, ref):
    """torch_checks.h's check_same: t on ref's device, of ref's dtype."""
    torch._check(t.device == ref.device, lambda: f"kernels.{op}: expected {name} and {ref_name} on the same device, "
                                                 f"got {name} on {t.device} and {ref_name} on {ref.device}")
    torch._check(t.dtype == ref.dtype, lambda: f"kernels.{op}: expected {name} and {ref_name} to have the same dtype, "
                                               f"got {name} {t.dtype} and {ref_name} {ref.dtype}")


def check_like_x(op, name, t, x, note=""):
    """The C++ ops' checks of a tensor that must be as x is (a residual, an output gradient): check_float_tensor,
    check_same, then x's shape."""
    check_float_tensor(op, name, t)
    check_same(op, name, t, "x", x)
    torch._check(t.shape == x.shape, lambda: f"kernels.{op}: {name} has shape {list(t.shape)} but x has shape "
                                             f"{list(x.shape)}{note}")


def eps_value(op, eps):
    """eps as eager's norms take it, a number or a one-element tensor, as a float; anything else a TypeError naming
    the op (float() would take a string)."""
    if not (isinstance(eps, numbers.Real) or (isinstance(eps, torch.Tensor) and eps.numel() == 1)):
        raise TypeError(f"kernels.{op}: eps must be a number, got {type(eps).__name__}")
    return float(eps)
