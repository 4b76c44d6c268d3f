// w's split made before a GEMM (gemm.h: launch_split_chunks), one power of two per row and chunk: one kernel for w,
// one for w given as its transpose. They take their block size, fold, group reduction and split_pack, and the
// second its column tiles, from the row splits (gemm_split_rows.cuh). Portable (any architecture).
#pragma once

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
// split_rows_in_registers_kernel: all of a thread's loads in flight together, one DRAM read.
template <int kGroup, int kPacks, bool kNatural>
__global__ void __launch_bounds__(kSplitThreads)
split_chunks_in_registers_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t cols,
                                 std::int64_t row_stride, __half* __restrict__ hi, __half* __restrict__ lo,
                                 std::int32_t* __restrict__ chunk_exponent, std::int32_t* __restrict__ flags) {
  static_assert(kGroup % kChunkPacks == 0, "a chunk's packs are consecutive lanes of one warp");
  const int member = threadIdx.x % kGroup;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (kSplitThreads / kGroup) + threadIdx.x / kGroup;
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
      if (i % kChunkPacks == 0) chunk_exponent[(i / kChunkPacks) * rows + row] = e;
      split_pack<kNatural>(v[p], power_of_two(e), i, hi + row * length, lo + row * length);
    }
  }
  group_max<kGroup>(0.0f, non_finite);
  if (inside && member == 0) flags[row] = non_finite ? kNonFiniteRow : 0;
}

// Any row length, one block per row, a pack per thread at a time.
template <bool kNatural>
__global__ void __launch_bounds__(kSplitThreads)
split_chunks_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                    __half* __restrict__ hi, __half* __restrict__ lo, std::int32_t* __restrict__ chunk_exponent,
                    std::int32_t* __restrict__ flags) {
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
      if (i % kChunkPacks == 0) chunk_exponent[(i / kChunkPacks) * rows + row] = e;
      split_pack<kNatural>(v, power_of_two(e), i, hi + row * length, lo + row * length);
    }
  }
  non_finite = __syncthreads_or(non_finite);
  if (threadIdx.x == 0) flags[row] = non_finite ? kNonFiniteRow : 0;
}

// The same split of w given as its transpose (src: k x n, row-major): row j of the split is column j of src. One
// block per chunk and column tile (gemm_split_rows.cuh: kTileRows == kSplitChunk rows, kTileColumns columns): the
// tile's loads all in flight together; each column's maximum over the chunk is combined across the warps in shared
// memory; then the tile is split with those scales and written as rows. kAligned: n % 4 == 0, row_stride % 4 == 0
// and src 16-byte aligned. flags must be zero before the launch: a block that meets a non-finite value sets its
// column's flag (atomicOr).
static_assert(kTileRows == kSplitChunk, "a column tile is one chunk of the split");

template <bool kAligned>
__global__ void __launch_bounds__(kTileThreads)
split_chunks_transposed_kernel(const float* __restrict__ src, std::int64_t k, std::int64_t n, std::int64_t row_stride,
                               __half* __restrict__ hi, __half* __restrict__ lo,
                               std::int32_t* __restrict__ chunk_exponent, std::int32_t* __restrict__ flags) {
  __shared__ TileStage stage;
  __shared__ float4 warp_max[kTileWarps][32];
  __shared__ unsigned warp_bad[kTileWarps][32];  // bit e: column 4 lane + e
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t first_column = static_cast<std::int64_t>(blockIdx.x) * kTileColumns;
  const std::int64_t chunk = blockIdx.y;
  const Tile values = load_tile<kAligned, true>(src, k, n, row_stride, chunk * kSplitChunk, first_column);
  float max_abs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  unsigned bad = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    bool non_finite = false;
#pragma unroll
    for (int i = 0; i < kTilePairsPerWarp; ++i) {
      fold(element(values.v[i][0], e), max_abs[e], non_finite);
      fold(element(values.v[i][1], e), max_abs[e], non_finite);
    }
    bad |= non_finite ? 1u << e : 0u;
  }
  warp_max[warp][lane] = make_float4(max_abs[0], max_abs[1], max_abs[2], max_abs[3]);
  warp_bad[warp][lane] = bad;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kTileWarps; ++w) {
    const float4 m = warp_max[w][lane];
#pragma unroll
    for (int e = 0; e < 4; ++e) max_abs[e] = fmaxf(max_abs[e], element(m, e));
    bad |= warp_bad[w][lane];
  }
  PowerOfTwo scale[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int exponent = scale_exponent(max_abs[e]);
    scale[e] = power_of_two(exponent);
    const std::int64_t column = first_column + 4 * lane + e;
    if (warp == 0 && column < n) {
      chunk_exponent[chunk * n + column] = exponent;
      if (bad & (1u << e)) atomicOr(flags + column, kNonFiniteRow);
    }
  }
  stage_split(values, scale, stage);
  __syncthreads();
  store_tile<false>(stage, hi, lo, split_row_length(k), first_column, n, chunk * kSplitChunk);
}

}  // namespace
}  // namespace kernels::gemm
