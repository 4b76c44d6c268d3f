// The split passes with one power of two per row of the result (gemm.h: launch_split_rows, launch_split_columns), and
// what the chunk splits (gemm_split_chunks.cuh) share with them: block size, the group reduction (fold and split_pack,
// which other families' kernels call too, are split_numerics.cuh's).
// launch_split_rows splits each row of a float32 matrix into a row exponent and fp16 rows hi, lo with hi + lo = v * 2^e
// to about 22 bits, in the order and padded length the GEMM reads (split_numerics.cuh: split_position,
// split_row_length). Memory-bound: one DRAM read and one write per element. A group of whole warps per row; rows of up
// to 16384 floats stay in registers between the maximum and the split, longer ones take a second pass (from L1/L2). The
// launcher requires 16-byte aligned rows of a multiple of 4 floats. Portable (any architecture).
#pragma once

#include "common/dependent_launch.cuh"
#include "gemm.h"
#include "split_numerics.cuh"

#include <cuda_fp16.h>

#include <cstring>

namespace kernels::gemm {
namespace {

constexpr int kSplitThreads = 256;

// The block's reduction of its threads' row maximum and non-finite flag into the row's exponent (written by thread
// 0) and scale. Every thread of the block (kThreads of them) must call it; it is a barrier for the block.
template <int kThreads = kSplitThreads>
__device__ __forceinline__ PowerOfTwo row_scale(float max_abs, bool non_finite, std::int32_t* exponent) {
  __shared__ float warp_max[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2)
    max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = max_abs;
  non_finite = __syncthreads_or(non_finite);  // also orders the warp_max writes before the reads below
  max_abs = warp_max[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) max_abs = fmaxf(max_abs, warp_max[w]);
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

// The rows the in-register kernel splits (split_rows_in_registers_kernel's Source): load(row, i) gives pack i (k =
// 4i .. 4i + 3) of a row, and keep(row, i, v) writes what the source makes beside the split (nothing for a matrix).
// Rows and packs are within the matrix; every load is its bytes' last use (the split is what is read next).
struct MatrixRows {  // a matrix's rows as they are: launch_split_rows
  const float* __restrict__ src;
  std::int64_t row_stride;
  __device__ __forceinline__ float4 load(std::int64_t row, int i) const {
    return __ldcs(reinterpret_cast<const float4*>(src + row * row_stride) + i);
  }
  __device__ __forceinline__ void keep(std::int64_t, int, float4) const {}
};

// The input gradient of a GELU, grad_y * gelu'(pre) (split_numerics.cuh, gelu_backward), made from the output's
// gradient and the GELU's input, and written to `gradient` (dense rows of cols floats) as it is split:
// launch_split_rows_gelu_backward.
template <Activation kGelu>
struct GeluBackwardRows {
  const float* __restrict__ grad_y;
  std::int64_t grad_y_stride;
  const float* __restrict__ pre;
  std::int64_t pre_stride;
  float* __restrict__ gradient;
  std::int64_t cols;
  __device__ __forceinline__ float4 load(std::int64_t row, int i) const {
    const float4 g = __ldcs(reinterpret_cast<const float4*>(grad_y + row * grad_y_stride) + i);
    const float4 v = __ldcs(reinterpret_cast<const float4*>(pre + row * pre_stride) + i);
    return make_float4(gelu_backward<kGelu>(g.x, v.x), gelu_backward<kGelu>(g.y, v.y),
                       gelu_backward<kGelu>(g.z, v.z), gelu_backward<kGelu>(g.w, v.w));
  }
  __device__ __forceinline__ void keep(std::int64_t row, int i, float4 v) const {
    reinterpret_cast<float4*>(gradient + row * cols)[i] = v;
  }
};

// Rows of up to kGroup * kPacks * 4 floats (split length included), kGroup threads per row: each thread loads its
// packs of 4 into registers at once (all of the row's loads in flight together), and the split is made from the
// registers: one DRAM read. Packs past the row's end (up to its split length) are written as zeros. Block `block`'s
// rows, for split_rows_in_registers_kernel and split_rows_and_chunks_kernel; every thread of the block calls it.
template <int kGroup, int kPacks, bool kNatural, class Source>
__device__ __forceinline__ void split_rows_in_registers(std::int64_t block, Source source, std::int64_t rows,
                                                        std::int64_t cols, __half* __restrict__ hi,
                                                        __half* __restrict__ lo, std::int32_t* __restrict__ exponent) {
  const int member = threadIdx.x % kGroup;
  const std::int64_t row = block * (kSplitThreads / kGroup) + threadIdx.x / kGroup;
  const bool inside = row < rows;  // the block's last rows may lie past the end; they still join its barriers
  const int packs = static_cast<int>(cols / 4);
  const std::int64_t length = split_row_length(cols);
  const int split_packs = static_cast<int>(length / 4);
  float4 v[kPacks];
  float max_abs = 0.0f;
  bool non_finite = false;
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int i = member + p * kGroup;
    v[p] = inside && i < packs ? source.load(row, i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const int i = member + p * kGroup;
    if (inside && i < packs) source.keep(row, i, v[p]);
    fold(v[p], max_abs, non_finite);
  }
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

template <int kGroup, int kPacks, bool kNatural, class Source>
__global__ void __launch_bounds__(kSplitThreads)
split_rows_in_registers_kernel(Source source, std::int64_t rows, std::int64_t cols, __half* __restrict__ hi,
                               __half* __restrict__ lo, std::int32_t* __restrict__ exponent) {
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
  split_rows_in_registers<kGroup, kPacks, kNatural>(blockIdx.x, source, rows, cols, hi, lo, exponent);
}

// Any row length: pass 1 finds the row's maximum, pass 2 re-reads the row (from L1/L2) and splits it.
template <bool kNatural>
__global__ void __launch_bounds__(kSplitThreads)
split_rows_kernel(const float* __restrict__ src, std::int64_t cols, std::int64_t row_stride, __half* __restrict__ hi,
                  __half* __restrict__ lo, std::int32_t* __restrict__ exponent) {
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
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
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
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

// Rows the in-register kernels do not take (any alignment: a vocabulary of 30522 or 50257 floats as the reduction;
// aligned rows past kMaxRowInRegisters): a block per row reads it once from DRAM, 16-byte loads from its first 16-byte
// boundary on (scalars before and after), keeping its first staged_packs packs of 4 in shared memory at their own
// indices; then splits it from there, the rest of the row read again (from L2). Where two blocks share a
// multiprocessor, one's loads run while the other stores. split_rows_kernel and split_rows_unaligned_kernel (the
// generic kernels) read each row twice.
constexpr int kStagedRowThreads = 512;

template <bool kNatural>
__global__ void __launch_bounds__(kStagedRowThreads, 2)
split_rows_staged_kernel(const float* __restrict__ src, std::int64_t cols, std::int64_t row_stride, int staged_packs,
                         __half* __restrict__ hi, __half* __restrict__ lo, std::int32_t* __restrict__ exponent) {
  extern __shared__ float4 staged_row[];  // the row's first staged_packs packs of 4, zeros past its end
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
  float* const staged = reinterpret_cast<float*>(staged_row);
  const std::int64_t row = blockIdx.x;
  const float* const in = src + row * row_stride;
  const int packs = static_cast<int>((cols + 3) / 4), staged_floats = 4 * staged_packs;
  // head: the floats before the row's first 16-byte boundary; body: the whole 16-byte units after it.
  const int head = static_cast<int>((16 - reinterpret_cast<std::uintptr_t>(in) % 16) % 16 / 4);
  const int body = cols > head ? static_cast<int>((cols - head) / 4) : 0;
  const float4* const aligned = reinterpret_cast<const float4*>(in + head);
  float max_abs = 0.0f;
  bool non_finite = false;
  const auto stage = [&](int c, float v) {
    if (c < staged_floats) staged[c] = v;
  };
#pragma unroll 4
  for (int j = threadIdx.x; j < body; j += kStagedRowThreads) {
    const float4 v = __ldg(aligned + j);  // the part past staged_packs is read again
    fold(v, max_abs, non_finite);
    const int c = head + 4 * j;
    stage(c, v.x);
    stage(c + 1, v.y);
    stage(c + 2, v.z);
    stage(c + 3, v.w);
  }
  // The head, then the tail and the last pack's padding (zeros): a float each for the first threads.
  const int tail_begin = head + 4 * body, tail = 4 * packs - tail_begin;
  if (threadIdx.x < head + tail) {
    const int c = threadIdx.x < head ? threadIdx.x : tail_begin + (threadIdx.x - head);
    const float v = c < cols ? in[c] : 0.0f;
    fold(v, max_abs, non_finite);
    stage(c, v);
  }
  const PowerOfTwo scale = row_scale<kStagedRowThreads>(max_abs, non_finite, exponent + row);  // also a barrier
  const std::int64_t length = split_row_length(cols);
  const auto at = [&](std::int64_t c) { return c < cols ? in[c] : 0.0f; };
  for (int i = threadIdx.x; i < length / 4; i += kStagedRowThreads) {
    const float4 v = i < staged_packs ? staged_row[i]
                     : i < packs      ? make_float4(at(4 * i), at(4 * i + 1), at(4 * i + 2), at(4 * i + 3))
                                      : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    split_pack<kNatural>(v, scale, i, hi + row * length, lo + row * length);
  }
}

// Column tiles of launch_split_columns, whose rows of the result are columns of a row-major matrix: kColumnTileRows rows
// by kColumnTileColumns columns, read by kColumnTileThreads threads. Warp w holds the row pairs (2p, 2p + 1), p = w + kColumnTileWarps
// * i, each lane 4 consecutive columns of both rows: 512 contiguous bytes per row and warp, all of a thread's loads in
// flight together. A row pair's split is one fp16 pair per column, the layout of the transposed result: the pairs
// are staged in shared memory, then each warp writes whole columns as rows of the result (128 bytes of hi and of lo
// per column).
constexpr int kColumnTileThreads = 256;
constexpr int kColumnTileWarps = kColumnTileThreads / 32;
constexpr int kColumnTileColumns = 4 * 32;
constexpr int kColumnTileRows = kSplitChunk;
constexpr int kColumnTilePairs = kColumnTileRows / 2;  // fp16 pairs per column of a tile: one per lane
constexpr int kColumnTilePairsPerWarp = kColumnTilePairs / kColumnTileWarps;
static_assert(kColumnTilePairs == 32 && kColumnTilePairs % kColumnTileWarps == 0, "a tile column's pairs are one word per lane");

struct ColumnTile {
  float4 v[kColumnTilePairsPerWarp][2];  // [i][h]: row 2 (warp + kColumnTileWarps i) + h, columns 4 lane .. 4 lane + 3
};

// fp16 pairs of a tile, as 32-bit words: column j's pair p at word p ^ (j / 4): conflict-free stores (a warp's
// lanes hold columns 4 lane + e) and loads (a warp reads one column).
struct ColumnTileStage {
  std::uint32_t hi[kColumnTileColumns][kColumnTilePairs], lo[kColumnTileColumns][kColumnTilePairs];
};

__device__ __forceinline__ int staged_word(int column, int pair) { return pair ^ (column / 4 % kColumnTilePairs); }

__device__ __forceinline__ float element(float4 v, int e) { return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w; }

// Loads the tile at (first_row, first_column) of src (rows x cols, rows row_stride apart); zeros outside.
// kAligned: cols % 4 == 0, row_stride % 4 == 0 and src 16-byte aligned (16-byte loads); else 4-byte loads.
// kLastUse: the loads leave L2 first (the data is not read again).
template <bool kAligned, bool kLastUse>
__device__ __forceinline__ ColumnTile load_tile(const float* __restrict__ src, std::int64_t rows, std::int64_t cols,
                                          std::int64_t row_stride, std::int64_t first_row,
                                          std::int64_t first_column) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t column = first_column + 4 * lane;
  const auto load = [](const float* at) { return kLastUse ? __ldcs(at) : __ldg(at); };
  ColumnTile tile;
#pragma unroll
  for (int i = 0; i < kColumnTilePairsPerWarp; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int64_t row = first_row + 2 * (warp + kColumnTileWarps * i) + h;
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
__device__ __forceinline__ void stage_split(const ColumnTile& tile, const PowerOfTwo (&scale)[4], ColumnTileStage& stage) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int i = 0; i < kColumnTilePairsPerWarp; ++i) {
    const int pair = warp + kColumnTileWarps * i;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int column = 4 * lane + e;
      const SplitPair split = split_pair(clean(element(tile.v[i][0], e)), clean(element(tile.v[i][1], e)), scale[e]);
      stage.hi[column][staged_word(column, pair)] = bits(split.hi);
      stage.lo[column][staged_word(column, pair)] = bits(split.lo);
    }
  }
}

// Writes the staged tile: column j (< cols - first_column) as kColumnTileRows halves of row first_column + j of hi and lo
// (rows `length` halves apart), from half `position` on. The stores leave L2 first (evict-first): the tile's input,
// which another block reads again, stays.
__device__ __forceinline__ void store_tile(const ColumnTileStage& stage, __half* __restrict__ hi, __half* __restrict__ lo,
                                           std::int64_t length, std::int64_t first_column, std::int64_t cols,
                                           std::int64_t position) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll 4
  for (int j = warp; j < kColumnTileColumns; j += kColumnTileWarps) {
    if (first_column + j >= cols) break;
    const std::int64_t at = (first_column + j) * length + position;
    __stcs(reinterpret_cast<unsigned*>(hi + at) + lane, stage.hi[j][staged_word(j, lane)]);
    __stcs(reinterpret_cast<unsigned*>(lo + at) + lane, stage.lo[j][staged_word(j, lane)]);
  }
}

// The split of src's columns (launch_split_columns; src rows x cols, row-major): row c of the result is column c, in
// natural order. Each item (a column tile of one slab) is done twice: A folds its columns' maxima and flags into the
// workspace (atomics: order-independent), writes their compensated slab sums and counts its tile's arrivals; B re-reads
// the item from L2 once its tile's A blocks have all arrived and splits it; the tile's first B adds the slab sums in
// slab order (deterministic). B items lag A items (column_item) so a B block only waits for A blocks started before it,
// which never wait, and the lag keeps an item's bytes in L2 between its two reads.
constexpr int kColumnLagItems = 256;

// The workspace: counters, zeroed by the launcher (one arrival count per column tile; each column's largest finite
// |v|, as float bits, and non-finite flag), then each item's column sums (total, error). Sizes in column tiles and
// slabs; offsets in bytes, 16-byte aligned.
struct ColumnSplitLayout {
  std::int64_t tiles, slabs, max_offset, bad_offset, counters_bytes, sums_offset, bytes;
};

KERNELS_GEMM_HOST_DEVICE inline ColumnSplitLayout column_split_layout(std::int64_t rows, std::int64_t cols) {
  const auto align = [](std::int64_t bytes, std::int64_t to) { return (bytes + to - 1) / to * to; };
  ColumnSplitLayout layout{};
  layout.tiles = (cols + kColumnTileColumns - 1) / kColumnTileColumns;
  layout.slabs = (rows + kColumnTileRows - 1) / kColumnTileRows;
  layout.max_offset = align(layout.tiles * 4, 16);
  layout.bad_offset = layout.max_offset + layout.tiles * kColumnTileColumns * 4;
  layout.counters_bytes = align(layout.bad_offset + layout.tiles * kColumnTileColumns * 4, 256);
  layout.sums_offset = layout.counters_bytes;
  layout.bytes = layout.sums_offset + layout.tiles * layout.slabs * kColumnTileColumns * 8;
  return layout;
}

// A compensated sum, total + error: Knuth's two-sum per thread, Neumaier's when adding partial sums, so that each
// add of a partial costs no more than one rounding of the total.
struct CompensatedSum {
  float total, error;
};

__device__ __forceinline__ void add(CompensatedSum& into, float2 part) {
  const float next = into.total + part.x;
  into.error += fabsf(into.total) >= fabsf(part.x) ? (into.total - next) + part.x : (part.x - next) + into.total;
  into.error += part.y;
  into.total = next;
}

// Block `block`'s item: phase A or B, and the item's index (tile-major: tile * slabs + slab). The first `lag` blocks
// take A items, then A and B items alternate, then the last `lag` blocks take B items.
struct ColumnItem {
  bool split;
  std::int64_t index;
};

__device__ __forceinline__ ColumnItem column_item(std::int64_t block, std::int64_t items, std::int64_t lag) {
  if (block < lag) return {false, block};
  const std::int64_t m = block - lag;
  if (m < 2 * (items - lag)) return m % 2 == 0 ? ColumnItem{false, lag + m / 2} : ColumnItem{true, m / 2};
  return {true, m - items + lag};
}

// Release and acquire at GPU scope: the arrival of an A block after its writes, the wait of a B block before reads.
__device__ __forceinline__ void arrive(unsigned* counter) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}

__device__ __forceinline__ unsigned arrived(const unsigned* counter) {
  unsigned value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(counter) : "memory");
  return value;
}

