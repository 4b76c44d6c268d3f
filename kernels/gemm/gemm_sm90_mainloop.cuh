// The Hopper GEMM's main loop (gemm_sm90.cu): warpgroup 0 is the producer (one thread issues TMA loads on each stage's
// "empty" mbarrier); warpgroups 1 and 2 are consumers, 64 rows of w each. Per chunk a consumer splits its rows of w in
// registers (gemm_sm90_w_split.cuh, double-buffered), issues 12 wgmma m64n128k16 (small terms first:
// issue_chunk_products) into a fresh accumulator, then releases the stage and promotes the accumulator, times the
// chunk's inverse power of two, into fp32 totals (the tensor cores' own accumulation loses precision over a long K).
// The consumers alternate on the tensor cores so one's split overlaps the other's products. kPresplit: w's split is
// loaded instead (multiply_tile_presplit), same products in the same order, bitwise the same results. Tails: TMA
// zero-fills w past n and x past m; x's split is zero-padded to whole chunks.
#pragma once

#include "gemm_sm90_layout.cuh"
#include "gemm_sm90_tile_scheduler.cuh"
#include "gemm_sm90_w_split.cuh"
#include "sm90_primitives.cuh"
#include "split_numerics.cuh"

#include <cuda.h>

#include <cstdint>

