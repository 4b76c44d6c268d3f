// LayerNorm over each row (nn.LayerNorm's formula with a weight and a bias, layer_norm.h), forward and backward. A
// block takes rows in turn and holds a row in registers (kPacks packs a thread, common/rows.cuh), so each operand is
// read once and each result written once; the weight and bias are loaded once per block. A row's sums are doubles
// added in a fixed order (a thread's packs in order, the warps' shuffles, then the warps in order), the mean first and
// then the squares of the deviations from it (two sums of the registers, no cancellation): the same inputs give the
// same bits every run, and the forward and the backward compute the same mean and rstd bit for bit where they take the
// same layout. The backward copies each row's next row into shared memory while it computes (cp.async, sm_80 on), adds
// each block's g h and g into per-column doubles, written to its row of partials; a second kernel adds those rows in
// order. The residual forms: the forward adds a residual to x first (writing the sum it normalizes), the backward adds
// the gradient of x's other uses to grad_x before rounding it. The forward can also write y's row split for the GEMM
// (the GEMM family's split method, gemm/split_numerics.cuh), so that the product reading y does not split it again.
#include "layer_norm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <optional>
#include <type_traits>

#include "common/dependent_launch.cuh"
#include "common/device_queries.h"
#include "common/elementwise.cuh"
#include "common/mma_sm80.cuh"
#include "common/rows.cuh"
#include "gemm/split_numerics.cuh"

