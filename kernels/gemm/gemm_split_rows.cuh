// The split passes with one power of two per row of the result (gemm.h: launch_split_rows, launch_split_columns),
// and what the chunk splits (gemm_split_chunks.cuh) share with them: the block size, fold (a thread's running
// maximum), the group reduction, split_pack (a pack's split and its stores) and the column tiles.
//
// launch_split_rows, the split pass of the fp32-accurate tensor-core GEMM over x: each row of a float32 matrix
// becomes a power-of-two row exponent and a pair of fp16 rows hi, lo with hi + lo = v * 2^e to about 22 bits, in the
// order along K and the padded length the GEMM reads (split_numerics.cuh: split_position, split_row_length).
// Memory-bound: each element is read from DRAM once and its two halves written once (4 + 4 bytes). A group of whole
// warps per row, sized so that each thread holds a few 16-byte packs: rows of up to 16384 floats are held in
// registers between finding the row's largest finite |v| and writing hi and lo; longer rows take two passes, the
// second re-reading the row from L1/L2. Rows are read as 16-byte packs (the launcher requires 16-byte aligned rows of
// a multiple of 4 floats); each pack's halves are written as two fp16 pairs to their places in the GEMM's order.
// Portable (any architecture).
#pragma once

#include "gemm.h"
#include "split_numerics.cuh"

#include <cuda_fp16.h>

#include <cstring>

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

__device__ __forceinline__ float clean(float v) { return is_finite(v) ? v : 0.0f; }

// Splits pack i of a row (k = 4i .. 4i + 3) and stores its halves at their places in the GEMM's order. A
// non-finite v becomes 0 + 0: its row is flagged, and the outputs it reaches are computed by
// nonfinite_outputs_kernel (the tensor cores would mix an infinity with the random signs of the other operand's lo
// into NaN where eager gives an infinity).
// kNatural: in k's own order (for the GEMM that reads w transposed); else in split_position's.
template <bool kNatural>
__device__ __forceinline__ void split_pack(float4 v, PowerOfTwo scale, std::int64_t i, __half* hi_row,
                                           __half* lo_row) {
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

// The maximum and non-finite flag over a group of kGroup consecutive threads (whole warps; kSplitThreads / kGroup
// groups per block). Every thread of the block must call it, once per kernel.
template <int kGroup>
__device__ __forceinline__ float group_max(float max_abs, bool& non_finite) {
  static_assert(kGroup % 32 == 0 && kSplitThreads % kGroup == 0, "whole warps per group, whole groups per block");
  for (int offset = 16; offset > 0; offset /= 2)
    max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, offset));
  non_finite = __any_sync(0xffffffffu, non_finite);
  if constexpr (kGroup > 32) {
    constexpr int kGroupWarps = kGroup / 32;
    __shared__ float warp_max[kSplitThreads / 32];
    __shared__ bool warp_bad[kSplitThreads / 32];
    if (threadIdx.x % 32 == 0) {
      warp_max[threadIdx.x / 32] = max_abs;
      warp_bad[threadIdx.x / 32] = non_finite;
    }
    __syncthreads();
    const int first = threadIdx.x / kGroup * kGroupWarps;
#pragma unroll
    for (int w = 0; w < kGroupWarps; ++w) {
      max_abs = fmaxf(max_abs, warp_max[first + w]);
      non_finite |= warp_bad[first + w];
    }
  }
  return max_abs;
}

