// w's split made before a GEMM (gemm.h: launch_split_chunks), one power of two per row and chunk: kernels for w, one
// for w given as its transpose. They take their block size and group reduction from the row splits
// (gemm_split_rows.cuh), fold and split_pack from split_numerics.cuh. Portable (any architecture).
#pragma once

#include "common/dependent_launch.cuh"
#include "gemm.h"
#include "gemm_split_rows.cuh"
#include "split_numerics.cuh"

#include <cuda_fp16.h>

namespace kernels::gemm {
namespace {

// The split of w (gemm.h, launch_split_chunks): a power of two per row and chunk of kSplitChunk along k, hi and lo in
// k's natural order (kNatural: the sm_80 GEMM's) or split_position's (the Hopper GEMM's). A thread takes a pack of 4,
// so a chunk's 16 packs are 16 consecutive lanes, whose largest |v| takes four shuffles.
constexpr int kChunkPacks = kSplitChunk / 4;

// Rows of up to kGroup * kPacks * 4 floats (split length included), kGroup threads per row, as
// split_rows_in_registers: all of a thread's loads in flight together, one DRAM read. Block `block`'s rows, for
// split_chunks_in_registers_kernel and split_rows_and_chunks_kernel; every thread of the block calls it.
template <int kGroup, int kPacks, bool kNatural>
__device__ __forceinline__ void split_chunks_in_registers(std::int64_t block, const float* __restrict__ src,
                                                          std::int64_t rows, std::int64_t cols,
                                                          std::int64_t row_stride, __half* __restrict__ hi,
                                                          __half* __restrict__ lo,
                                                          std::int32_t* __restrict__ chunk_exponent,
                                                          std::int32_t* __restrict__ flags) {
  static_assert(kGroup % kChunkPacks == 0, "a chunk's packs are consecutive lanes of one warp");
  const int member = threadIdx.x % kGroup;
  const std::int64_t row = block * (kSplitThreads / kGroup) + threadIdx.x / kGroup;
  const bool inside = row < rows;  // the block's last rows may lie past the end; they still join its barriers
  const float4* in = reinterpret_cast<const float4*>(src + (inside ? row : 0) * row_stride);
  const int packs = static_cast<int>(cols / 4);
  const std::int64_t length = split_row_length(cols);
  const int split_packs = static_cast<int>(length / 4);
  float4 v[kPacks];
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int i = member + p * kGroup;
    v[p] = inside && i < packs ? __ldcs(in + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  bool non_finite = false;
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int i = member + p * kGroup;
    float max_abs = 0.0f;
    fold(v[p], max_abs, non_finite);
    for (int offset = kChunkPacks / 2; offset > 0; offset /= 2)
      max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, offset));
    const int e = scale_exponent(max_abs);
    if (inside && i < split_packs) {
      if (i % kChunkPacks == 0) chunk_exponent[(i / kChunkPacks) * split_exponent_stride(rows) + row] = e;
      split_pack<kNatural>(v[p], power_of_two(e), i, hi + row * length, lo + row * length);
    }
  }
  group_max<kGroup>(0.0f, non_finite);
  if (inside && member == 0) flags[row] = non_finite ? kNonFiniteRow : 0;
}

template <int kGroup, int kPacks, bool kNatural>
__global__ void __launch_bounds__(kSplitThreads)
split_chunks_in_registers_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t cols,
                                 std::int64_t row_stride, __half* __restrict__ hi, __half* __restrict__ lo,
                                 std::int32_t* __restrict__ chunk_exponent, std::int32_t* __restrict__ flags) {
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
  split_chunks_in_registers<kGroup, kPacks, kNatural>(blockIdx.x, src, rows, cols, row_stride, hi, lo,
                                                      chunk_exponent, flags);
}

// x's row split and w's chunk split in one grid (launch_split_rows_and_chunks): blocks below x_blocks split x's rows
// as split_rows_in_registers_kernel does, the others w's as split_chunks_in_registers_kernel does; both of k floats a
// row, so one shape of block serves both.
template <int kGroup, int kPacks, bool kNatural>
__global__ void __launch_bounds__(kSplitThreads)
split_rows_and_chunks_kernel(const float* __restrict__ x, std::int64_t m, std::int64_t x_stride,
                             __half* __restrict__ x_hi, __half* __restrict__ x_lo,
                             std::int32_t* __restrict__ x_exponent, const float* __restrict__ w, std::int64_t n,
                             std::int64_t w_stride, __half* __restrict__ w_hi, __half* __restrict__ w_lo,
                             std::int32_t* __restrict__ w_chunk_exponent, std::int32_t* __restrict__ w_flags,
                             std::int64_t k, std::int64_t x_blocks) {
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
  const std::int64_t block = blockIdx.x;
  if (block < x_blocks)
    split_rows_in_registers<kGroup, kPacks, kNatural>(block, MatrixRows{x, x_stride}, m, k, x_hi, x_lo, x_exponent);
  else
    split_chunks_in_registers<kGroup, kPacks, kNatural>(block - x_blocks, w, n, k, w_stride, w_hi, w_lo,
                                                        w_chunk_exponent, w_flags);
}

