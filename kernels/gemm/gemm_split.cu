// The split pass of the fp32-accurate tensor-core GEMM over x (gemm.h, launch_split_rows): each row of a float32
// matrix becomes a power-of-two row exponent and a pair of fp16 rows hi, lo with hi + lo = v * 2^e to about 22 bits,
// in the order along K and the padded length the GEMM reads (split_numerics.cuh: split_position, split_row_length).
//
// Memory-bound: each element is read from DRAM once and its two halves written once (4 + 4 bytes). One block per
// row. Rows of up to 16384 floats are held in registers between finding the row's largest finite |v| and writing
// hi and lo; longer rows take two passes, the second re-reading the row from L1/L2. Rows are read as 16-byte packs
// (the launcher requires 16-byte aligned rows of a multiple of 4 floats); each pack's halves are written as two
// fp16 pairs to their places in the GEMM's order. Portable (any architecture).
#include "gemm.h"
#include "split_numerics.cuh"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

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
  for (int offset = 16; offset > 0; offset /= 2) max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, offset));
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

// The split of src's columns (src: rows x cols, row-major): row c of the result is column c of src, in natural
// order. One block per kColumnTile columns: pass 1 reads the block's columns (each warp a row at a time, 128 bytes)
// for each column's largest finite |v|, non-finite flag and sum; pass 2 re-reads them (from L2) through a shared
// tile, transposed, and writes each column's hi and lo as rows. split_row_length(rows) is a multiple of 64.
constexpr int kColumnTile = 32;
constexpr int kColumnThreads = 1024;  // a warp per row in flight: pass 1 is a strided walk down the columns

__global__ void __launch_bounds__(kColumnThreads)
split_columns_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                     __half* __restrict__ hi, __half* __restrict__ lo, std::int32_t* __restrict__ exponent,
                     float* __restrict__ column_sums) {
  constexpr int kWarps = kColumnThreads / 32;
  __shared__ float warp_max[kWarps][kColumnTile], warp_sum[kWarps][kColumnTile];
  __shared__ float warp_compensation[kWarps][kColumnTile];
  __shared__ bool warp_bad[kWarps][kColumnTile];
  __shared__ PowerOfTwo scales[kColumnTile];
  __shared__ float tile[2 * kColumnTile][kColumnTile + 1];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t column = static_cast<std::int64_t>(blockIdx.x) * kColumnTile + lane;
  const bool inside = column < cols;
  // Compensated (Kahan) sums, whose error does not grow with the number of rows; the plain sum beside them gives
  // IEEE's inf or NaN where a value is not finite or the sum overflows (compensation would turn an inf into NaN).
  float max_abs = 0.0f, sum = 0.0f, compensation = 0.0f, plain_sum = 0.0f;
  bool non_finite = false;
  for (std::int64_t r = warp; r < rows && inside; r += kWarps) {
    const float v = src[r * row_stride + column];
    max_abs = fmaxf(max_abs, is_finite(v) ? fabsf(v) : 0.0f);
    non_finite |= !is_finite(v);
    const float term = v - compensation, next = sum + term;
    compensation = (next - sum) - term;
    sum = next;
    plain_sum += v;
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
  // Pass 2, 64 rows at a time: each warp loads two rows of the tile; then warp i writes column first_column + i's
  // rows r0 .. r0 + 63 as fp16 pairs, 128 bytes of hi and of lo per warp.
  for (std::int64_t r0 = 0; r0 < length; r0 += 2 * kColumnTile) {
    for (int i = warp; i < 2 * kColumnTile; i += kWarps) {
      const std::int64_t r = r0 + i;
      tile[i][lane] = r < rows && inside ? src[r * row_stride + column] : 0.0f;
    }
    __syncthreads();
    for (int i = warp; i < kColumnTile; i += kWarps) {
      if (first_column + i < cols) {
        const auto clean = [](float v) { return is_finite(v) ? v : 0.0f; };
        const SplitPair pair = split_pair(clean(tile[2 * lane][i]), clean(tile[2 * lane + 1][i]), scales[i]);
        const std::int64_t at = (first_column + i) * length + r0 + 2 * lane;
        *reinterpret_cast<__half2*>(hi + at) = pair.hi;
        *reinterpret_cast<__half2*>(lo + at) = pair.lo;
      }
    }
    __syncthreads();
  }
}

// The split of w for the sm_80 GEMM (gemm.h, launch_split_chunks): a power of two per row and chunk of kSplitChunk
// along k, hi and lo in k's natural order. One block per row: each thread takes a pack of 4, so a chunk's 16 packs
// are 16 consecutive lanes, whose largest |v| takes four shuffles.
constexpr int kChunkPacks = kSplitChunk / 4;

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
      split_pack<true>(v, power_of_two(e), i, hi + row * length, lo + row * length);
    }
  }
  non_finite = __syncthreads_or(non_finite);
  if (threadIdx.x == 0) flags[row] = non_finite ? kNonFiniteRow : 0;
}