namespace kernels::layer_norm {
namespace {

using common::from_double;
using common::from_opmath;
using common::kRowThreads;
using common::kRowWarps;
using common::Pack;
using common::Rows;
using common::to_opmath;

// Elements a thread holds: a backward's row, gradient, weight and its two partial sums (doubles) fit its registers.
constexpr int kMaxElements = 16;
// Threads a row (whole warps): rows of up to kShortGroup * kMaxElements elements take kShortGroup threads, so that a
// block holds kRowThreads / kShortGroup rows at once (enough bytes in flight for short rows); longer ones the block.
constexpr int kShortGroup = 64;
// The blocks whose registers a multiprocessor holds at once: the forward's (one fewer for single elements, whose
// wider index arithmetic would spill) and the backward's for float32 (16-bit types' wider packs take one block's).
constexpr int kForwardBlocksPerProcessor = 4;
constexpr int kBackwardBlocksPerProcessor = 2;

struct DoublePair {
  double first, second;
};

__device__ __forceinline__ DoublePair operator+(DoublePair a, DoublePair b) {
  return {a.first + b.first, a.second + b.second};
}

__device__ __forceinline__ DoublePair shuffle_xor(DoublePair v, int offset) {
  return {common::shuffle_xor(v.first, offset), common::shuffle_xor(v.second, offset)};
}

// A row's largest finite |y| and whether it holds a non-finite y, combined by Rows::sum as a sum is: y's row split.
struct RowMaximum {
  float max_abs;
  bool non_finite;
};

__device__ __forceinline__ RowMaximum operator+(RowMaximum a, RowMaximum b) {
  return {fmaxf(a.max_abs, b.max_abs), a.non_finite || b.non_finite};
}

__device__ __forceinline__ RowMaximum shuffle_xor(RowMaximum v, int offset) {
  return {__shfl_xor_sync(0xffffffffu, v.max_abs, offset),
          __shfl_xor_sync(0xffffffffu, static_cast<int>(v.non_finite), offset) != 0};
}

// A parameter's pack i as floats (the parameters are read once per row from L1: registers go to the rows in flight).
template <typename T, int kWidth>
__device__ __forceinline__ void load_parameter_pack(const T* __restrict__ parameter, std::int64_t i,
                                                    float (&out)[kWidth]) {
  const Pack<T, kWidth> v = reinterpret_cast<const Pack<T, kWidth>*>(parameter)[i];
#pragma unroll
  for (int j = 0; j < kWidth; ++j) out[j] = to_opmath(v.v[j]);
}

// The forward's blocks a multiprocessor holds: kForwardBlocksPerProcessor, one fewer for single elements (whose wider
// index arithmetic would spill), for the residual's sum (its next row held too), and for the residual's sum with y's
// row split (its maximum and split packs).
template <int kWidth, bool kAdd, bool kSplit>
constexpr int forward_blocks_per_processor() {
  return kForwardBlocksPerProcessor - (kWidth == 1 ? 1 : 0) - (kAdd ? 1 : 0) - (kAdd && kSplit ? 1 : 0);
}

// y = LayerNorm(x), or with kAdd: sum = x + residual (rounded to T, as eager's add), written, and y = LayerNorm(sum).
// With kSplit (float32 in packs of 4 only), y's row split is written too (layer_norm.h, RowSplitOut): the row's
// largest finite |y| by one more sum over the row's threads, then each pack computed again and split by the GEMM
// family's split_pack, so that it holds the bits the GEMM's row pass would make from y.
template <typename T, int kWidth, int kPacks, int kGroup, bool kAdd, bool kSplit>
__global__ void __launch_bounds__(kRowThreads, (forward_blocks_per_processor<kWidth, kAdd, kSplit>()))
layer_norm_kernel(const T* __restrict__ x, const T* __restrict__ residual, const T* __restrict__ weight,
                  const T* __restrict__ bias, T* __restrict__ sum_out, T* __restrict__ y, std::int64_t rows,
                  std::int64_t columns, double inverse_columns, double eps, RowSplitOut split) {
  static_assert(!kSplit || (std::is_same_v<T, float> && kWidth == 4), "the row split takes float32 packs of 4");
  using P = Pack<T, kWidth>;
  using R = Rows<kGroup>;
  __shared__ double slots[2][kRowWarps];
  const std::int64_t packs = columns / kWidth, stride = gridDim.x * std::int64_t{R::kRows};
  // Every row of the block goes round the loop as often (a row past the end still joins the sums' barriers); the
  // next row's loads are issued before this row's sums, so that they are in flight meanwhile.
  const std::int64_t group_rows = rows + R::group();  // the loop runs while the block's first row is a row
  std::int64_t row = blockIdx.x * std::int64_t{R::kRows} + R::group();
  P next[kPacks], next_residual[kAdd ? kPacks : 1];
  const auto load_next = [&](std::int64_t r) {
    R::template load_row<T, kWidth, kPacks>(x + (r < rows ? r : 0) * columns, r < rows, packs, next);
    if constexpr (kAdd)
      R::template load_row<T, kWidth, kPacks>(residual + (r < rows ? r : 0) * columns, r < rows, packs,
                                              next_residual);
  };
  load_next(row);
  for (; row < group_rows; row += stride) {
    const bool inside = row < rows;
    P v[kPacks];
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      v[p] = next[p];
      if constexpr (kAdd) {
#pragma unroll
        for (int j = 0; j < kWidth; ++j)
          v[p].v[j] = from_opmath<T>(to_opmath(v[p].v[j]) + to_opmath(next_residual[p].v[j]));
      }
    }
    load_next(row + stride);
    if constexpr (kAdd) {
      if (inside) {
        P* out = reinterpret_cast<P*>(sum_out + row * columns);
#pragma unroll
        for (int p = 0; p < kPacks; ++p)
          if (R::pack(p) < packs) out[R::pack(p)] = v[p];
      }
    }
    double sum = 0.0;
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      if (!inside || R::pack(p) >= packs) continue;
#pragma unroll
      for (int j = 0; j < kWidth; ++j) sum += to_opmath(v[p].v[j]);
    }
    const double mean = R::sum(sum, slots[0]) * inverse_columns;
    double squares = 0.0;
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      if (!inside || R::pack(p) >= packs) continue;
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        const double deviation = to_opmath(v[p].v[j]) - mean;
        squares += deviation * deviation;
      }
    }
    const double rstd = common::reciprocal_sqrt(R::sum(squares, slots[1]) * inverse_columns + eps);
    if (!inside) continue;  // (a whole row group: its threads share the row)
    // y's pack p of this thread (pack R::pack(p) < packs of the row), each result in double rounded once.
    const auto y_pack = [&](int p) {
      const std::int64_t i = R::pack(p);
      float w[kWidth], b[kWidth];
      load_parameter_pack<T, kWidth>(weight, i, w);
      load_parameter_pack<T, kWidth>(bias, i, b);
      P result;
#pragma unroll
      for (int j = 0; j < kWidth; ++j)
        result.v[j] = from_double<T>(fma((to_opmath(v[p].v[j]) - mean) * rstd, double{w[j]}, double{b[j]}));
      return result;
    };
    P* out = reinterpret_cast<P*>(y + row * columns);
    RowMaximum mine{0.0f, false};  // (kSplit)
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const std::int64_t i = R::pack(p);
      if (i >= packs) continue;
      const P result = y_pack(p);
      out[i] = result;
      if constexpr (kSplit) {
#pragma unroll
        for (int j = 0; j < kWidth; ++j) gemm::fold(result.v[j], mine.max_abs, mine.non_finite);
      }
    }
    if constexpr (kSplit) {
      // y's packs are computed again for the split rather than held (held, they spill registers).
      __shared__ RowMaximum maximum_slots[kRowWarps];
      const RowMaximum maximum = R::sum(mine, maximum_slots);
      const int e = gemm::scale_exponent(maximum.max_abs);
      if (R::pack(0) == 0) split.exponent[row] = maximum.non_finite ? gemm::kNonFiniteRow : e;
      const gemm::PowerOfTwo scale = gemm::power_of_two(e);
      const std::int64_t length = gemm::split_row_length(columns);
      __half* const hi = static_cast<__half*>(split.hi) + row * length;
      __half* const lo = static_cast<__half*>(split.lo) + row * length;
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
        const std::int64_t i = R::pack(p);  // packs past the row's end, up to its split length, split as zeros
        if (i >= length / 4) continue;
        const P result = i < packs ? y_pack(p) : P{};
        gemm::split_pack</*kNatural=*/false>(make_float4(result.v[0], result.v[1], result.v[2], result.v[3]), scale,
                                             i, hi, lo);
      }
    }
  }
}