// What both column-split kernels do with an item and a tile, in one order (the same bits): the workspace's pointers,
// each warp's partials of an A phase, the A phase's fold and publication, the B phase's wait and stores, and a tile's
// sums.
struct ColumnWorkspace {
  ColumnSplitLayout layout;
  unsigned* arrivals;  // per tile
  unsigned* max_bits;  // per column: the largest finite |v|, as float bits
  unsigned* bad;       // per column: a non-finite value seen
  float2* sums;        // per item and column: the compensated sum (total, error)

  __device__ ColumnWorkspace(std::int64_t rows, std::int64_t cols, unsigned char* workspace)
      : layout(column_split_layout(rows, cols)),
        arrivals(reinterpret_cast<unsigned*>(workspace)),
        max_bits(reinterpret_cast<unsigned*>(workspace + layout.max_offset)),
        bad(reinterpret_cast<unsigned*>(workspace + layout.bad_offset)),
        sums(reinterpret_cast<float2*>(workspace + layout.sums_offset)) {}
};

struct ColumnPartials {
  float2 sums[kColumnTileWarps][kColumnTileColumns];
  float max_abs[kColumnTileWarps][kColumnTileColumns];
  unsigned char bad[kColumnTileWarps][kColumnTileColumns];
};

// A, per thread: the compensated sums over its 8 rows of its 4 columns (rows 2 (warp + kColumnTileWarps i) + h, as
// row_pair(i, h) gives them), in row order, each add's rounding error kept exactly (Knuth's two-sum: Kahan's drops
// some where a value outweighs the running sum, as it often does over 8 rows); the plain sums beside them give IEEE's
// inf or NaN where a value is not finite or a sum overflows.
template <typename RowPair>
__device__ __forceinline__ void fold_column_values(RowPair row_pair, ColumnPartials& partials) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float max_abs = 0.0f, sum = 0.0f, error = 0.0f, plain_sum = 0.0f;
    bool non_finite = false;
