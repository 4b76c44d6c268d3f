// The Hopper GEMM's (gemm_sm90.cu) tile shapes, shared-memory layout, named barriers and register budgets, and the
// rows of a tile that a consumer thread holds.
//
// Tiles: 128 rows of w (output features) by 128 rows of x per CTA, K in chunks of 64. Per stage, TMA loads the w
// tile as float32 (two 128 x 32 boxes, 128-byte swizzle), or, where w's split is given (kPresplit), its w_hi and
// w_lo tiles (128 x 64 fp16 each, in the places of the two boxes), and the x_hi, x_lo tiles (128 x 64 fp16 each):
// 64 KB; 3 stages in 192 KB of shared memory. After the stages: each consumer's staging buffer for its TMA stores
// (gemm_sm90_epilogue.cuh), the stages' w exponents (128 per stage, where w's split is given), then the stages'
// "full" and "empty" mbarriers.
#pragma once

#include "gemm.h"

#include <cstdint>

namespace kernels::gemm {
namespace {

constexpr int kBlockW = 128;                              // w rows per tile: wgmma's M, 64 per consumer
constexpr int kBlockX = 128;                              // x rows per tile: wgmma's N
constexpr int kBlockK = kSplitChunk;                      // one chunk: one scale per w row, one promotion
constexpr int kBoxK = 32;                                 // floats in a 128-byte swizzle row of the w tile
constexpr int kStages = 3;
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kWBoxBytes = kBlockW * kBoxK * 4;            // 16 KB
constexpr int kWTransposedBoxBytes = kBlockK * kBoxK * 4;  // 8 KB: 64 of k x 32 rows of w, when w comes transposed
constexpr int kXTileBytes = kBlockX * kBlockK * 2;         // 16 KB
constexpr int kStageBytes = 2 * kWBoxBytes + 2 * kXTileBytes;
constexpr int kOutBoxRows = 64;                             // y rows (rows of x) per TMA store box
constexpr int kOutBoxBytes = kOutBoxRows * kBoxK * 4;       // 8 KB: 64 rows of y x 32 columns (rows of w)
constexpr int kStagingBytes = 2 * kOutBoxBytes;             // per consumer: 64 rows of y x its 64 columns
constexpr int kExponentBytes = kBlockW * 4;                 // a stage's w exponents, where w's split is given
constexpr int kSharedBytes = kStages * kStageBytes + kConsumers * kStagingBytes + kStages * kExponentBytes +
                             2 * kStages * 8 + 1024;  // tiles, staging, exponents, barriers, alignment
// A consumer's staging buffer (64 rows of y on their way to TMA stores), after the stages in the CTA's shared memory.
__device__ __forceinline__ std::uint32_t staging_buffer(std::uint32_t shared_base, int consumer) {
  return shared_base + kStages * kStageBytes + consumer * kStagingBytes;
}
constexpr int kTurnBarrier = 1;     // named barriers 1 and 2: consumer 0's and consumer 1's turn to issue products
constexpr int kStagingBarrier = 3;  // named barriers 3 and 4: consumer 0's and consumer 1's staging buffer
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;
static_assert(kBlockW == 64 * kConsumers, "each consumer warpgroup owns 64 rows of w");
static_assert(kBlockK == 2 * kBoxK && kBlockK * 2 == 128, "a chunk is two w boxes and one fp16 swizzle row of x");
static_assert(4 * kWTransposedBoxBytes == 2 * kWBoxBytes, "either way, a stage holds 128 rows of w x 64 of k");
static_assert(kWBoxBytes == kBlockW * kBlockK * 2, "w's fp16 hi (or lo) tile takes the place of one float32 box");
// setmaxnreg moves registers within the CTA's own pool: the launch's per-thread count (in steps of 8) times the
// warpgroups. Asking for more leaves the consumers waiting for registers forever. Checked here for the most a launch
// can give (65536 / kThreads: 168), and at run time for what ptxas gave (split_gemm_supported).
constexpr bool register_pool_holds_budgets(int registers_per_thread) {
  return (registers_per_thread + 7) / 8 * 8 * (1 + kConsumers) >= kProducerRegisters + kConsumerRegisters * kConsumers;
}
static_assert(register_pool_holds_budgets(65536 / kThreads / 8 * 8), "the CTA's register pool");
static_assert(kSharedBytes <= 227 * 1024, "an sm_90 CTA's shared memory");
static_assert(2 * kOutBoxRows == kBlockX && 2 * kBoxK == kBlockW / kConsumers, "a consumer stores 2 x 2 boxes a tile");

// A consumer thread's place in wgmma's fragments. Consumer i (warpgroup i + 1) owns the tile's rows of w 64 i ..
// 64 i + 63, 16 per warp; with g = lane / 4 and t = lane % 4, the thread holds two of its warp's rows of w,
// tile_row + half * row_step for half 0 and 1 (its A registers: gemm_sm90_w_split.cuh), and, of the products,
// accumulator element j * 4 + half * 2 + c at w row tile_row + half * row_step, x row 8 j + 2 t + c. The fragment's
// rows g and g + 8 are rows 16 warp + g and + 8 of the tile, or, where w comes transposed, 16 warp + 2 g and + 1:
// side by side along the transposed tile's rows, so that one 8-byte load reads both at a k (any order of a tile's
// rows of w computes the same products; the epilogue writes each output to its row's column).
struct ConsumerThread {
  int consumer, lane, t;
  int tile_row;  // the tile's row of w of the thread's fragment row g
  int row_step;  // ... and of its fragment row g + 8: tile_row + row_step (a constant once inlined)

  __device__ __forceinline__ ConsumerThread(int warpgroup, bool paired_rows) {
    consumer = warpgroup - 1;
    const int warp = (threadIdx.x % 128) / 32;
    lane = threadIdx.x % 32;
    const int g = lane / 4;
    t = lane % 4;
    tile_row = consumer * 64 + warp * 16 + (paired_rows ? 2 * g : g);
    row_step = paired_rows ? 1 : 8;
  }
};

}  // namespace
}  // namespace kernels::gemm
