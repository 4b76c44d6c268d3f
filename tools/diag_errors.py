"""Device diagnosis: does an error raised inside the op library reach Python as a RuntimeError (with and without
autograd), on CPU and CUDA. (The per-call host overhead is tools/per_call.py's.)"""

import subprocess
import sys

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