// Rows of up to kGroup * kPacks * 4 floats (split length included), kGroup threads per row: each thread loads its
// packs of 4 into registers at once (all of the row's loads in flight together), and the split is made from the
// registers: one DRAM read. Packs past the row's end (up to its split length) are written as zeros.
template <int kGroup, int kPacks, bool kNatural>
__global__ void __launch_bounds__(kSplitThreads)
split_rows_in_registers_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t cols,
                               std::int64_t row_stride, __half* __restrict__ hi, __half* __restrict__ lo,
                               std::int32_t* __restrict__ exponent) {
  const int member = threadIdx.x % kGroup;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (kSplitThreads / kGroup) + threadIdx.x / kGroup;
  const bool inside = row < rows;  // the block's last rows may lie past the end; they still join its barriers
  const float4* in = reinterpret_cast<const float4*>(src + (inside ? row : 0) * row_stride);
  const int packs = static_cast<int>(cols / 4);
  const std::int64_t length = split_row_length(cols);
  const int split_packs = static_cast<int>(length / 4);
  float4 v[kPacks];
  float max_abs = 0.0f;
  bool non_finite = false;
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int i = member + p * kGroup;
    v[p] = inside && i < packs ? __ldcs(in + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // read once: no need to keep in L2
  }
#pragma unroll
  for (int p = 0; p < kPacks; ++p) fold(v[p], max_abs, non_finite);
  max_abs = group_max<kGroup>(max_abs, non_finite);
  if (!inside) return;
  const int e = scale_exponent(max_abs);
  if (member == 0) exponent[row] = non_finite ? kNonFiniteRow : e;
  const PowerOfTwo scale = power_of_two(e);
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int i = member + p * kGroup;
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

// Column tiles, for splits whose rows of the result are columns of a row-major matrix (launch_split_columns here,
// the split of w given transposed in gemm_split_chunks.cuh): kTileRows rows by kTileColumns columns, read by
// kTileThreads threads. Warp w holds the row pairs (2p, 2p + 1), p = w + kTileWarps * i, each lane 4 consecutive
// columns of both rows: 512 contiguous bytes per row and warp, all of a thread's loads in flight together. A row
// pair's split is one fp16 pair per column, the layout of the transposed result: the pairs are staged in shared
// memory, then each warp writes whole columns as rows of the result (128 bytes of hi and of lo per column).
constexpr int kTileThreads = 256;
constexpr int kTileWarps = kTileThreads / 32;
constexpr int kTileColumns = 4 * 32;
constexpr int kTileRows = kSplitChunk;
constexpr int kTilePairs = kTileRows / 2;  // fp16 pairs per column of a tile: one per lane
constexpr int kTilePairsPerWarp = kTilePairs / kTileWarps;
static_assert(kTilePairs == 32 && kTilePairs % kTileWarps == 0, "a tile column's pairs are one word per lane");

struct Tile {
  float4 v[kTilePairsPerWarp][2];  // [i][h]: row 2 (warp + kTileWarps i) + h, columns 4 lane .. 4 lane + 3
};

// fp16 pairs of a tile, as 32-bit words: column j's pair p at word p ^ (j / 4): conflict-free stores (a warp's
// lanes hold columns 4 lane + e) and loads (a warp reads one column).
struct TileStage {
  std::uint32_t hi[kTileColumns][kTilePairs], lo[kTileColumns][kTilePairs];
};

__device__ __forceinline__ int staged_word(int column, int pair) { return pair ^ (column / 4 % kTilePairs); }

__device__ __forceinline__ std::uint32_t bits(__half2 pair) {
  std::uint32_t word;
  std::memcpy(&word, &pair, sizeof word);
  return word;
}

__device__ __forceinline__ float element(float4 v, int e) { return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w; }

// Loads the tile at (first_row, first_column) of src (rows x cols, rows row_stride apart); zeros outside.
// kAligned: cols % 4 == 0, row_stride % 4 == 0 and src 16-byte aligned (16-byte loads); else 4-byte loads.
// kLastUse: the loads leave L2 first (the data is not read again).
template <bool kAligned, bool kLastUse>
__device__ __forceinline__ Tile load_tile(const float* __restrict__ src, std::int64_t rows, std::int64_t cols,
                                          std::int64_t row_stride, std::int64_t first_row,
                                          std::int64_t first_column) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t column = first_column + 4 * lane;
  const auto load = [](const float* at) { return kLastUse ? __ldcs(at) : __ldg(at); };
  Tile tile;
#pragma unroll
  for (int i = 0; i < kTilePairsPerWarp; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int64_t row = first_row + 2 * (warp + kTileWarps * i) + h;
      const float* at = src + (row < rows ? row : 0) * row_stride + column;
      float4& v = tile.v[i][h];
      if constexpr (kAligned) {
        const float4* at4 = reinterpret_cast<const float4*>(at);
        v = row < rows && column < cols ? (kLastUse ? __ldcs(at4) : __ldg(at4)) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      } else {
        v.x = row < rows && column < cols ? load(at) : 0.0f;
        v.y = row < rows && column + 1 < cols ? load(at + 1) : 0.0f;
        v.z = row < rows && column + 2 < cols ? load(at + 2) : 0.0f;
        v.w = row < rows && column + 3 < cols ? load(at + 3) : 0.0f;
      }
    }
  }
  return tile;
}