#pragma unroll
    for (int i = 0; i < kColumnTilePairsPerWarp; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float v = element(row_pair(i, h), e);
        fold(v, max_abs, non_finite);
        const float next = sum + v, v_part = next - sum;
        error += (sum - (next - v_part)) + (v - v_part);
        sum = next;
        plain_sum += v;
      }
    }
    const bool finite = is_finite(sum);
    partials.sums[warp][4 * lane + e] = make_float2(finite ? sum : plain_sum, finite ? error : 0.0f);
    partials.max_abs[warp][4 * lane + e] = max_abs;
    partials.bad[warp][4 * lane + e] = non_finite;
  }
}

// A, per block, after fold_column_values: the warps' partials combined in warp order, the columns' maxima and flags
// folded into the workspace (atomics: order-independent), the item's sums written, then its tile's arrival.
__device__ __forceinline__ void publish_column_item(const ColumnPartials& partials, const ColumnWorkspace& work,
                                                   std::int64_t index) {
  const std::int64_t tile = index / work.layout.slabs;
  __syncthreads();
  if (threadIdx.x < kColumnTileColumns) {
    const float2 first = partials.sums[0][threadIdx.x];
    float max_abs = partials.max_abs[0][threadIdx.x];
    CompensatedSum sum{first.x, first.y};
    bool non_finite = partials.bad[0][threadIdx.x] != 0;
#pragma unroll
    for (int w = 1; w < kColumnTileWarps; ++w) {
      max_abs = fmaxf(max_abs, partials.max_abs[w][threadIdx.x]);
      add(sum, partials.sums[w][threadIdx.x]);
      non_finite |= partials.bad[w][threadIdx.x] != 0;
    }
    const std::int64_t at = tile * kColumnTileColumns + threadIdx.x;
    if (max_abs > 0.0f) atomicMax(work.max_bits + at, __float_as_uint(max_abs));  // non-negative floats order as bits
    if (non_finite) atomicOr(work.bad + at, 1u);
    work.sums[index * kColumnTileColumns + threadIdx.x] = make_float2(sum.total, sum.error);
  }
  __syncthreads();  // the partials free again; the writes above, then (thread 0's release) the arrival
  if (threadIdx.x == 0) arrive(work.arrivals + tile);
}

