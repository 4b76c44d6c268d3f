"""What the multi-GPU tests share with the checks that tools/checks/ddp_check.py and tools/checks/tp_check.py run
under torchrun: the environment that keeps NVLink multicast off, and the grad_output that leaves LeakyReLU's kink out.
Imports only torch, so the tools can import it too (nothing in tests/ imports tools/)."""

import torch

# NVLink multicast stays off in every multi-GPU process (pytest's subprocesses, torchrun's ranks): nothing here needs
# it, and on a shared multi-GPU host a program that uses it can leave the GPUs unusable.
NO_NVLINK_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def grad_output_away_from_the_kink(pre, generator):
    """A randn grad_output that is zero wherever the reference's pre-activation `pre` is within 1e-4 of its largest
    magnitude from zero. There LeakyReLU's derivative jumps: a pre-activation a rounding error away on the other side
    of zero (the split_fp16 path rounds differently from SGEMM, as SGEMM does from float64) changes that element's
    gradient by (1 - slope) times its grad_output, a difference between two right answers. Everywhere else both
    models apply the same formulas on the same branch, so their gradients must agree. (The stack's inner layers run
    on the cuBLAS path, whose pre-activations are eager's bit for bit, so only the last one needs this.)"""
    grad = torch.randn(pre.shape, device=pre.device, generator=generator)
    return grad.masked_fill(pre.abs() <= 1e-4 * pre.abs().max(), 0.0)
