// The fix-up after the split GEMMs (gemm.h: launch_nonfinite_outputs): the split passes and the Hopper kernel split
// a non-finite value as 0 and flag its row, and this kernel writes the outputs such rows reach with eager's
// non-finite result. Portable (any architecture).
#pragma once

#include "common/dependent_launch.cuh"
#include "gemm.h"
#include "split_numerics.cuh"

namespace kernels::gemm {
namespace {

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
                         std::int64_t k, Epilogue epilogue) {
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  allow_next_grid();
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
      const float b = bias ? bias[j] : 0.0f;
      const Activated out = apply_epilogue_non_finite(sum, b, epilogue);  // sum is +-inf or NaN
      y[i * n + j] = out.value;
      if (positive) positive[i * n + j] = out.positive;
      if (epilogue.pre) epilogue.pre[i * n + j] = pre_activation(sum, b, epilogue);
    }
    __syncthreads();  // count and positions are reused by the next flagged row
  }
}

}  // namespace
}  // namespace kernels::gemm
