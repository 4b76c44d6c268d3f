// What the row-normalization families (rms_norm.cu, layer_norm.cu) share: blocks of kRowThreads threads taking rows
// in turn, a row held in registers as 16-byte packs (or single elements) spread over a group of its threads (Rows),
// sums of doubles over a row in a fixed order, the launch shape by row layout, and the fixed-order sum of the blocks'
// per-column partials (the parameters' gradients). No torch headers.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <type_traits>

#include <cuda_runtime.h>

#include "common/dependent_launch.cuh"
#include "common/elementwise.cuh"
#include "common/once_per_device.h"

namespace kernels::common {

constexpr int kRowThreads = 256;
constexpr int kRowWarps = kRowThreads / 32;
constexpr int kRowMaxPacks = 8;  // packs a thread holds
constexpr int kRowBlocksPerProcessor = 4;

__device__ __forceinline__ double shuffle_xor(double v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }

// 1 / sqrt(v) in double, within an ulp or two: inline arithmetic only (the library's rsqrt calls a slow path for
// special values, and the registers a call saves spill in the row kernels). v = m 2^(2k) with m in [1, 4): a float
// estimate of 1 / sqrt(m), two Newton steps in double, then 2^-k. +0 gives +inf, +inf gives 0, NaN and v < 0 NaN.
__device__ __forceinline__ double reciprocal_sqrt(double v) {
  if (!(v > 0.0) || v == __longlong_as_double(0x7ff0000000000000LL))
    return v == 0.0 ? __longlong_as_double(0x7ff0000000000000LL) : v > 0.0 ? 0.0 : __longlong_as_double(-1LL);
  int rescale = 0;  // subnormals: 2^108 v first, 2^54 on the result
  if (v < 2.2250738585072014e-308) {
    v *= 0x1p108;
    rescale = 54;
  }
  const long long bits = __double_as_longlong(v);
  const int k = (static_cast<int>(bits >> 52) - 1023) >> 1;  // floor((exponent) / 2)
  const double m = __longlong_as_double(bits - (static_cast<long long>(2 * k) << 52));
  double y = rsqrtf(static_cast<float>(m));
#pragma unroll
  for (int step = 0; step < 2; ++step) y = fma(0.5 * y, fma(-m * y, y, 1.0), y);
  return y * __longlong_as_double(static_cast<long long>(1023 - k + rescale) << 52);
}

// A block's rows at a time: kGroup threads each (whole warps), kRows of them.
template <int kGroup>
struct Rows {
  static constexpr int kRows = kRowThreads / kGroup;
  static constexpr int kGroupWarps = kGroup / 32;
  static_assert(kGroup % 32 == 0 && kRowThreads % kGroup == 0, "whole warps a row, whole rows a block");

  // This thread's row of the block's kRows, and its p-th pack of that row (a row's packs spread over its threads).
  __device__ static int group() { return kRows == 1 ? 0 : threadIdx.x / kGroup; }
  __device__ static std::int64_t pack(int p) {
    return (kRows == 1 ? threadIdx.x : threadIdx.x % kGroup) + std::int64_t{p} * kGroup;
  }

  // The sum of one value per thread over its row's threads, the same bits in each: a warp's by shuffles (both lanes
  // of each add compute the same sum), then the row's warps in order through `slots` (kRowWarps of them). Successive
  // sums alternate between two sets of slots, so one barrier a sum suffices: the row group's own (named barrier
  // 1 + group), so that a block's rows do not wait for each other. Every thread of the group calls it.
  template <typename V>
  __device__ static V sum(V value, V* slots) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) value = value + shuffle_xor(value, offset);
    if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32] = value;
    if constexpr (kRows == 1) {
      __syncthreads();
    } else {
      asm volatile("bar.sync %0, %1;" ::"r"(group() + 1), "n"(kGroup) : "memory");
    }
    const int first = group() * kGroupWarps;
    V total = slots[first];
#pragma unroll
    for (int w = 1; w < kGroupWarps; ++w) total = total + slots[first + w];
    return total;
  }

  // A per-column parameter's packs of this thread, as floats (0 past the columns).
  template <typename T, int kWidth, int kPacks>
  __device__ static void load_parameter(const T* __restrict__ parameter, std::int64_t packs,
                                        float (&out)[kPacks][kWidth]) {
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const std::int64_t i = pack(p);
      Pack<T, kWidth> v{};
      if (i < packs) v = reinterpret_cast<const Pack<T, kWidth>*>(parameter)[i];
#pragma unroll
      for (int j = 0; j < kWidth; ++j) out[p][j] = i < packs ? to_opmath(v.v[j]) : 0.0f;
    }
  }

  // The row's packs of this thread (those past the columns, and a row past the end, left as they are).
  template <typename T, int kWidth, int kPacks>
  __device__ static void load_row(const T* __restrict__ row, bool inside, std::int64_t packs,
                                  Pack<T, kWidth> (&v)[kPacks]) {
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const std::int64_t i = pack(p);
      if (inside && i < packs) v[p] = reinterpret_cast<const Pack<T, kWidth>*>(row)[i];
    }
  }
};