// Whether the backward stages rows in shared memory: rows in 16-byte packs, where its code has cp.async (sm_80 on).
template <typename T, int kWidth>
__host__ __device__ constexpr bool backward_stages_rows() {
  return sizeof(Pack<T, kWidth>) == 16;
}

// The rows the backward stages per row group: x's and g's, and with kAddGrad the residual gradient's.
template <bool kAddGrad>
__host__ __device__ constexpr int backward_staged_rows() {
  return kAddGrad ? 3 : 2;
}

// With kAddGrad, grad_residual (the gradient x receives through its other uses: a residual connection) is added to
// each grad_x in double before the one rounding.
template <typename T, int kWidth, int kPacks, int kGroup, bool kAddGrad>
__global__ void __launch_bounds__(kRowThreads, sizeof(T) == 4 ? kBackwardBlocksPerProcessor : 1)
layer_norm_backward_kernel(const T* __restrict__ grad_y, const T* __restrict__ x, const T* __restrict__ weight,
                           const T* __restrict__ grad_residual, T* __restrict__ grad_x,
                           double* __restrict__ partials, std::int64_t rows, std::int64_t columns,
                           double inverse_columns, double eps) {
  using P = Pack<T, kWidth>;
  using R = Rows<kGroup>;
  __shared__ DoublePair slots[2][kRowWarps];
  // Each row group's sums of g h and g per column, in shared memory (registers hold the rows): a thread's element j
  // of pack i at [group][j][i], so that a warp's threads touch consecutive slots (no bank conflicts).
  extern __shared__ double2 parameter_grads[];
  double2* const own_grads = parameter_grads + R::group() * columns;
  const std::int64_t packs = columns / kWidth;
  // Staged rows, after the sums: each thread copies its own packs of its group's next row (x, then g, then the
  // residual's gradient) while this row is computed, and reads them back itself, so no barrier guards them.
  constexpr bool kStaged = backward_stages_rows<T, kWidth>() && KERNELS_SM80_DEVICE;
  constexpr int kStagedRows = backward_staged_rows<kAddGrad>();
  P* const staged = reinterpret_cast<P*>(parameter_grads + R::kRows * columns) + R::group() * kStagedRows * packs;
  const auto stage = [&](std::int64_t row) {
    if constexpr (kStaged) {
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
        const std::int64_t i = R::pack(p);
        if (row >= rows || i >= packs) continue;
        common::sm80::copy_16_async(common::sm80::shared_address(staged + i),
                                    reinterpret_cast<const P*>(x + row * columns) + i, true);
        common::sm80::copy_16_async(common::sm80::shared_address(staged + packs + i),
                                    reinterpret_cast<const P*>(grad_y + row * columns) + i, true);
      }
      common::sm80::commit_copies();
    }
  };
  // The residual gradient's row, staged apart: copied once this row's grad_x is written (its slots free), and needed
  // only when the next row's grad_x is, so that the copy is in flight through that row's sums. Its own group of
  // copies: x's and g's wait for theirs alone (one group may stay in flight), grad_x for the residual's.
  const auto stage_residual = [&](std::int64_t row) {
    if constexpr (kStaged && kAddGrad) {
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
        const std::int64_t i = R::pack(p);
        if (row >= rows || i >= packs) continue;
        common::sm80::copy_16_async(common::sm80::shared_address(staged + 2 * packs + i),
                                    reinterpret_cast<const P*>(grad_residual + row * columns) + i, true);
      }
      common::sm80::commit_copies();
    }
  };
  for (std::int64_t c = threadIdx.x; c < R::kRows * columns; c += kRowThreads)
    parameter_grads[c] = make_double2(0.0, 0.0);
  __syncthreads();
  wait_for_previous_grid();  // launched by launch_dependent (common/dependent_launch.cuh)
  const std::int64_t stride = gridDim.x * std::int64_t{R::kRows};
  stage(blockIdx.x * std::int64_t{R::kRows} + R::group());
  stage_residual(blockIdx.x * std::int64_t{R::kRows} + R::group());
  for (std::int64_t first = blockIdx.x * std::int64_t{R::kRows}; first < rows; first += stride) {
    const std::int64_t row = first + R::group();
    const bool inside = row < rows;
    P v[kPacks], g[kPacks];
    // This row's residual gradient, pack i (read where grad_x is written: staged, or from memory).
    const auto residual_pack = [&](std::int64_t i) {
      if constexpr (kStaged) {
        return staged[2 * packs + i];
      } else {
        return reinterpret_cast<const P*>(grad_residual + row * columns)[i];
      }
    };
    if constexpr (kStaged) {
      common::sm80::wait_copies<kAddGrad ? 1 : 0>();
#pragma unroll
      for (int p = 0; p < kPacks; ++p) {
        const std::int64_t i = R::pack(p);
        if (!inside || i >= packs) continue;
        v[p] = staged[i];
        g[p] = staged[packs + i];
      }
    } else {
      R::template load_row<T, kWidth, kPacks>(x + (inside ? row : 0) * columns, inside, packs, v);
      R::template load_row<T, kWidth, kPacks>(grad_y + (inside ? row : 0) * columns, inside, packs, g);
    }
    // The weight's packs, from L1: once a row into registers, or in each sweep where a thread holds a block-wide
    // row's most elements (registers held for the weight there would spill).
    constexpr bool kHoldWeight = !(R::kRows == 1 && kPacks * kWidth == kMaxElements);
    float held[kHoldWeight ? kPacks : 1][kWidth];
    if constexpr (kHoldWeight) R::template load_parameter<T, kWidth, kPacks>(weight, packs, held);
    const auto weight_pack = [&](int p, float (&w)[kWidth]) {
#pragma unroll
      for (int j = 0; j < kWidth; ++j) w[j] = held[kHoldWeight ? p : 0][j];
      if constexpr (!kHoldWeight) load_parameter_pack<T, kWidth>(weight, R::pack(p), w);
    };
    // The mean as the forward sums it (the same mean and rstd), with sum(g w); then the deviations' squares, with
    // sum(g w (x - mean)).
    DoublePair sums{0.0, 0.0};
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      if (!inside || R::pack(p) >= packs) continue;
      float w[kWidth];
      weight_pack(p, w);
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        sums.first += to_opmath(v[p].v[j]);
        sums.second += static_cast<double>(to_opmath(g[p].v[j])) * w[j];
      }
    }
    sums = R::sum(sums, slots[0]);
    stage(row + stride);  // the staged packs are in registers and used: their slots take the next row
    const double mean = sums.first * inverse_columns, mean_gw = sums.second * inverse_columns;
    DoublePair deviations{0.0, 0.0};
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      if (!inside || R::pack(p) >= packs) continue;
      float w[kWidth];
      weight_pack(p, w);
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        const double deviation = to_opmath(v[p].v[j]) - mean;
        deviations.first += deviation * deviation;
        deviations.second += static_cast<double>(to_opmath(g[p].v[j])) * w[j] * deviation;
      }
    }
    deviations = R::sum(deviations, slots[1]);
    if (!inside) continue;
    const double rstd = common::reciprocal_sqrt(deviations.first * inverse_columns + eps);
    const double mean_gwh = deviations.second * rstd * inverse_columns;
    if constexpr (kStaged && kAddGrad) common::sm80::wait_copies<1>();  // all but the next row's x and g
    P* out = reinterpret_cast<P*>(grad_x + row * columns);
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const std::int64_t i = R::pack(p);
      if (i >= packs) continue;
      float w[kWidth];
      weight_pack(p, w);
      P result, residual;
      if constexpr (kAddGrad) residual = residual_pack(i);
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        const double h = (to_opmath(v[p].v[j]) - mean) * rstd, grad = to_opmath(g[p].v[j]);
        double grad_input = rstd * (grad * w[j] - mean_gw - h * mean_gwh);
        if constexpr (kAddGrad) grad_input += to_opmath(residual.v[j]);
        result.v[j] = from_double<T>(grad_input);
        // This thread's own (no other thread touches it); 32-bit offsets: a row has at most 4096 columns.
        double2& sums_of_column = own_grads[j * static_cast<int>(packs) + static_cast<int>(i)];
        sums_of_column = make_double2(sums_of_column.x + grad * h, sums_of_column.y + grad);
      }
      out[i] = result;
    }
    stage_residual(row + stride);
  }
  allow_next_grid();  // the partials' sum may launch; it waits for this grid's end
  // The block's row of partials: its row groups' sums added in group order (the same bits every run).
  __syncthreads();
  double* const weight_partials = partials + blockIdx.x * 2 * columns;
