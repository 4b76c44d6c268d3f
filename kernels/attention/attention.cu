// fp32-accurate attention on fp16 tensor cores (contract: attention.h), the GEMM family's split method
// (gemm/split_numerics.cuh) in a flash-attention loop on sm_80 instructions (mma.sync, cp.async), so it runs from
// the A100 on; on Hopper its products take wgmma.
// - Passes split k and v ahead: k's rows over the head dim, each with its power of two; v's columns over the keys,
//   written transposed (head dim x keys) so that the products read their pairs along the keys. Rows are padded to
//   kAttentionTile with zeros. Heads whose values the split cannot take are flagged.
// - The kernel: a CTA per 64 query rows of a head, a warp per 16 rows, 64 keys a step, two stages of cp.async. It
//   splits its own query rows (each is read by one CTA) into registers as the pass splits k's. Its products run on
//   mma.sync from ldmatrix fragments (sm_80 on), or on sm_90a on wgmma, the CTA's four warps one warpgroup (one
//   instruction over its 64 rows, A from the same registers, k's and v's tiles in the 128-byte swizzle read by
//   shared-memory descriptors): the same products in the same order, the same accumulator layout. Scores: per 16 of
//   the head dim three products, the large one in a fresh accumulator each; then the scale and both powers of two, the
//   causal mask (on the last key tile only), the online softmax in fp32: exp(score - row max) as exp2f((score - row
//   max) log2(e)), which is at most 1 (its split times 2^13 stays within fp16) and exactly 1 for the largest score.
//   Probabilities, times 2^13, are split in registers into the next products' operands; the running output is
//   multiplied by the softmax's correction, then the products with v are added to it the same way. A last key tile
//   of at most kShortKeys keys (ViT's 197 = 3 x 64 + 5) takes a short step over its first kShortKeys alone: the keys
//   past them are padding, whose probabilities are 0.
// - Flagged heads, and tiles whose query rows the split cannot take: the same CTAs compute them on the plain path, a
//   thread per query row, fp32 throughout.
#include "attention.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <optional>
#include <type_traits>

#include "common/dependent_launch.cuh"
#include "common/device_queries.h"
#include "common/mma_sm80.cuh"
#include "common/once_per_device.h"
#include "gemm/sm90_primitives.cuh"
#include "gemm/split_numerics.cuh"

namespace kernels::attention {
namespace {

using common::sm80::commit_copies;
using common::sm80::copy_16_async;
using common::sm80::load_matrix_x4;
using common::sm80::mma_m16n8k16;
using common::sm80::shared_address;
using common::sm80::wait_copies;
using gemm::bits;
using gemm::exact_power_of_two;
using gemm::is_finite;
using gemm::scale_exponent;
using gemm::split_pair;
using gemm::SplitPair;

constexpr int kTile = kAttentionTile;
constexpr int kWarps = kTile / 16;
constexpr int kThreads = 32 * kWarps;
constexpr int kRowPad = 8;  // fp16 values after each shared-memory row: a quad's rows fall in distinct banks
// Probabilities are split as p * 2^13: p <= 1, so the largest is in [2^12, 2^13] as the split's scaled values are.
constexpr int kProbabilityExponent = 13;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kSplitThreads = 256;
constexpr int kShortKeys = 16;  // a short last key step's keys: one k16 step of the products with v

// A row or column the split takes: finite, and its largest |value| 0 or within [2^-40, 2^40), where every power of
// two the kernel multiplies by, and its products with the scale, are exact floats.
__device__ __forceinline__ bool splittable(float max_abs, bool finite) {
  return finite && (max_abs == 0.0f || (max_abs >= 0x1p-40f && max_abs < 0x1p40f));
}

// Query head `head` (of batch x heads) as its batch, its head in the batch and, over batch x kv heads, the kv head
// it reads (head h reads kv head h / (heads / kv heads)).
struct HeadIndex {
  std::int64_t batch, head_in_batch, kv_head;
};

__device__ __forceinline__ HeadIndex head_index(const AttentionShape& shape, std::int64_t head) {
  const std::int64_t batch = head / shape.heads, head_in_batch = head % shape.heads;
  return {batch, head_in_batch, batch * shape.kv_heads + head_in_batch / (shape.heads / shape.kv_heads)};
}

// ---- the passes ---------------------------------------------------------------------------------------------------

// k's rows (heads x padded rows): a warp per row; hi and lo (heads, padded rows, kDim) fp16, the power of
// two per row. Padding rows are zeros with exponent 0. A head with a row the split cannot take gets its flag set; v's
// pass, launched before this one, wrote every head's flag.
template <int kDim>
__global__ void __launch_bounds__(kSplitThreads)
split_rows_kernel(const float* __restrict__ x, OperandStrides strides, std::int64_t heads, std::int64_t rows,
                  std::int64_t padded_rows, std::int64_t total_rows, __half* __restrict__ hi, __half* __restrict__ lo,
                  std::int32_t* __restrict__ exponent, std::int32_t* __restrict__ flags) {
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
  constexpr int kPairs = kDim / 64;  // a lane's pairs: columns 64 p + 2 lane, + 1
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kSplitThreads / 32);
  for (std::int64_t r = (static_cast<std::int64_t>(blockIdx.x) * kSplitThreads + threadIdx.x) / 32; r < total_rows;
       r += warps) {
    const std::int64_t head = r / padded_rows, row = r % padded_rows;
    float v[kPairs][2];
    float max_abs = 0.0f;
    bool finite = true;
    const float* source = x + (head / heads) * strides.batch + (head % heads) * strides.head + row * strides.row;
#pragma unroll
    for (int p = 0; p < kPairs; ++p)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        v[p][i] = row < rows ? source[64 * p + 2 * lane + i] : 0.0f;
        max_abs = fmaxf(max_abs, fabsf(v[p][i]));
        finite = finite && is_finite(v[p][i]);
      }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
      max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, offset));
    const bool ok = __all_sync(0xffffffffu, splittable(max_abs, finite));
    const int e = ok ? scale_exponent(max_abs) : 0;
    const float scale = ok ? exact_power_of_two(e) : 0.0f;
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      const SplitPair s = split_pair(v[p][0] * scale, v[p][1] * scale);
      const std::int64_t at = r * kDim + 64 * p + 2 * lane;
      *reinterpret_cast<__half2*>(hi + at) = s.hi;
      *reinterpret_cast<__half2*>(lo + at) = s.lo;
    }
    if (lane == 0) {
      exponent[r] = e;
      if (!ok) flags[head] = 1;
    }
  }
}

