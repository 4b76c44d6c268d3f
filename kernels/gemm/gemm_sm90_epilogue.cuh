// The Hopper GEMM's epilogue (gemm_sm90.cu): a consumer's outputs of a tile, y[x row, w row] =
// activation((total 2^-e + bias) * multiplier), e the x row's exponent (split_numerics.cuh: unscale,
// apply_epilogue), and `positive` beside them; and w's non-finite row flags. Where K is split (gemm.h,
// launch_split_gemm_split_k), y is the partials' workspace, slice s's plain outputs in its rows s * slice_rows ..
// s * slice_rows + m - 1.
//
// The consumers write their totals into shared memory, make the outputs there, and TMA stores them (y's rows 16-byte
// aligned), so that a consumer goes on to the next tile's products without waiting on global stores; else (a
// vocabulary's 50257 or 30522 columns) each warp makes a row's 32 outputs of a box from shared memory at a time and
// stores them as 128 consecutive bytes. TMA stores and the plain stores' guards write nothing outside y. A non-finite
// w value was split as 0 and its row flagged (gemm_sm90_w_split.cuh); the CTAs of x's first tile write the flags to
// w_flags, and launch_nonfinite_outputs then writes the outputs it reaches. A product computed transposed (a tall,
// narrow forward as y^T = w x^T) may write y itself: store_tile_y_transposed.
#pragma once

#include "gemm_sm90_layout.cuh"
#include "sm90_primitives.cuh"
#include "split_numerics.cuh"

#include <cuda.h>

#include <cstdint>

