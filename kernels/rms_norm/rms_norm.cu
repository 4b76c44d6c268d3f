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

#include "common/elementwise.cuh"
#include "common/rows.cuh"

namespace kernels::rms_norm {
namespace {

using common::from_double;
using common::from_opmath;
using common::Pack;
using common::to_opmath;

constexpr int kThreads = common::kRowThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxElements = 32;  // elements a thread holds: a backward's row, weight and sums fit its registers

struct DoublePair {
  double squares, dot;
};

__device__ __forceinline__ DoublePair operator+(DoublePair a, DoublePair b) {
  return {a.squares + b.squares, a.dot + b.dot};
}

using common::shuffle_xor;

__device__ __forceinline__ DoublePair shuffle_xor(DoublePair v, int offset) {
  return {shuffle_xor(v.squares, offset), shuffle_xor(v.dot, offset)};
}

// A block's sum of one value per thread, the same bits in every thread: a warp's by shuffles (both lanes of each add
// compute the same sum), then the warps' in order (common::Rows<kThreads>::sum, specialized: one row a block). Rows
// alternate between two sets of slots, so one __syncthreads a row suffices: a warp writing row k + 2's slots has
// passed row k + 1's barrier, after every read of row k's.
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

template <typename T>
cudaError_t forward_typed(const void* x, const void* weight, void* y, std::int64_t rows, std::int64_t columns,
                          double eps, cudaStream_t stream) {
  const unsigned int blocks = static_cast<unsigned int>(common::row_blocks(common::current_device(), rows));
  return common::with_row_layout<T, kMaxElements>(columns, common::all_aligned({x, weight, y}), [&](auto width,
                                                                                                    auto packs) {
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
  const cudaError_t err = common::with_row_layout<T, kMaxElements>(
      columns, common::all_aligned({grad_y, x, weight, grad_x}), [&](auto width, auto packs) {
        rms_norm_backward_kernel<T, width.value, packs.value><<<blocks, kThreads, 0, stream>>>(
            static_cast<const T*>(grad_y), static_cast<const T*>(x), static_cast<const T*>(weight),
            static_cast<T*>(grad_x), partials, rows, columns, 1.0 / static_cast<double>(columns), eps);
        return cudaGetLastError();
      });
  if (err != cudaSuccess) return err;
  return common::launch_column_partials_sum<T>(partials, blocks, columns, 1, static_cast<T*>(grad_weight), nullptr,
                                               stream);
}

}  // namespace

bool rms_norm_fits(ElementType type, std::int64_t columns, bool aligned) {
  if (type == ElementType::kFloat64) return false;
  return common::row_fits<kMaxElements>(type == ElementType::kFloat32 ? 4 : 2, columns, aligned);
}

int rms_norm_backward_blocks(int device, std::int64_t rows) { return common::row_blocks(device, rows); }

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
