// The second kernel of a split-K product (gemm.h, launch_split_gemm_split_k): y = the sum of the slices' partial
// products, added in slice order (0, then 1, ...), so that every run gives the same bits; then, for a forward, the
// fused epilogue (split_numerics.cuh) on the sum. Portable (its tile order is the Hopper GEMM's).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "common/dependent_launch.cuh"
#include "gemm_sm90_tile_scheduler.cuh"
#include "split_numerics.cuh"

namespace kernels::gemm {
namespace {

constexpr int kSplitKSumThreads = 256;
constexpr int kSplitKSumBlocksPerProcessor = 8;  // a grid-stride loop over enough blocks to keep the loads in flight

// The epilogue a forward's sum applies, apply_epilogue()'s: bias (null: none), the epilogue, the mask (null: none); n:
// y's columns, the bias's index.
struct SplitKEpilogue {
  const float* bias;
  Epilogue epilogue;
  std::uint8_t* positive;
  std::int64_t n;
};

// The partials output i (row i / n, column i % n of y) adds: `slices` of equal slices, or, under stream-K, as many as
// its tile has parts (gemm_sm90_tile_scheduler.cuh, StreamK::parts).
struct SplitKParts {
  int slices;
  bool stream;
  std::int64_t n;
  StreamK streamk;
  int x_tiles, w_tiles;
  __device__ __forceinline__ int of(std::int64_t i) const {
    if (!stream) return slices;
    const std::int64_t row = i / n, column = i - row * n;
    const int tile_x = static_cast<int>(row / kBlockX), tile_w = static_cast<int>(column / kBlockW);
    return streamk.parts(tile_of(tile_x, tile_w, x_tiles, w_tiles));
  }
};

// One output of the sum: the sum itself for a plain product, else apply_epilogue()'s value, and its mask byte.
template <bool kEpilogue, Activation kActivation>
__device__ __forceinline__ float split_k_output(float sum, std::int64_t i, const SplitKEpilogue& e) {
  if constexpr (!kEpilogue) {
    return sum;
  } else {
    const Activated out = apply_epilogue<kActivation>(sum, e.bias ? e.bias[i % e.n] : 0.0f, e.epilogue);
    if (e.positive) e.positive[i] = out.positive;
    return out.value;
  }
}

// y[i] = output of ((partials[i] + partials[stride + i]) + partials[2 stride + i]) + ..., parts.of(i) terms, for
// i < count: slice s's partial at partials + s * stride; the output is the sum itself for a plain product (kEpilogue
// false), else apply_epilogue()'s. kVectors: 4 floats at a time (count, stride and both pointers in whole 16-byte
// units; with kEpilogue or stream-K, n too, the mask 4-byte aligned and the activation LeakyReLU).
template <bool kVectors, bool kEpilogue>
__global__ void __launch_bounds__(kSplitKSumThreads)
split_k_sum_kernel(const float* __restrict__ partials, std::int64_t stride, SplitKParts parts,
                   float* __restrict__ y, std::int64_t count, SplitKEpilogue e) {
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * kSplitKSumThreads;
  if constexpr (kVectors) {
    const float4* const in = reinterpret_cast<const float4*>(partials);
    float4* const out = reinterpret_cast<float4*>(y);
    const std::int64_t vectors = count / 4, vector_stride = stride / 4;
    for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kSplitKSumThreads) + threadIdx.x; i < vectors;
         i += step) {
      float4 sum = __ldcs(in + i);  // each partial is read once: streamed past L2's kept lines
      const int slices = parts.of(i * 4);  // the 4 outputs share a row, so a tile
      for (int s = 1; s < slices; ++s) {
        const float4 part = __ldcs(in + s * vector_stride + i);
        sum.x += part.x;
        sum.y += part.y;
        sum.z += part.z;
        sum.w += part.w;
      }
      if constexpr (kEpilogue) {
        const std::int64_t column = i * 4 % e.n;
        const float b[4] = {e.bias ? e.bias[column] : 0.0f, e.bias ? e.bias[column + 1] : 0.0f,
                            e.bias ? e.bias[column + 2] : 0.0f, e.bias ? e.bias[column + 3] : 0.0f};
        // LeakyReLU's only: the launcher gives GELUs to the scalar kernel (their IEEE divisions' slow paths would
        // need a stack frame in this one).
        constexpr Activation kLeaky = Activation::kLeakyReLU;
        const Activated a[4] = {apply_epilogue<kLeaky>(sum.x, b[0], e.epilogue),
                                apply_epilogue<kLeaky>(sum.y, b[1], e.epilogue),
                                apply_epilogue<kLeaky>(sum.z, b[2], e.epilogue),
                                apply_epilogue<kLeaky>(sum.w, b[3], e.epilogue)};
        if (e.positive)
          reinterpret_cast<std::uint32_t*>(e.positive)[i] =
              std::uint32_t{a[0].positive} | std::uint32_t{a[1].positive} << 8 |
              std::uint32_t{a[2].positive} << 16 | std::uint32_t{a[3].positive} << 24;
        sum = make_float4(a[0].value, a[1].value, a[2].value, a[3].value);
      }
      out[i] = sum;
    }
  } else {
    with_activation(e.epilogue.activation, [&](auto activation) {
      for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kSplitKSumThreads) + threadIdx.x; i < count;
           i += step) {
        float sum = __ldcs(partials + i);
        const int slices = parts.of(i);
        for (int s = 1; s < slices; ++s) sum += __ldcs(partials + s * stride + i);
        y[i] = split_k_output<kEpilogue, decltype(activation)::value>(sum, i, e);
      }
    });
  }
}

}  // namespace
}  // namespace kernels::gemm