// v's columns over the keys, a CTA per head: the column maxima first, then 64 keys at a time through shared memory,
// written transposed: hi and lo (heads, kDim, padded rows), the power of two per column (heads, kDim). It writes each
// head's flag, so that no memset comes between the previous kernel and this dependent launch.
template <int kDim>
__global__ void __launch_bounds__(kSplitThreads)
split_columns_kernel(const float* __restrict__ v, OperandStrides strides, std::int64_t heads, std::int64_t rows,
                     std::int64_t padded_rows, __half* __restrict__ hi, __half* __restrict__ lo,
                     std::int32_t* __restrict__ exponent, std::int32_t* __restrict__ flags) {
  wait_for_previous_grid();
  allow_next_grid();
  constexpr int kGroups = kSplitThreads / kDim;  // threads per column
  __shared__ float tile[kTile][kDim + 1];
  __shared__ float maxima[kSplitThreads];
  __shared__ float scales[kDim];
  const std::int64_t head = blockIdx.x;
  const float* source = v + (head / heads) * strides.batch + (head % heads) * strides.head;
  const int column = threadIdx.x % kDim, group = threadIdx.x / kDim;
  float max_abs = 0.0f;
  bool finite = true;
  for (std::int64_t r = group; r < rows; r += kGroups) {
    const float value = source[r * strides.row + column];
    max_abs = fmaxf(max_abs, fabsf(value));
    finite = finite && is_finite(value);
  }
  maxima[threadIdx.x] = max_abs;
  __syncthreads();
  if (group == 0) {
#pragma unroll
    for (int g = 1; g < kGroups; ++g) max_abs = fmaxf(max_abs, maxima[g * kDim + column]);
  }
  // The head is flagged where any value is non-finite or a column's maximum is out of range.
  const bool ok = !__syncthreads_or(!finite || (group == 0 && !splittable(max_abs, true)));
  if (group == 0) {
    const int e = ok ? scale_exponent(max_abs) : 0;
    scales[column] = ok ? exact_power_of_two(e) : 0.0f;
    exponent[head * kDim + column] = e;
  }
  if (threadIdx.x == 0) flags[head] = ok ? 0 : 1;  // every head's flag written: k's pass, launched after, only sets it
  __syncthreads();
  const float scale = scales[column];
  __half* const hi_head = hi + head * kDim * padded_rows;
  __half* const lo_head = lo + head * kDim * padded_rows;
  for (std::int64_t first = 0; first < padded_rows; first += kTile) {
    for (int r = group; r < kTile; r += kGroups)
      tile[r][column] = first + r < rows ? source[(first + r) * strides.row + column] * scale : 0.0f;
    __syncthreads();
    for (int i = threadIdx.x; i < kDim * kTile / 2; i += kSplitThreads) {
      const int c = i / (kTile / 2), pair = i % (kTile / 2);
      const SplitPair s = split_pair(tile[2 * pair][c], tile[2 * pair + 1][c]);
      const std::int64_t at = c * padded_rows + first + 2 * pair;
      *reinterpret_cast<__half2*>(hi_head + at) = s.hi;
      *reinterpret_cast<__half2*>(lo_head + at) = s.lo;
    }
    __syncthreads();
  }
}

// ---- the plain path: flagged heads ----------------------------------------------------------------------------

struct PlainOperands {
  const float *q, *k, *v;
  OperandStrides q_strides, k_strides, v_strides;
  float* out;
  OperandStrides out_strides;
  float* logsumexp;
};

