// The fp32-accurate GEMM of gemm_multiply_leaky_relu on Hopper tensor cores (gemm.h,
// launch_split_gemm_multiply_leaky_relu): y = leaky_relu((x w^T + b) * multiplier) from the fp16 split of x
// (gemm_split.cu) and the float32 weight itself, which this kernel splits in registers: three fp16 products per K
// step, fp32 promotion, the epilogue fused.
//
// It computes y^T = w x^T, so that w is wgmma's A operand, which may come from registers. Tiles: 128 rows of w
// (output features) by 128 rows of x per CTA, K in chunks of 64. Per stage, TMA loads the w tile as float32 (two
// 128 x 32 boxes, 128-byte swizzle) and the x_hi, x_lo tiles (128 x 64 fp16 each): 64 KB; 3 stages in 192 KB of
// shared memory. Warp specialisation: warpgroup 0 is the producer (one thread issues the TMA loads, waiting on
// each stage's "empty" mbarrier) and keeps few registers; warpgroups 1 and 2 are consumers, each owning 64 rows of
// w. Per chunk a consumer thread reads its 2 rows x 16 floats of w, finds each row's largest finite |value| over
// the chunk (its quad of threads holds the row: two shuffles), splits the values with that row-and-chunk's power of
// two into fp16 hi and lo registers, and issues 12 wgmma m64n128k16 (small terms first: lo_w hi_x, hi_w lo_x,
// hi_w hi_x per 16 of K) into a fresh accumulator. Once they complete it releases the stage and adds the
// accumulator, times the chunk's inverse power of two, into fp32 registers ("promotion": the tensor cores' own
// accumulation over a long K loses precision; the per-chunk scale needs no pass over w before the GEMM). The two
// consumers alternate on the tensor cores, so one's splitting overlaps the other's products.
// Persistent CTAs, one per multiprocessor, take tiles in turn, x's tiles fastest, so those running together share a
// w tile in L2; the producer loads a tile's first chunks while the consumers write the last one's outputs. The
// consumers write outputs into shared memory and TMA stores them (y's rows 16-byte aligned; plain stores else), so
// that a consumer goes on to the next tile's products without waiting on global stores.
// A non-finite w value is split as 0 and its row flagged in w_flags (written by the CTAs of x's first tile);
// launch_nonfinite_outputs then writes the outputs it reaches.
// Tails: TMA fills out-of-range w elements with zeros; x's split is zero-padded to whole chunks and TMA fills rows
// past m with zeros; TMA stores and the plain stores' guards write nothing outside y.
//
// Requires sm_90a; built for any other target, the kernel is an empty stub, split_gemm_supported() is false and
// the caller takes its cuBLAS path.
#include "gemm.h"
#include "sm90_primitives.cuh"
#include "split_numerics.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdlib>

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
constexpr int kSharedBytes =
    kStages * kStageBytes + kConsumers * kStagingBytes + 2 * kStages * 8 + 1024;  // tiles, staging, barriers, align
constexpr int kTurnBarrier = 1;     // named barriers 1 and 2: consumer 0's and consumer 1's turn to issue products
constexpr int kStagingBarrier = 3;  // named barriers 3 and 4: consumer 0's and consumer 1's staging buffer
constexpr int kProducerRegisters = 40;
constexpr int kConsumerRegisters = 232;
static_assert(kBlockW == 64 * kConsumers, "each consumer warpgroup owns 64 rows of w");
static_assert(kBlockK == 2 * kBoxK && kBlockK * 2 == 128, "a chunk is two w boxes and one fp16 swizzle row of x");
static_assert(4 * kWTransposedBoxBytes == 2 * kWBoxBytes, "either way, a stage holds 128 rows of w x 64 of k");
static_assert(kProducerRegisters * 128 + kConsumerRegisters * 128 * kConsumers <= 65536, "the register file");
static_assert(kSharedBytes <= 227 * 1024, "an sm_90 CTA's shared memory");
static_assert(2 * kOutBoxRows == kBlockX && 2 * kBoxK == kBlockW / kConsumers, "a consumer stores 2 x 2 boxes a tile");

