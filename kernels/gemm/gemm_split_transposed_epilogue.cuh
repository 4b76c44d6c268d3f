// The epilogue of a split product computed transposed (gemm.h: launch_transposed_epilogue): where x has far more
// elements than w, the forward splits w by the row pass and lets the Hopper GEMM split x in its registers, which
// gives y^T; this kernel writes y from it through the fused epilogue (split_numerics.cuh). Portable.
#pragma once

#include "common/dependent_launch.cuh"
#include "gemm.h"
#include "split_numerics.cuh"

namespace kernels::gemm {
namespace {

constexpr int kTransposeTile = 32;
constexpr int kTransposeThreads = kTransposeTile * 8;

// Per 32 x 32 tile, through shared memory so that both the reads of product_t's rows and the writes of y's rows are
// 128-byte runs: y[i, j] = activation((product_t[j, i] + bias[j]) * multiplier), and positive[i, j] beside it.
// Tiles in a grid-stride loop over a 1-D grid: any m and n.
__global__ void __launch_bounds__(kTransposeThreads)
transposed_epilogue_kernel(const float* __restrict__ product_t, const float* __restrict__ bias,
                           float* __restrict__ y, std::uint8_t* __restrict__ positive, std::int64_t m,
                           std::int64_t n, Epilogue epilogue) {
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
  __shared__ float tile[kTransposeTile][kTransposeTile + 1];
  const int lane = threadIdx.x % kTransposeTile, row = threadIdx.x / kTransposeTile;
  const std::int64_t row_tiles = (m + kTransposeTile - 1) / kTransposeTile;
  const std::int64_t tiles = row_tiles * ((n + kTransposeTile - 1) / kTransposeTile);
  // Each activation's loop compiled apart (with_activation).
  with_activation(epilogue.activation, [&](auto activation) {
    constexpr Activation kActivation = decltype(activation)::value;
    for (std::int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
      const std::int64_t first_i = (t % row_tiles) * kTransposeTile, first_j = (t / row_tiles) * kTransposeTile;
      for (int r = row; r < kTransposeTile; r += kTransposeThreads / kTransposeTile) {
        const std::int64_t j = first_j + r, i = first_i + lane;
        if (j < n && i < m) tile[r][lane] = product_t[j * m + i];
      }
      __syncthreads();
      const std::int64_t j = first_j + lane;
      const float column_bias = bias && j < n ? bias[j] : 0.0f;
      for (int r = row; r < kTransposeTile; r += kTransposeThreads / kTransposeTile) {
        const std::int64_t i = first_i + r;
        if (i < m && j < n) {
          const Activated out = apply_epilogue<kActivation>(tile[lane][r], column_bias, epilogue);
          y[i * n + j] = out.value;
          if (positive) positive[i * n + j] = out.positive;
        }
      }
      __syncthreads();  // the tile is read before the next one overwrites it
    }
  });
}

}  // namespace
}  // namespace kernels::gemm