// One query row of a head in fp32: the scores (a sequential sum of products, then the scale), their maximum (NaN
// once any score is NaN), then exp(score - max), its sum and the weighted sum of v's rows accumulated in out. IEEE
// arithmetic carries every non-finite value as eager's sum does.
__device__ __forceinline__ void plain_row(const PlainOperands& ops, const AttentionShape& shape, std::int64_t head,
                                          std::int64_t row, bool causal, float scale) {
  const auto [batch, head_in_batch, kv_head] = head_index(shape, head);
  const std::int64_t d = shape.head_dim;
  const float* q_row = ops.q + batch * ops.q_strides.batch + head_in_batch * ops.q_strides.head +
                       row * ops.q_strides.row;
  const std::int64_t kv_in_batch = kv_head - batch * shape.kv_heads;
  const float* k_head = ops.k + batch * ops.k_strides.batch + kv_in_batch * ops.k_strides.head;
  const float* v_head = ops.v + batch * ops.v_strides.batch + kv_in_batch * ops.v_strides.head;
  float* out_row = ops.out + batch * ops.out_strides.batch + head_in_batch * ops.out_strides.head +
                   row * ops.out_strides.row;
  const std::int64_t keys = causal ? min(shape.key_rows, row + 1) : shape.key_rows;
  const auto score_of = [&](std::int64_t key) {
    const float* k_row = k_head + key * ops.k_strides.row;
    float dot = 0.0f;
    for (std::int64_t i = 0; i < d; ++i) dot = fmaf(q_row[i], k_row[i], dot);
    return dot * scale;
  };
  float max_score = -INFINITY;
  for (std::int64_t key = 0; key < keys; ++key) {
    const float s = score_of(key);
    if (s > max_score || s != s) max_score = s;
    if (max_score != max_score) break;  // NaN stays
  }
  for (std::int64_t i = 0; i < d; ++i) out_row[i] = 0.0f;
  float sum = 0.0f;
  for (std::int64_t key = 0; key < keys; ++key) {
    const float p = expf(score_of(key) - max_score);
    sum += p;
    const float* v_row = v_head + key * ops.v_strides.row;
    for (std::int64_t i = 0; i < d; ++i) out_row[i] = fmaf(p, v_row[i], out_row[i]);
  }
  for (std::int64_t i = 0; i < d; ++i) out_row[i] = out_row[i] / sum;
  if (ops.logsumexp != nullptr)
    ops.logsumexp[head * logsumexp_stride(shape.query_rows) + row] = max_score + logf(sum);
}

// Every head on the plain path (the generic path, which tests force): a thread per query row.
__global__ void __launch_bounds__(kTile)
attention_plain_kernel(PlainOperands ops, AttentionShape shape, std::int64_t query_tiles, bool causal, float scale) {
  wait_for_previous_grid();
  allow_next_grid();
  const std::int64_t head = blockIdx.x / query_tiles, row = blockIdx.x % query_tiles * kTile + threadIdx.x;
  if (row < shape.query_rows) plain_row(ops, shape, head, row, causal, scale);
}

// ---- the split kernel ---------------------------------------------------------------------------------------------

struct SplitOperands {
  const __half *k_hi, *k_lo, *v_hi, *v_lo;
  const std::int32_t *k_exponent, *v_exponent, *flags;  // flags: per kv head
};

// d (+)= a b^T by one wgmma of N = 8 kFragments: m64n64k16's, or m64n16k16's for a short last key step.
template <int kFragments>
__device__ __forceinline__ void wgmma_rs(float (&d)[kFragments][4], const std::uint32_t (&a)[4], std::uint64_t b,
                                         bool accumulate) {
  static_assert(kFragments == 8 || kFragments == 2, "wgmma's N: 64 or 16");
  if constexpr (kFragments == 8)
    gemm::sm90::wgmma_m64n64k16_f16_rs(d, a, b, accumulate);
  else
    gemm::sm90::wgmma_m64n16k16_f16_rs(d, a, b, accumulate);
}

