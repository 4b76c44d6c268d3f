// The consumers' own work on each chunk of the Hopper GEMM's main loop (gemm_sm90_mainloop.cuh), on the CUDA cores
// between their tensor-core products: w's split in registers, and the promotion's scaling of the chunk's products.
//
// Per chunk a consumer thread reads its 2 rows x 16 floats of w from the stage, finds each row's largest finite
// |value| over the chunk (its quad of threads holds the row: two shuffles) and splits the values with that
// row-and-chunk's power of two into fp16 hi and lo registers, wgmma's A operand; after the chunk's products the
// accumulator, times the chunk's inverse power of two, is added into the fp32 totals. A non-finite w value is split
// as 0 and its row flagged (gemm_sm90_epilogue.cuh writes the flags).
#pragma once

#include "gemm_sm90_layout.cuh"
#include "sm90_primitives.cuh"
#include "split_numerics.cuh"

#include <cstdint>

namespace kernels::gemm {
namespace {

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

// Row half's power of two 2^e for the chunk, and its inverse; scales.single must start true.
__device__ __forceinline__ void set_row_scale(ChunkScales& scales, int half, int e) {
  scales.single &= e <= 126;
  scales.scale[half] = power_of_two(e);
  scales.inverse[half] = power_of_two(-e);
  if (e <= 126) {
    scales.scale[half] = {exact_power_of_two(e), 1.0f};
    scales.inverse[half] = {exact_power_of_two(-e), 1.0f};
  }
}

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

// Loads the thread's values of w from the stage and finds each row's scale over the chunk. Non-finite values become
// 0; non_finite[half] is set where the row held one. In the 128-byte swizzle, 16-byte unit u of a box's row r sits
// at unit u ^ (r % 8).
// kTransposed = false: w is (n x k), row-major; the stage holds two boxes of 128 rows of w x 32 of k, and the thread
//   reads pack [half][box][h] as one 16-byte load: k = 32 box + 8 t + 4 h .. + 3, in x's split order
//   (split_position).
// kTransposed = true: w is given as its transpose (k x n, row-major); the stage holds four boxes of 64 of k x 32
//   rows of w, and the thread's rows are side by side (ConsumerThread): one 8-byte load reads both at a k. Element e
//   of pack [half][box][h] holds k = 16 (2 box + h) + 8 (e / 2) + 2 t + e % 2, the natural order (the warp's 8-byte
//   loads: 8 lanes read 64 bytes of one k, its 4 values of t fill 4 rows of k in two pairs of bank halves).
// tile_row, row_step: the thread's rows (ConsumerThread: tile_row and tile_row + row_step).
template <bool kTransposed>
__device__ __forceinline__ ChunkScales load_w_chunk(std::uint32_t w_tiles, int tile_row, int row_step, int t,
                                                    WChunk& w, bool (&non_finite)[2]) {
  if constexpr (!kTransposed) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = tile_row + half * row_step;
#pragma unroll
      for (int box = 0; box < 2; ++box) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int unit = (2 * t + h) ^ (row % 8);
          w.pack[half][box][h] = sm90::load_shared_float4(w_tiles + box * kWBoxBytes + row * 128 + unit * 16);
        }
      }
    }
  } else {
    const int row = tile_row;  // even; the second row is row + 1 (row_step is 1 here), in the same 16-byte unit
    const std::uint32_t column_box = w_tiles + (row / 32) * kWTransposedBoxBytes + (row % 4) * 4;
    const int unit = (row % 32) / 4;
#pragma unroll
    for (int box = 0; box < 2; ++box) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int k = 16 * (2 * box + h) + 8 * (e / 2) + 2 * t + e % 2;
          const float2 pair = sm90::load_shared_float2(column_box + k * 128 + ((unit ^ (k % 8)) * 16));
          reinterpret_cast<float*>(&w.pack[0][box][h])[e] = pair.x;
          reinterpret_cast<float*>(&w.pack[1][box][h])[e] = pair.y;
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
    set_row_scale(scales, half, scale_exponent(is_finite(max_abs) ? max_abs : 0.0f));
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

}  // namespace
}  // namespace kernels::gemm