// The same split of w given as its transpose (src: k x n, row-major): row j of the split is column j of src. One
// block per chunk and kColumnTile columns: each warp reads 8 of the chunk's rows of src (128 bytes each) into a
// shared tile; the columns' maxima are combined across the warps; then each warp writes 4 columns' hi and lo as
// rows (128 bytes of each per column). flags must be zero before the launch: a block that meets a non-finite value
// sets its column's flag (atomicOr).
constexpr int kChunkColumnThreads = 256;

__global__ void __launch_bounds__(kChunkColumnThreads)
split_chunks_transposed_kernel(const float* __restrict__ src, std::int64_t k, std::int64_t n, std::int64_t row_stride,
                               __half* __restrict__ hi, __half* __restrict__ lo,
                               std::int32_t* __restrict__ chunk_exponent, std::int32_t* __restrict__ flags) {
  constexpr int kWarps = kChunkColumnThreads / 32;
  __shared__ float tile[kSplitChunk][kColumnTile + 1];
  __shared__ float warp_max[kWarps][kColumnTile];
  __shared__ bool warp_bad[kWarps][kColumnTile];
  __shared__ PowerOfTwo scales[kColumnTile];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t first_column = static_cast<std::int64_t>(blockIdx.x) * kColumnTile;
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
      chunk_exponent[chunk * n + column] = e;
      if (non_finite) atomicOr(flags + column, kNonFiniteRow);
    }
  }
  __syncthreads();
  const std::int64_t length = split_row_length(k);
  for (int i = warp; i < kColumnTile; i += kWarps) {
    if (first_column + i >= n) break;
    const SplitPair pair = split_pair(tile[2 * lane][i], tile[2 * lane + 1][i], scales[i]);
    const std::int64_t at = (first_column + i) * length + chunk * kSplitChunk + 2 * lane;
    *reinterpret_cast<__half2*>(hi + at) = pair.hi;
    *reinterpret_cast<__half2*>(lo + at) = pair.lo;
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
nonfinite_outputs_kernel(const float* __restrict__ x, std::int64_t x_stride, std::int64_t x_element_stride,
                         const float* __restrict__ w,
                         std::int64_t w_stride, std::int64_t w_element_stride,
                         const std::int32_t* __restrict__ x_exponent,
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
    // Element i of a row: x's at x_element_stride, w's at w_element_stride (either may be given transposed).
    const float* flagged = x_row ? x + row * x_stride : w + row * w_stride;
    const std::int64_t flagged_step = x_row ? x_element_stride : w_element_stride;
    const std::int64_t partner_step = x_row ? w_element_stride : x_element_stride;
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    for (std::int64_t i = threadIdx.x; i < k; i += kFixupThreads) {
      if (isfinite(flagged[i * flagged_step])) continue;
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
        for (int p = 0; p < listed; ++p)
          sum += flagged[positions[p] * flagged_step] * partner[positions[p] * partner_step];
      } else {
        for (std::int64_t i = 0; i < k; ++i) {
          const float term = flagged[i * flagged_step] * partner[i * partner_step];
          if (!isfinite(term)) sum += term;
        }
      }
      const std::int64_t i = x_row ? row : other, j = x_row ? other : row;
      const Activated out = epilogue(sum, bias ? bias[j] : 0.0f, multiplier, negative_slope);
      y[i * n + j] = out.value;
      if (positive) positive[i * n + j] = out.positive;
    }
    __syncthreads();  // count and positions are reused by the next flagged row
  }
}

}  // namespace