// acc (64 rows x 8 kFragments columns a warpgroup, mma.sync's accumulator layout) = or += a b^T on wgmma (sm_90a),
// the split product of the warpgroup's A fragments (a_hi, a_lo per 16 of the reduction, mma.sync's A layout) with a
// K-major tile pair of 8 kFragments rows (64, or a short last key step's 16) in the 128-byte swizzle (b_hi, b_lo:
// shared-window addresses, 32 bytes further per 16 of the reduction), as the mma.sync path computes it: per 16, the
// small products (lo hi, hi lo) into one accumulator, the large one (hi hi) into a fresh one added to acc in fp32
// (first: set by the first); the small sum added last. The fresh accumulators are two, used in turn, so that a step's
// large product is added while the next step's run. Every thread of the warpgroup must call it.
template <int kSteps, int kFragments>
__device__ __forceinline__ void wgmma_split_product(float (&acc)[kFragments][4],
                                                    const std::uint32_t (&a_hi)[kSteps][4],
                                                    const std::uint32_t (&a_lo)[kSteps][4], std::uint32_t b_hi,
                                                    std::uint32_t b_lo, bool first) {
  using namespace gemm::sm90;
  float small[kFragments][4], big[2][kFragments][4];
  const auto add_big = [&](int step) {
#pragma unroll
    for (int j = 0; j < kFragments; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        acc[j][c] = first && step == 0 ? big[step % 2][j][c] : acc[j][c] + big[step % 2][j][c];
  };
#pragma unroll
  for (int step = 0; step < kSteps; ++step) {
    wgmma_fence();  // a's registers and the accumulators were written by other instructions
    wgmma_rs(small, a_lo[step], k_major_swizzle128_descriptor(b_hi + 32 * step), step != 0);
    wgmma_rs(small, a_hi[step], k_major_swizzle128_descriptor(b_lo + 32 * step), true);
    wgmma_rs(big[step % 2], a_hi[step], k_major_swizzle128_descriptor(b_hi + 32 * step), false);
    wgmma_commit();
    if (step == 0) continue;
    wgmma_wait<1>();  // the step before's products, while this step's run
    add_big(step - 1);
  }
  wgmma_wait<0>();
  add_big(kSteps - 1);
#pragma unroll
  for (int j = 0; j < kFragments; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[j][c] += small[j][c];
}

// A stage: k hi, lo (keys x head dim), v hi, lo (head dim x keys), the keys' exponents. mma.sync's (kWgmma false):
// rows padded by kRowPad for ldmatrix. wgmma's: rows of 64 fp16 (128 bytes) unpadded in the 128-byte swizzle (16-byte
// unit u of row r at u ^ (r % 8)), each tile 1024-byte aligned, as its shared-memory descriptors read them.
template <int kDim, bool kWgmma>
struct Stage {
  static constexpr int kKeyRow = kWgmma ? kDim : kDim + kRowPad;    // k tiles: keys x head dim
  static constexpr int kValueRow = kWgmma ? kTile : kTile + kRowPad;  // v tiles: head dim x keys
  static constexpr int kKeyValues = kTile * kKeyRow, kValueValues = kDim * kValueRow;
  static constexpr int kExponents = 2 * (2 * kKeyValues + 2 * kValueValues);  // byte offset of the keys' exponents
  static constexpr int kBytes = kWgmma ? (kExponents + 4 * kTile + 1023) / 1024 * 1024 : kExponents + 4 * kTile;
};

// Two stages of 36 KB where the head dim is 64; one past it (a stage of 70 KB at 128: two CTAs an SM overlap each
// other's loads instead).
template <int kDim>
constexpr int kStages = kDim == 64 ? 2 : 1;

// wgmma's stages start at the first 1024-byte boundary of the block's shared memory.
template <int kDim, bool kWgmma>
constexpr int attention_shared_bytes() {
  return kStages<kDim> * Stage<kDim, kWgmma>::kBytes + (kWgmma ? 1024 : 0);
}

// kWgmma: the products by wgmma (sm_90a, its four warps one warpgroup: each product one instruction over the CTA's
// 64 rows, its B operand read from shared memory by a descriptor), else by mma.sync from ldmatrix fragments; the
// same products in the same order, the same fragments of q and the probabilities (wgmma's A registers are mma.sync's),
// the same accumulator layout. kShortLastTile: the keys' last tile holds no more than kShortKeys keys (its own
// instance, so that other key counts run the kernel without the short step's code).
template <int kDim, bool kWgmma, bool kShortLastTile>
__global__ void __launch_bounds__(kThreads, 2)
attention_split_kernel(SplitOperands ops, PlainOperands plain, AttentionShape shape, std::int64_t query_tiles,
                       bool causal, float scale) {
#if KERNELS_SM80_DEVICE
  static_assert(!kWgmma || kDim == 64, "wgmma's tiles: 64 keys x a head dim of 64");
#if !KERNELS_SM90A_DEVICE
  if constexpr (kWgmma) __trap();  // its products compile to nothing off sm_90a: a launch there fails loudly
#endif
  using S = Stage<kDim, kWgmma>;
  wait_for_previous_grid();
  allow_next_grid();
  const std::int64_t head = blockIdx.x / query_tiles;
  // The longest tiles (the last, under a causal mask) first.
  const std::int64_t tile = query_tiles - 1 - blockIdx.x % query_tiles;
  const auto [batch, head_in_batch, kv_head] = head_index(shape, head);
  const auto plain_tile = [&] {
    const std::int64_t row = tile * kTile + threadIdx.x;
    if (threadIdx.x < kTile && row < shape.query_rows) plain_row(plain, shape, head, row, causal, scale);
  };
  if (ops.flags[kv_head] != 0) {  // k or v holds values the split cannot take
    plain_tile();
    return;
  }
  extern __shared__ __align__(16) unsigned char shared_block[];
  const std::uint32_t block_base = shared_address(shared_block);
  const std::uint32_t shared_base = kWgmma ? (block_base + 1023) / 1024 * 1024 : block_base;
  unsigned char* const shared = shared_block + (shared_base - block_base);
  const std::int64_t k_padded = padded(shape.key_rows);
  const std::int64_t key_tiles_all = k_padded / kTile;
  const std::int64_t key_tiles = causal ? min(key_tiles_all, tile + 1) : key_tiles_all;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;

  // The stage loads: k's hi and lo (64 keys x kDim), v's (kDim x 64 keys), the keys' exponents.
  const __half* k_sources[2] = {ops.k_hi + kv_head * k_padded * kDim, ops.k_lo + kv_head * k_padded * kDim};
  const __half* v_sources[2] = {ops.v_hi + kv_head * kDim * k_padded, ops.v_lo + kv_head * kDim * k_padded};
  const std::int32_t* k_exponents = ops.k_exponent + kv_head * k_padded;
  const auto load_stage = [&](std::int64_t key_tile, int stage) {
    const std::uint32_t base = shared_base + stage * S::kBytes;
    constexpr int kKeyUnits = kTile * kDim / 8, kValueUnits = kDim * kTile / 8;  // 16-byte units per tile
#pragma unroll
    for (int side = 0; side < 2; ++side) {
#pragma unroll
      for (int u = threadIdx.x; u < kKeyUnits; u += kThreads) {
        const int row = u / (kDim / 8), unit = u % (kDim / 8);
        const int place = kWgmma ? row * S::kKeyRow + ((unit ^ (row % 8)) * 8) : row * S::kKeyRow + unit * 8;
        copy_16_async(base + 2 * (side * S::kKeyValues + place),
                      k_sources[side] + (key_tile * kTile + row) * kDim + unit * 8, true);
      }
#pragma unroll
      for (int u = threadIdx.x; u < kValueUnits; u += kThreads) {
        const int row = u / (kTile / 8), unit = u % (kTile / 8);
        const int place = kWgmma ? row * S::kValueRow + ((unit ^ (row % 8)) * 8) : row * S::kValueRow + unit * 8;
        copy_16_async(base + 2 * (2 * S::kKeyValues + side * S::kValueValues + place),
                      v_sources[side] + row * k_padded + key_tile * kTile + unit * 8, true);
      }
    }
    if (threadIdx.x < kTile / 4)
      copy_16_async(base + S::kExponents + 16 * threadIdx.x, k_exponents + key_tile * kTile + 4 * threadIdx.x, true);
  };
  load_stage(0, 0);
  commit_copies();

  // The warp's 16 query rows, split here (this CTA alone reads them) as split_rows_kernel splits k's, into A
  // fragments: per 16 of the head dim, rows g and g + 8 (h = 0, 1) at pairs 2t and 2t + 8 (p = 0, 1), fragment
  // register 2p + h. A row's 64 values lie in its quad's four lanes; rows past the queries are zeros. A tile with a
  // value the split cannot take (non-finite, or a row's largest |value| out of range) runs on the plain path.
  const std::int64_t first_row = tile * kTile + warp * 16;
  std::uint32_t q_hi[kDim / 16][4], q_lo[kDim / 16][4];
  float row_factor[2];
  {
    float q_value[kDim / 16][4][2];
    float max_abs[2] = {0.0f, 0.0f};
    bool finite = true;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int64_t row = first_row + g + 8 * h;
      const float* source = plain.q + batch * plain.q_strides.batch + head_in_batch * plain.q_strides.head +
                            row * plain.q_strides.row + 2 * t;
#pragma unroll
      for (int step = 0; step < kDim / 16; ++step)
#pragma unroll
        for (int p = 0; p < 2; ++p)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float value = row < shape.query_rows ? source[16 * step + 8 * p + e] : 0.0f;
            q_value[step][2 * p + h][e] = value;
            max_abs[h] = fmaxf(max_abs[h], fabsf(value));
            finite = finite && is_finite(value);
          }
      max_abs[h] = fmaxf(max_abs[h], __shfl_xor_sync(0xffffffffu, max_abs[h], 1));
      max_abs[h] = fmaxf(max_abs[h], __shfl_xor_sync(0xffffffffu, max_abs[h], 2));
    }
    if (__syncthreads_or(!(splittable(max_abs[0], finite) && splittable(max_abs[1], true)))) {
      wait_copies<0>();  // the first stage's copies land before the CTA leaves
      plain_tile();
      return;
    }
    float factor[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int e = scale_exponent(max_abs[h]);
      factor[h] = exact_power_of_two(e);
      row_factor[h] = scale * exact_power_of_two(-e);  // exact: a power of two within range
    }
#pragma unroll
    for (int step = 0; step < kDim / 16; ++step)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const SplitPair pair = split_pair(q_value[step][i][0] * factor[i % 2], q_value[step][i][1] * factor[i % 2]);
        q_hi[step][i] = bits(pair.hi);
        q_lo[step][i] = bits(pair.lo);
      }
  }
  // Rows g and g + 8: the largest score so far and the sum of exp(score - that largest).
  float row_max[2], row_sum[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_max[h] = -INFINITY;
    row_sum[h] = 0.0f;
  }
  float out_acc[kDim / 8][4];
