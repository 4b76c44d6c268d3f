"""Device diagnosis: does an error raised inside the op library reach Python as a RuntimeError (with and without
autograd), on CPU and CUDA; and the per-call host overhead of the op with and without the autograd layer."""

import os
import subprocess
import sys
import time

CASES = {
    "leaky int cpu": "kernels.leaky_relu(torch.ones(4, dtype=torch.int64))",
    "gemm mismatch cpu nograd": "kernels.gemm_scale_leaky_relu(torch.randn(4,15), torch.randn(8,16))",
    "gemm mismatch cpu grad": "kernels.gemm_scale_leaky_relu(torch.randn(4,15), torch.randn(8,16, requires_grad=True))",
    "gemm mismatch cuda grad": "kernels.gemm_scale_leaky_relu(torch.randn(4,15,device='cuda'), torch.randn(8,16,device='cuda', requires_grad=True))",
    "leaky bwd bad saved cuda grad": "torch.ops.kernels.leaky_relu_backward(torch.randn(4,device='cuda'), torch.randn(5,device='cuda'), 0.1, 1.0)",
    "custom_op raise under grad": "torch.ops.kernels.leaky_relu(torch.ones(3, dtype=torch.float64, requires_grad=True).to(torch.int64) if False else torch.ones(3, requires_grad=True).to(torch.complex64), 0.1)",
}
for name, expr in CASES.items():
    code = f"import torch, kernels\ntry:\n    {expr}\n    print('no error')\nexcept Exception as e:\n    print(type(e).__name__, str(e).splitlines()[0][:150])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"{name:32s} rc={r.returncode} {r.stdout.strip()} {r.stderr.strip().splitlines()[-1:] if r.returncode else ''}")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import kernels
import torch.nn.functional as F

x = torch.randn(16, 16384, device="cuda")
op = torch.ops.kernels.leaky_relu.default


def per_call_us(fn, calls=2000):
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def below_autograd():
    with torch._C._AutoDispatchBelowAutograd():
        return op(x, 0.01)


print(f"eager F.leaky_relu           {per_call_us(lambda: F.leaky_relu(x, 0.01)):.2f} us")
print(f"op through autograd kernel   {per_call_us(lambda: op(x, 0.01)):.2f} us")
print(f"op below autograd            {per_call_us(below_autograd):.2f} us")
with torch.inference_mode():
    print(f"op in inference_mode         {per_call_us(lambda: op(x, 0.01)):.2f} us")
    print(f"eager in inference_mode      {per_call_us(lambda: F.leaky_relu(x, 0.01)):.2f} us")
print(f"torch.empty_like             {per_call_us(lambda: torch.empty_like(x)):.2f} us")