cudaError_t launch_nonfinite_outputs(const float* x, std::int64_t x_stride, std::int64_t x_element_stride,
                                     const float* w, std::int64_t w_stride,
                                     std::int64_t w_element_stride, const std::int32_t* x_exponent, const std::int32_t* w_exponent,
                                     const float* bias, float* y, std::uint8_t* positive, std::int64_t m,
                                     std::int64_t n, std::int64_t k, float multiplier, float negative_slope,
                                     cudaStream_t stream) {
  if (m <= 0 || n <= 0) return cudaSuccess;
  const std::int64_t blocks = (m + n + kFixupRowsPerBlock - 1) / kFixupRowsPerBlock;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  nonfinite_outputs_kernel<<<static_cast<unsigned>(blocks), kFixupThreads, 0, stream>>>(
      x, x_stride, x_element_stride, w, w_stride, w_element_stride, x_exponent, w_exponent, bias, y, positive, m, n, k, multiplier, negative_slope);
  return cudaGetLastError();
}

cudaError_t launch_split_columns(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                                 void* hi, void* lo, std::int32_t* exponent, float* column_sums,
                                 cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const std::int64_t blocks = (cols + kColumnTile - 1) / kColumnTile;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  split_columns_kernel<<<static_cast<unsigned>(blocks), kColumnThreads, 0, stream>>>(
      src, rows, cols, row_stride, static_cast<__half*>(hi), static_cast<__half*>(lo), exponent, column_sums);
  return cudaGetLastError();
}

cudaError_t launch_split_chunks(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                                bool transposed, void* hi, void* lo, std::int32_t* chunk_exponent,
                                std::int32_t* flags, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const std::int64_t chunks = split_row_length(cols) / kSplitChunk;
  if (reinterpret_cast<std::uintptr_t>(hi) % 4 != 0 || reinterpret_cast<std::uintptr_t>(lo) % 4 != 0)
    return cudaErrorInvalidValue;
  if (!transposed) {
    if (rows > 0x7fffffff || cols % 4 != 0 || row_stride % 4 != 0 || reinterpret_cast<std::uintptr_t>(src) % 16 != 0)
      return cudaErrorInvalidValue;
    split_chunks_kernel<<<static_cast<unsigned>(rows), kSplitThreads, 0, stream>>>(
        src, rows, cols, row_stride, static_cast<__half*>(hi), static_cast<__half*>(lo), chunk_exponent, flags);
    return cudaGetLastError();
  }
  // src is w's transpose: cols x rows, rows row_stride apart.
  const std::int64_t column_blocks = (rows + kColumnTile - 1) / kColumnTile;
  if (column_blocks > 0x7fffffff || chunks > 65535) return cudaErrorInvalidValue;
  cudaError_t err = cudaMemsetAsync(flags, 0, rows * sizeof(std::int32_t), stream);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(column_blocks), static_cast<unsigned>(chunks));
  split_chunks_transposed_kernel<<<grid, kChunkColumnThreads, 0, stream>>>(
      src, cols, rows, row_stride, static_cast<__half*>(hi), static_cast<__half*>(lo), chunk_exponent, flags);
  return cudaGetLastError();
}

cudaError_t launch_split_rows(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                              bool natural_order, void* hi, void* lo, std::int32_t* exponent, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (rows > 0x7fffffff || cols % 4 != 0 || row_stride % 4 != 0 || reinterpret_cast<std::uintptr_t>(src) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(hi) % 4 != 0 || reinterpret_cast<std::uintptr_t>(lo) % 4 != 0)
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(rows));
  const auto split = [&](auto kernel) {
    kernel<<<grid, kSplitThreads, 0, stream>>>(src, cols, row_stride, static_cast<__half*>(hi),
                                               static_cast<__half*>(lo), exponent);
    return cudaGetLastError();
  };
  const auto in_order = [&](auto natural) {
    constexpr bool kNatural = decltype(natural)::value;
    constexpr std::int64_t kPackFloats = 4 * kSplitThreads;
    const std::int64_t length = split_row_length(cols);
    if (length <= 2 * kPackFloats) return split(split_rows_in_registers_kernel<2, kNatural>);
    if (length <= 4 * kPackFloats) return split(split_rows_in_registers_kernel<4, kNatural>);
    if (length <= 8 * kPackFloats) return split(split_rows_in_registers_kernel<8, kNatural>);
    if (length <= 16 * kPackFloats) return split(split_rows_in_registers_kernel<16, kNatural>);
    return split(split_rows_kernel<kNatural>);
  };
  return natural_order ? in_order(std::true_type{}) : in_order(std::false_type{});
}

}  // namespace kernels::gemm