// The thread's 2 rows (half 0: row g, half 1: row g + 8 of its warp's 16) x 16 values of w for one chunk: pack
// [half][box][h] holds k = 32 box + 8 t + 4 h .. + 3 (split_numerics.cuh: split_position).
struct WChunk {
  float4 pack[2][2][2];
};

// wgmma's A registers for one chunk: [step][register], steps of 16 along K in the split order.
struct ARegisters {
  std::uint32_t hi[4][4], lo[4][4];
};

// Each of the thread's two rows' power of two for the chunk, and its inverse for the promotion. Where every row of
// the thread has 2^e and 2^-e as floats (e <= 126: all but rows whose largest |value| is below 2^-113), one
// multiply applies each (single.a); else two (a, b).
struct ChunkScales {
  PowerOfTwo scale[2], inverse[2];
  bool single;
};

__device__ __forceinline__ std::uint32_t bits(__half2 pair) { return *reinterpret_cast<std::uint32_t*>(&pair); }

// max(a, |b|), NaN if either is NaN.
__device__ __forceinline__ float max_abs_nan(float a, float b) {
  float r;
#if KERNELS_SM90A_DEVICE
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(fabsf(b)));
#else
  r = fmaxf(a, fabsf(b));
#endif
  return r;
}

__device__ __forceinline__ float4 load_shared_float4(std::uint32_t address) {
  float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#if KERNELS_SM90A_DEVICE
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(address));
#endif
  return v;
}

__device__ __forceinline__ float load_shared_float(std::uint32_t address) {
  float v = 0.0f;
#if KERNELS_SM90A_DEVICE
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(address));
#endif
  return v;
}

// Loads the thread's values of w from the stage and finds each row's scale over the chunk. Non-finite values become
// 0; non_finite[half] is set where the row held one. In the 128-byte swizzle, 16-byte unit u of a box's row r sits
// at unit u ^ (r % 8).
// kTransposed = false: w is (n x k), row-major; the stage holds two boxes of 128 rows of w x 32 of k, and the thread
//   reads pack [half][box][h] as one 16-byte load: k = 32 box + 8 t + 4 h .. + 3, in x's split order
//   (split_position).
// kTransposed = true: w is given as its transpose (k x n, row-major); the stage holds four boxes of 64 of k x 32
//   rows of w, and the thread reads each value alone: pack [half][box][h] holds k = 16 (2 box + h) + {0, 1, 8, 9}
//   + 2 t, the natural order (its 4 lanes t read k of distinct k % 8 and so distinct banks).
template <bool kTransposed>
__device__ __forceinline__ ChunkScales load_w_chunk(std::uint32_t w_tiles, int tile_row, int t, WChunk& w,
                                                    bool (&non_finite)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = tile_row + 8 * half;
#pragma unroll
    for (int box = 0; box < 2; ++box) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if constexpr (!kTransposed) {
          const int unit = (2 * t + h) ^ (row % 8);
          w.pack[half][box][h] = load_shared_float4(w_tiles + box * kWBoxBytes + row * 128 + unit * 16);
        } else {
          const std::uint32_t column_box = w_tiles + (row / 32) * kWTransposedBoxBytes;
          const int unit = (row % 32) / 4, word = row % 4;
          float* v = reinterpret_cast<float*>(&w.pack[half][box][h]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int k = 16 * (2 * box + h) + 8 * (e / 2) + 2 * t + e % 2;
            v[e] = load_shared_float(column_box + k * 128 + ((unit ^ (k % 8)) * 16) + word * 4);
          }
        }
      }
    }
  }
  ChunkScales scales;
  scales.single = true;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float max_abs = 0.0f;
#pragma unroll
    for (int box = 0; box < 2; ++box) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4 v = w.pack[half][box][h];
        max_abs = max_abs_nan(max_abs_nan(max_abs_nan(max_abs_nan(max_abs, v.x), v.y), v.z), v.w);
      }
    }
    if (!is_finite(max_abs)) {  // rare: clean the row's values, then their finite maximum
      non_finite[half] = true;
      max_abs = 0.0f;
#pragma unroll
      for (int box = 0; box < 2; ++box) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float* v = reinterpret_cast<float*>(&w.pack[half][box][h]);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            v[e] = is_finite(v[e]) ? v[e] : 0.0f;
            max_abs = fmaxf(max_abs, fabsf(v[e]));
          }
        }
      }
    }
    // The quad of threads t = 0..3 holds the row; a NaN from a neighbour reads as "its values were cleaned".
    max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, 1));
    max_abs = fmaxf(max_abs, __shfl_xor_sync(0xffffffffu, max_abs, 2));
    const int e = scale_exponent(is_finite(max_abs) ? max_abs : 0.0f);
    scales.single &= e <= 126;
    scales.scale[half] = power_of_two(e);
    scales.inverse[half] = power_of_two(-e);
    if (e <= 126) {
      scales.scale[half] = {exact_power_of_two(e), 1.0f};
      scales.inverse[half] = {exact_power_of_two(-e), 1.0f};
    }
  }
  return scales;
}