// Splits the thread's part of a tile with its 4 columns' scales into the stage (non-finite values as 0). The caller
// synchronizes the block before store_tile reads the stage.
__device__ __forceinline__ void stage_split(const Tile& tile, const PowerOfTwo (&scale)[4], TileStage& stage) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int i = 0; i < kTilePairsPerWarp; ++i) {
    const int pair = warp + kTileWarps * i;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int column = 4 * lane + e;
      const SplitPair split = split_pair(clean(element(tile.v[i][0], e)), clean(element(tile.v[i][1], e)), scale[e]);
      stage.hi[column][staged_word(column, pair)] = bits(split.hi);
      stage.lo[column][staged_word(column, pair)] = bits(split.lo);
    }
  }
}

// Writes the staged tile: column j (< cols - first_column) as kTileRows halves of row first_column + j of hi and lo
// (rows `length` halves apart), from half `position` on. kLastUse: the stores leave L2 first.
template <bool kLastUse>
__device__ __forceinline__ void store_tile(const TileStage& stage, __half* __restrict__ hi, __half* __restrict__ lo,
                                           std::int64_t length, std::int64_t first_column, std::int64_t cols,
                                           std::int64_t position) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll 4
  for (int j = warp; j < kTileColumns; j += kTileWarps) {
    if (first_column + j >= cols) break;
    const std::int64_t at = (first_column + j) * length + position;
    std::uint32_t* hi_words = reinterpret_cast<std::uint32_t*>(hi + at);
    std::uint32_t* lo_words = reinterpret_cast<std::uint32_t*>(lo + at);
    const std::uint32_t hi_word = stage.hi[j][staged_word(j, lane)], lo_word = stage.lo[j][staged_word(j, lane)];
    if constexpr (kLastUse) {
      __stcs(reinterpret_cast<unsigned*>(hi_words + lane), hi_word);
      __stcs(reinterpret_cast<unsigned*>(lo_words + lane), lo_word);
    } else {
      hi_words[lane] = hi_word;
      lo_words[lane] = lo_word;
    }
  }
}

// The split of src's columns (launch_split_columns; src: rows x cols, row-major): row c of the result is column c
// of src, in natural order. The matrix is cut into column tiles (kTileColumns wide) and slabs (kTileRows rows): an
// item is one tile of one slab, and each item is done twice, by two blocks:
// - A (statistics): reads its item, and writes each column's largest finite |v|, non-finite flag and compensated sum
//   over the slab to the workspace; the last A block of a column tile to finish (counted in arrivals) combines the
//   tile's slabs in slab order (a fixed order: the same sums on every run), writes the exponents and sums, and marks
//   the tile ready.
// - B (split): re-reads its item (from L2: A read it shortly before) and, once its tile is ready, splits it with the
//   columns' scales.
// Blocks take their items in the order of a ticket (an atomic counter), not of blockIdx: A items in order, B items
// kColumnLagItems behind (at least a whole tile of slabs behind), so that a B block waits only for A items taken
// before its own, which run to the end without waiting: no deadlock, however many blocks are resident. The lag keeps
// the bytes between an item's two reads well inside L2.
constexpr int kColumnLagItems = 256;