namespace kernels::gemm {
namespace {

// The kernel's arguments that the epilogue reads (gemm.h, launch_split_gemm_multiply_leaky_relu).
struct EpilogueArguments {
  const CUtensorMap* y_map;
  bool y_by_tma;                // TMA stores through the staging buffers; plain stores else
  bool y_transposed;            // y_map is y's (n x m): store_tile_y_transposed
  const CUtensorMap* pre_map;   // a GELU's pre-activation (Epilogue::pre), stored before y by TMA; null: none
  const std::int32_t* x_exponent;
  std::int32_t* w_flags;  // null where w's split is given: its pass wrote the flags
  bool w_flags_set_only;  // K split: each slice sees part of w's rows, so flags are set (on zeros), never cleared
  const float* bias;
  float* y;
  std::uint8_t* positive;
  int m, n;
  int slice_rows;  // y's rows per slice of K (a multiple of kBlockX), where K is split
  Epilogue epilogue;
};

// The mask bytes of a unit's 4 outputs (consecutive columns of y) at `at`: one word store where y's rows keep the
// mask 4-byte aligned (mask_words), else byte by byte.
__device__ __forceinline__ void store_unit_mask(std::uint8_t* at, const Activated (&out)[4], bool mask_words) {
  if (mask_words) {
    *reinterpret_cast<std::uint32_t*>(at) = std::uint32_t{out[0].positive} | std::uint32_t{out[1].positive} << 8 |
                                            std::uint32_t{out[2].positive} << 16 | std::uint32_t{out[3].positive} << 24;
  } else {
#pragma unroll
    for (int q = 0; q < 4; ++q) at[q] = out[q].positive;
  }
}

// Writes, from the CTAs of x's first tile, the flags of the tile's rows of w that this thread's quad split.
__device__ __forceinline__ void write_w_flags(const EpilogueArguments& arguments, const ConsumerThread& thread,
                                              int tile_x, int tile_w, const bool (&non_finite)[2]) {
  const bool flags_writer = tile_x == 0 && arguments.w_flags != nullptr;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    bool bad = non_finite[half];
    bad |= __shfl_xor_sync(0xffffffffu, bad, 1);
    bad |= __shfl_xor_sync(0xffffffffu, bad, 2);
    const int row = tile_w * kBlockW + thread.tile_row + half * thread.row_step;
    if (flags_writer && thread.t == 0 && row < arguments.n && (bad || !arguments.w_flags_set_only))
      arguments.w_flags[row] = bad ? kNonFiniteRow : 0;
  }
}

// Writes the tile's outputs from this consumer thread's totals (ConsumerThread's layout) and, from the CTAs of x's
// first tile, its rows' flags; `slice`: the unit's slice of K (0 where K is not split). shared_base is the CTA's
// shared memory (its shared-window address); row_exponents holds the x exponents of the rows a thread makes outputs
// of in one part, on the TMA path. kGelus: whether the GELU activations are compiled in (LeakyReLU's alone else);
// kPre: whether a GELU's pre-activation may be stored too (pre_map: the kernel that reads w's split).
template <bool kGelus, bool kPre>
__device__ __forceinline__ void store_tile(const EpilogueArguments& arguments, const ConsumerThread& thread,
                                           std::uint32_t shared_base, int tile_x, int tile_w, int slice,
                                           const float (&total)[64], const bool (&non_finite)[2],
                                           int (&row_exponents)[kOutBoxRows / 8]) {
  using namespace sm90;
  const CUtensorMap* const y_map = arguments.y_map;
  const std::int32_t* const x_exponent = arguments.x_exponent;
  const float* const bias = arguments.bias;
  float* const y = arguments.y;
  std::uint8_t* const positive = arguments.positive;
  const int m = arguments.m, n = arguments.n;
  const Epilogue& epilogue = arguments.epilogue;
  const int consumer = thread.consumer, t = thread.t, tile_row = thread.tile_row, row_step = thread.row_step;
  // Epilogue: y[x row, w row] from total[j * 4 + half * 2 + c] at w row tile_row + half * row_step, x row
  // 8 j + 2 t + c.
  write_w_flags(arguments, thread, tile_x, tile_w, non_finite);
  // Both ways go through this consumer's staging buffer, 64 rows of y (a part) at a time. The buffer holds two
  // 32-column boxes in the 128-byte swizzle (16-byte unit u of box row r at u ^ (r % 8)). Per part, threads write
  // their totals there as they are, then make the outputs from there.
  const std::uint32_t staging = staging_buffer(shared_base, consumer);
  const int thread_index = threadIdx.x % 128;
  // The thread's totals of row c, half `half` of a part's first 8 rows (jj = 0); of row jj, 8 jj rows (1 KB)
  // further: the swizzle depends on the row only through row % 8.
  std::uint32_t total_address[2][2];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int local_column = tile_row + half * row_step - consumer * 64;  // 0 .. 63: the consumer's columns
      const int box = local_column / kBoxK, box_column = local_column % kBoxK, box_row = 2 * t + c;
      total_address[c][half] = staging + box * kOutBoxBytes + box_row * 128 +
                               ((box_column / 4) ^ (box_row % 8)) * 16 + (box_column % 4) * 4;
    }
  }
  const auto stage_totals = [&](int part) {
#pragma unroll
    for (int jj = 0; jj < kOutBoxRows / 8; ++jj) {
      const int j = part * (kOutBoxRows / 8) + jj;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
          store_shared_float(total_address[c][half] + jj * 8 * 128, total[j * 4 + half * 2 + c]);
      }
    }
  };
  // A plain product (the backward's: no bias, multiplier and slope 1, no mask): each output by plain_product_output,
  // apply_epilogue()'s value bit for bit in fewer instructions (kernels/gemm/NOTES.md, Decisions, "The plain product's
  // epilogue").
  const bool plain_product = bias == nullptr && is_identity_epilogue(epilogue) && positive == nullptr;
  if (arguments.y_by_tma) {
    // TMA stores that run on while the consumer moves to the next tile. One loop pass makes a part's outputs, 4 at a
    // time, each thread unscaling and activating a 16-byte unit of 8 rows: a small loop body instead of a large
    // straight-line block (kernels/gemm/NOTES.md, Decisions, "The epilogue: totals staged as they are").
    const bool store_thread = thread_index == 0;
    // The pass's unit: unit `unit` of box `box` of rows first_row + 8 i (i = 0 .. 7), columns first_column .. + 3.
    const int unit = thread_index % 8, box = (thread_index / 8) % 2, first_row = thread_index / 16;
    const std::uint32_t unit_address = staging + box * kOutBoxBytes + first_row * 128 + (unit ^ first_row) * 16;
    const int first_column = tile_w * kBlockW + consumer * 64 + box * kBoxK + unit * 4;
    const bool columns_inside = first_column < n;  // n % 4 == 0 on the TMA path: all 4 or none
    float unit_bias[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) unit_bias[q] = bias && columns_inside ? bias[first_column + q] : 0.0f;
    const bool mask_words = reinterpret_cast<std::uintptr_t>(positive) % 4 == 0;  // n % 4 == 0: rows stay aligned
#pragma unroll
    for (int part = 0; part < kBlockX / kOutBoxRows; ++part) {
      if (store_thread) tma_store_wait_read<0>();  // the buffer's previous stores have read it
      named_barrier_sync(kStagingBarrier + consumer, 128);
      stage_totals(part);
      named_barrier_sync(kStagingBarrier + consumer, 128);
      // The exponents of the thread's 8 rows of the part, loaded together: one global latency per part.
      const int part_row = tile_x * kBlockX + part * kOutBoxRows + first_row;
#pragma unroll
      for (int i = 0; i < kOutBoxRows / 8; ++i)
        row_exponents[i] = part_row + 8 * i < m ? x_exponent[part_row + 8 * i] : 0;
      // The unit's totals of row part_row + 8 i, in turn, with their row's factors; the next row's exponent moved
      // into place (a rolled loop reads one register).
      const auto next_row = [&](std::uint32_t address, float4& totals, RowUnscale& factors) {
        totals = load_shared_float4(address);
        factors = row_unscale(row_exponents[0]);
#pragma unroll
        for (int e = 0; e + 1 < kOutBoxRows / 8; ++e) row_exponents[e] = row_exponents[e + 1];
      };
      // Each activation's loop compiled apart (with_activation): LeakyReLU's carries none of the GELUs' code.
      with_activation<kGelus>(epilogue.activation, [&](auto activation) {
        constexpr Activation kActivation = decltype(activation)::value;
        if constexpr (kPre && kActivation != Activation::kLeakyReLU) {
          if (arguments.pre_map != nullptr) {
            // The part's pre-activations made in place and stored by TMA; their GELUs made into registers while
            // the stores read the buffer, then written over it once they have, for the y stores below.
#pragma unroll 1
            for (int i = 0; i < kOutBoxRows / 8; ++i) {
              const std::uint32_t address = unit_address + i * 8 * 128;
              float4 totals;
              RowUnscale factors;
              next_row(address, totals, factors);
              const auto pre = [&](float total, int q) {
                return pre_activation(unscale(total, factors), unit_bias[q], epilogue);
              };
              store_shared_float4(address, make_float4(pre(totals.x, 0), pre(totals.y, 1), pre(totals.z, 2),
                                                       pre(totals.w, 3)));
            }
            fence_async_shared();
            named_barrier_sync(kStagingBarrier + consumer, 128);
            if (store_thread) {
#pragma unroll
              for (int b = 0; b < 2; ++b)
                tma_store_2d(arguments.pre_map, staging + b * kOutBoxBytes,
                             tile_w * kBlockW + consumer * 64 + b * kBoxK, tile_x * kBlockX + part * kOutBoxRows);
              tma_store_commit();
            }
            float4 out[kOutBoxRows / 8];
#pragma unroll
            for (int i = 0; i < kOutBoxRows / 8; ++i) {
              const float4 v = load_shared_float4(unit_address + i * 8 * 128);
              out[i] = make_float4(activate<kActivation>(v.x, epilogue.negative_slope),
                                   activate<kActivation>(v.y, epilogue.negative_slope),
                                   activate<kActivation>(v.z, epilogue.negative_slope),
                                   activate<kActivation>(v.w, epilogue.negative_slope));
            }
            if (store_thread) tma_store_wait_read<0>();
            named_barrier_sync(kStagingBarrier + consumer, 128);
#pragma unroll
            for (int i = 0; i < kOutBoxRows / 8; ++i) store_shared_float4(unit_address + i * 8 * 128, out[i]);
            return;
          }
        }
#pragma unroll 1
        for (int i = 0; i < kOutBoxRows / 8; ++i) {
          const int row = part_row + 8 * i;
          const std::uint32_t address = unit_address + i * 8 * 128;
          float4 totals;
          RowUnscale factors;
          next_row(address, totals, factors);
          if (plain_product) {
            store_shared_float4(address, make_float4(plain_product_output(unscale(totals.x, factors)),
                                                     plain_product_output(unscale(totals.y, factors)),
                                                     plain_product_output(unscale(totals.z, factors)),
                                                     plain_product_output(unscale(totals.w, factors))));
            continue;
          }
          const Activated out[4] = {apply_epilogue<kActivation>(unscale(totals.x, factors), unit_bias[0], epilogue),
                                    apply_epilogue<kActivation>(unscale(totals.y, factors), unit_bias[1], epilogue),
                                    apply_epilogue<kActivation>(unscale(totals.z, factors), unit_bias[2], epilogue),
                                    apply_epilogue<kActivation>(unscale(totals.w, factors), unit_bias[3], epilogue)};
          store_shared_float4(address, make_float4(out[0].value, out[1].value, out[2].value, out[3].value));
          if (positive && row < m && columns_inside)
            store_unit_mask(positive + static_cast<std::int64_t>(row) * n + first_column, out, mask_words);
        }
      });
      fence_async_shared();
      named_barrier_sync(kStagingBarrier + consumer, 128);
      if (store_thread) {
#pragma unroll
        for (int b = 0; b < 2; ++b)
          tma_store_2d(y_map, staging + b * kOutBoxBytes, tile_w * kBlockW + consumer * 64 + b * kBoxK,
                       slice * arguments.slice_rows + tile_x * kBlockX + part * kOutBoxRows);
        tma_store_commit();
      }
    }
  } else {
    // Plain stores (y's rows not 16-byte aligned, or KERNELS_GEMM_PLAIN_STORES): warp w makes the part's rows
    // w + 4 i (i = 0 .. 15) of both boxes, lane l column l of a box: each store writes 128 consecutive bytes of a row.
    const int warp = thread_index / 32, lane = thread.lane;
    const std::int64_t out_row0 = static_cast<std::int64_t>(slice) * arguments.slice_rows;
    int column[2];
    float lane_bias[2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      column[b] = tile_w * kBlockW + consumer * 64 + b * kBoxK + lane;
      lane_bias[b] = bias && column[b] < n ? bias[column[b]] : 0.0f;
    }
#pragma unroll
    for (int part = 0; part < kBlockX / kOutBoxRows; ++part) {
      named_barrier_sync(kStagingBarrier + consumer, 128);  // the buffer's previous outputs have been read
      stage_totals(part);
      named_barrier_sync(kStagingBarrier + consumer, 128);
      // Lane l loads the exponent of the warp's row l % 16; each row's is taken from its lane by a shuffle.
      const int part_first_row = tile_x * kBlockX + part * kOutBoxRows;
      const int lane_row = part_first_row + warp + 4 * (lane % 16);
      const int lane_exponent = lane_row < m ? x_exponent[lane_row] : 0;
      with_activation<kGelus>(epilogue.activation, [&](auto activation) {
        constexpr Activation kActivation = decltype(activation)::value;
#pragma unroll 4
        for (int i = 0; i < kOutBoxRows / 4; ++i) {
          const int local_row = warp + 4 * i, row = part_first_row + local_row;
          const RowUnscale factors = row_unscale(__shfl_sync(0xffffffffu, lane_exponent, i));
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const float product = unscale(
                load_shared_float(staging + b * kOutBoxBytes + local_row * 128 + (((lane / 4) ^ (local_row % 8)) << 4) +
                                  (lane % 4) * 4),
                factors);
            if (row >= m || column[b] >= n) continue;
            const std::int64_t at = (out_row0 + row) * n + column[b];
            if (plain_product) {
              y[at] = plain_product_output(product);
            } else {
              const Activated out = apply_epilogue<kActivation>(product, lane_bias[b], epilogue);
              y[at] = out.value;
              if (positive) positive[at] = out.positive;
            }
          }
        }
      });
    }
  }
}