// B: waits until all of the tile's A phases have arrived (thread 0's acquire, then the block's barrier, orders the
// reads after their writes).
__device__ __forceinline__ void wait_for_column_tile(const ColumnWorkspace& work, std::int64_t tile) {
  if (threadIdx.x == 0)
    while (arrived(work.arrivals + tile) != work.layout.slabs) __nanosleep(64);
  __syncthreads();
}

// The scale of `column` once its tile has arrived.
__device__ __forceinline__ PowerOfTwo column_scale(const ColumnWorkspace& work, std::int64_t column) {
  return power_of_two(scale_exponent(__uint_as_float(__ldcg(work.max_bits + column))));
}

// A tile's end, once it has arrived: each column's slab sums added in slab order in two halves (a thread each), then
// the halves in order (half_sums: kColumnTileColumns in shared memory), its exponent and flag, its sum.
__device__ __forceinline__ void finish_column_tile(const ColumnWorkspace& work, std::int64_t tile, std::int64_t cols,
                                                   std::int32_t* __restrict__ exponent,
                                                   float* __restrict__ column_sums, float2* half_sums) {
  static_assert(kColumnTileThreads == 2 * kColumnTileColumns, "the sums are added in two halves of the slabs");
  const std::int64_t slabs = work.layout.slabs;
  const int column_in_tile = threadIdx.x % kColumnTileColumns, half = threadIdx.x / kColumnTileColumns;
  const std::int64_t half_slabs = (slabs + 1) / 2, begin = half * half_slabs;
  const std::int64_t end = begin + half_slabs < slabs ? begin + half_slabs : slabs;
  const float2* from = work.sums + tile * slabs * kColumnTileColumns + column_in_tile;
  CompensatedSum sum{0.0f, 0.0f};
#pragma unroll 16
  for (std::int64_t s = begin; s < end; ++s) add(sum, __ldcg(from + s * kColumnTileColumns));
  if (half == 1) half_sums[column_in_tile] = make_float2(sum.total, sum.error);
  __syncthreads();
  const std::int64_t column = tile * kColumnTileColumns + column_in_tile;
  if (half == 0 && column < cols) {
    add(sum, half_sums[column_in_tile]);
    const int e = scale_exponent(__uint_as_float(__ldcg(work.max_bits + column)));
    exponent[column] = __ldcg(work.bad + column) != 0 ? kNonFiniteRow : e;
    // An inf or NaN total is IEEE's, as the plain sums'.
    if (column_sums) column_sums[column] = is_finite(sum.total) ? sum.total + sum.error : sum.total;
  }
  __syncthreads();  // half_sums free again
}

