// RMSNorm over each row (LlamaRMSNorm's formula, rms_norm.h), forward and backward. A block takes rows in turn and
// holds a row in registers (kPacks packs a thread), so each operand is read once and each result written once; the
// weight is loaded once per block. A row's sums are doubles added in a fixed order (a thread's packs in order, the
// warps' shuffles, then the warps in order): the same inputs give the same bits every run, and the forward and the
// backward compute the same r bit for bit where they take the same layout (all their pointers aligned, or not). The
// backward adds each block's g h into per-column doubles, written to its row of partials; a second kernel adds those
// rows in order.
#include "rms_norm.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <optional>

#include "common/elementwise.cuh"
#include "common/once_per_device.h"

namespace kernels::rms_norm {
namespace {

using common::from_double;
using common::from_opmath;
using common::Pack;
using common::to_opmath;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPacks = 8;  // packs a thread holds
constexpr int kMaxElements = 32;  // elements a thread holds: a backward's row, weight and sums fit its registers
constexpr int kBlocksPerProcessor = 4;

struct DoublePair {
  double squares, dot;
};

__device__ __forceinline__ DoublePair operator+(DoublePair a, DoublePair b) {
  return {a.squares + b.squares, a.dot + b.dot};
}

__device__ __forceinline__ double shuffle_xor(double v, int offset) { return __shfl_xor_sync(0xffffffffu, v, offset); }

__device__ __forceinline__ DoublePair shuffle_xor(DoublePair v, int offset) {
  return {shuffle_xor(v.squares, offset), shuffle_xor(v.dot, offset)};
}

// A block's sum of one value per thread, the same bits in every thread: a warp's by shuffles (both lanes of each add
// compute the same sum), then the warps' in order. Rows alternate between two sets of slots, so one __syncthreads a
// row suffices: a warp writing row k + 2's slots has passed row k + 1's barrier, after every read of row k's.
template <typename V>
__device__ __forceinline__ V block_sum(V value, V* slots) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = value + shuffle_xor(value, offset);
  if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32] = value;
  __syncthreads();
  V total = slots[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) total = total + slots[w];
  return total;
}

// This thread's p-th pack of a row: packs of a row are spread over the block's threads in turn.
__device__ __forceinline__ std::int64_t pack_index(int p) { return threadIdx.x + std::int64_t{p} * kThreads; }

// r = 1 / sqrt(mean + eps), in double (rsqrt: within an ulp of double), rounded to float once. The mean is the sum
// times 1 / columns (computed on the host): no division on the device.
__device__ __forceinline__ float reciprocal_rms(double squares, double inverse_columns, double eps) {
  return static_cast<float>(rsqrt(squares * inverse_columns + eps));
}

// h = x r rounded to T (LlamaRMSNorm's hidden_states.to(input_dtype)), as float.
template <typename T>
__device__ __forceinline__ float normalized(float x, float r) { return to_opmath(from_opmath<T>(x * r)); }

// The weight's packs of this thread, as floats (0 past the columns).
template <typename T, int kWidth, int kPacks>
__device__ __forceinline__ void load_weight(const T* __restrict__ weight, std::int64_t packs,
                                            float (&w)[kPacks][kWidth]) {
  using P = Pack<T, kWidth>;
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const std::int64_t i = pack_index(p);
    P v{};
    if (i < packs) v = reinterpret_cast<const P*>(weight)[i];
#pragma unroll
    for (int j = 0; j < kWidth; ++j) w[p][j] = i < packs ? to_opmath(v.v[j]) : 0.0f;
  }
}

template <typename T, int kWidth, int kPacks>
__global__ void __launch_bounds__(kThreads)
rms_norm_kernel(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ y, std::int64_t rows,
                std::int64_t columns, double inverse_columns, double eps) {
  using P = Pack<T, kWidth>;
  __shared__ double slots[2][kWarps];
  const std::int64_t packs = columns / kWidth;
  float w[kPacks][kWidth];
  load_weight<T, kWidth, kPacks>(weight, packs, w);
  int parity = 0;
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x, parity ^= 1) {
    const P* in = reinterpret_cast<const P*>(x + row * columns);
    P v[kPacks];
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const std::int64_t i = pack_index(p);
      if (i < packs) v[p] = in[i];
    }
    double squares = 0.0;
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      if (pack_index(p) >= packs) continue;
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        const double value = to_opmath(v[p].v[j]);
        squares += value * value;
      }
    }
    const float r = reciprocal_rms(block_sum(squares, slots[parity]), inverse_columns, eps);
    P* out = reinterpret_cast<P*>(y + row * columns);
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const std::int64_t i = pack_index(p);
      if (i >= packs) continue;
      P result;
#pragma unroll
      for (int j = 0; j < kWidth; ++j) result.v[j] = from_opmath<T>(w[p][j] * normalized<T>(to_opmath(v[p].v[j]), r));
      out[i] = result;
    }
  }
}

