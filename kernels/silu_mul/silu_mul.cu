// The SwiGLU gate, y = silu(gate) * up, forward and backward, one memory-bound pass each: each operand read once and
// each result written once (the two element-wise kernels and the product's saved silu output of eager's
// `act_fn(gate) * up` fold away). Math in double, each result rounded once: at least as accurate as eager's float
// roundings, and the double arithmetic stays under the memory time (kernels/silu_mul/NOTES.md).
// - Vectorized path: every pointer 16-byte aligned; two 16-byte packs per operand per thread, all loaded before any
//   is computed; the n % width tail done by block 0.
// - Scalar path: any other alignment, 4 elements per thread.
#include "silu_mul.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/elementwise.cuh"

namespace kernels::silu_mul {
namespace {

using common::aligned;
using common::for_each_pack;
using common::from_double;
using common::OpMath;
using common::Pack;
using common::to_opmath;
using common::vector_width;
constexpr int kThreads = common::kElementwiseThreads;

template <int kWidth> __host__ __device__ constexpr int unroll() { return kWidth == 1 ? 4 : 2; }

template <typename T> __device__ __forceinline__ double in_double(T v) { return static_cast<double>(to_opmath(v)); }

__device__ __forceinline__ double sigmoid(double g) { return 1.0 / (1.0 + exp(-g)); }

template <typename T>
__device__ __forceinline__ T silu_times(T gate, T up) {
  const double g = in_double(gate);
  return from_double<T>(g * sigmoid(g) * in_double(up));
}

template <typename T>
__device__ __forceinline__ void gradients(T grad, T gate, T up, T& grad_gate, T& grad_up) {
  const double dy = in_double(grad), g = in_double(gate), sigma = sigmoid(g);
  grad_up = from_double<T>(dy * (g * sigma));
  grad_gate = from_double<T>(dy * in_double(up) * sigma * (1.0 + g * (1.0 - sigma)));
}

template <typename T, int kWidth>
__global__ void __launch_bounds__(kThreads)
silu_mul_kernel(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ y, std::int64_t n) {
  using P = Pack<T, kWidth>;
  constexpr int kUnroll = unroll<kWidth>();
  for_each_pack<kWidth, kUnroll>(
      n,
      [&](const std::int64_t (&index)[kUnroll]) {
        P g[kUnroll], u[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          if (index[k] < 0) continue;
          g[k] = reinterpret_cast<const P*>(gate)[index[k]];
          u[k] = reinterpret_cast<const P*>(up)[index[k]];
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          if (index[k] < 0) continue;
          P out;
#pragma unroll
          for (int j = 0; j < kWidth; ++j) out.v[j] = silu_times(g[k].v[j], u[k].v[j]);
          reinterpret_cast<P*>(y)[index[k]] = out;
        }
      },
      [&](std::int64_t i) { y[i] = silu_times(gate[i], up[i]); });
}

template <typename T, int kWidth>
__global__ void __launch_bounds__(kThreads)
silu_mul_backward_kernel(const T* __restrict__ grad_y, const T* __restrict__ gate, const T* __restrict__ up,
                         T* __restrict__ grad_gate, T* __restrict__ grad_up, std::int64_t n) {
  using P = Pack<T, kWidth>;
  constexpr int kUnroll = unroll<kWidth>();
  for_each_pack<kWidth, kUnroll>(
      n,
      [&](const std::int64_t (&index)[kUnroll]) {
        P dy[kUnroll], g[kUnroll], u[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          if (index[k] < 0) continue;
          dy[k] = reinterpret_cast<const P*>(grad_y)[index[k]];
          g[k] = reinterpret_cast<const P*>(gate)[index[k]];
          u[k] = reinterpret_cast<const P*>(up)[index[k]];
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          if (index[k] < 0) continue;
          P to_gate, to_up;
#pragma unroll
          for (int j = 0; j < kWidth; ++j) gradients(dy[k].v[j], g[k].v[j], u[k].v[j], to_gate.v[j], to_up.v[j]);
          reinterpret_cast<P*>(grad_gate)[index[k]] = to_gate;
          reinterpret_cast<P*>(grad_up)[index[k]] = to_up;
        }
      },
      [&](std::int64_t i) { gradients(grad_y[i], gate[i], up[i], grad_gate[i], grad_up[i]); });
}

template <int kWidth> unsigned int grid_for(std::int64_t n) {
  return common::elementwise_grid<kWidth, unroll<kWidth>()>(n);
}

template <typename T>
cudaError_t forward_typed(const void* gate, const void* up, void* y, std::int64_t n, cudaStream_t stream) {
  constexpr int kWidth = vector_width<T>();
  const T* g = static_cast<const T*>(gate);
  const T* u = static_cast<const T*>(up);
  T* out = static_cast<T*>(y);
  if (aligned(gate, 16) && aligned(up, 16) && aligned(y, 16)) {
    silu_mul_kernel<T, kWidth><<<grid_for<kWidth>(n), kThreads, 0, stream>>>(g, u, out, n);
  } else {
    silu_mul_kernel<T, 1><<<grid_for<1>(n), kThreads, 0, stream>>>(g, u, out, n);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward_typed(const void* grad_y, const void* gate, const void* up, void* grad_gate, void* grad_up,
                           std::int64_t n, cudaStream_t stream) {
  constexpr int kWidth = vector_width<T>();
  const T* dy = static_cast<const T*>(grad_y);
  const T* g = static_cast<const T*>(gate);
  const T* u = static_cast<const T*>(up);
  T* to_gate = static_cast<T*>(grad_gate);
  T* to_up = static_cast<T*>(grad_up);
  if (aligned(grad_y, 16) && aligned(gate, 16) && aligned(up, 16) && aligned(grad_gate, 16) && aligned(grad_up, 16)) {
    silu_mul_backward_kernel<T, kWidth><<<grid_for<kWidth>(n), kThreads, 0, stream>>>(dy, g, u, to_gate, to_up, n);
  } else {
    silu_mul_backward_kernel<T, 1><<<grid_for<1>(n), kThreads, 0, stream>>>(dy, g, u, to_gate, to_up, n);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_silu_mul(ElementType type, const void* gate, const void* up, void* y, std::int64_t n,
                            cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (type) {
    case ElementType::kFloat32: return forward_typed<float>(gate, up, y, n, stream);
    case ElementType::kFloat64: return forward_typed<double>(gate, up, y, n, stream);
    case ElementType::kFloat16: return forward_typed<__half>(gate, up, y, n, stream);
    case ElementType::kBFloat16: return forward_typed<__nv_bfloat16>(gate, up, y, n, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_silu_mul_backward(ElementType type, const void* grad_y, const void* gate, const void* up,
                                     void* grad_gate, void* grad_up, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (type) {
    case ElementType::kFloat32: return backward_typed<float>(grad_y, gate, up, grad_gate, grad_up, n, stream);
    case ElementType::kFloat64: return backward_typed<double>(grad_y, gate, up, grad_gate, grad_up, n, stream);
    case ElementType::kFloat16: return backward_typed<__half>(grad_y, gate, up, grad_gate, grad_up, n, stream);
    case ElementType::kBFloat16:
      return backward_typed<__nv_bfloat16>(grad_y, gate, up, grad_gate, grad_up, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kernels::silu_mul