template <bool kAligned>
__global__ void __launch_bounds__(kColumnTileThreads)
split_columns_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                     __half* __restrict__ hi, __half* __restrict__ lo, std::int32_t* __restrict__ exponent,
                     float* __restrict__ column_sums, unsigned char* __restrict__ workspace, std::int64_t lag) {
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
  union Shared {
    ColumnTileStage stage;
    ColumnPartials partials;
  };
  __shared__ Shared shared;
  __shared__ float2 half_sums[kColumnTileColumns];
  const ColumnWorkspace work(rows, cols, workspace);
  const int lane = threadIdx.x % 32;
  const ColumnItem item = column_item(blockIdx.x, work.layout.tiles * work.layout.slabs, lag);
  const std::int64_t tile = item.index / work.layout.slabs, slab = item.index % work.layout.slabs;
  const std::int64_t first_column = tile * kColumnTileColumns, first_row = slab * kColumnTileRows;

  if (item.split) {
    const ColumnTile values = load_tile<kAligned, true>(src, rows, cols, row_stride, first_row, first_column);
    wait_for_column_tile(work, tile);
    PowerOfTwo scale[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) scale[e] = column_scale(work, first_column + 4 * lane + e);
    stage_split(values, scale, shared.stage);
    __syncthreads();
    store_tile(shared.stage, hi, lo, split_row_length(rows), first_column, cols, first_row);
    if (slab == 0) finish_column_tile(work, tile, cols, exponent, column_sums, half_sums);
    return;
  }

  const ColumnTile values = load_tile<kAligned, false>(src, rows, cols, row_stride, first_row, first_column);
  fold_column_values([&](int i, int h) { return values.v[i][h]; }, shared.partials);
  publish_column_item(shared.partials, work, item.index);
}