template <typename T, int kWidth, int kPacks>
__global__ void __launch_bounds__(kThreads)
rms_norm_backward_kernel(const T* __restrict__ grad_y, const T* __restrict__ x, const T* __restrict__ weight,
                         T* __restrict__ grad_x, double* __restrict__ partials, std::int64_t rows,
                         std::int64_t columns, double inverse_columns, double eps) {
  using P = Pack<T, kWidth>;
  __shared__ DoublePair slots[2][kWarps];
  const std::int64_t packs = columns / kWidth;
  float w[kPacks][kWidth];
  load_weight<T, kWidth, kPacks>(weight, packs, w);
  double weight_grad[kPacks][kWidth] = {};
  int parity = 0;
  for (std::int64_t row = blockIdx.x; row < rows; row += gridDim.x, parity ^= 1) {
    const P* in = reinterpret_cast<const P*>(x + row * columns);
    const P* grad_in = reinterpret_cast<const P*>(grad_y + row * columns);
    P v[kPacks], g[kPacks];
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const std::int64_t i = pack_index(p);
      if (i < packs) {
        v[p] = in[i];
        g[p] = grad_in[i];
      }
    }
    // The squares as the forward sums them (the same r), and sum(g w x).
    DoublePair sums{0.0, 0.0};
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      if (pack_index(p) >= packs) continue;
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        const double value = to_opmath(v[p].v[j]);
        sums.squares += value * value;
        sums.dot += static_cast<double>(to_opmath(g[p].v[j])) * w[p][j] * value;
      }
    }
    sums = block_sum(sums, slots[parity]);
    const float r = reciprocal_rms(sums.squares, inverse_columns, eps);
    const double rd = r, c = rd * rd * sums.dot * inverse_columns;
    P* out = reinterpret_cast<P*>(grad_x + row * columns);
#pragma unroll
    for (int p = 0; p < kPacks; ++p) {
      const std::int64_t i = pack_index(p);
      if (i >= packs) continue;
      P result;
#pragma unroll
      for (int j = 0; j < kWidth; ++j) {
        const float value = to_opmath(v[p].v[j]), grad = to_opmath(g[p].v[j]);
        result.v[j] = from_double<T>(rd * (static_cast<double>(grad) * w[p][j] - value * c));
        weight_grad[p][j] += static_cast<double>(grad) * normalized<T>(value, r);
      }
      out[i] = result;
    }
  }
#pragma unroll
  for (int p = 0; p < kPacks; ++p) {
    const std::int64_t i = pack_index(p);
    if (i >= packs) continue;
#pragma unroll
    for (int j = 0; j < kWidth; ++j) partials[blockIdx.x * columns + i * kWidth + j] = weight_grad[p][j];
  }
}

// grad_weight[j] = the blocks' partials of column j, rounded to T once. A block takes kSumColumns columns; each of its
// kSumSlices slices of threads adds one fixed range of the partials' rows in order, then the slices' sums are added in
// order: the same bits every run, with the loads spread over enough threads to stream the partials.
constexpr int kSumColumns = 16;
constexpr int kSumSlices = kThreads / kSumColumns;

template <typename T>
__global__ void __launch_bounds__(kThreads)
weight_grad_sum_kernel(const double* __restrict__ partials, int blocks, std::int64_t columns, T* __restrict__ out) {
  __shared__ double slice_sums[kSumSlices][kSumColumns];
  const int lane = threadIdx.x % kSumColumns, slice = threadIdx.x / kSumColumns;
  const std::int64_t column = blockIdx.x * std::int64_t{kSumColumns} + lane;
  const int per_slice = (blocks + kSumSlices - 1) / kSumSlices;
  const int begin = slice * per_slice, end = begin + per_slice < blocks ? begin + per_slice : blocks;
  double total = 0.0;
  if (column < columns) {
#pragma unroll 4
    for (int b = begin; b < end; ++b) total += partials[b * columns + column];
  }
  slice_sums[slice][lane] = total;
  __syncthreads();
  if (slice != 0 || column >= columns) return;
  double sum = slice_sums[0][lane];
#pragma unroll
  for (int s = 1; s < kSumSlices; ++s) sum += slice_sums[s][lane];
  out[column] = from_double<T>(sum);
}

int multiprocessors(int device) {
  const std::optional<int> count = once_per_device(device, [](int d) -> std::optional<int> {
    int value = 0;
    if (cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount, d) != cudaSuccess || value <= 0)
      return std::nullopt;
    return value;
  });
  return count.value_or(1);
}

int current_device() {
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess ? device : 0;
}

// Packs a thread holds for `columns` (1, 2, 4 or 8), 0 where they exceed kMaxPacks or kMaxElements.
int packs_for(std::int64_t columns, int width) {
  const std::int64_t packs = (columns / width + kThreads - 1) / kThreads;
  for (int p = 1; p <= kMaxPacks && p * width <= kMaxElements; p *= 2)
    if (packs <= p) return p;
  return 0;
}

