// The split passes with one power of two per row of the result (gemm.h: launch_split_rows, launch_split_columns),
// and what the chunk splits (gemm_split_chunks.cuh) share with them: the block size, fold (a thread's running
// maximum), split_pack (a pack's split and its stores) and the column tile.
//
// launch_split_rows, the split pass of the fp32-accurate tensor-core GEMM over x: each row of a float32 matrix
// becomes a power-of-two row exponent and a pair of fp16 rows hi, lo with hi + lo = v * 2^e to about 22 bits, in the
// order along K and the padded length the GEMM reads (split_numerics.cuh: split_position, split_row_length).
// Memory-bound: each element is read from DRAM once and its two halves written once (4 + 4 bytes). One block per
// row. Rows of up to 16384 floats are held in registers between finding the row's largest finite |v| and writing
// hi and lo; longer rows take two passes, the second re-reading the row from L1/L2. Rows are read as 16-byte packs
// (the launcher requires 16-byte aligned rows of a multiple of 4 floats); each pack's halves are written as two
// fp16 pairs to their places in the GEMM's order. Portable (any architecture).
#pragma once

#include "gemm.h"
#include "split_numerics.cuh"

#include <cuda_fp16.h>

namespace kernels::gemm {
namespace {

constexpr int kSplitThreads = 256;

// Folds a pack of four into a thread's running row maximum of finite |v| and non-finite flag.
__device__ __forceinline__ void fold(float v, float& max_abs, bool& non_finite) {
  max_abs = fmaxf(max_abs, is_finite(v) ? fabsf(v) : 0.0f);
  non_finite |= !is_finite(v);
}

__device__ __forceinline__ void fold(float4 v, float& max_abs, bool& non_finite) {
  fold(v.x, max_abs, non_finite);
  fold(v.y, max_abs, non_finite);
  fold(v.z, max_abs, non_finite);
  fold(v.w, max_abs, non_finite);
}

// Splits pack i of a row (k = 4i .. 4i + 3) and stores its halves at their places in the GEMM's order. A
// non-finite v becomes 0 + 0: its row is flagged, and the outputs it reaches are computed by
// nonfinite_outputs_kernel (the tensor cores would mix an infinity with the random signs of the other operand's lo
// into NaN where eager gives an infinity).
// kNatural: in k's own order (for the GEMM that reads w transposed); else in split_position's.
template <bool kNatural>
__device__ __forceinline__ void split_pack(float4 v, PowerOfTwo scale, std::int64_t i, __half* hi_row,
                                           __half* lo_row) {
  const auto clean = [](float e) { return is_finite(e) ? e : 0.0f; };
  const SplitPair first = split_pair(clean(v.x), clean(v.y), scale);
  const SplitPair second = split_pair(clean(v.z), clean(v.w), scale);
  const std::int64_t chunk_start = i / (kSplitChunk / 4) * kSplitChunk;
  const int q = static_cast<int>(i % (kSplitChunk / 4));
  const std::int64_t place = chunk_start + (kNatural ? 4 * q : split_position(q));
  const int second_offset = kNatural ? 2 : 8;
  *reinterpret_cast<__half2*>(hi_row + place) = first.hi;
  *reinterpret_cast<__half2*>(lo_row + place) = first.lo;
  *reinterpret_cast<__half2*>(hi_row + place + second_offset) = second.hi;
  *reinterpret_cast<__half2*>(lo_row + place + second_offset) = second.lo;
}

// The block's reduction of its threads' row maximum and non-finite flag into the row's exponent (written by thread
// 0) and scale. Every thread of the block must call it.
__device__ __forceinline__ PowerOfTwo row_scale(float max_abs, bool non_finite, std::int32_t* exponent) {
  __shared__ float warp_max[kSplitThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2)
    max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = max_abs;
  non_finite = __syncthreads_or(non_finite);  // also orders the warp_max writes before the reads below
  max_abs = warp_max[0];
#pragma unroll
  for (int w = 1; w < kSplitThreads / 32; ++w) max_abs = fmaxf(max_abs, warp_max[w]);
  const int e = scale_exponent(max_abs);
  if (threadIdx.x == 0) *exponent = non_finite ? kNonFiniteRow : e;
  return power_of_two(e);
}

// Rows of up to kPacks * 4 * kSplitThreads floats (split length included): each thread loads its packs of 4 into
// registers at once (all of the row's loads in flight together), and the split is made from the registers: one
// DRAM read. Packs past the row's end (up to its split length) are written as zeros.
template <int kPacks, bool kNatural>
__global__ void __launch_bounds__(kSplitThreads)
split_rows_in_registers_kernel(const float* __restrict__ src, std::int64_t cols, std::int64_t row_stride,
                               __half* __restrict__ hi, __half* __restrict__ lo, std::int32_t* __restrict__ exponent) {
  const std::int64_t row = blockIdx.x;
  const float4* in = reinterpret_cast<const float4*>(src + row * row_stride);
  const int packs = static_cast<int>(cols / 4);
  const std::int64_t length = split_row_length(cols);
  const int split_packs = static_cast<int>(length / 4);
  float4 v[kPacks];
  float max_abs = 0.0f;
  bool non_finite = false;
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int i = threadIdx.x + p * kSplitThreads;
    v[p] = i < packs ? __ldcs(in + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // read once: no need to keep in L2
  }
#pragma unroll
  for (int p = 0; p < kPacks; ++p) fold(v[p], max_abs, non_finite);
  const PowerOfTwo scale = row_scale(max_abs, non_finite, exponent + row);
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int i = threadIdx.x + p * kSplitThreads;
    if (i >= split_packs) break;
    split_pack<kNatural>(v[p], scale, i, hi + row * length, lo + row * length);
  }
}

// Any row length: pass 1 finds the row's maximum, pass 2 re-reads the row (from L1/L2) and splits it.
template <bool kNatural>
__global__ void __launch_bounds__(kSplitThreads)
split_rows_kernel(const float* __restrict__ src, std::int64_t cols, std::int64_t row_stride, __half* __restrict__ hi,
                  __half* __restrict__ lo, std::int32_t* __restrict__ exponent) {
  const std::int64_t row = blockIdx.x;
  const float4* in = reinterpret_cast<const float4*>(src + row * row_stride);
  const std::int64_t packs = cols / 4, length = split_row_length(cols);
  float max_abs = 0.0f;
  bool non_finite = false;
  for (std::int64_t i = threadIdx.x; i < packs; i += kSplitThreads) fold(in[i], max_abs, non_finite);
  const PowerOfTwo scale = row_scale(max_abs, non_finite, exponent + row);
  for (std::int64_t i = threadIdx.x; i < length / 4; i += kSplitThreads)
    split_pack<kNatural>(i < packs ? in[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f), scale, i, hi + row * length,
               lo + row * length);
}

// Rows of any length and stride (not 16-byte aligned: a vocabulary of 50257 as the reduction): split_rows_kernel's two
// passes with scalar loads, each pack of 4 gathered from its floats (those past the row's end are zeros).
template <bool kNatural>
__global__ void __launch_bounds__(kSplitThreads)
split_rows_unaligned_kernel(const float* __restrict__ src, std::int64_t cols, std::int64_t row_stride,
                            __half* __restrict__ hi, __half* __restrict__ lo, std::int32_t* __restrict__ exponent) {
  const std::int64_t row = blockIdx.x;
  const float* in = src + row * row_stride;
  const std::int64_t length = split_row_length(cols);
  float max_abs = 0.0f;
  bool non_finite = false;
  for (std::int64_t c = threadIdx.x; c < cols; c += kSplitThreads) fold(in[c], max_abs, non_finite);
  const PowerOfTwo scale = row_scale(max_abs, non_finite, exponent + row);
  const auto at = [&](std::int64_t c) { return c < cols ? in[c] : 0.0f; };
  for (std::int64_t i = threadIdx.x; i < length / 4; i += kSplitThreads)
    split_pack<kNatural>(make_float4(at(4 * i), at(4 * i + 1), at(4 * i + 2), at(4 * i + 3)), scale, i,
                         hi + row * length, lo + row * length);
}

// The split of src's columns (src: rows x cols, row-major): row c of the result is column c of src, in natural
// order. One block per kColumnTile columns: pass 1 reads the block's columns (each warp kColumnRowsInFlight rows
// at a time, 128 bytes each) for each column's largest finite |v|, non-finite flag and sum; pass 2 re-reads them
// (from L2) through a shared tile, transposed, and writes each column's hi and lo as rows. split_row_length(rows) is
// a multiple of 64. Each warp's loads of kColumnRowsInFlight rows are in flight before any is used: the pass is
// bound by the bytes in flight (two blocks per SM where an SM takes 2048 threads: sm_80, sm_90), not by arithmetic.
constexpr int kColumnTile = 32;
constexpr int kColumnThreads = 1024;  // a warp per row: pass 1 is a strided walk down the columns
constexpr int kColumnRowsInFlight = 4;  // 32 registers, no spills (8 spill)

__global__ void __launch_bounds__(kColumnThreads, 2)
split_columns_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                     __half* __restrict__ hi, __half* __restrict__ lo, std::int32_t* __restrict__ exponent,
                     float* __restrict__ column_sums) {
  constexpr int kWarps = kColumnThreads / 32;
  __shared__ float warp_max[kWarps][kColumnTile], warp_sum[kWarps][kColumnTile];
  __shared__ float warp_compensation[kWarps][kColumnTile];
  __shared__ bool warp_bad[kWarps][kColumnTile];
  __shared__ PowerOfTwo scales[kColumnTile];
  __shared__ float tile[kColumnRowsInFlight * kColumnTile][kColumnTile + 1];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t column = static_cast<std::int64_t>(blockIdx.x) * kColumnTile + lane;
  const bool inside = column < cols;
  // Compensated (Kahan) sums, whose error does not grow with the number of rows; the plain sum beside them gives
  // IEEE's inf or NaN where a value is not finite or the sum overflows (compensation would turn an inf into NaN).
  float max_abs = 0.0f, sum = 0.0f, compensation = 0.0f, plain_sum = 0.0f;
  bool non_finite = false;
  // Rows warp, warp + kWarps, ... in that order (the sums' order), loaded kColumnRowsInFlight at a time.
  const std::int64_t warp_step = kWarps * row_stride;
  const float* at = src + warp * row_stride + column;
  for (std::int64_t r0 = warp; r0 < rows && inside; r0 += kWarps * kColumnRowsInFlight) {
    float values[kColumnRowsInFlight];
#pragma unroll
    for (int u = 0; u < kColumnRowsInFlight; ++u) values[u] = r0 + u * kWarps < rows ? at[u * warp_step] : 0.0f;
    at += kColumnRowsInFlight * warp_step;
#pragma unroll
    for (int u = 0; u < kColumnRowsInFlight; ++u) {
      if (r0 + u * kWarps >= rows) break;
      const float v = values[u];
      max_abs = fmaxf(max_abs, is_finite(v) ? fabsf(v) : 0.0f);
      non_finite |= !is_finite(v);
      const float term = v - compensation, next = sum + term;
      compensation = (next - sum) - term;
      sum = next;
      plain_sum += v;
    }
  }
  warp_max[warp][lane] = max_abs;
  warp_sum[warp][lane] = is_finite(sum) ? sum : plain_sum;
  warp_compensation[warp][lane] = is_finite(sum) ? compensation : 0.0f;
  warp_bad[warp][lane] = non_finite;
  __syncthreads();
  if (warp == 0) {
    // The warps' partial sums (each sum - compensation) added with Neumaier's two-sum, so that adding the 32 parts
    // costs no more than one rounding of the total: plain adds here would double the error of 1024 rows' sums.
    float total = warp_sum[0][lane], error = -warp_compensation[0][lane];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      max_abs = fmaxf(max_abs, warp_max[w][lane]);
      const float part = warp_sum[w][lane], next = total + part;
      error += fabsf(total) >= fabsf(part) ? (total - next) + part : (part - next) + total;
      error -= warp_compensation[w][lane];
      total = next;
      non_finite |= warp_bad[w][lane];
    }
    sum = is_finite(total) ? total + error : total;  // an inf or NaN total is IEEE's, as the plain sum's
    const int e = scale_exponent(max_abs);
    scales[lane] = power_of_two(e);
    if (inside) {
      exponent[column] = non_finite ? kNonFiniteRow : e;
      if (column_sums) column_sums[column] = sum;
    }
  }
  __syncthreads();
  const std::int64_t length = split_row_length(rows);
  const std::int64_t first_column = static_cast<std::int64_t>(blockIdx.x) * kColumnTile;
  // Pass 2, kTileRows rows at a time: each warp loads kColumnRowsInFlight rows of the tile; then warp i writes
  // column first_column + i's rows, 64 at a time, as fp16 pairs: 128 bytes of hi and of lo per warp and step.
  constexpr int kTileRows = kColumnRowsInFlight * kWarps;
  static_assert(kWarps == kColumnTile && kTileRows % 64 == 0, "a warp per column of the tile; whole steps of 64 rows");
  for (std::int64_t r0 = 0; r0 < length; r0 += kTileRows) {
    const float* from = src + (r0 + warp) * row_stride + column;
#pragma unroll
    for (int u = 0; u < kColumnRowsInFlight; ++u) {
      const int i = warp + u * kWarps;
      tile[i][lane] = r0 + i < rows && inside ? from[u * warp_step] : 0.0f;
    }
    __syncthreads();
    const std::int64_t column_i = first_column + warp;
    if (column_i < cols) {
#pragma unroll
      for (int step = 0; step < kTileRows / 64; ++step) {
        if (r0 + 64 * step >= length) break;
        const auto clean = [](float v) { return is_finite(v) ? v : 0.0f; };
        const int row = 64 * step + 2 * lane;
        const SplitPair pair = split_pair(clean(tile[row][warp]), clean(tile[row + 1][warp]), scales[warp]);
        const std::int64_t at = column_i * length + r0 + row;
        *reinterpret_cast<__half2*>(hi + at) = pair.hi;
        *reinterpret_cast<__half2*>(lo + at) = pair.lo;
      }
    }
    __syncthreads();
  }
}

}  // namespace
}  // namespace kernels::gemm
