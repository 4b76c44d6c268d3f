// The split pass of the fp32-accurate tensor-core GEMM (gemm.h, launch_split_rows): each row of a float32 matrix
// becomes a power-of-two row exponent and a pair of fp16 matrices hi, lo with hi + lo = v * 2^e to about 22 bits.
//
// Memory-bound: each element is read from DRAM once and its two halves written once (4 + 4 bytes). One block per
// row. Rows of up to 16384 floats, 16-byte aligned, are held in registers between finding the row's largest finite
// |v| and writing hi and lo; longer or unaligned rows take two passes, the second re-reading the row from L1/L2.
// Rows whose length is a multiple of 4 move 16-byte packs of src (8-byte packs of hi and lo); others go element by
// element. Portable (any architecture).
#include "gemm.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace kernels::gemm {
namespace {

constexpr int kSplitThreads = 256;
constexpr int kTargetExponent = 14;  // the row maximum lands in [2^(kTargetExponent - 1), 2^kTargetExponent)

// 2^p as a float, for -126 <= p <= 127.
__device__ __forceinline__ float exact_power_of_two(int p) { return __int_as_float((127 + p) << 23); }

// The exponent e with max_abs * 2^e in [2^13, 2^14), computed from the bits (exact for subnormals); 0 if max_abs is 0.
__device__ __forceinline__ int row_exponent(float max_abs) {
  if (max_abs == 0.0f) return 0;
  unsigned bits = __float_as_uint(max_abs);
  int biased = static_cast<int>((bits >> 23) & 0xff);
  int offset = 0;
  if (biased == 0) {  // subnormal: scale by 2^64 (exact) to read its exponent
    bits = __float_as_uint(max_abs * exact_power_of_two(64));
    biased = static_cast<int>((bits >> 23) & 0xff);
    offset = 64;
  }
  // max_abs = 1.f * 2^(biased - 127 - offset), with 1 <= f < 2; f * 2^(biased - 127 - offset + e) in [2^13, 2^14).
  return (kTargetExponent - 1) - (biased - 127 - offset);
}

struct Split {
  __half hi, lo;
};

// v * 2^e as two exact multiplies (2^e alone may not be a float: e reaches 162 for subnormal rows), then the split.
// A non-finite v becomes 0 + 0: its row is flagged, and the outputs it reaches are computed by
// nonfinite_outputs_kernel (the tensor cores would mix an infinity with the random signs of the other operand's lo
// into NaN where eager gives an infinity).
__device__ __forceinline__ Split split_one(float v, float scale_a, float scale_b) {
  if (!isfinite(v)) return {__float2half_rn(0.0f), __float2half_rn(0.0f)};
  const float s = (v * scale_a) * scale_b;
  const __half hi = __float2half_rn(s);
  return {hi, __float2half_rn(s - __half2float(hi))};
}

__device__ __forceinline__ float finite_abs(float v) { return isfinite(v) ? fabsf(v) : 0.0f; }

// Folds one element, or a pack of four, into a thread's running row maximum and non-finite flag.
__device__ __forceinline__ void fold(float v, float& max_abs, bool& non_finite) {
  max_abs = fmaxf(max_abs, finite_abs(v));
  non_finite |= !isfinite(v);
}

__device__ __forceinline__ void fold(float4 v, float& max_abs, bool& non_finite) {
  fold(v.x, max_abs, non_finite);
  fold(v.y, max_abs, non_finite);
  fold(v.z, max_abs, non_finite);
  fold(v.w, max_abs, non_finite);
}

struct RowScale {
  float a, b;  // 2^e = a * b, each factor a float
};

// Splits a pack of four and stores its hi and lo halves as one 8-byte pack each.
__device__ __forceinline__ void split_pack(float4 v, RowScale scale, uint2* hi, uint2* lo) {
  const Split a = split_one(v.x, scale.a, scale.b), b = split_one(v.y, scale.a, scale.b);
  const Split c = split_one(v.z, scale.a, scale.b), d = split_one(v.w, scale.a, scale.b);
  __half2 hi_pack[2] = {__halves2half2(a.hi, b.hi), __halves2half2(c.hi, d.hi)};
  __half2 lo_pack[2] = {__halves2half2(a.lo, b.lo), __halves2half2(c.lo, d.lo)};
  *hi = *reinterpret_cast<const uint2*>(hi_pack);
  *lo = *reinterpret_cast<const uint2*>(lo_pack);
}

// The block's reduction of its threads' row maximum and non-finite flag into the row's exponent (written by thread
// 0) and scale. Every thread of the block must call it.
__device__ __forceinline__ RowScale row_scale(float max_abs, bool non_finite, std::int32_t* exponent) {
  __shared__ float warp_max[kSplitThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = max_abs;
  non_finite = __syncthreads_or(non_finite);  // also orders the warp_max writes before the reads below
  max_abs = warp_max[0];
#pragma unroll
  for (int w = 1; w < kSplitThreads / 32; ++w) max_abs = fmaxf(max_abs, warp_max[w]);
  const int e = row_exponent(max_abs);
  if (threadIdx.x == 0) *exponent = non_finite ? kNonFiniteRow : e;
  return {exact_power_of_two(e / 2), exact_power_of_two(e - e / 2)};
}

// Rows of up to kPacks * 4 * kSplitThreads floats, 16-byte aligned: each thread loads its packs of 4 into registers
// at once (all of the row's loads in flight together), and the split is made from the registers: one DRAM read.
template <int kPacks>
__global__ void __launch_bounds__(kSplitThreads)
split_rows_in_registers_kernel(const float* __restrict__ src, std::int64_t cols, std::int64_t row_stride,
                               __half* __restrict__ hi, __half* __restrict__ lo, std::int32_t* __restrict__ exponent) {
  const std::int64_t row = blockIdx.x;
  const float4* in = reinterpret_cast<const float4*>(src + row * row_stride);
  const int packs = static_cast<int>(cols / 4);
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
  const RowScale scale = row_scale(max_abs, non_finite, exponent + row);
  uint2* hi_row = reinterpret_cast<uint2*>(hi + row * cols);
  uint2* lo_row = reinterpret_cast<uint2*>(lo + row * cols);
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int i = threadIdx.x + p * kSplitThreads;
    if (i >= packs) break;
    split_pack(v[p], scale, hi_row + i, lo_row + i);
  }
}

// Any row: pass 1 finds the row's maximum, pass 2 re-reads the row (from L1/L2) and splits it.
template <bool kVector>
__global__ void __launch_bounds__(kSplitThreads)
split_rows_kernel(const float* __restrict__ src, std::int64_t cols, std::int64_t row_stride, __half* __restrict__ hi,
                  __half* __restrict__ lo, std::int32_t* __restrict__ exponent) {
  const std::int64_t row = blockIdx.x;
  const float* in = src + row * row_stride;
  __half* hi_row = hi + row * cols;
  __half* lo_row = lo + row * cols;

  float max_abs = 0.0f;
  bool non_finite = false;
  if (kVector) {
    for (std::int64_t i = threadIdx.x; i < cols / 4; i += kSplitThreads)
      fold(reinterpret_cast<const float4*>(in)[i], max_abs, non_finite);
  } else {
    for (std::int64_t i = threadIdx.x; i < cols; i += kSplitThreads) fold(in[i], max_abs, non_finite);
  }
  const RowScale scale = row_scale(max_abs, non_finite, exponent + row);

  if (kVector) {
    for (std::int64_t i = threadIdx.x; i < cols / 4; i += kSplitThreads)
      split_pack(reinterpret_cast<const float4*>(in)[i], scale, reinterpret_cast<uint2*>(hi_row) + i,
                 reinterpret_cast<uint2*>(lo_row) + i);
  } else {
    for (std::int64_t i = threadIdx.x; i < cols; i += kSplitThreads) {
      const Split s = split_one(in[i], scale.a, scale.b);
      hi_row[i] = s.hi;
      lo_row[i] = s.lo;
    }
  }
}

constexpr int kFixupThreads = 256;
constexpr int kFixupRowsPerBlock = 32;
constexpr int kListedPositions = 1024;  // non-finite positions of a row kept in shared memory; beyond: full scans

// The outputs whose x row or w row holds a non-finite value. Such an output is itself non-finite (an infinity or
// NaN times anything is), and which one depends only on the non-finite terms x[i, k] * w[j, k]: their IEEE sum is
// NaN if any is NaN or infinities of both signs meet, else an infinity of their sign, as in eager's sum. Each block
// checks the flags of kFixupRowsPerBlock rows (those of x, then those of w) with one read per thread and leaves if
// none is flagged, the common case; for each flagged row it lists the row's non-finite positions, then computes
// every output the row reaches. Where the other operand's row is flagged too, or the list overflowed, it scans the
// whole of k.
__global__ void __launch_bounds__(kFixupThreads)
nonfinite_outputs_kernel(const float* __restrict__ x, std::int64_t x_stride, const float* __restrict__ w,
                         std::int64_t w_stride, const std::int32_t* __restrict__ x_exponent,
                         const std::int32_t* __restrict__ w_exponent, const float* __restrict__ bias,
                         float* __restrict__ y, std::uint8_t* __restrict__ positive, std::int64_t m, std::int64_t n,
                         std::int64_t k, float multiplier, float negative_slope) {
  __shared__ std::int32_t positions[kListedPositions];
  __shared__ int count;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * kFixupRowsPerBlock;
  const std::int64_t mine = first + threadIdx.x;
  const bool flagged_mine = threadIdx.x < kFixupRowsPerBlock && mine < m + n &&
                            (mine < m ? x_exponent[mine] : w_exponent[mine - m]) == kNonFiniteRow;
  if (!__syncthreads_or(flagged_mine)) return;
  const std::int64_t end = first + kFixupRowsPerBlock < m + n ? first + kFixupRowsPerBlock : m + n;
  for (std::int64_t r = first; r < end; ++r) {
    const bool x_row = r < m;
    const std::int64_t row = x_row ? r : r - m;
    if ((x_row ? x_exponent : w_exponent)[row] != kNonFiniteRow) continue;  // the same for the whole block
    const float* flagged = x_row ? x + row * x_stride : w + row * w_stride;
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    for (std::int64_t i = threadIdx.x; i < k; i += kFixupThreads) {
      if (isfinite(flagged[i])) continue;
      const int slot = atomicAdd(&count, 1);
      if (slot < kListedPositions) positions[slot] = static_cast<std::int32_t>(i);
    }
    __syncthreads();
    const int listed = min(count, kListedPositions);
    const bool listed_all = count <= kListedPositions;
    const std::int64_t others = x_row ? n : m;
    for (std::int64_t other = threadIdx.x; other < others; other += kFixupThreads) {
      const float* partner = x_row ? w + other * w_stride : x + other * x_stride;
      const bool partner_flagged = (x_row ? w_exponent : x_exponent)[other] == kNonFiniteRow;
      float sum = 0.0f;
      if (listed_all && !partner_flagged) {
        for (int p = 0; p < listed; ++p) sum += flagged[positions[p]] * partner[positions[p]];
      } else {
        for (std::int64_t i = 0; i < k; ++i) {
          const float term = flagged[i] * partner[i];
          if (!isfinite(term)) sum += term;
        }
      }
      const std::int64_t i = x_row ? row : other, j = x_row ? other : row;
      float v = sum;
      if (bias) v += bias[j];
      v *= multiplier;
      const bool is_positive = v > 0.0f;
      y[i * n + j] = is_positive ? v : v * negative_slope;
      if (positive) positive[i * n + j] = is_positive;
    }
    __syncthreads();  // count and positions are reused by the next flagged row
  }
}

}  // namespace