// Splits the chunk into wgmma's A registers: lo and hi of v 2^e per row.
template <bool kSingle>
__device__ __forceinline__ void split_w_chunk(const WChunk& w, const ChunkScales& scales, ARegisters& a) {
#pragma unroll
  for (int box = 0; box < 2; ++box) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int step = 2 * box + h;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float4 v = w.pack[half][box][h];
        const PowerOfTwo scale = kSingle ? PowerOfTwo{scales.scale[half].a, 1.0f} : scales.scale[half];
        const SplitPair first = kSingle ? split_pair(v.x * scale.a, v.y * scale.a)     // k = 2 t, 2 t + 1
                                        : split_pair(v.x, v.y, scale);
        const SplitPair second = kSingle ? split_pair(v.z * scale.a, v.w * scale.a)    // k = 2 t + 8, 2 t + 9
                                         : split_pair(v.z, v.w, scale);
        a.hi[step][half] = bits(first.hi);
        a.lo[step][half] = bits(first.lo);
        a.hi[step][2 + half] = bits(second.hi);
        a.lo[step][2 + half] = bits(second.lo);
      }
    }
  }
}

// total += accumulator * 2^-e per row. Accumulator element j * 4 + half * 2 + c is at row g + 8 half.
template <bool kSingle>
__device__ __forceinline__ void promote_chunk(const float (&accumulator)[64], const ChunkScales& scales,
                                              float (&total)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) total[i] = promote<kSingle>(accumulator[i], scales.inverse[(i / 2) % 2], total[i]);
}

