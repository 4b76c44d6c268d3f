"""The tensor cores' measured rates for the split GEMMs' instructions: mma.sync m16n8k16 (fp16 in, fp32 accumulate),
alone and fed by ldmatrix at the sm_80 kernel's ratio, beside cuBLAS's fp16 and fp32 GEMMs; the ceilings in
kernels/gemm/NOTES.md.

    python tools/tensor_core_rates.py      # on the GPU machine, from the repo root

Rows:
  mma.sync, W warps per SM   independent m16n8k16 products in registers (8 accumulators per warp, no memory): the
                             instruction's peak at that occupancy (the sm_80 kernel runs 8 warps per SM).
  ldmatrix + mma.sync        per 16 of k, 12 ldmatrix.x4 from a 128-byte-swizzled tile, then 48 products into 16
                             accumulators: the sm_80 kernel's inner step (a 64 x 32 warp tile, three products) with
                             no pipeline, barrier or promotion around it: the most that kernel's warp tile can reach.
  cuBLAS fp16 / fp32         torch.mm at the problem's shape (1024 x 8192 x 8192), fp16 with fp32 accumulation, fp32.
Each the median of 20 samples (kernels.timing, no L2 flush: the operands are meant to stay cached); TFLOP/s counts
2 m n k per product.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

SOURCE = r"""
#include <cstdint>
#include <cuda_runtime.h>
#include <torch/extension.h>

__device__ __forceinline__ void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void load_x4(std::uint32_t address, std::uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// fp16 values near 1 with varied low bits (the tensor cores' power, and so their clock, depends on the data).
__device__ __forceinline__ std::uint32_t operand(int salt) {
  const std::uint32_t low = (threadIdx.x * 2654435761u + salt * 40503u) & 0x03ff03ffu;
  return 0x3c003c00u | low;
}

__global__ void __launch_bounds__(1024) mma_only(float* out, int iterations) {
  std::uint32_t a[4] = {operand(1), operand(2), operand(3), operand(4)};
  const std::uint32_t b0 = operand(5), b1 = operand(6);
  float acc[8][4] = {};
  for (int i = 0; i < iterations; ++i) {
#pragma unroll
    for (int c = 0; c < 8; ++c) mma(acc[c], a, b0, b1);
  }
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; ++c) sum += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  if (sum == 1234.5f) out[threadIdx.x] = sum;  // never true; keeps the products
}

// The sm_80 kernel's step: a warp's 64 x 32 tile, x_hi, x_lo (4 m16 fragments each) and w_hi, w_lo (2 pairs of n8
// fragments each) by ldmatrix.x4 from 128-byte rows with 16-byte unit u at u ^ (row % 8), then three products per
// fragment pair.
// At most 512 threads, the 16-warp row's block: 128 registers, which ptxas meets for sm_90a as it is and for sm_80
// with a 20-byte spill.
__global__ void __launch_bounds__(512) ldmatrix_mma(float* out, int iterations) {
  extern __shared__ __align__(128) unsigned char tiles[];  // 4 tiles of 128 rows x 128 bytes
  for (int i = threadIdx.x; i < 4 * 128 * 32; i += blockDim.x)
    reinterpret_cast<std::uint32_t*>(tiles)[i] = operand(i);
  __syncthreads();
  const std::uint32_t base = static_cast<std::uint32_t>(__cvta_generic_to_shared(tiles));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warp_x = warp % 2, warp_w = (warp / 2) % 4;
  const auto swizzled = [](int row, int unit) {
    return static_cast<std::uint32_t>(row * 128 + ((unit ^ (row % 8)) * 16));
  };
  float acc[4][4][4] = {};
  for (int i = 0; i < iterations; ++i) {
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      std::uint32_t a_hi[4][4], a_lo[4][4], b_hi[2][4], b_lo[2][4];
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        const std::uint32_t offset = swizzled(warp_x * 64 + f * 16 + lane % 16, 2 * step + lane / 16);
        load_x4(base + offset, a_hi[f]);
        load_x4(base + 16384 + offset, a_lo[f]);
      }
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const std::uint32_t offset =
            swizzled(warp_w * 32 + p * 16 + lane % 8 + 8 * (lane / 16), 2 * step + (lane / 8) % 2);
        load_x4(base + 32768 + offset, b_hi[p]);
        load_x4(base + 49152 + offset, b_lo[p]);
      }