// The column split with each item read from DRAM once (launch_split_columns where the whole grid is resident): a
// persistent block holds its items in a ring of kStagedColumnSlots shared-memory slots, loading two ahead, running
// an item's A phase one item ahead of its B phase; tile t's sums by block t mod blocks after its last item. A block's
// B waits for A phases of other blocks at most one of their items ahead, so every tile must lie within two rounds of
// the grid (slabs <= blocks) and every block must be resident (a cooperative launch).
constexpr int kStagedColumnSlots = 3;
constexpr int kStagedItemPacks = kColumnTileRows * kColumnTileColumns / 4;  // packs of 4 floats per item (32 KB)

struct StagedColumnShared {
  float4 slot[kStagedColumnSlots][kStagedItemPacks];
  ColumnPartials partials;
  float2 half_sums[kColumnTileColumns];
  PowerOfTwo scale[kColumnTileColumns];  // B: the tile's columns' scales
};

// A slot's place for pack q (columns 4q .. 4q + 3) of the item's row r, swizzled: a warp reading one row's 32 packs
// (A) and one reading a pack of rows 2l and 2l + 1 (B) are both free of bank conflicts.
__device__ __forceinline__ int staged_column_pack(int r, int q) { return r * 32 + (q ^ ((r >> 1) & 7)); }