#pragma unroll
  for (int n = 0; n < kDim / 8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) out_acc[n][c] = 0.0f;

  // The keys' last tile, where it holds no more than kShortKeys keys and is this CTA's last step, takes a short step
  // (the count checked here too: right whichever instance the launcher chose).
  const bool short_last_step =
      kShortLastTile && key_tiles == key_tiles_all && shape.key_rows - (key_tiles_all - 1) * kTile <= kShortKeys;
  for (std::int64_t key_tile = 0; key_tile < key_tiles; ++key_tile) {
    const int stage = kStages<kDim> == 1 ? 0 : static_cast<int>(key_tile % 2);
    if (kStages<kDim> == 2 && key_tile + 1 < key_tiles) {
      load_stage(key_tile + 1, stage ^ 1);
      commit_copies();
      wait_copies<1>();
    } else {
      wait_copies<0>();
    }
    if constexpr (kWgmma) gemm::sm90::fence_async_shared();  // this thread's copies, before wgmma's reads of them
    __syncthreads();
    const std::int32_t* key_exponent =
        reinterpret_cast<const std::int32_t*>(shared + stage * S::kBytes + S::kExponents);

    // One key step over the tile's first kKeys keys: all kTile, or for a last tile holding no more than kShortKeys
    // keys, those (the rest are padding, whose probabilities are 0: the same outputs for a quarter of the work).
    const auto key_step = [&](auto keys) {
      constexpr int kKeys = decltype(keys)::value;
      // Scores of the warp's 16 rows x kKeys keys: n-fragment j holds keys 8 j + 2t, + 1 (rows g; g + 8). The tensor
      // cores truncate their sums, a bias that grows with each product added to a sum: the large product (hi hi) of
      // each 16 of the head dim goes to a fresh accumulator and is added to the score in fp32; the small ones (lo hi,
      // hi lo) share one accumulator, added last. ldmatrix.x4 gives the B fragments of n-fragments j, j + 1 for one 16
      // of the head dim: lane l addresses key 8 (j + l / 16) + l % 8 at 8 ((l / 8) % 2).
      float score[kKeys / 8][4];
      const std::uint32_t k_hi_base = shared_base + stage * S::kBytes;
      const std::uint32_t k_lo_base = k_hi_base + 2 * S::kKeyValues;
      if constexpr (kWgmma) {
        wgmma_split_product(score, q_hi, q_lo, k_hi_base, k_lo_base, /*first=*/true);
      } else {
        const std::uint32_t key_lane = 2 * ((lane % 8 + 8 * (lane / 16)) * S::kKeyRow + 8 * ((lane / 8) % 2));
#pragma unroll
        for (int j = 0; j < kKeys / 8; j += 2) {
          float small[2][4];
#pragma unroll
          for (int step = 0; step < kDim / 16; ++step) {
            std::uint32_t bh[4], bl[4];
            const std::uint32_t at = key_lane + 2 * (8 * j * S::kKeyRow + 16 * step);
            load_matrix_x4(k_hi_base + at, bh);
            load_matrix_x4(k_lo_base + at, bl);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              if (step == 0)
                mma_m16n8k16<true>(small[i], q_lo[step], bh[2 * i], bh[2 * i + 1]);
              else
                mma_m16n8k16<false>(small[i], q_lo[step], bh[2 * i], bh[2 * i + 1]);
              mma_m16n8k16<false>(small[i], q_hi[step], bl[2 * i], bl[2 * i + 1]);
              float big[4];
              mma_m16n8k16<true>(big, q_hi[step], bh[2 * i], bh[2 * i + 1]);
#pragma unroll
              for (int c = 0; c < 4; ++c) score[j + i][c] = step == 0 ? big[c] : score[j + i][c] + big[c];
            }
          }
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) score[j + i][c] += small[i][c];
        }
      }
      // Unscale (one rounding: the scale's). The thread's keys 8 j + 2t, + 1 have adjacent exponents.
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        const int2 exponents = reinterpret_cast<const int2*>(key_exponent)[4 * j + t];
        const float key_factor[2] = {exact_power_of_two(-exponents.x), exact_power_of_two(-exponents.y)};
