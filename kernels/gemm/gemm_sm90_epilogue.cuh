// The Hopper GEMM's epilogue (gemm_sm90.cu): a consumer's outputs of a tile, y[x row, w row] =
// leaky_relu((total 2^-e + bias) * multiplier), e the x row's exponent (split_numerics.cuh: unscale, epilogue), and
// `positive` beside them; and w's non-finite row flags.
//
// The consumers write outputs into shared memory and TMA stores them (y's rows 16-byte aligned; plain stores else),
// so that a consumer goes on to the next tile's products without waiting on global stores. TMA stores and the plain
// stores' guards write nothing outside y. A non-finite w value was split as 0 and its row flagged
// (gemm_sm90_w_split.cuh); the CTAs of x's first tile write the flags to w_flags, and launch_nonfinite_outputs then
// writes the outputs it reaches.
#pragma once

#include "gemm_sm90_layout.cuh"
#include "sm90_primitives.cuh"
#include "split_numerics.cuh"

#include <cuda.h>

#include <cstdint>

namespace kernels::gemm {
namespace {

// The kernel's arguments that the epilogue reads (gemm.h, launch_split_gemm_multiply_leaky_relu).
struct EpilogueArguments {
  const CUtensorMap* y_map;
  bool y_by_tma;  // TMA stores through the staging buffers; plain stores else
  const std::int32_t* x_exponent;
  std::int32_t* w_flags;  // null where w's split is given: its pass wrote the flags
  const float* bias;
  float* y;
  std::uint8_t* positive;
  int m, n;
  float multiplier, negative_slope;
};

// Writes the tile's outputs from this consumer thread's totals (ConsumerThread's layout) and, from the CTAs of x's
// first tile, its rows' flags. `shared` is the CTA's shared memory (at shared address shared_base); `exponents`
// holds one part's x exponents at a time on the TMA path.
__device__ __forceinline__ void store_tile(const EpilogueArguments& arguments, const ConsumerThread& thread,
                                           unsigned char* shared, std::uint32_t shared_base, int tile_x, int tile_w,
                                           const float (&total)[64], const bool (&non_finite)[2],
                                           int (&exponents)[kOutBoxRows / 8][2]) {
  using namespace sm90;
  const CUtensorMap* const y_map = arguments.y_map;
  const std::int32_t* const x_exponent = arguments.x_exponent;
  const float* const bias = arguments.bias;
  float* const y = arguments.y;
  std::uint8_t* const positive = arguments.positive;
  const int m = arguments.m, n = arguments.n;
  const float multiplier = arguments.multiplier, negative_slope = arguments.negative_slope;
  const int consumer = thread.consumer, t = thread.t, tile_row = thread.tile_row, row_step = thread.row_step;
  // Epilogue: y[x row, w row] from total[j * 4 + half * 2 + c] at w row tile_row + half * row_step, x row
  // 8 j + 2 t + c.
  const bool flags_writer = tile_x == 0 && arguments.w_flags != nullptr;
  float column_bias[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    bool bad = non_finite[half];
    bad |= __shfl_xor_sync(0xffffffffu, bad, 1);
    bad |= __shfl_xor_sync(0xffffffffu, bad, 2);
    const int column = tile_w * kBlockW + tile_row + half * row_step;
    if (flags_writer && t == 0 && column < n) arguments.w_flags[column] = bad ? kNonFiniteRow : 0;
    column_bias[half] = bias && column < n ? bias[column] : 0.0f;
  }
  // The output of total[j * 4 + half * 2 + c]; row: its x row's factors.
  const auto output = [&](int j, int half, int c, RowUnscale row) {
    return epilogue(unscale(total[j * 4 + half * 2 + c], row), column_bias[half], multiplier, negative_slope);
  };
  if (arguments.y_by_tma) {
    // Through this consumer's staging buffer, 64 rows of y at a time, and TMA stores, which run on while the
    // consumer goes on to the next tile: the tensor cores wait for no global store. The buffer holds two boxes
    // (32 columns each) in the 128-byte swizzle: unit u of box row r at u ^ (r % 8), so that the warp's 32
    // writes (4 rows x 8 columns) fall in 32 distinct banks where the thread's rows of w are g and g + 8; where
    // they are side by side (w transposed: ConsumerThread), two lanes share each bank.
    const int staging_offset = kStages * kStageBytes + consumer * kStagingBytes;
    const std::uint32_t staging = shared_base + staging_offset;
    float* const staging_floats = reinterpret_cast<float*>(shared + staging_offset);  // plain stores: STS
    const bool store_thread = threadIdx.x % 128 == 0;
#pragma unroll
    for (int part = 0; part < kBlockX / kOutBoxRows; ++part) {
      if (store_thread) tma_store_wait_read<0>();  // the buffer's previous stores have read it
      named_barrier_sync(kStagingBarrier + consumer, 128);
      // The part's x exponents loaded together, ahead of the outputs: one global latency per part.
#pragma unroll
      for (int jj = 0; jj < kOutBoxRows / 8; ++jj) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int row = tile_x * kBlockX + part * kOutBoxRows + 8 * jj + 2 * t + c;
          exponents[jj][c] = row < m ? x_exponent[row] : 0;
        }
      }
#pragma unroll
      for (int jj = 0; jj < kOutBoxRows / 8; ++jj) {
        const int j = part * (kOutBoxRows / 8) + jj;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const RowUnscale row_factors = row_unscale(exponents[jj][c]);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int local_column = tile_row + half * row_step - consumer * 64;  // 0 .. 63: the consumer's columns
            const int box = local_column / kBoxK, box_column = local_column % kBoxK;
            const int box_row = 8 * jj + 2 * t + c, row = tile_x * kBlockX + 8 * j + 2 * t + c;
            const int column = tile_w * kBlockW + tile_row + half * row_step;
            const Activated out = output(j, half, c, row_factors);
            staging_floats[(box * kOutBoxBytes + box_row * 128) / 4 + ((box_column / 4) ^ (box_row % 8)) * 4 +
                           box_column % 4] = out.value;
            if (positive && row < m && column < n)
              positive[static_cast<std::int64_t>(row) * n + column] = out.positive;
          }
        }
      }
      fence_async_shared();
      named_barrier_sync(kStagingBarrier + consumer, 128);
      if (store_thread) {
#pragma unroll
        for (int box = 0; box < 2; ++box)
          tma_store_2d(y_map, staging + box * kOutBoxBytes, tile_w * kBlockW + consumer * 64 + box * kBoxK,
                       tile_x * kBlockX + part * kOutBoxRows);
        tma_store_commit();
      }
    }
  } else {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int column = tile_w * kBlockW + tile_row + half * row_step;
      if (column >= n) continue;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int row = tile_x * kBlockX + 8 * j + 2 * t + c;
          if (row >= m) continue;
          const Activated out = output(j, half, c, row_unscale(x_exponent[row]));
          const std::int64_t at = static_cast<std::int64_t>(row) * n + column;
          y[at] = out.value;
          if (positive) positive[at] = out.positive;
        }
      }
    }
  }
}

// Waits until this thread's TMA stores have written y, before the CTA ends.
__device__ __forceinline__ void finish_stores(const EpilogueArguments& arguments) {
  using namespace sm90;
  if (arguments.y_by_tma && threadIdx.x % 128 == 0) tma_store_wait<0>();
}

}  // namespace
}  // namespace kernels::gemm