// The outputs of a product computed transposed written as y itself (EpilogueArguments::y_transposed): the kernel's
// rows of x are y's columns and its rows of w y's rows, y[w row, x row] = LeakyReLU((total 2^-e + bias[x row]) *
// multiplier), e the x row's exponent; y is (n x m), m % 4 == 0, stored by TMA through a map of y. Per part (64 of
// the tile's x rows), the consumer stages its 64 rows of y by 64 columns in the layout of store_tile's staging
// buffer (two 32-column boxes), now rows = w rows; the pass's unit is 4 columns of 8 rows, with per-column factors.
// column_exponents: store_tile's row_exponents, the part's 4 column exponents here.
__device__ __forceinline__ void store_tile_y_transposed(const EpilogueArguments& arguments,
                                                        const ConsumerThread& thread, std::uint32_t shared_base,
                                                        int tile_x, int tile_w, const float (&total)[64],
                                                        const bool (&non_finite)[2],
                                                        int (&column_exponents)[kOutBoxRows / 8]) {
  using namespace sm90;
  const int m = arguments.m, n = arguments.n;
  const Epilogue& epilogue = arguments.epilogue;
  const int consumer = thread.consumer, t = thread.t;
  write_w_flags(arguments, thread, tile_x, tile_w, non_finite);
  const std::uint32_t staging = staging_buffer(shared_base, consumer);
  const int thread_index = threadIdx.x % 128;
  // Total j * 4 + half * 2 + c of a part (jj = j % 8) goes to box jj / 4, row (the w row) tile_row + half * row_step
  // - 64 consumer, column 8 (jj % 4) + 2 t + c: 16-byte unit (2 (jj % 4) + t / 2) ^ (row % 8), which is jj = 0's unit
  // XOR 2 (jj % 4), so an address is jj = 0's offset XOR 32 (jj % 4). Two lanes of a warp meet in a bank at most.
  std::uint32_t total_offset[2][2];
#pragma unroll
  for (int c = 0; c < 2; ++c) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int box_row = thread.tile_row + half * thread.row_step - consumer * 64;
      total_offset[c][half] = box_row * 128 + (((t / 2) ^ (box_row % 8)) * 16) + ((2 * t + c) % 4) * 4;
    }
  }
  const bool plain_product = arguments.bias == nullptr && is_identity_epilogue(epilogue) &&
                             arguments.positive == nullptr;
  const bool store_thread = thread_index == 0;
  // The pass's unit: unit `unit` of box `box` of rows first_row + 8 i (i = 0 .. 7), columns 4 unit .. 4 unit + 3.
  const int unit = thread_index % 8, box = (thread_index / 8) % 2, first_row = thread_index / 16;
  const std::uint32_t unit_address = staging + box * kOutBoxBytes + first_row * 128 + (unit ^ first_row) * 16;
  const int unit_first_row = tile_w * kBlockW + consumer * 64 + first_row;
  const bool mask_words = reinterpret_cast<std::uintptr_t>(arguments.positive) % 4 == 0;