#pragma unroll
        for (int c = 0; c < 4; ++c) score[j][c] = score[j][c] * row_factor[c / 2] * key_factor[c % 2];
      }
      // Masked keys lie in the last key tile only: the padding past the keys, and under the causal mask the keys past
      // each row (a query tile's key tiles end at its own).
      if (key_tile + 1 == key_tiles) {
        const std::int64_t first_key = key_tile * kTile;
#pragma unroll
        for (int j = 0; j < kKeys / 8; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const std::int64_t key = first_key + 8 * j + 2 * t + c % 2;
            if (key >= shape.key_rows || (causal && key > first_row + g + 8 * (c / 2))) score[j][c] = -INFINITY;
          }
      }
      // The rows' new maxima.
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) tile_max[c / 2] = fmaxf(tile_max[c / 2], score[j][c]);
      float correction[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
        const float new_max = fmaxf(row_max[h], tile_max[h]);
        correction[h] = exp2f((row_max[h] - new_max) * kLog2e);  // 0 at the first step (row_max -inf)
        row_max[h] = new_max;
        row_sum[h] *= correction[h];
      }
      // Probabilities, split as the A fragments of the products with v: key step s holds n-fragments 2s and 2s + 1.
      std::uint32_t p_hi[kKeys / 16][4], p_lo[kKeys / 16][4];