cudaError_t launch_nonfinite_outputs(const float* x, std::int64_t x_stride, const float* w, std::int64_t w_stride,
                                     const std::int32_t* x_exponent, const std::int32_t* w_exponent,
                                     const float* bias, float* y, std::uint8_t* positive, std::int64_t m,
                                     std::int64_t n, std::int64_t k, float multiplier, float negative_slope,
                                     cudaStream_t stream) {
  if (m <= 0 || n <= 0) return cudaSuccess;
  const std::int64_t blocks = (m + n + kFixupRowsPerBlock - 1) / kFixupRowsPerBlock;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  nonfinite_outputs_kernel<<<static_cast<unsigned>(blocks), kFixupThreads, 0, stream>>>(
      x, x_stride, w, w_stride, x_exponent, w_exponent, bias, y, positive, m, n, k, multiplier, negative_slope);
  return cudaGetLastError();
}

cudaError_t launch_split_rows(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                              void* hi, void* lo, std::int32_t* exponent, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  const bool vector = cols % 4 == 0 && row_stride % 4 == 0 && reinterpret_cast<std::uintptr_t>(src) % 16 == 0 &&
                      reinterpret_cast<std::uintptr_t>(hi) % 8 == 0 && reinterpret_cast<std::uintptr_t>(lo) % 8 == 0;
  const dim3 grid(static_cast<unsigned>(rows));
  const auto split = [&](auto kernel) {
    kernel<<<grid, kSplitThreads, 0, stream>>>(src, cols, row_stride, static_cast<__half*>(hi),
                                               static_cast<__half*>(lo), exponent);
    return cudaGetLastError();
  };
  constexpr std::int64_t kPackFloats = 4 * kSplitThreads;
  if (vector && cols <= 2 * kPackFloats) return split(split_rows_in_registers_kernel<2>);
  if (vector && cols <= 4 * kPackFloats) return split(split_rows_in_registers_kernel<4>);
  if (vector && cols <= 8 * kPackFloats) return split(split_rows_in_registers_kernel<8>);
  if (vector && cols <= 16 * kPackFloats) return split(split_rows_in_registers_kernel<16>);
  if (vector) {
    split_rows_kernel<true><<<grid, kSplitThreads, 0, stream>>>(src, cols, row_stride, static_cast<__half*>(hi),
                                                                static_cast<__half*>(lo), exponent);
  } else {
    split_rows_kernel<false><<<grid, kSplitThreads, 0, stream>>>(src, cols, row_stride, static_cast<__half*>(hi),
                                                                 static_cast<__half*>(lo), exponent);
  }
  return cudaGetLastError();
}

}  // namespace kernels::gemm