#pragma unroll 1
  for (std::int64_t c = threadIdx.x; c < columns; c += kRowThreads) {
    const std::int64_t slot = c % kWidth * packs + c / kWidth;  // column c is element c % kWidth of pack c / kWidth
    double2 total = parameter_grads[slot];
#pragma unroll
    for (int group = 1; group < R::kRows; ++group) {
      const double2 part = parameter_grads[group * columns + slot];
      total = make_double2(total.x + part.x, total.y + part.y);
    }
    weight_partials[c] = total.x;
    weight_partials[columns + c] = total.y;
  }
}

// Whether layer_norm_backward_kernel stages rows on `device`, the current one: rows in 16-byte packs, and its code for
// the device built for sm_80 or later (its own KERNELS_SM80_DEVICE). Asked once per device; where the query fails,
// true (room for staged rows that go unused is harmless).
template <typename T, int kWidth, int kPacks, int kGroup, bool kAddGrad>
bool backward_stages_rows_on(int device) {
  if constexpr (!backward_stages_rows<T, kWidth>()) {
    return false;
  } else {
    return once_per_device(device, [](int) -> std::optional<bool> {
      const std::optional<int> version =
          kernel_code_version(layer_norm_backward_kernel<T, kWidth, kPacks, kGroup, kAddGrad>);
      if (!version) return std::nullopt;
      return *version >= 80;
    }).value_or(true);
  }
}