namespace kernels::gemm {
namespace {

// The maps of the w operand: the float32 w (w), or, where its split is given, w_hi (w), w_lo and the exponents.
struct WMaps {
  const CUtensorMap* w;
  const CUtensorMap* w_lo;
  const CUtensorMap* exponent;
};

// The producer's one thread: every chunk of the CTA's units (their tiles' chunks of their slices of K), into the
// stages in turn. `iteration` counts the CTA's chunks, across units: its stage is iteration % kStages, refilled once
// the consumers' warps have released it. `exponents`: the stages' w exponents (kPresplit).
template <bool kTransposed, bool kPresplit>
__device__ __forceinline__ void load_tiles(const WMaps& w_maps, const CUtensorMap& x_hi_map,
                                           const CUtensorMap& x_lo_map, unsigned char* shared, std::int32_t* exponents,
                                           std::uint64_t* full, std::uint64_t* empty, const TileScheduler& scheduler) {
  using namespace sm90;
  static_assert(!(kTransposed && kPresplit), "a given split of w is w's own, not its transpose's");
  const CUtensorMap& w_map = *w_maps.w;
  int iteration = 0;
  for (int unit = scheduler.first(); unit < scheduler.units; unit = scheduler.next(unit)) {
    const int tile = scheduler.tile(unit);
    const int tile_x = scheduler.x_tile(tile), tile_w = scheduler.w_tile(tile);
    const int first_chunk = scheduler.first_chunk(unit), end_chunk = first_chunk + scheduler.unit_chunks(unit);
    for (int chunk = first_chunk; chunk < end_chunk; ++chunk, ++iteration) {
      const int stage = iteration % kStages, round = iteration / kStages;
      if (round > 0) barrier_wait(&empty[stage], (round - 1) & 1);
      unsigned char* stage_tiles = shared + stage * kStageBytes;
      barrier_arrive_expect_bytes(&full[stage], kStageBytes + (kPresplit ? kExponentBytes : 0));
      if constexpr (kPresplit) {
        tma_load_2d(stage_tiles, &w_map, &full[stage], chunk * kBlockK, tile_w * kBlockW);
        tma_load_2d(stage_tiles + kWBoxBytes, w_maps.w_lo, &full[stage], chunk * kBlockK, tile_w * kBlockW);
        tma_load_2d(exponents + stage * kBlockW, w_maps.exponent, &full[stage], tile_w * kBlockW, chunk);
      } else if constexpr (!kTransposed) {
        tma_load_2d(stage_tiles, &w_map, &full[stage], chunk * kBlockK, tile_w * kBlockW);
        tma_load_2d(stage_tiles + kWBoxBytes, &w_map, &full[stage], chunk * kBlockK + kBoxK, tile_w * kBlockW);
      } else {
        for (int box = 0; box < 4; ++box)
          tma_load_2d(stage_tiles + box * kWTransposedBoxBytes, &w_map, &full[stage],
                      tile_w * kBlockW + box * kBoxK, chunk * kBlockK);
      }
      tma_load_2d(stage_tiles + 2 * kWBoxBytes, &x_hi_map, &full[stage], chunk * kBlockK, tile_x * kBlockX);
      tma_load_2d(stage_tiles + 2 * kWBoxBytes + kXTileBytes, &x_lo_map, &full[stage], chunk * kBlockK,
                  tile_x * kBlockX);
    }
  }
}

// What multiply_tile and multiply_tile_presplit share, chunk by chunk: the turn on the tensor cores, the products'
// order, and the stage's release and the promotion once the products complete.

// The consumers take turns issuing their chunk's products, so that the tensor cores run one's while the other
// promotes and splits (issued at once, the two would interleave, finish together and leave the tensor cores idle
// while both split). Consumer 1 goes after consumer 0 in every chunk; consumer 0 after consumer 1 in every chunk
// but the CTA's first.
__device__ __forceinline__ void wait_for_turn(int consumer, int iteration) {
  if (consumer == 1 || iteration > 0) sm90::named_barrier_sync(kTurnBarrier + consumer, 2 * 128);
}

// Gives the other consumer its turn, unless this was consumer 1's last chunk of the CTA (nobody waits for it).
__device__ __forceinline__ void pass_turn(int consumer, bool more_chunks, bool last_tile) {
  if (consumer == 0 || more_chunks || !last_tile) sm90::named_barrier_arrive(kTurnBarrier + 1 - consumer, 2 * 128);
}

// Issues a chunk's 12 products into a fresh accumulator: lo_w hi_x over the chunk's four 16s of K, then hi_w lo_x,
// then hi_w hi_x. The tensor cores' fp32 accumulation truncates (toward zero, so its errors add up alike in every
// row that shares a large component); the small terms first, while the accumulator is small, leave four such adds at
// the accumulator's full size instead of ten. product(step, w_lo, x, offset, accumulate) issues one wgmma of w's lo
// (w_lo) or hi half at K step `step` with the x half whose descriptor is x, both advanced by `offset`.
template <typename Product>
__device__ __forceinline__ void issue_chunk_products(std::uint64_t x_hi, std::uint64_t x_lo, const Product& product) {
  using namespace sm90;
  wgmma_fence();
  // offset: 16 fp16 = 32 bytes along the swizzled row, in 16-byte units, per step
#pragma unroll
  for (int step = 0; step < 4; ++step) product(step, /*w_lo=*/true, x_hi, step * 2, step != 0);
#pragma unroll
  for (int step = 0; step < 4; ++step) product(step, /*w_lo=*/false, x_lo, step * 2, true);
#pragma unroll
  for (int step = 0; step < 4; ++step) product(step, /*w_lo=*/false, x_hi, step * 2, true);
  wgmma_commit();
}

// Once the chunk's products complete: the stage released (this warp's reads of it are done) and the accumulator,
// times the chunk's inverse powers of two, added into total.
__device__ __forceinline__ void finish_chunk(int lane, std::uint64_t* empty, int stage, const ChunkScales& scales,
                                             float (&accumulator)[64], float (&total)[64]) {
  sm90::wgmma_wait<0>();
  if (lane == 0) sm90::barrier_arrive(&empty[stage]);
  if (scales.single) promote_chunk<true>(accumulator, scales, total);
  else promote_chunk<false>(accumulator, scales, total);
}

// A consumer's products of one unit: total (its 64 rows of w x the tile's 128 rows of x, as ConsumerThread lays
// them out) over the unit's `chunks` chunks (all of K's, or its slice's); non_finite[half] is set where the thread's
// row half of w holds a non-finite value there. `iteration` counts the CTA's chunks, across units, as the producer's
// does; last_tile: this is the CTA's last unit.
template <bool kTransposed>
__device__ __forceinline__ void multiply_tile(const ConsumerThread& thread, std::uint32_t shared_base,
                                              std::uint64_t* full, std::uint64_t* empty, int chunks, bool last_tile,
                                              int& iteration, float (&accumulator)[64], float (&total)[64],
                                              bool (&non_finite)[2]) {
  using namespace sm90;
  const int consumer = thread.consumer, lane = thread.lane, t = thread.t, tile_row = thread.tile_row;
  const int row_step = thread.row_step;
#pragma unroll
  for (int i = 0; i < 64; ++i) total[i] = 0.0f;
  non_finite[0] = non_finite[1] = false;

  // Software pipeline: chunk c + 1's w is loaded, scaled and split into the other set of A registers while chunk
  // c's products run (they read theirs until they complete), so that only the promotion follows their completion.
  WChunk w;
  ARegisters a[2];
  barrier_wait(&full[iteration % kStages], (iteration / kStages) & 1);
  ChunkScales scales = load_w_chunk<kTransposed>(shared_base + (iteration % kStages) * kStageBytes, tile_row, row_step,
                                                 t, w, non_finite);
  if (scales.single) split_w_chunk<true>(w, scales, a[0]);
  else split_w_chunk<false>(w, scales, a[0]);

  const auto multiply_chunk = [&](int chunk, const ARegisters& a_now, ARegisters& a_next) {
    const int stage = iteration % kStages;
    const std::uint32_t x_hi_tile = shared_base + stage * kStageBytes + 2 * kWBoxBytes;
    const std::uint64_t x_hi = k_major_swizzle128_descriptor(x_hi_tile);
    const std::uint64_t x_lo = k_major_swizzle128_descriptor(x_hi_tile + kXTileBytes);
    wait_for_turn(consumer, iteration);
    issue_chunk_products(x_hi, x_lo, [&](int step, bool w_lo, std::uint64_t x, std::uint64_t offset, bool accumulate) {
      wgmma_m64n128k16_f16_rs(accumulator, w_lo ? a_now.lo[step] : a_now.hi[step], x + offset, accumulate);
    });
    const bool more = chunk + 1 < chunks;
    pass_turn(consumer, more, last_tile);

    const ChunkScales current = scales;
    if (more) {
      const int next = (iteration + 1) % kStages;
      barrier_wait(&full[next], ((iteration + 1) / kStages) & 1);
      scales = load_w_chunk<kTransposed>(shared_base + next * kStageBytes, tile_row, row_step, t, w, non_finite);
      if (scales.single) split_w_chunk<true>(w, scales, a_next);
      else split_w_chunk<false>(w, scales, a_next);
    }
    finish_chunk(lane, empty, stage, current, accumulator, total);
    ++iteration;
  };
  for (int chunk = 0; chunk < chunks; chunk += 2) {
    multiply_chunk(chunk, a[0], a[1]);
    if (chunk + 1 < chunks) multiply_chunk(chunk + 1, a[1], a[0]);
  }
}

// multiply_tile where w's split is given: per chunk the thread reads its two rows' exponents from the stage, and
// issues the chunk's 12 products with both operands in shared memory, in multiply_tile's order and turns; after
// they complete, the stage is released and the chunk promoted.
__device__ __forceinline__ void multiply_tile_presplit(const ConsumerThread& thread, std::uint32_t shared_base,
                                                       const std::int32_t* exponents, std::uint64_t* full,
                                                       std::uint64_t* empty, int chunks, bool last_tile,
                                                       int& iteration, float (&accumulator)[64], float (&total)[64]) {
  using namespace sm90;
  const int consumer = thread.consumer, lane = thread.lane, tile_row = thread.tile_row;
  const int row_step = thread.row_step;
#pragma unroll
  for (int i = 0; i < 64; ++i) total[i] = 0.0f;
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const int stage = iteration % kStages;
    barrier_wait(&full[stage], (iteration / kStages) & 1);
    ChunkScales scales;
    scales.single = true;
#pragma unroll
    for (int half = 0; half < 2; ++half)
      set_row_scale(scales, half, exponents[stage * kBlockW + tile_row + half * row_step]);
    const std::uint32_t stage_tiles = shared_base + stage * kStageBytes;
    const std::uint32_t w_rows = stage_tiles + consumer * 64 * 128;  // the consumer's 64 rows of 128 bytes
    const std::uint64_t w_hi = k_major_swizzle128_descriptor(w_rows);
    const std::uint64_t w_lo = k_major_swizzle128_descriptor(w_rows + kWBoxBytes);
    const std::uint64_t x_hi = k_major_swizzle128_descriptor(stage_tiles + 2 * kWBoxBytes);
    const std::uint64_t x_lo = k_major_swizzle128_descriptor(stage_tiles + 2 * kWBoxBytes + kXTileBytes);
    wait_for_turn(consumer, iteration);
    issue_chunk_products(x_hi, x_lo, [&](int, bool w_is_lo, std::uint64_t x, std::uint64_t offset, bool accumulate) {
      wgmma_m64n128k16_f16_ss(accumulator, (w_is_lo ? w_lo : w_hi) + offset, x + offset, accumulate);
    });
    pass_turn(consumer, chunk + 1 < chunks, last_tile);
    finish_chunk(lane, empty, stage, scales, accumulator, total);
    ++iteration;
  }
}

}  // namespace
}  // namespace kernels::gemm