// out_v[j] (v = blockIdx.y: out0, then out1) = column j of the v-th vector of the blocks' partials (rows of
// vectors x columns doubles, one per block of the backward), rounded to T once. A block takes kColumnSumColumns
// columns; each of its kColumnSumSlices slices of threads adds one fixed range of the partials' rows in order, then
// the slices' sums are added in order: the same bits every run, with the loads spread over enough threads to stream
// the partials.
constexpr int kColumnSumColumns = 16;
constexpr int kColumnSumSlices = kRowThreads / kColumnSumColumns;

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
column_partials_sum_kernel(const double* __restrict__ partials, int blocks, std::int64_t columns, T* __restrict__ out0,
                           T* __restrict__ out1) {
  __shared__ double slice_sums[kColumnSumSlices][kColumnSumColumns];
  wait_for_previous_grid();  // launched by launch_dependent: the partials are the previous grid's
  allow_next_grid();
  const int lane = threadIdx.x % kColumnSumColumns, slice = threadIdx.x / kColumnSumColumns;
  const std::int64_t column = blockIdx.x * std::int64_t{kColumnSumColumns} + lane;
  const std::int64_t row_length = gridDim.y * columns, offset = blockIdx.y * columns;
  const int per_slice = (blocks + kColumnSumSlices - 1) / kColumnSumSlices;
  const int begin = slice * per_slice, end = begin + per_slice < blocks ? begin + per_slice : blocks;
  double total = 0.0;
  if (column < columns) {
#pragma unroll 4
    for (int b = begin; b < end; ++b) total += partials[b * row_length + offset + column];
  }
  slice_sums[slice][lane] = total;
  __syncthreads();
  if (slice != 0 || column >= columns) return;
  double sum = slice_sums[0][lane];
#pragma unroll
  for (int s = 1; s < kColumnSumSlices; ++s) sum += slice_sums[s][lane];
  (blockIdx.y == 0 ? out0 : out1)[column] = from_double<T>(sum);
}

// column_partials_sum_kernel over `vectors` (1 or 2) vectors of partials.
template <typename T>
cudaError_t launch_column_partials_sum(const double* partials, int blocks, std::int64_t columns, int vectors, T* out0,
                                       T* out1, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned int>((columns + kColumnSumColumns - 1) / kColumnSumColumns),
                  static_cast<unsigned int>(vectors));
  return launch_dependent(column_partials_sum_kernel<T>, grid, dim3(kRowThreads), 0, stream, partials, blocks, columns,
                          out0, out1);
}

inline int multiprocessors(int device) {
  const std::optional<int> count = once_per_device(device, [](int d) -> std::optional<int> {
    int value = 0;
    if (cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, d) != cudaSuccess || value <= 0)
      return std::nullopt;
    return value;
  });
  return count.value_or(1);
}

inline int current_device() {
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess ? device : 0;
}

// The blocks a row kernel launches over `rows` on `device`: kRowBlocksPerProcessor a multiprocessor at most.
inline int row_blocks(int device, std::int64_t rows) {
  const std::int64_t most = std::int64_t{kRowBlocksPerProcessor} * multiprocessors(device);
  return static_cast<int>(rows < most ? (rows > 0 ? rows : 1) : most);
}

// Packs a thread holds for `columns` (1, 2, 4 or 8), 0 where they exceed kRowMaxPacks or kMaxElements elements.
template <int kMaxElements>
int row_packs_for(std::int64_t columns, int width) {
  const std::int64_t packs = (columns / width + kRowThreads - 1) / kRowThreads;
  for (int p = 1; p <= kRowMaxPacks && p * width <= kMaxElements; p *= 2)
    if (packs <= p) return p;
  return 0;
}

// Calls fn with the kernel's (kWidth, kPacks) as integral constants.
template <int kWidth, int kMaxElements, typename Fn>
cudaError_t with_row_packs(int packs, const Fn& fn) {
  switch (packs) {
    case 1: return fn(std::integral_constant<int, kWidth>{}, std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, kWidth>{}, std::integral_constant<int, 2>{});
  }
  if constexpr (4 * kWidth <= kMaxElements) {
    if (packs == 4) return fn(std::integral_constant<int, kWidth>{}, std::integral_constant<int, 4>{});
  }
  if constexpr (8 * kWidth <= kMaxElements) {
    if (packs == 8) return fn(std::integral_constant<int, kWidth>{}, std::integral_constant<int, 8>{});
  }
  return cudaErrorInvalidValue;
}

// fn(width, packs) for the row layout: kWidth = 16 bytes where the columns fill whole packs and the pointers are
// 16-byte aligned, else 1.
template <typename T, int kMaxElements, typename Fn>
cudaError_t with_row_layout(std::int64_t columns, bool aligned, const Fn& fn) {
  constexpr int kWidth = vector_width<T>();
  if (aligned && columns % kWidth == 0) return with_row_packs<kWidth, kMaxElements>(
      row_packs_for<kMaxElements>(columns, kWidth), fn);
  return with_row_packs<1, kMaxElements>(row_packs_for<kMaxElements>(columns, 1), fn);
}

// Whether the kernels of a family holding kMaxElements a thread take rows of `columns` of an element `width` bytes
// wide (2 or 4), `aligned` as with_row_layout's.
template <int kMaxElements>
bool row_fits(int width, std::int64_t columns, bool aligned) {
  const int pack = 16 / width;
  return columns > 0 && row_packs_for<kMaxElements>(columns, aligned && columns % pack == 0 ? pack : 1) != 0;
}

inline bool all_aligned(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (!aligned(p, 16)) return false;
  return true;
}

}  // namespace kernels::common
