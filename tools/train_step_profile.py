"""Where one fp32 training step of gemm_multiply_leaky_relu's ModelNew (1024x8192 -> 8192) spends its device time,
kernel by kernel (torch.profiler, 10 steps).

    python tools/train_step_profile.py     # on the GPU machine, from the repo root
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from model_new import GemmMultiplyLeakyReLUModelNew


def main():
    new = GemmMultiplyLeakyReLUModelNew(8192, 8192, 2.0, 0.1).cuda()
    x = torch.randn(1024, 8192, device="cuda", requires_grad=True)
    grad = torch.randn(1024, 8192, device="cuda")
    params = [x, new.gemm.weight, new.gemm.bias]
    for _ in range(3):
        torch.autograd.grad(new(x), params, grad)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            torch.autograd.grad(new(x), params, grad)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))


if __name__ == "__main__":
    main()