// The dynamic shared memory of layer_norm_backward_kernel: two doubles per column for each of a block's row groups,
// and where it stages rows, x's and g's of each (and the residual gradient's); at most kMaxElements a thread.
template <typename T, int kGroup, bool kAddGrad>
std::size_t backward_shared_bytes(std::int64_t columns, bool staged) {
  const std::size_t per_column = sizeof(double2) + (staged ? backward_staged_rows<kAddGrad>() * sizeof(T) : 0);
  return static_cast<std::size_t>(Rows<kGroup>::kRows * columns) * per_column;
}
constexpr std::size_t kBackwardMostSharedBytes =
    std::size_t{kRowThreads} * kMaxElements * (sizeof(double2) + 3 * sizeof(float));

// The dynamic shared memory the backward may take on `device`: kBackwardMostSharedBytes, or what a block holds beside
// the kernel's static part where that is less (a GPU whose blocks take 64 KB in all); 0 where the query fails.
std::size_t backward_shared_limit(int device) {
  return once_per_device(device, [](int d) -> std::optional<std::size_t> {
    int block = 0;
    if (cudaDeviceGetAttribute(&block, cudaDevAttrMaxSharedMemoryPerBlockOptin, d) != cudaSuccess) {
      (void)cudaGetLastError();  // a failed query leaves no error for a later launch's check to report
      return std::nullopt;
    }
    const std::size_t room = block > 1024 ? static_cast<std::size_t>(block) - 1024 : 0;  // the static part within 1 KB
    return room < kBackwardMostSharedBytes ? room : kBackwardMostSharedBytes;
  }).value_or(0);
}

