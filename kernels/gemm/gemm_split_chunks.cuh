// Splits with one power of two per row and chunk (gemm.h): w's made before a GEMM (launch_split_chunks), kernels for w
// and one for w given as its transpose; and grad_W's x, the columns of grad_pre, with their sums
// (launch_split_column_chunks). They take their block size, fold, group reduction, split_pack and column tiles from the
// row splits (gemm_split_rows.cuh). Portable (any architecture).
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
// split_rows_in_registers_kernel: all of a thread's loads in flight together, one DRAM read.
template <int kGroup, int kPacks, bool kNatural>
__global__ void __launch_bounds__(kSplitThreads)
split_chunks_in_registers_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t cols,
                                 std::int64_t row_stride, __half* __restrict__ hi, __half* __restrict__ lo,
                                 std::int32_t* __restrict__ chunk_exponent, std::int32_t* __restrict__ flags) {
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
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
      if (i % kChunkPacks == 0) chunk_exponent[(i / kChunkPacks) * split_exponent_stride(rows) + row] = e;
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

// The split of src's columns with a power of two per column and chunk of kSplitChunk rows (launch_split_column_chunks;
// src rows x cols, row-major): split_chunks_transposed_kernel's result (row c of hi and lo is column c, natural order)
// and launch_split_columns's compensated column sums, from one read of src. Block b takes item b of
// launch_split_columns's layout (a chunk of rows of a tile of kColumnTileColumns columns): its columns' maxima over the
// chunk are its own, so it splits what it loaded without waiting for other blocks; it writes its chunk sums, and the
// tile's last block to arrive adds them in chunk order (the same bits on every run) and writes the columns' flags.
__device__ __forceinline__ bool arrive_last(unsigned* counter, unsigned arrivals) {
  unsigned before;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
  return before == arrivals - 1;
}

template <bool kAligned>
__global__ void __launch_bounds__(kColumnTileThreads)
split_column_chunks_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t cols,
                           std::int64_t row_stride, __half* __restrict__ hi, __half* __restrict__ lo,
                           std::int32_t* __restrict__ chunk_exponent, std::int32_t* __restrict__ flags,
                           float* __restrict__ column_sums, unsigned char* __restrict__ workspace) {
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
  static_assert(kColumnTileThreads == 2 * kColumnTileColumns, "the sums are added in two halves of the chunks");
  static_assert(kColumnTileRows == kSplitChunk, "a column tile's rows are one chunk");
  union Shared {
    ColumnTileStage stage;
    float4 partials[kColumnTileWarps][kColumnTileColumns];  // a thread's max, sum (total, error) and flag per column
  };
  __shared__ Shared shared;
  __shared__ PowerOfTwo scales[kColumnTileColumns];
  __shared__ float2 half_sums[kColumnTileColumns];
  __shared__ bool last;
  const ColumnSplitLayout layout = column_split_layout(rows, cols);
  unsigned* const arrivals = reinterpret_cast<unsigned*>(workspace);
  unsigned* const bad = reinterpret_cast<unsigned*>(workspace + layout.bad_offset);
  float2* const sums = reinterpret_cast<float2*>(workspace + layout.sums_offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t item = blockIdx.x, tile = item / layout.slabs, chunk = item % layout.slabs;
  const std::int64_t first_column = tile * kColumnTileColumns, first_row = chunk * kColumnTileRows;

  // Each thread's maxima, flags and compensated sums (Knuth's two-sum, as launch_split_columns's) over its 8 rows of
  // its 4 columns; the plain sums beside them give IEEE's inf or NaN where a value is not finite or a sum overflows.
  const ColumnTile values = load_tile<kAligned, true>(src, rows, cols, row_stride, first_row, first_column);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float max_abs = 0.0f, sum = 0.0f, error = 0.0f, plain_sum = 0.0f;
    bool non_finite = false;
#pragma unroll
    for (int i = 0; i < kColumnTilePairsPerWarp; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float v = element(values.v[i][h], e);
        fold(v, max_abs, non_finite);
        const float next = sum + v, v_part = next - sum;
        error += (sum - (next - v_part)) + (v - v_part);
        sum = next;
        plain_sum += v;
      }
    }
    const bool finite = is_finite(sum);
    shared.partials[warp][4 * lane + e] = make_float4(max_abs, finite ? sum : plain_sum, finite ? error : 0.0f,
                                                      non_finite ? 1.0f : 0.0f);
  }
  __syncthreads();
  if (threadIdx.x < kColumnTileColumns) {
    const float4 first = shared.partials[0][threadIdx.x];
    float max_abs = first.x;
    CompensatedSum sum{first.y, first.z};
    bool non_finite = first.w != 0.0f;
#pragma unroll
    for (int w = 1; w < kColumnTileWarps; ++w) {
      const float4 part = shared.partials[w][threadIdx.x];
      max_abs = fmaxf(max_abs, part.x);
      add(sum, make_float2(part.y, part.z));
      non_finite |= part.w != 0.0f;
    }
    const int e = scale_exponent(max_abs);
    scales[threadIdx.x] = power_of_two(e);
    // The exponents' padding columns (up to split_exponent_stride) are written as 0: the GEMM reads them in pairs.
    const std::int64_t column = first_column + threadIdx.x, stride = split_exponent_stride(cols);
    if (column < stride) chunk_exponent[chunk * stride + column] = column < cols ? e : 0;
    if (non_finite) atomicOr(bad + column, 1u);
    sums[item * kColumnTileColumns + threadIdx.x] = make_float2(sum.total, sum.error);
  }
  __syncthreads();  // the partials read before the stage takes their place; the scales written
  PowerOfTwo scale[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) scale[e] = scales[4 * lane + e];
  stage_split(values, scale, shared.stage);
  __syncthreads();
  store_tile(shared.stage, hi, lo, split_row_length(rows), first_column, cols, first_row);
  // The block's sums and flags are written (the barrier above orders them before thread 0's release).
  if (threadIdx.x == 0) last = arrive_last(arrivals + tile, static_cast<unsigned>(layout.slabs));
  __syncthreads();
  if (!last) return;

  // The tile's last block: each column's chunk sums added in chunk order, in two halves, then the halves in order.
  const int column_in_tile = threadIdx.x % kColumnTileColumns, half = threadIdx.x / kColumnTileColumns;
  const std::int64_t half_chunks = (layout.slabs + 1) / 2, begin = half * half_chunks;
  const std::int64_t end = begin + half_chunks < layout.slabs ? begin + half_chunks : layout.slabs;
  const float2* from = sums + tile * layout.slabs * kColumnTileColumns + column_in_tile;
  CompensatedSum sum{0.0f, 0.0f};
#pragma unroll 8
  for (std::int64_t s = begin; s < end; ++s) add(sum, __ldcg(from + s * kColumnTileColumns));
  if (half == 1) half_sums[column_in_tile] = make_float2(sum.total, sum.error);
  __syncthreads();
  const std::int64_t column = first_column + column_in_tile;
  if (half == 0 && column < cols) {
    add(sum, half_sums[column_in_tile]);
    flags[column] = __ldcg(bad + column) != 0 ? kNonFiniteRow : 0;
    // An inf or NaN total is IEEE's, as the plain sums'.
    if (column_sums) column_sums[column] = is_finite(sum.total) ? sum.total + sum.error : sum.total;
  }
}

}  // namespace
}  // namespace kernels::gemm