// The workspace: counters (the ticket, then one arrival count per column tile, zeroed by the launcher), each item's
// column partials, each column's exponent. Sizes in column tiles and slabs; offsets in bytes, 16-byte aligned.
struct ColumnSplitLayout {
  std::int64_t tiles, slabs, counters_bytes, partials_offset, exponents_offset, bytes;
};

KERNELS_GEMM_HOST_DEVICE inline ColumnSplitLayout column_split_layout(std::int64_t rows, std::int64_t cols) {
  ColumnSplitLayout layout{};
  layout.tiles = (cols + kTileColumns - 1) / kTileColumns;
  layout.slabs = (rows + kTileRows - 1) / kTileRows;
  layout.counters_bytes = ((1 + layout.tiles) * 4 + 255) / 256 * 256;
  layout.partials_offset = layout.counters_bytes;
  layout.exponents_offset = layout.partials_offset + layout.tiles * layout.slabs * kTileColumns * 16;
  layout.bytes = layout.exponents_offset + layout.tiles * kTileColumns * 4;
  return layout;
}

// A running compensated sum, total + error: Kahan's per thread (error = -compensation), Neumaier's two-sum when
// adding partial sums, so that each add of a partial costs no more than one rounding of the total.
struct ColumnPartial {
  float max_abs, total, error;
  bool non_finite;
};

__device__ __forceinline__ void combine(ColumnPartial& into, const ColumnPartial& part) {
  into.max_abs = fmaxf(into.max_abs, part.max_abs);
  into.non_finite |= part.non_finite;
  const float next = into.total + part.total;
  into.error += fabsf(into.total) >= fabsf(part.total) ? (into.total - next) + part.total
                                                       : (part.total - next) + into.total;
  into.error += part.error;
  into.total = next;
}

__device__ __forceinline__ float4 pack(const ColumnPartial& p) {
  return make_float4(p.max_abs, p.total, p.error, p.non_finite ? 1.0f : 0.0f);
}

__device__ __forceinline__ ColumnPartial unpack(float4 v) { return {v.x, v.y, v.z, v.w != 0.0f}; }

// The ticket's item: phase A or B, and the item's index (tile-major: tile * slabs + slab).
struct ColumnItem {
  bool split;
  std::int64_t index;
};

__device__ __forceinline__ ColumnItem column_item(std::int64_t ticket, std::int64_t items, std::int64_t lag) {
  if (ticket < lag) return {false, ticket};
  const std::int64_t m = ticket - lag;
  if (m < 2 * (items - lag)) return m % 2 == 0 ? ColumnItem{false, lag + m / 2} : ColumnItem{true, m / 2};
  return {true, m - items + lag};
}

