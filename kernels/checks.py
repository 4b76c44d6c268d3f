"""The C++ ops' argument checks (kernels/common/torch_checks.h) in Python, for the families' fakes: under tracing and
on the meta device the fakes stand in for the C++ ops, so they raise the same messages. Plain functions of torch
alone: the export copies them into a candidate beside the families' modules."""

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