// Starts the loads of item `index` into `slot` (16 bytes a copy, zeros outside the matrix; aligned matrices only).
__device__ __forceinline__ void stage_column_item(float4* slot, const float* __restrict__ src, std::int64_t rows,
                                                  std::int64_t cols, std::int64_t row_stride, std::int64_t slabs,
                                                  std::int64_t index) {
  const std::int64_t first_column = index / slabs * kColumnTileColumns, first_row = index % slabs * kColumnTileRows;
  const int q = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < kStagedItemPacks / kColumnTileThreads; ++j) {
    const int r = threadIdx.x / 32 + kColumnTileWarps * j;
    const std::int64_t row = first_row + r, column = first_column + 4 * q;
    const bool in_range = row < rows && column < cols;
    const float* from = src + (in_range ? row * row_stride + column : 0);
    float4* to = slot + staged_column_pack(r, q);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(to))),
                 "l"(from), "r"(in_range ? 16 : 0) : "memory");
#else
    *to = in_range ? *reinterpret_cast<const float4*>(from) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#endif
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until the thread's loads have arrived, but for the last item's where `but_last` (the caller then syncs the
// block).
__device__ __forceinline__ void wait_for_staged_items(bool but_last) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (but_last)
    asm volatile("cp.async.wait_group 1;" ::: "memory");
  else
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

__global__ void __launch_bounds__(kColumnTileThreads, 2)
split_columns_staged_kernel(const float* __restrict__ src, std::int64_t rows, std::int64_t cols,
                            std::int64_t row_stride, __half* __restrict__ hi, __half* __restrict__ lo,
                            std::int32_t* __restrict__ exponent, float* __restrict__ column_sums,
                            unsigned char* __restrict__ workspace) {
  wait_for_previous_grid();  // launched with a programmatic dependency where the device takes one
  allow_next_grid();
  extern __shared__ __align__(16) unsigned char staged_bytes[];
  StagedColumnShared& shared = *reinterpret_cast<StagedColumnShared*>(staged_bytes);
  const ColumnWorkspace work(rows, cols, workspace);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const std::int64_t slabs = work.layout.slabs, items = work.layout.tiles * slabs, blocks = gridDim.x;
  const std::int64_t mine = blockIdx.x < items ? (items - 1 - blockIdx.x) / blocks + 1 : 0;
  const auto item_of = [&](std::int64_t k) { return blockIdx.x + k * blocks; };  // the block's k-th item
  const auto slot_of = [&](std::int64_t k) { return shared.slot[k % kStagedColumnSlots]; };

  // A: the item's maxima, flags and sums, from its slot.
  const auto fold_item = [&](std::int64_t k) {
    const float4* slot = slot_of(k);
    fold_column_values([&](int i, int h) { return slot[staged_column_pack(2 * (warp + kColumnTileWarps * i) + h, lane)]; },
                       shared.partials);
    publish_column_item(shared.partials, work, item_of(k));
  };

  // B: once the tile has arrived, the item's split from its slot, each warp a pack of 4 columns at a time, each lane
  // a pair of rows: 128 bytes of hi and of lo per column, as store_tile writes them.
  const auto split_item = [&](std::int64_t k) {
    const std::int64_t index = item_of(k), tile = index / slabs;
    const std::int64_t first_column = tile * kColumnTileColumns, first_row = index % slabs * kColumnTileRows;
    const float4* slot = slot_of(k);
    wait_for_column_tile(work, tile);
    if (threadIdx.x < kColumnTileColumns) shared.scale[threadIdx.x] = column_scale(work, first_column + threadIdx.x);
    __syncthreads();
    const std::int64_t length = split_row_length(rows);
#pragma unroll
    for (int j = 0; j < kColumnTileColumns / 4 / kColumnTileWarps; ++j) {
      const int q = warp + kColumnTileWarps * j;
      const float4 v0 = slot[staged_column_pack(2 * lane, q)], v1 = slot[staged_column_pack(2 * lane + 1, q)];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const std::int64_t column = first_column + 4 * q + e;
        if (column >= cols) break;
        const SplitPair split = split_pair(clean(element(v0, e)), clean(element(v1, e)), shared.scale[4 * q + e]);
        const std::int64_t at = column * length + first_row;
        __stcs(reinterpret_cast<unsigned*>(hi + at) + lane, bits(split.hi));
        __stcs(reinterpret_cast<unsigned*>(lo + at) + lane, bits(split.lo));
      }
    }
    __syncthreads();  // the slot and the scales free again
  };

  // At step k the slots hold items k (split), k + 1 (folded) and k + 2 (loading).
  for (std::int64_t k = 0; k < 2 && k < mine; ++k)
    stage_column_item(slot_of(k), src, rows, cols, row_stride, slabs, item_of(k));
  if (mine > 0) {
    wait_for_staged_items(mine > 1);
    __syncthreads();
    fold_item(0);
  }
  for (std::int64_t k = 0; k < mine; ++k) {
    if (k + 2 < mine) stage_column_item(slot_of(k + 2), src, rows, cols, row_stride, slabs, item_of(k + 2));
    wait_for_staged_items(k + 2 < mine);
    __syncthreads();
    if (k + 1 < mine) fold_item(k + 1);
    split_item(k);
  }
  for (std::int64_t tile = blockIdx.x; tile < work.layout.tiles; tile += blocks) {
    wait_for_column_tile(work, tile);
    finish_column_tile(work, tile, cols, exponent, column_sums, shared.half_sums);
  }
}

}  // namespace
}  // namespace kernels::gemm