template <bool kAligned>
__global__ void __launch_bounds__(kTileThreads)
split_columns_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                     __half* __restrict__ hi, __half* __restrict__ lo, std::int32_t* __restrict__ exponent,
                     float* __restrict__ column_sums, unsigned char* __restrict__ workspace, std::int64_t lag) {
  static_assert(kTileThreads == 2 * kTileColumns, "the last A block combines each column's slabs in two halves");
  union Shared {
    TileStage stage;
    float4 partials[kTileWarps][kTileColumns];
  };
  __shared__ Shared shared;
  __shared__ std::int64_t item_ticket;
  __shared__ bool last;
  const ColumnSplitLayout layout = column_split_layout(rows, cols);
  unsigned* const ticket = reinterpret_cast<unsigned*>(workspace);
  unsigned* const arrivals = ticket + 1;
  float4* const partials = reinterpret_cast<float4*>(workspace + layout.partials_offset);
  std::int32_t* const column_exponent = reinterpret_cast<std::int32_t*>(workspace + layout.exponents_offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) item_ticket = atomicAdd(ticket, 1u);
  __syncthreads();
  const ColumnItem item = column_item(item_ticket, layout.tiles * layout.slabs, lag);
  const std::int64_t tile = item.index / layout.slabs, slab = item.index % layout.slabs;
  const std::int64_t first_column = tile * kTileColumns, first_row = slab * kTileRows;
  const unsigned ready = static_cast<unsigned>(layout.slabs) + 1;  // every A block arrived, then the combine

  if (item.split) {
    const Tile values = load_tile<kAligned, true>(src, rows, cols, row_stride, first_row, first_column);
    if (threadIdx.x == 0) {
      while (*reinterpret_cast<volatile unsigned*>(arrivals + tile) != ready) __nanosleep(64);
      __threadfence();
    }
    __syncthreads();
    PowerOfTwo scale[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const std::int64_t column = first_column + 4 * lane + e;
      scale[e] = power_of_two(column < cols ? __ldcg(column_exponent + column) : 0);
    }
    stage_split(values, scale, shared.stage);
    __syncthreads();
    store_tile<true>(shared.stage, hi, lo, split_row_length(rows), first_column, cols, first_row);
    return;
  }

  // A: each thread's Kahan sums over its 8 rows of its 4 columns, in row order; the plain sums beside them give
  // IEEE's inf or NaN where a value is not finite or a sum overflows (compensation would turn an inf into NaN).
  const Tile values = load_tile<kAligned, false>(src, rows, cols, row_stride, first_row, first_column);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float max_abs = 0.0f, sum = 0.0f, compensation = 0.0f, plain_sum = 0.0f;
    bool non_finite = false;
#pragma unroll
    for (int i = 0; i < kTilePairsPerWarp; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float v = element(values.v[i][h], e);
        fold(v, max_abs, non_finite);
        const float term = v - compensation, next = sum + term;
        compensation = (next - sum) - term;
        sum = next;
        plain_sum += v;
      }
    }
    const bool finite = is_finite(sum);
    shared.partials[warp][4 * lane + e] =
        pack({max_abs, finite ? sum : plain_sum, finite ? -compensation : 0.0f, non_finite});
  }
  __syncthreads();
  if (threadIdx.x < kTileColumns) {
    ColumnPartial part = unpack(shared.partials[0][threadIdx.x]);
#pragma unroll
    for (int w = 1; w < kTileWarps; ++w) combine(part, unpack(shared.partials[w][threadIdx.x]));
    partials[item.index * kTileColumns + threadIdx.x] = pack(part);
    __threadfence();
  }
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(arrivals + tile, 1u) == ready - 2;
  __syncthreads();
  if (!last) return;

  // The tile's last A block: each column's slabs combined in slab order, in two halves, then the halves in order.
  __threadfence();
  const int column_in_tile = threadIdx.x % kTileColumns, half = threadIdx.x / kTileColumns;
  const std::int64_t half_slabs = (layout.slabs + 1) / 2, begin = half * half_slabs;
  const std::int64_t end = begin + half_slabs < layout.slabs ? begin + half_slabs : layout.slabs;
  const float4* from = partials + tile * layout.slabs * kTileColumns + column_in_tile;
  ColumnPartial part{0.0f, 0.0f, 0.0f, false};
#pragma unroll 8
  for (std::int64_t s = begin; s < end; ++s) combine(part, unpack(__ldcg(from + s * kTileColumns)));
  if (half == 1) shared.partials[0][column_in_tile] = pack(part);
  __syncthreads();
  const std::int64_t column = first_column + column_in_tile;
  if (half == 0 && column < cols) {
    combine(part, unpack(shared.partials[0][column_in_tile]));
    const int e = scale_exponent(part.max_abs);
    column_exponent[column] = e;
    exponent[column] = part.non_finite ? kNonFiniteRow : e;
    // An inf or NaN total is IEEE's, as the plain sums'.
    if (column_sums) column_sums[column] = is_finite(part.total) ? part.total + part.error : part.total;
    __threadfence();
  }
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(arrivals + tile, 1u);
}

}  // namespace
}  // namespace kernels::gemm