#pragma unroll
  for (int part = 0; part < kBlockX / kOutBoxRows; ++part) {
    if (store_thread) tma_store_wait_read<0>();  // the buffer's previous stores have read it
    named_barrier_sync(kStagingBarrier + consumer, 128);
#pragma unroll
    for (int jj = 0; jj < kOutBoxRows / 8; ++jj) {
      const int j = part * (kOutBoxRows / 8) + jj;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
          store_shared_float(staging + (jj / 4) * kOutBoxBytes + (total_offset[c][half] ^ ((jj % 4) * 32)),
                             total[j * 4 + half * 2 + c]);
      }
    }
    named_barrier_sync(kStagingBarrier + consumer, 128);
    // The unit's 4 columns (x rows): their exponents and bias, once a part.
    const int first_column = tile_x * kBlockX + part * kOutBoxRows + box * kBoxK + unit * 4;
    const bool columns_inside = first_column < m;  // m % 4 == 0: all 4 or none
#pragma unroll
    for (int q = 0; q < 4; ++q) column_exponents[q] = columns_inside ? arguments.x_exponent[first_column + q] : 0;
    RowUnscale factors[4];
    float column_bias[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      factors[q] = row_unscale(column_exponents[q]);
      column_bias[q] = arguments.bias && columns_inside ? arguments.bias[first_column + q] : 0.0f;
    }