template <bool kTransposed>
__global__ void __launch_bounds__(kThreads, 1)
split_gemm_kernel(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_hi_map,
                  const __grid_constant__ CUtensorMap x_lo_map, const __grid_constant__ CUtensorMap y_map,
                  bool y_by_tma, const std::int32_t* __restrict__ x_exponent, std::int32_t* __restrict__ w_flags,
                  const float* __restrict__ bias, float* __restrict__ y, std::uint8_t* __restrict__ positive, int m,
                  int n, int k, float multiplier, float negative_slope) {
#if KERNELS_SM90A_DEVICE
  using namespace sm90;
  extern __shared__ unsigned char shared_raw[];
  unsigned char* shared = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<std::uintptr_t>(shared_raw) + 1023) & ~std::uintptr_t{1023});
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(shared + kStages * kStageBytes + kConsumers * kStagingBytes);
  std::uint64_t* empty = full + kStages;

  const int x_tiles = (m + kBlockX - 1) / kBlockX;
  const int tiles = x_tiles * ((n + kBlockW - 1) / kBlockW);
  const int chunks = static_cast<int>(split_row_length(k) / kBlockK);
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrier_init(&full[s], 1);
      barrier_init(&empty[s], kConsumers * 4);  // one arrival per consumer warp
    }
    barrier_init_fence();
  }
  __syncthreads();

  // Persistent: the CTA takes tiles blockIdx.x, + gridDim.x, ...; the stages and their phases run on across tiles
  // (`iteration` counts the CTA's chunks), so the producer loads the next tile's first chunks during the epilogue.
  if (warpgroup == 0) {  // producer
    registers_decrease<kProducerRegisters>();
    if (threadIdx.x == 0) {
      int iteration = 0;
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int tile_x = tile % x_tiles, tile_w = tile / x_tiles;
        for (int chunk = 0; chunk < chunks; ++chunk, ++iteration) {
          const int stage = iteration % kStages, round = iteration / kStages;
          if (round > 0) barrier_wait(&empty[stage], (round - 1) & 1);
          unsigned char* stage_tiles = shared + stage * kStageBytes;
          barrier_arrive_expect_bytes(&full[stage], kStageBytes);
          if constexpr (!kTransposed) {
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
    return;
  }

  registers_increase<kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int tile_row = consumer * 64 + warp * 16 + g;  // this thread's first w row in the tile; the second is + 8
  const std::uint32_t shared_base = smem_address(shared);
  float accumulator[64], total[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) accumulator[i] = 0.0f;
  int iteration = 0;

  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int tile_x = tile % x_tiles, tile_w = tile / x_tiles;
    const bool last_tile = tile + static_cast<int>(gridDim.x) >= tiles;
#pragma unroll
    for (int i = 0; i < 64; ++i) total[i] = 0.0f;
    bool non_finite[2] = {false, false};

    // Software pipeline: chunk c + 1's w is loaded and scaled while chunk c's products run; it is split into the A
    // registers once they have completed (wgmma reads them until then).
    WChunk w;
    ARegisters a;
    barrier_wait(&full[iteration % kStages], (iteration / kStages) & 1);
    ChunkScales scales =
        load_w_chunk<kTransposed>(shared_base + (iteration % kStages) * kStageBytes, tile_row, t, w, non_finite);
    if (scales.single) split_w_chunk<true>(w, scales, a);
    else split_w_chunk<false>(w, scales, a);

    for (int chunk = 0; chunk < chunks; ++chunk, ++iteration) {
      const int stage = iteration % kStages;
      const std::uint32_t x_hi_tile = shared_base + stage * kStageBytes + 2 * kWBoxBytes;
      const std::uint64_t x_hi = k_major_swizzle128_descriptor(x_hi_tile);
      const std::uint64_t x_lo = k_major_swizzle128_descriptor(x_hi_tile + kXTileBytes);
      // The consumers take turns issuing their chunk's products, so that the tensor cores run one's while the
      // other promotes and splits (issued at once, the two would interleave, finish together and leave the tensor
      // cores idle while both split). Consumer 1 goes after consumer 0 in every chunk; consumer 0 after consumer 1
      // in every chunk but the CTA's first.
      if (consumer == 1 || iteration > 0) named_barrier_sync(kTurnBarrier + consumer, 2 * 128);
      wgmma_fence();
#pragma unroll
      for (int step = 0; step < 4; ++step) {
        const std::uint64_t offset = step * 2;  // 16 fp16 = 32 bytes along the swizzled row, in 16-byte units
        wgmma_m64n128k16_f16_rs(accumulator, a.lo[step], x_hi + offset, step != 0);
        wgmma_m64n128k16_f16_rs(accumulator, a.hi[step], x_lo + offset, true);
        wgmma_m64n128k16_f16_rs(accumulator, a.hi[step], x_hi + offset, true);
      }
      wgmma_commit();
      const bool more = chunk + 1 < chunks;
      if (consumer == 0 || more || !last_tile) named_barrier_arrive(kTurnBarrier + 1 - consumer, 2 * 128);

      const ChunkScales current = scales;
      if (more) {
        const int next = (iteration + 1) % kStages;
        barrier_wait(&full[next], ((iteration + 1) / kStages) & 1);
        scales = load_w_chunk<kTransposed>(shared_base + next * kStageBytes, tile_row, t, w, non_finite);
      }
      wgmma_wait<0>();
      if (lane == 0) barrier_arrive(&empty[stage]);  // this warp's reads of the stage are done
      if (current.single) promote_chunk<true>(accumulator, current, total);
      else promote_chunk<false>(accumulator, current, total);
      if (more) {
        if (scales.single) split_w_chunk<true>(w, scales, a);
        else split_w_chunk<false>(w, scales, a);
      }
    }

    // Epilogue: y[x row, w row] from total[j * 4 + half * 2 + c] at w row tile_row + 8 half, x row 8 j + 2 t + c.
    const bool flags_writer = tile_x == 0;
    float column_bias[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      bool bad = non_finite[half];
      bad |= __shfl_xor_sync(0xffffffffu, bad, 1);
      bad |= __shfl_xor_sync(0xffffffffu, bad, 2);
      const int column = tile_w * kBlockW + tile_row + 8 * half;
      if (flags_writer && t == 0 && column < n) w_flags[column] = bad ? kNonFiniteRow : 0;
      column_bias[half] = bias && column < n ? bias[column] : 0.0f;
    }
    // The output of total[j * 4 + half * 2 + c]; e is its x row's exponent.
    const auto output = [&](int j, int half, int c, int e) {
      return epilogue(unscale(total[j * 4 + half * 2 + c], e), column_bias[half], multiplier, negative_slope);
    };
    if (y_by_tma) {
      // Through this consumer's staging buffer, 64 rows of y at a time, and TMA stores, which run on while the
      // consumer goes on to the next tile: the tensor cores wait for no global store. The buffer holds two boxes
      // (32 columns each) in the 128-byte swizzle: unit u of box row r at u ^ (r % 8), so that the warp's 32
      // writes (4 rows x 8 columns) fall in 32 distinct banks.
      const int staging_offset = kStages * kStageBytes + consumer * kStagingBytes;
      const std::uint32_t staging = shared_base + staging_offset;
      float* const staging_floats = reinterpret_cast<float*>(shared + staging_offset);  // plain stores: STS
      const bool store_thread = threadIdx.x % 128 == 0;
#pragma unroll
      for (int part = 0; part < kBlockX / kOutBoxRows; ++part) {
        if (store_thread) tma_store_wait_read<0>();  // the buffer's previous stores have read it
        named_barrier_sync(kStagingBarrier + consumer, 128);
        // The part's x exponents loaded together, ahead of the outputs: one global latency per part.
        int exponents[kOutBoxRows / 8][2];
#pragma unroll
        for (int jj = 0; jj < kOutBoxRows / 8; ++jj) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int row = tile_x * kBlockX + part * kOutBoxRows + 8 * jj + 2 * t + c;
            exponents[jj][c] = row < m ? x_exponent[row] : 0;
          }
        }
#pragma unroll
        for (int jj = 0; jj < kOutBoxRows / 8; ++jj) {
          const int j = part * (kOutBoxRows / 8) + jj;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int local_column = tile_row - consumer * 64 + 8 * half;  // 0 .. 63 within the consumer's columns
            const int box = local_column / kBoxK, box_column = local_column % kBoxK;
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int box_row = 8 * jj + 2 * t + c, row = tile_x * kBlockX + 8 * j + 2 * t + c;
              const int column = tile_w * kBlockW + tile_row + 8 * half;
              const Activated out = output(j, half, c, exponents[jj][c]);
              staging_floats[(box * kOutBoxBytes + box_row * 128) / 4 + ((box_column / 4) ^ (box_row % 8)) * 4 +
                             box_column % 4] = out.value;
              if (positive && row < m && column < n)
                positive[static_cast<std::int64_t>(row) * n + column] = out.positive;
            }
          }
        }
        fence_async_shared();
        named_barrier_sync(kStagingBarrier + consumer, 128);
        if (store_thread) {
#pragma unroll
          for (int box = 0; box < 2; ++box)
            tma_store_2d(&y_map, staging + box * kOutBoxBytes, tile_w * kBlockW + consumer * 64 + box * kBoxK,
                         tile_x * kBlockX + part * kOutBoxRows);
          tma_store_commit();
        }
      }
    } else {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int column = tile_w * kBlockW + tile_row + 8 * half;
        if (column >= n) continue;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int row = tile_x * kBlockX + 8 * j + 2 * t + c;
            if (row >= m) continue;
            const Activated out = output(j, half, c, x_exponent[row]);
            const std::int64_t at = static_cast<std::int64_t>(row) * n + column;
            y[at] = out.value;
            if (positive) positive[at] = out.positive;
          }
        }
      }
    }
  }
  if (y_by_tma && threadIdx.x % 128 == 0) tma_store_wait<0>();  // the stores' writes are done before the CTA ends