// fn(width, packs, group) as integral constants for the row layout: kWidth = 16 bytes where the columns fill whole
// packs and the pointers are 16-byte aligned, else 1; kShortGroup threads a row where the row fits them, else the
// block; packs a thread: 1, 2, 4 or 8, at most kMaxElements elements.
template <typename T, typename Fn>
cudaError_t with_layout(std::int64_t columns, bool aligned, const Fn& fn) {
  using std::integral_constant;
  const auto with_width = [&](auto width) -> cudaError_t {
    constexpr int kWidth = decltype(width)::value;
    constexpr int kMostPacks = kMaxElements / kWidth < common::kRowMaxPacks ? kMaxElements / kWidth
                                                                            : common::kRowMaxPacks;
    const std::int64_t packs = columns / kWidth;
    const auto with_group = [&](auto group) -> cudaError_t {
      constexpr int kGroup = decltype(group)::value;
      const std::int64_t per_thread = (packs + kGroup - 1) / kGroup;
      if (per_thread <= 1) return fn(width, integral_constant<int, 1>{}, group);
      if constexpr (kMostPacks >= 2) {
        if (per_thread <= 2) return fn(width, integral_constant<int, 2>{}, group);
      }
      if constexpr (kMostPacks >= 4) {
        if (per_thread <= 4) return fn(width, integral_constant<int, 4>{}, group);
      }
      if constexpr (kMostPacks >= 8) {
        if (per_thread <= 8) return fn(width, integral_constant<int, 8>{}, group);
      }
      return cudaErrorInvalidValue;
    };
    if (packs <= std::int64_t{kShortGroup} * kMostPacks) return with_group(integral_constant<int, kShortGroup>{});
    return with_group(integral_constant<int, kRowThreads>{});
  };
  constexpr int kVector = common::vector_width<T>();
  if (aligned && columns % kVector == 0) return with_width(integral_constant<int, kVector>{});
  return with_width(integral_constant<int, 1>{});
}

