"""Peak device memory and gradient errors of one fp32 training step of gemm_multiply_leaky_relu at the problem's
size (1024x8192 -> 8192): eager against ModelNew, each gradient's error against float64 through that forward's own
branch mask (tests/test_gemm.py, float64_gradients).

    python tools/train_step_memory.py     # on the GPU machine, from the repo root
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch
import torch.nn.functional as F

import reference
from kernels.precision import relative_error
from model_new import GemmMultiplyLeakyReLUModelNew
from test_gemm import float64_gradients


def main():
    init = reference.gemm_multiply_leaky_relu_get_init_inputs()
    multiplier, slope = init[2], init[3]
    torch.manual_seed(0)
    eager = reference.GemmMultiplyLeakyReLUModel(*init).cuda()
    torch.manual_seed(0)
    new = GemmMultiplyLeakyReLUModelNew(*init).cuda()
    x = torch.randn(1024, init[0], device="cuda", requires_grad=True)
    grad_y = torch.randn(1024, init[1], device="cuda")
    print(f"{'variant':>9} {'peak MiB over held':>18} {'err grad_x':>11} {'err grad_W':>11} {'err grad_b':>11}")
    for name, model in (("eager", eager), ("ModelNew", new)):
        for _ in range(2):  # the second step is measured: the first loads kernels and makes handles
            model.zero_grad(set_to_none=True)
            x.grad = None
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            model(x).backward(grad_y)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - held
        with torch.no_grad():
            positive = F.linear(x, model.gemm.weight, model.gemm.bias) * multiplier > 0
            if name == "ModelNew":
                positive = torch.ops.kernels.gemm_multiply_leaky_relu(x, new.gemm.weight, new.gemm.bias, multiplier,
                                                                      slope, True)[1]
        references = float64_gradients(x.detach(), model.gemm.weight.detach(), grad_y, positive, multiplier, slope)
        errors = [relative_error(g, r) for g, r in zip((x.grad, model.gemm.weight.grad, model.gemm.bias.grad),
                                                       references)]
        print(f"{name:>9} {peak / 2**20:18.1f} {errors[0]:11.3e} {errors[1]:11.3e} {errors[2]:11.3e}")


if __name__ == "__main__":
    main()