#pragma unroll
      for (int f = 0; f < 4; ++f)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma(acc[f][j], a_hi[f], b_lo[j / 2][2 * (j % 2)], b_lo[j / 2][2 * (j % 2) + 1]);
#pragma unroll
      for (int f = 0; f < 4; ++f)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma(acc[f][j], a_lo[f], b_hi[j / 2][2 * (j % 2)], b_hi[j / 2][2 * (j % 2) + 1]);
#pragma unroll
      for (int f = 0; f < 4; ++f)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma(acc[f][j], a_hi[f], b_hi[j / 2][2 * (j % 2)], b_hi[j / 2][2 * (j % 2) + 1]);
    }
  }
  float sum = 0.0f;
#pragma unroll
  for (int f = 0; f < 4; ++f)
#pragma unroll
    for (int j = 0; j < 4; ++j) sum += acc[f][j][0] + acc[f][j][1] + acc[f][j][2] + acc[f][j][3];
  if (sum == 1234.5f) out[threadIdx.x] = sum;
}

// Launches `kernel` (0: mma_only, 1: ldmatrix_mma) on blocks x warps; returns nothing (timed by the caller).
void launch_rate_kernel(int64_t kernel, int64_t blocks, int64_t warps, int64_t iterations, torch::Tensor out) {
  const cudaStream_t stream = 0;
  if (kernel == 0) {
    mma_only<<<blocks, warps * 32, 0, stream>>>(out.data_ptr<float>(), static_cast<int>(iterations));
  } else {
    cudaFuncSetAttribute(ldmatrix_mma, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
    ldmatrix_mma<<<blocks, warps * 32, 65536, stream>>>(out.data_ptr<float>(), static_cast<int>(iterations));
  }
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "launch failed");
}
"""

DECLARATION = ("void launch_rate_kernel(int64_t kernel, int64_t blocks, int64_t warps, int64_t iterations, "
               "torch::Tensor out);")

# Products per warp per iteration of each kernel.
PRODUCTS_PER_ITERATION = {0: 8, 1: 4 * 48}


def build():
    from torch.utils.cpp_extension import load_inline

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}{'a' if major == 9 else ''}"
    return load_inline("tensor_core_rates", cpp_sources=DECLARATION, cuda_sources=SOURCE,
                       functions=["launch_rate_kernel"],
                       extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"], verbose=False)


def main():
    from kernels.timing import time_ms

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    module = build()
    processors = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(1024, device="cuda")
    print(f"{torch.cuda.get_device_name()}, {processors} SMs")
    print(f"{'case':<44} {'ms':>8} {'TFLOP/s':>8}")
    for kernel, warps_per_sm, iterations in ((0, 4, 20000), (0, 8, 20000), (0, 16, 10000), (0, 32, 5000),
                                             (1, 8, 2000), (1, 16, 1000)):
        blocks, warps = (processors, warps_per_sm) if warps_per_sm <= 32 else (processors * 2, warps_per_sm // 2)
        ms = time_ms(lambda: module.launch_rate_kernel(kernel, blocks, warps, iterations, out), samples=20,
                     flush_l2=False)
        flops = blocks * warps * iterations * PRODUCTS_PER_ITERATION[kernel] * 2 * 16 * 8 * 16
        name = (f"mma.sync, {warps_per_sm} warps per SM" if kernel == 0
                else f"ldmatrix + mma.sync (64x32 tile), {warps_per_sm} warps/SM")
        print(f"{name:<44} {ms:8.3f} {flops / ms / 1e9:8.1f}")
    m, k, n = 1024, 8192, 8192
    for dtype in (torch.float16, torch.float32):
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        ms = time_ms(lambda: torch.mm(a, b), samples=20, flush_l2=False)
        print(f"{'cuBLAS ' + str(dtype).replace('torch.', '') + ' 1024x8192x8192':<44} {ms:8.3f} "
              f"{2 * m * n * k / ms / 1e9:8.1f}")


if __name__ == "__main__":
    main()