// fn(std::bool_constant<flag>{}): a kernel's template flag from a run-time one.
template <typename Fn>
cudaError_t with_flag(bool flag, const Fn& fn) {
  return flag ? fn(std::true_type{}) : fn(std::false_type{});
}

template <typename T>
cudaError_t forward_typed(const void* x, const void* residual, const void* weight, const void* bias, void* sum,
                          void* y, std::int64_t rows, std::int64_t columns, double eps, const RowSplitOut* split,
                          cudaStream_t stream) {
  const bool aligned = common::all_aligned({x, residual, weight, bias, sum, y});  // (nullptr is aligned)
  const RowSplitOut split_out = split != nullptr ? *split : RowSplitOut{};
  return with_flag(split != nullptr, [&](auto leave_split) {
    return with_flag(residual != nullptr, [&](auto add) {
      return with_layout<T>(columns, aligned, [&](auto width, auto packs, auto group) -> cudaError_t {
        if constexpr (leave_split.value && !(std::is_same_v<T, float> && width.value == 4)) {
          return cudaErrorInvalidValue;  // the row split takes float32 packs of 4 (layer_norm_leaves_row_split)
        } else {
          constexpr int kRows = Rows<decltype(group)::value>::kRows;
          // Every pack of the split row is some thread's (the layouts' packs a row cover whole chunks of the split).
          if (leave_split.value && gemm::split_row_length(columns) / 4 > std::int64_t{packs.value} * group.value)
            return cudaErrorInvalidValue;
          const unsigned int blocks =
              static_cast<unsigned int>(common::row_blocks(common::current_device(), (rows + kRows - 1) / kRows));
          layer_norm_kernel<T, width.value, packs.value, group.value, add.value, leave_split.value>
              <<<blocks, kRowThreads, 0, stream>>>(
                  static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<const T*>(weight),
                  static_cast<const T*>(bias), static_cast<T*>(sum), static_cast<T*>(y), rows, columns,
                  1.0 / static_cast<double>(columns), eps, split_out);
          return cudaGetLastError();
        }
      });
    });
  });
}

template <typename T>
cudaError_t backward_typed(const void* grad_y, const void* x, const void* weight, const void* grad_residual,
                           void* grad_x, void* grad_weight, void* grad_bias, double* partials, int blocks,
                           std::int64_t rows, std::int64_t columns, double eps, std::size_t shared_limit,
                           cudaStream_t stream) {
  const bool aligned = common::all_aligned({grad_y, x, weight, grad_residual, grad_x});
  const cudaError_t err = with_flag(grad_residual != nullptr, [&](auto add_grad) {
    return with_layout<T>(columns, aligned, [&](auto width, auto packs, auto group) {
      constexpr auto kKernel = layer_norm_backward_kernel<T, width.value, packs.value, group.value, add_grad.value>;
      const int device = common::current_device();
      const std::size_t limit = backward_shared_limit(device);
      const std::size_t usable = shared_limit != 0 && shared_limit < limit ? shared_limit : limit;
      const std::size_t shared_bytes = backward_shared_bytes<T, group.value, add_grad.value>(
          columns, backward_stages_rows_on<T, width.value, packs.value, group.value, add_grad.value>(device));
      if (shared_bytes > usable) return cudaErrorNotSupported;
      const cudaError_t raised = raise_shared_memory_limit<kKernel>(device, limit);
      if (raised != cudaSuccess) return raised;
      return launch_dependent(kKernel, dim3(static_cast<unsigned int>(blocks)), dim3(kRowThreads), shared_bytes,
                              stream, static_cast<const T*>(grad_y), static_cast<const T*>(x),
                              static_cast<const T*>(weight), static_cast<const T*>(grad_residual),
                              static_cast<T*>(grad_x), partials, rows, columns, 1.0 / static_cast<double>(columns),
                              eps);
    });
  });
  if (err != cudaSuccess) return err;
  return common::launch_column_partials_sum<T>(partials, blocks, columns, 2, static_cast<T*>(grad_weight),
                                               static_cast<T*>(grad_bias), stream);
}

}  // namespace

