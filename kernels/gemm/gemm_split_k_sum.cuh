// The second kernel of a split-K product (gemm.h, launch_split_gemm_split_k): y = the sum of the slices' partial
// products, added in slice order (0, then 1, ...), so that every run gives the same bits. Portable.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace kernels::gemm {
namespace {

constexpr int kSplitKSumThreads = 256;
constexpr int kSplitKSumBlocksPerProcessor = 8;  // a grid-stride loop over enough blocks to keep the loads in flight

// y[i] = ((partials[i] + partials[stride + i]) + partials[2 stride + i]) + ..., for i < count: slice s's partial at
// partials + s * stride. kVectors: 4 floats at a time (count, stride and both pointers in whole 16-byte units).
template <bool kVectors>
__global__ void __launch_bounds__(kSplitKSumThreads)
split_k_sum_kernel(const float* __restrict__ partials, std::int64_t stride, int slices, float* __restrict__ y,
                   std::int64_t count) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * kSplitKSumThreads;
  if constexpr (kVectors) {
    const float4* const in = reinterpret_cast<const float4*>(partials);
    float4* const out = reinterpret_cast<float4*>(y);
    const std::int64_t vectors = count / 4, vector_stride = stride / 4;
    for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kSplitKSumThreads) + threadIdx.x; i < vectors;
         i += step) {
      float4 sum = __ldcs(in + i);  // each partial is read once: streamed past L2's kept lines
      for (int s = 1; s < slices; ++s) {
        const float4 part = __ldcs(in + s * vector_stride + i);
        sum.x += part.x;
        sum.y += part.y;
        sum.z += part.z;
        sum.w += part.w;
      }
      out[i] = sum;
    }
  } else {
    for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kSplitKSumThreads) + threadIdx.x; i < count;
         i += step) {
      float sum = __ldcs(partials + i);
      for (int s = 1; s < slices; ++s) sum += __ldcs(partials + s * stride + i);
      y[i] = sum;
    }
  }
}

}  // namespace
}  // namespace kernels::gemm