#endif
}

// cuTensorMapEncodeTiled from the driver, found through the runtime (no -lcuda); null where the driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encoder;
}

// The TMA map of a (rows x columns) matrix whose rows are row_bytes apart, in boxes of box_rows rows by one
// 128-byte swizzle row.
bool make_tile_map(CUtensorMap* map, CUtensorMapDataType type, int element_bytes, const void* base,
                   std::int64_t rows, std::int64_t columns, std::int64_t row_bytes, int box_rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(columns), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / element_bytes), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  return tensor_map_encoder()(map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace

bool split_gemm_supported(int device, std::int64_t m, std::int64_t n, std::int64_t k) {
  if (m <= 0 || n <= 0 || k <= 0 || k % 4 != 0) return false;  // TMA: 16-byte row strides of w
  if (m >= (std::int64_t{1} << 31) || n >= (std::int64_t{1} << 31) || k >= (std::int64_t{1} << 31) - kSplitChunk)
    return false;
  const std::int64_t tiles = ((m + kBlockX - 1) / kBlockX) * ((n + kBlockW - 1) / kBlockW);
  if (tiles >= (std::int64_t{1} << 31) - 4096) return false;  // tile indices plus a grid stay ints
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess || major != 9 ||
      minor != 0)
    return false;
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, split_gemm_kernel<false>) != cudaSuccess || attributes.binaryVersion != 90)
    return false;  // the library holds no sm_90a code of the kernel
  return tensor_map_encoder() != nullptr;
}