#pragma unroll
      for (int j = 0; j < kKeys / 8; ++j) {
        float p[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          p[c] = exp2f((score[j][c] - row_max[c / 2]) * kLog2e);
          row_sum[c / 2] += p[c];
        }
        const float factor = exact_power_of_two(kProbabilityExponent);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const SplitPair s = split_pair(p[2 * h] * factor, p[2 * h + 1] * factor);
          p_hi[j / 2][2 * (j % 2) + h] = bits(s.hi);
          p_lo[j / 2][2 * (j % 2) + h] = bits(s.lo);
        }
      }
      // This step's products with v, 64 columns of the head dim at a time, as the scores': the running output times
      // the correction, then each 16 keys' large product from a fresh accumulator, the small ones' sum last.
      // ldmatrix.x4 as for k: lane l addresses column 8 (n + l / 16) + l % 8 of v's tile at key 8 ((l / 8) % 2).
      const std::uint32_t v_hi_base = k_lo_base + 2 * S::kKeyValues;
      const std::uint32_t v_lo_base = v_hi_base + 2 * S::kValueValues;
#pragma unroll
      for (int n = 0; n < kDim / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) out_acc[n][c] *= correction[c / 2];
      if constexpr (kWgmma) {
        wgmma_split_product(out_acc, p_hi, p_lo, v_hi_base, v_lo_base, /*first=*/false);
      } else {
        const std::uint32_t value_lane = 2 * ((lane % 8 + 8 * (lane / 16)) * S::kValueRow + 8 * ((lane / 8) % 2));
#pragma unroll
        for (int half = 0; half < kDim / 64; ++half) {
          float small[8][4];
#pragma unroll
          for (int s = 0; s < kKeys / 16; ++s)
#pragma unroll
            for (int n = 0; n < 8; n += 2) {
              std::uint32_t bh[4], bl[4];
              const std::uint32_t at = value_lane + 2 * ((64 * half + 8 * n) * S::kValueRow + 16 * s);
              load_matrix_x4(v_hi_base + at, bh);
              load_matrix_x4(v_lo_base + at, bl);
#pragma unroll
              for (int i = 0; i < 2; ++i) {
                if (s == 0)
                  mma_m16n8k16<true>(small[n + i], p_lo[s], bh[2 * i], bh[2 * i + 1]);
                else
                  mma_m16n8k16<false>(small[n + i], p_lo[s], bh[2 * i], bh[2 * i + 1]);
                mma_m16n8k16<false>(small[n + i], p_hi[s], bl[2 * i], bl[2 * i + 1]);
                float big[4];
                mma_m16n8k16<true>(big, p_hi[s], bh[2 * i], bh[2 * i + 1]);
#pragma unroll
                for (int c = 0; c < 4; ++c) out_acc[8 * half + n + i][c] += big[c];
              }
            }
#pragma unroll
          for (int n = 0; n < 8; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) out_acc[8 * half + n][c] += small[n][c];
        }
      }
    };
    if constexpr (kShortLastTile) {
      if (short_last_step && key_tile + 1 == key_tiles)
        key_step(std::integral_constant<int, kShortKeys>{});
      else
        key_step(std::integral_constant<int, kTile>{});
    } else {
      key_step(std::integral_constant<int, kTile>{});
    }
    __syncthreads();  // the stage is read: the next step's loads may overwrite it
    if (kStages<kDim> == 1 && key_tile + 1 < key_tiles) {
      load_stage(key_tile + 1, 0);
      commit_copies();
    }
  }

  // The rows' sums over the quad, then out = acc * 2^-(13 + e_column) / sum (one rounding: the division's), and the
  // logsumexp, the row's largest score + ln sum.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
    row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], 2);
  }
  const std::int32_t* v_exponent = ops.v_exponent + kv_head * kDim;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const std::int64_t row = first_row + g + 8 * h;
    if (row >= shape.query_rows) continue;
    float* target = plain.out + batch * plain.out_strides.batch + head_in_batch * plain.out_strides.head +
                    row * plain.out_strides.row;
#pragma unroll
    for (int n = 0; n < kDim / 8; ++n)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int column = 8 * n + 2 * t + i;
        const float unscale = exact_power_of_two(-(kProbabilityExponent + v_exponent[column]));
        target[column] = (out_acc[n][2 * h + i] * unscale) / row_sum[h];
      }
    if (plain.logsumexp != nullptr && t == 0)
      plain.logsumexp[head * logsumexp_stride(shape.query_rows) + row] = row_max[h] + logf(row_sum[h]);
  }
#endif
}

// Whether `device` (the current one) runs the wgmma kernel: compute capability 9.0 and the library's sm_90a code of
// it (on any other target its products compile to nothing). Asked once per device.
template <int kDim>
bool wgmma_kernel_runs(int device) {
  return once_per_device(device, [](int d) -> std::optional<bool> {
    const std::optional<int> capability = compute_capability(d);
    if (!capability) return std::nullopt;
    return *capability == 90 && kernel_code_version(attention_split_kernel<kDim, true, false>) == 90;
  }).value_or(false);
}