// Calls fn with the kernel's (kWidth, kPacks) as integral constants.
template <int kWidth, typename Fn>
cudaError_t with_packs(int packs, const Fn& fn) {
  switch (packs) {
    case 1: return fn(std::integral_constant<int, kWidth>{}, std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, kWidth>{}, std::integral_constant<int, 2>{});
    case 4: return fn(std::integral_constant<int, kWidth>{}, std::integral_constant<int, 4>{});
  }
  if constexpr (8 * kWidth <= kMaxElements) {
    if (packs == 8) return fn(std::integral_constant<int, kWidth>{}, std::integral_constant<int, 8>{});
  }
  return cudaErrorInvalidValue;
}

// fn(width, packs) for the row layout: kWidth = 16 bytes where the columns fill whole packs and the pointers are
// 16-byte aligned, else 1.
template <typename T, typename Fn>
cudaError_t with_layout(std::int64_t columns, bool aligned, const Fn& fn) {
  constexpr int kWidth = common::vector_width<T>();
  if (aligned && columns % kWidth == 0) return with_packs<kWidth>(packs_for(columns, kWidth), fn);
  return with_packs<1>(packs_for(columns, 1), fn);
}

bool all_aligned(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (!common::aligned(p, 16)) return false;
  return true;
}

template <typename T>
cudaError_t forward_typed(const void* x, const void* weight, void* y, std::int64_t rows, std::int64_t columns,
                          double eps, cudaStream_t stream) {
  const std::int64_t most = std::int64_t{kBlocksPerProcessor} * multiprocessors(current_device());
  const unsigned int blocks = static_cast<unsigned int>(rows < most ? rows : most);
  return with_layout<T>(columns, all_aligned({x, weight, y}), [&](auto width, auto packs) {
    rms_norm_kernel<T, width.value, packs.value><<<blocks, kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<T*>(y), rows, columns,
        1.0 / static_cast<double>(columns), eps);
    return cudaGetLastError();
  });
}

template <typename T>
cudaError_t backward_typed(const void* grad_y, const void* x, const void* weight, void* grad_x, void* grad_weight,
                           double* partials, int blocks, std::int64_t rows, std::int64_t columns, double eps,
                           cudaStream_t stream) {
  const cudaError_t err =
      with_layout<T>(columns, all_aligned({grad_y, x, weight, grad_x}), [&](auto width, auto packs) {
        rms_norm_backward_kernel<T, width.value, packs.value><<<blocks, kThreads, 0, stream>>>(
            static_cast<const T*>(grad_y), static_cast<const T*>(x), static_cast<const T*>(weight),
            static_cast<T*>(grad_x), partials, rows, columns, 1.0 / static_cast<double>(columns), eps);
        return cudaGetLastError();
      });
  if (err != cudaSuccess) return err;
  const unsigned int sum_blocks = static_cast<unsigned int>((columns + kSumColumns - 1) / kSumColumns);
  weight_grad_sum_kernel<T><<<sum_blocks, kThreads, 0, stream>>>(partials, blocks, columns,
                                                                  static_cast<T*>(grad_weight));
  return cudaGetLastError();
}

}  // namespace

bool rms_norm_fits(ElementType type, std::int64_t columns, bool aligned) {
  const int width = type == ElementType::kFloat32 ? 4 : 8;
  if (type == ElementType::kFloat64 || columns <= 0) return false;
  return packs_for(columns, aligned && columns % width == 0 ? width : 1) != 0;
}

int rms_norm_backward_blocks(int device, std::int64_t rows) {
  const std::int64_t most = std::int64_t{kBlocksPerProcessor} * multiprocessors(device);
  return static_cast<int>(rows < most ? (rows > 0 ? rows : 1) : most);
}

cudaError_t launch_rms_norm(ElementType type, const void* x, const void* weight, void* y, std::int64_t rows,
                            std::int64_t columns, double eps, cudaStream_t stream) {
  if (rows <= 0 || columns <= 0) return cudaSuccess;
  switch (type) {
    case ElementType::kFloat32: return forward_typed<float>(x, weight, y, rows, columns, eps, stream);
    case ElementType::kFloat16: return forward_typed<__half>(x, weight, y, rows, columns, eps, stream);
    case ElementType::kBFloat16: return forward_typed<__nv_bfloat16>(x, weight, y, rows, columns, eps, stream);
    case ElementType::kFloat64: break;
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_rms_norm_backward(ElementType type, const void* grad_y, const void* x, const void* weight,
                                     void* grad_x, void* grad_weight, double* partials, int blocks, std::int64_t rows,
                                     std::int64_t columns, double eps, cudaStream_t stream) {
  if (rows <= 0 || columns <= 0) return cudaSuccess;
  switch (type) {
    case ElementType::kFloat32:
      return backward_typed<float>(grad_y, x, weight, grad_x, grad_weight, partials, blocks, rows, columns, eps,
                                   stream);
    case ElementType::kFloat16:
      return backward_typed<__half>(grad_y, x, weight, grad_x, grad_weight, partials, blocks, rows, columns, eps,
                                    stream);
    case ElementType::kBFloat16:
      return backward_typed<__nv_bfloat16>(grad_y, x, weight, grad_x, grad_weight, partials, blocks, rows, columns,
                                           eps, stream);
    case ElementType::kFloat64: break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace kernels::rms_norm