#pragma unroll 1
    for (int i = 0; i < kOutBoxRows / 8; ++i) {
      const int row = unit_first_row + 8 * i;
      const std::uint32_t address = unit_address + i * 8 * 128;
      const float4 totals = load_shared_float4(address);
      if (plain_product) {
        store_shared_float4(address, make_float4(plain_product_output(unscale(totals.x, factors[0])),
                                                 plain_product_output(unscale(totals.y, factors[1])),
                                                 plain_product_output(unscale(totals.z, factors[2])),
                                                 plain_product_output(unscale(totals.w, factors[3]))));
        continue;
      }
      constexpr Activation kLeaky = Activation::kLeakyReLU;
      const Activated out[4] = {apply_epilogue<kLeaky>(unscale(totals.x, factors[0]), column_bias[0], epilogue),
                                apply_epilogue<kLeaky>(unscale(totals.y, factors[1]), column_bias[1], epilogue),
                                apply_epilogue<kLeaky>(unscale(totals.z, factors[2]), column_bias[2], epilogue),
                                apply_epilogue<kLeaky>(unscale(totals.w, factors[3]), column_bias[3], epilogue)};
      store_shared_float4(address, make_float4(out[0].value, out[1].value, out[2].value, out[3].value));
      if (arguments.positive && row < n && columns_inside)
        store_unit_mask(arguments.positive + static_cast<std::int64_t>(row) * m + first_column, out, mask_words);
    }
    fence_async_shared();
    named_barrier_sync(kStagingBarrier + consumer, 128);
    if (store_thread) {
#pragma unroll
      for (int b = 0; b < 2; ++b)
        tma_store_2d(arguments.y_map, staging + b * kOutBoxBytes, tile_x * kBlockX + part * kOutBoxRows + b * kBoxK,
                     tile_w * kBlockW + consumer * 64);
      tma_store_commit();
    }
  }
}

// Waits until this thread's TMA stores have written y, before the CTA ends.
__device__ __forceinline__ void finish_stores(const EpilogueArguments& arguments) {
  using namespace sm90;
  if (arguments.y_by_tma && threadIdx.x % 128 == 0) tma_store_wait<0>();
}

}  // namespace
}  // namespace kernels::gemm