cudaError_t launch_split_gemm_multiply_leaky_relu(const void* x_hi, const void* x_lo, const std::int32_t* x_exponent,
                                                  const float* w, std::int64_t w_stride, bool w_transposed,
                                                  std::int32_t* w_flags, const float* bias, float* y,
                                                  std::uint8_t* positive, std::int64_t m, std::int64_t n,
                                                  std::int64_t k, float multiplier, float negative_slope,
                                                  cudaStream_t stream) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (!split_gemm_supported(device, m, n, k) || (w_transposed && n % 4 != 0)) return cudaErrorNotSupported;
  if (w_stride % 4 != 0 || w_stride < (w_transposed ? n : k) || reinterpret_cast<std::uintptr_t>(w) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(x_hi) % 16 != 0 || reinterpret_cast<std::uintptr_t>(x_lo) % 16 != 0)
    return cudaErrorInvalidValue;
  const std::int64_t x_row = split_row_length(k);
  CUtensorMap maps[4] = {};
  const bool w_map = w_transposed
                         ? make_tile_map(&maps[0], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, w, k, n, w_stride * 4, kBlockK)
                         : make_tile_map(&maps[0], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, w, n, k, w_stride * 4, kBlockW);
  if (!w_map || !make_tile_map(&maps[1], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, x_hi, m, x_row, x_row * 2, kBlockX) ||
      !make_tile_map(&maps[2], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, x_lo, m, x_row, x_row * 2, kBlockX))
    return cudaErrorInvalidValue;
  // y through TMA stores where its rows are 16-byte aligned (TMA's rule for strides and addresses); plain stores
  // else, or where KERNELS_GEMM_PLAIN_STORES is set (not "" or "0"): compute-sanitizer's initcheck does not see TMA
  // stores' writes (every later read of y is reported as uninitialized), so tools/sanitize.sh runs it on the plain
  // stores.
  static const bool plain_stores = [] {
    const char* value = std::getenv("KERNELS_GEMM_PLAIN_STORES");
    return value != nullptr && value[0] != '\0' && value[0] != '0';
  }();
  const bool y_by_tma = !plain_stores && n % 4 == 0 && reinterpret_cast<std::uintptr_t>(y) % 16 == 0 &&
                        make_tile_map(&maps[3], CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, y, m, n, n * 4, kOutBoxRows);
  const auto kernel = w_transposed ? split_gemm_kernel<true> : split_gemm_kernel<false>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
  if (err != cudaSuccess) return err;
  const std::int64_t tiles = ((m + kBlockX - 1) / kBlockX) * ((n + kBlockW - 1) / kBlockW);
  int processors = 0;
  err = cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const std::int64_t ctas = tiles < processors ? tiles : processors;  // persistent: one CTA per multiprocessor
  kernel<<<static_cast<unsigned>(ctas), kThreads, kSharedBytes, stream>>>(
      maps[0], maps[1], maps[2], maps[3], y_by_tma, x_exponent, w_flags, bias, y, positive, static_cast<int>(m),
      static_cast<int>(n), static_cast<int>(k), multiplier, negative_slope);
  return cudaGetLastError();
}

}  // namespace kernels::gemm