template <int kDim, bool kWgmma, bool kShortLastTile>
cudaError_t launch_split(const PlainOperands& plain, const AttentionShape& shape, bool causal, float scale,
                         const AttentionWorkspace& layout, unsigned char* workspace, cudaStream_t stream,
                         int device) {
  const auto kernel = attention_split_kernel<kDim, kWgmma, kShortLastTile>;
  cudaError_t err = raise_shared_memory_limit<attention_split_kernel<kDim, kWgmma, kShortLastTile>>(
      device, attention_shared_bytes<kDim, kWgmma>());
  if (err != cudaSuccess) return err;
  const std::int64_t q_heads = shape.batch * shape.heads, kv_heads = shape.batch * shape.kv_heads;
  const std::int64_t q_padded = padded(shape.query_rows), k_padded = padded(shape.key_rows);
  auto* k_split = reinterpret_cast<__half*>(workspace + layout.k_split);
  auto* v_split = reinterpret_cast<__half*>(workspace + layout.v_split);
  auto* k_exponent = reinterpret_cast<std::int32_t*>(workspace + layout.k_exponent);
  auto* v_exponent = reinterpret_cast<std::int32_t*>(workspace + layout.v_exponent);
  auto* flags = reinterpret_cast<std::int32_t*>(workspace + layout.flags);
  const std::int64_t kv_values = kv_heads * k_padded * kDim;
  // v's pass first: it writes the flags that k's pass may set (each waits for the grid before it to complete).
  err = launch_dependent(split_columns_kernel<kDim>, dim3(static_cast<unsigned>(kv_heads)), dim3(kSplitThreads), 0,
                         stream, plain.v, plain.v_strides, shape.kv_heads, shape.key_rows, k_padded, v_split,
                         v_split + kv_values, v_exponent, flags);
  if (err != cudaSuccess) return err;
  const auto row_blocks = [](std::int64_t rows) {
    const std::int64_t blocks = (rows + kSplitThreads / 32 - 1) / (kSplitThreads / 32);
    return dim3(static_cast<unsigned>(blocks < 65536 ? blocks : 65536));
  };
  err = launch_dependent(split_rows_kernel<kDim>, row_blocks(kv_heads * k_padded), dim3(kSplitThreads), 0, stream,
                         plain.k, plain.k_strides, shape.kv_heads, shape.key_rows, k_padded, kv_heads * k_padded,
                         k_split, k_split + kv_values, k_exponent, flags);
  if (err != cudaSuccess) return err;
  const SplitOperands ops{k_split, k_split + kv_values, v_split, v_split + kv_values, k_exponent, v_exponent, flags};
  const std::int64_t query_tiles = q_padded / kTile;
  return launch_dependent(kernel, dim3(static_cast<unsigned>(q_heads * query_tiles)), dim3(kThreads),
                          attention_shared_bytes<kDim, kWgmma>(), stream, ops, plain, shape, query_tiles, causal,
                          scale);
}

template <int kDim>
bool supported_on(int device) {
  return once_per_device(device, [](int d) -> std::optional<bool> {
    const std::optional<int> capability = compute_capability(d);
    int shared = 0;
    if (!capability || cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, d) != cudaSuccess) {
      (void)cudaGetLastError();
      return std::nullopt;
    }
    return *capability >= 80 && shared >= attention_shared_bytes<kDim, false>();
  }).value_or(false);
}

}  // namespace

bool attention_supported(int device, std::int64_t head_dim) {
  return supported_head_dim(head_dim) && supported_on<64>(device);
}

cudaError_t launch_attention(const float* q, OperandStrides q_strides, const float* k, OperandStrides k_strides,
                             const float* v, OperandStrides v_strides, float* out, OperandStrides out_strides,
                             float* logsumexp, const AttentionShape& shape, bool causal, float scale,
                             bool mma_sync_only, bool plain_only, void* workspace, cudaStream_t stream) {
  if (!supported_head_dim(shape.head_dim) || shape.kv_heads <= 0 || shape.heads % shape.kv_heads != 0)
    return cudaErrorInvalidValue;
  const PlainOperands plain{q, k, v, q_strides, k_strides, v_strides, out, out_strides, logsumexp};
  if (plain_only) {
    const std::int64_t query_tiles = padded(shape.query_rows) / kTile;
    return launch_dependent(attention_plain_kernel,
                            dim3(static_cast<unsigned>(shape.batch * shape.heads * query_tiles)), dim3(kTile), 0,
                            stream, plain, shape, query_tiles, causal, scale);
  }
  const AttentionWorkspace layout = attention_workspace(shape);
  auto* base = static_cast<unsigned char*>(workspace);
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool wgmma = !mma_sync_only && wgmma_kernel_runs<64>(device);
  if (shape.key_rows > 0 && (shape.key_rows - 1) % kTile < kShortKeys) {  // a short last key tile
    if (wgmma) return launch_split<64, true, true>(plain, shape, causal, scale, layout, base, stream, device);
    return launch_split<64, false, true>(plain, shape, causal, scale, layout, base, stream, device);
  }
  if (wgmma) return launch_split<64, true, false>(plain, shape, causal, scale, layout, base, stream, device);
  return launch_split<64, false, false>(plain, shape, causal, scale, layout, base, stream, device);
}

}  // namespace kernels::attention
