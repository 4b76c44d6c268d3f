// GELU with the tanh approximation, forward and backward, one memory-bound pass each (the formula in
// gelu_tanh_math.h). Each element is read once and written once, so the kernels aim at the device-to-device copy rate.
// - Vectorized path: every pointer 16-byte aligned. Each thread moves two 16-byte packs per operand, both loaded
//   before either is computed, so that the loads stay in flight through the arithmetic (kernels/gelu_tanh/NOTES.md);
//   the n % kWidth elements past the last pack are done by block 0.
// - Scalar path: any other alignment (a view such as x[1:]), kUnroll = 4 elements per thread, all loads issued
//   before the first store so that they are in flight together.
// Indices are 64-bit: tensors of 2^31 or more elements are fine. One block per tile, striding if the grid is capped.
#include "gelu_tanh.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/elementwise.cuh"

#include "gelu_tanh_math.h"

namespace kernels::gelu_tanh {
namespace {

using common::aligned;
using common::for_each_pack;
using common::from_opmath;
using common::OpMath;
using common::Pack;
using common::to_opmath;
using common::vector_width;
constexpr int kThreads = common::kElementwiseThreads;

// Packs per thread: two 16-byte packs; scalar accesses are 4 to 8 times smaller, so the unaligned path keeps 4.
template <int kWidth> __host__ __device__ constexpr int unroll() { return kWidth == 1 ? 4 : 2; }
// float16 and bfloat16 results take the approximate division (gelu_tanh_math.h, divide()).
template <typename T> __host__ __device__ constexpr bool fast_divide() { return sizeof(T) == 2; }

template <typename T, int kWidth>
__global__ void __launch_bounds__(kThreads)
gelu_tanh_kernel(const T* __restrict__ x, T* __restrict__ y, std::int64_t n) {
  using Op = typename OpMath<T>::type;
  using P = Pack<T, kWidth>;
  constexpr int kUnroll = unroll<kWidth>();
  const auto apply = [](T in) { return from_opmath<T>(gelu_tanh_element<Op, fast_divide<T>()>(to_opmath(in))); };
  for_each_pack<kWidth, unroll<kWidth>()>(
      n,
      [&](const std::int64_t (&index)[kUnroll]) {
        P in[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k)
          if (index[k] >= 0) in[k] = reinterpret_cast<const P*>(x)[index[k]];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          if (index[k] < 0) continue;
          P out;
#pragma unroll
          for (int j = 0; j < kWidth; ++j) out.v[j] = apply(in[k].v[j]);
          reinterpret_cast<P*>(y)[index[k]] = out;
        }
      },
      [&](std::int64_t i) { y[i] = apply(x[i]); });
}

template <typename T, int kWidth>
__global__ void __launch_bounds__(kThreads)
gelu_tanh_backward_kernel(const T* __restrict__ grad_output, const T* __restrict__ x, T* __restrict__ grad_input,
                          std::int64_t n) {
  using Op = typename OpMath<T>::type;
  using P = Pack<T, kWidth>;
  constexpr int kUnroll = unroll<kWidth>();
  const auto apply = [](T g, T in) {
    return from_opmath<T>(gelu_tanh_backward_element<Op, fast_divide<T>()>(to_opmath(g), to_opmath(in)));
  };
  for_each_pack<kWidth, unroll<kWidth>()>(
      n,
      [&](const std::int64_t (&index)[kUnroll]) {
        P grads[kUnroll], in[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          if (index[k] < 0) continue;
          grads[k] = reinterpret_cast<const P*>(grad_output)[index[k]];
          in[k] = reinterpret_cast<const P*>(x)[index[k]];
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          if (index[k] < 0) continue;
          P out;
#pragma unroll
          for (int j = 0; j < kWidth; ++j) out.v[j] = apply(grads[k].v[j], in[k].v[j]);
          reinterpret_cast<P*>(grad_input)[index[k]] = out;
        }
      },
      [&](std::int64_t i) { grad_input[i] = apply(grad_output[i], x[i]); });
}


template <int kWidth> unsigned int grid_for(std::int64_t n) {
  return common::elementwise_grid<kWidth, unroll<kWidth>()>(n);
}

template <typename T>
cudaError_t gelu_tanh_typed(const void* x, void* y, std::int64_t n, cudaStream_t stream) {
  constexpr int kWidth = vector_width<T>();
  const T* in = static_cast<const T*>(x);
  T* out = static_cast<T*>(y);
  if (aligned(x, 16) && aligned(y, 16)) {
    gelu_tanh_kernel<T, kWidth><<<grid_for<kWidth>(n), kThreads, 0, stream>>>(in, out, n);
  } else {
    gelu_tanh_kernel<T, 1><<<grid_for<1>(n), kThreads, 0, stream>>>(in, out, n);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t gelu_tanh_backward_typed(const void* grad_output, const void* x, void* grad_input, std::int64_t n,
                                     cudaStream_t stream) {
  constexpr int kWidth = vector_width<T>();
  const T* g = static_cast<const T*>(grad_output);
  const T* in = static_cast<const T*>(x);
  T* out = static_cast<T*>(grad_input);
  if (aligned(grad_output, 16) && aligned(x, 16) && aligned(grad_input, 16)) {
    gelu_tanh_backward_kernel<T, kWidth><<<grid_for<kWidth>(n), kThreads, 0, stream>>>(g, in, out, n);
  } else {
    gelu_tanh_backward_kernel<T, 1><<<grid_for<1>(n), kThreads, 0, stream>>>(g, in, out, n);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gelu_tanh(ElementType type, const void* x, void* y, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (type) {
    case ElementType::kFloat32: return gelu_tanh_typed<float>(x, y, n, stream);
    case ElementType::kFloat64: return gelu_tanh_typed<double>(x, y, n, stream);
    case ElementType::kFloat16: return gelu_tanh_typed<__half>(x, y, n, stream);
    case ElementType::kBFloat16: return gelu_tanh_typed<__nv_bfloat16>(x, y, n, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_gelu_tanh_backward(ElementType type, const void* grad_output, const void* x, void* grad_input,
                                      std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (type) {
    case ElementType::kFloat32: return gelu_tanh_backward_typed<float>(grad_output, x, grad_input, n, stream);
    case ElementType::kFloat64: return gelu_tanh_backward_typed<double>(grad_output, x, grad_input, n, stream);
    case ElementType::kFloat16: return gelu_tanh_backward_typed<__half>(grad_output, x, grad_input, n, stream);
    case ElementType::kBFloat16:
      return gelu_tanh_backward_typed<__nv_bfloat16>(grad_output, x, grad_input, n, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kernels::gelu_tanh