bool layer_norm_fits(ElementType type, std::int64_t columns, bool aligned) {
  if (type == ElementType::kFloat64) return false;
  return common::row_fits<kMaxElements>(type == ElementType::kFloat32 ? 4 : 2, columns, aligned);
}

bool layer_norm_leaves_row_split(ElementType type, std::int64_t columns, bool aligned) {
  return type == ElementType::kFloat32 && aligned && columns % 4 == 0 && layer_norm_fits(type, columns, aligned);
}

int layer_norm_backward_blocks(int device, std::int64_t rows) {
  const std::int64_t most = std::int64_t{kBackwardBlocksPerProcessor} * common::multiprocessors(device);
  return static_cast<int>(rows < most ? (rows > 0 ? rows : 1) : most);
}

cudaError_t launch_layer_norm(ElementType type, const void* x, const void* residual, const void* weight,
                              const void* bias, void* sum, void* y, std::int64_t rows, std::int64_t columns,
                              double eps, cudaStream_t stream, const RowSplitOut* split) {
  if (rows <= 0 || columns <= 0) return cudaSuccess;
  if ((residual == nullptr) != (sum == nullptr)) return cudaErrorInvalidValue;
  if (split != nullptr && type != ElementType::kFloat32) return cudaErrorInvalidValue;
  switch (type) {
    case ElementType::kFloat32:
      return forward_typed<float>(x, residual, weight, bias, sum, y, rows, columns, eps, split, stream);
    case ElementType::kFloat16:
      return forward_typed<__half>(x, residual, weight, bias, sum, y, rows, columns, eps, nullptr, stream);
    case ElementType::kBFloat16:
      return forward_typed<__nv_bfloat16>(x, residual, weight, bias, sum, y, rows, columns, eps, nullptr, stream);
    case ElementType::kFloat64: break;
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_layer_norm_backward(ElementType type, const void* grad_y, const void* x, const void* weight,
                                       const void* grad_residual, void* grad_x, void* grad_weight, void* grad_bias,
                                       double* partials, int blocks, std::int64_t rows, std::int64_t columns,
                                       double eps, std::size_t shared_limit, cudaStream_t stream) {
  if (rows <= 0 || columns <= 0) return cudaSuccess;
  switch (type) {
    case ElementType::kFloat32:
      return backward_typed<float>(grad_y, x, weight, grad_residual, grad_x, grad_weight, grad_bias, partials, blocks,
                                   rows, columns, eps, shared_limit, stream);
    case ElementType::kFloat16:
      return backward_typed<__half>(grad_y, x, weight, grad_residual, grad_x, grad_weight, grad_bias, partials,
                                    blocks, rows, columns, eps, shared_limit, stream);
    case ElementType::kBFloat16:
      return backward_typed<__nv_bfloat16>(grad_y, x, weight, grad_residual, grad_x, grad_weight, grad_bias, partials,
                                           blocks, rows, columns, eps, shared_limit, stream);
    case ElementType::kFloat64: break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace kernels::layer_norm
