"""Device experiment: block size, packs per thread and cache hints of a float32 LeakyReLU streaming kernel, timed
against eager F.leaky_relu and a device-to-device copy of the same 6.44 GB (cupy compiles the variants)."""

import os
import sys

import cupy
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import time_ms  # noqa: E402

SOURCE = r"""
template <int kThreads, int kUnroll, int kHint>
__global__ void __launch_bounds__(kThreads) lr(const float4* __restrict__ x, float4* __restrict__ y,
                                               long long packs, float slope) {
  const long long base = (long long)blockIdx.x * kThreads * kUnroll + threadIdx.x;
  float4 v[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const long long i = base + (long long)k * kThreads;
    if (i < packs) v[k] = kHint == 1 ? __ldcs(x + i) : kHint == 3 ? __ldlu(x + i) : x[i];
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const long long i = base + (long long)k * kThreads;
    float4 r;
    r.x = v[k].x > 0.f ? v[k].x : v[k].x * slope;
    r.y = v[k].y > 0.f ? v[k].y : v[k].y * slope;
    r.z = v[k].z > 0.f ? v[k].z : v[k].z * slope;
    r.w = v[k].w > 0.f ? v[k].w : v[k].w * slope;
    if (i < packs) {
      if (kHint == 1 || kHint == 2) __stcs(y + i, r); else y[i] = r;
    }
  }
}
"""
VARIANTS = [(128, 1, 0), (256, 1, 0), (512, 1, 0), (128, 2, 0), (256, 2, 0), (128, 4, 0), (256, 4, 0),
            (256, 4, 1), (256, 4, 2), (256, 2, 2), (128, 1, 2), (256, 8, 0), (1024, 1, 0)]
names = [f"lr<{t},{u},{h}>" for t, u, h in VARIANTS]
module = cupy.RawModule(code=SOURCE, options=("-std=c++17",), name_expressions=names)


x = torch.randn(4096, 393216, device="cuda")
y = torch.empty_like(x)
packs = x.numel() // 4
stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
cx, cy = cupy.from_dlpack(x), cupy.from_dlpack(y)
copy_ms = time_ms(lambda: y.copy_(x))
eager_ms = time_ms(lambda: F.leaky_relu(x, 0.01))
print(f"copy {copy_ms:.4f} ms, eager {eager_ms:.4f} ms ({copy_ms / eager_ms * 100:.1f}% of copy)")
expected = F.leaky_relu(x, 0.01)
for (threads, unroll, hint), name in zip(VARIANTS, names):
    kernel = module.get_function(name)
    grid = (packs + threads * unroll - 1) // (threads * unroll)
    run = lambda: kernel((grid,), (threads,), (cx, cy, cupy.int64(packs), cupy.float32(0.01)), stream=stream)
    ms = time_ms(run)
    ok = torch.equal(y, expected)
    print(f"threads {threads:4d} unroll {unroll} hint {hint}: {ms:.4f} ms, {copy_ms / ms * 100:.1f}% of copy, "
          f"{eager_ms / ms:.3f}x eager, correct={ok}")