// Any row length, one block per row, a pack per thread at a time.
template <bool kNatural>
__global__ void __launch_bounds__(kSplitThreads)
split_chunks_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                    __half* __restrict__ hi, __half* __restrict__ lo, std::int32_t* __restrict__ chunk_exponent,
                    std::int32_t* __restrict__ flags) {
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
  const std::int64_t row = blockIdx.x;
  const float4* in = reinterpret_cast<const float4*>(src + row * row_stride);
  const std::int64_t packs = cols / 4, length = split_row_length(cols);
  bool non_finite = false;
  for (std::int64_t base = 0; base < length / 4; base += kSplitThreads) {  // the same trip count for every thread
    const std::int64_t i = base + threadIdx.x;
    const float4 v = i < packs ? __ldcs(in + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float max_abs = 0.0f;
    fold(v, max_abs, non_finite);
    for (int offset = kChunkPacks / 2; offset > 0; offset /= 2)
      max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, offset));
    const int e = scale_exponent(max_abs);
    if (i < length / 4) {
      if (i % kChunkPacks == 0) chunk_exponent[(i / kChunkPacks) * split_exponent_stride(rows) + row] = e;
      split_pack<kNatural>(v, power_of_two(e), i, hi + row * length, lo + row * length);
    }
  }
  non_finite = __syncthreads_or(non_finite);
  if (threadIdx.x == 0) flags[row] = non_finite ? kNonFiniteRow : 0;
}

// The same split of w given as its transpose (src: k x n, row-major): row j of the split is column j of src. One
// block per chunk and kChunkColumnTile columns: each warp reads 8 of the chunk's rows of src (128 bytes each) into
// a shared tile; the columns' maxima are combined across the warps; then each warp writes 4 columns' hi and lo as
// rows (128 bytes of each per column). flags must be zero before the launch: a block that meets a non-finite value
// sets its column's flag (atomicOr).
constexpr int kChunkColumnThreads = 256;
constexpr int kChunkColumnTile = 32;

__global__ void __launch_bounds__(kChunkColumnThreads)
split_chunks_transposed_kernel(const float* __restrict__ src, std::int64_t k, std::int64_t n, std::int64_t row_stride,
                               __half* __restrict__ hi, __half* __restrict__ lo,
                               std::int32_t* __restrict__ chunk_exponent, std::int32_t* __restrict__ flags) {
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
  constexpr int kWarps = kChunkColumnThreads / 32;
  __shared__ float tile[kSplitChunk][kChunkColumnTile + 1];
  __shared__ float warp_max[kWarps][kChunkColumnTile];
  __shared__ bool warp_bad[kWarps][kChunkColumnTile];
  __shared__ PowerOfTwo scales[kChunkColumnTile];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t first_column = static_cast<std::int64_t>(blockIdx.x) * kChunkColumnTile;
  const std::int64_t chunk = blockIdx.y, column = first_column + lane;
  float max_abs = 0.0f;
  bool non_finite = false;
  for (int r = warp; r < kSplitChunk; r += kWarps) {
    const std::int64_t kk = chunk * kSplitChunk + r;
    const float v = kk < k && column < n ? src[kk * row_stride + column] : 0.0f;
    fold(v, max_abs, non_finite);
    tile[r][lane] = is_finite(v) ? v : 0.0f;
  }
  warp_max[warp][lane] = max_abs;
  warp_bad[warp][lane] = non_finite;
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      max_abs = fmaxf(max_abs, warp_max[w][lane]);
      non_finite |= warp_bad[w][lane];
    }
    const int e = scale_exponent(max_abs);
    scales[lane] = power_of_two(e);
    if (column < n) {
      chunk_exponent[chunk * split_exponent_stride(n) + column] = e;
      if (non_finite) atomicOr(flags + column, kNonFiniteRow);
    }
  }
  __syncthreads();
  const std::int64_t length = split_row_length(k);
  for (int i = warp; i < kChunkColumnTile; i += kWarps) {
    if (first_column + i >= n) break;
    const SplitPair pair = split_pair(tile[2 * lane][i], tile[2 * lane + 1][i], scales[i]);
    const std::int64_t at = (first_column + i) * length + chunk * kSplitChunk + 2 * lane;
    *reinterpret_cast<__half2*>(hi + at) = pair.hi;
    *reinterpret_cast<__half2*>(lo + at) = pair.lo;
  }
}

}  // namespace
}  // namespace kernels::gemm
