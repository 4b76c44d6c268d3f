// Element-wise LeakyReLU kernels, forward and backward: leaky_relu (y = leaky_relu(x, slope)), and for the GEMM's
// cuBLAS path (through kernels::multiply_leaky_relu_ and kernels::leaky_relu_backward) y = leaky_relu(y * multiplier,
// slope) in place and grad_pre = (positive ? g : g * slope) * multiplier. Memory-bound, aiming at the copy rate.
// - Vectorized path: every pointer 16-byte aligned (the mask kWidth-byte aligned), one 16-byte pack per operand and
//   thread (unroll()); block 0 does the n % kWidth tail elements.
// - Scalar path: any other alignment (a view such as x[1:]), kUnroll = 4 elements per thread, loads before stores.
// 64-bit indices (2^31 elements and more); blocks stride over tiles. Arithmetic in float (double for double) as ATen's,
// so results are bitwise F.leaky_relu's: NaN, Inf, -0.0 and any slope included.
#include "leaky_relu.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/elementwise.cuh"

namespace kernels::leaky_relu {
namespace {

using common::aligned;
using common::for_each_pack;
using common::from_opmath;
using common::OpMath;
using common::Pack;
using common::to_opmath;
using common::vector_width;
constexpr int kThreads = common::kElementwiseThreads;

template <int kWidth> struct alignas(kWidth) MaskPack { std::uint8_t v[kWidth]; };

// Packs per thread: one 16-byte pack already reaches the copy rate, more only lose (measured:
// kernels/leaky_relu/NOTES.md); scalar accesses are smaller, so that path keeps 4 in flight.
template <int kWidth> __host__ __device__ constexpr int unroll() { return kWidth == 1 ? 4 : 1; }

template <typename T, int kWidth, bool kMultiply, bool kMask>
__global__ void __launch_bounds__(kThreads)
multiply_leaky_relu_kernel(const T* __restrict__ x, T* __restrict__ y, std::uint8_t* __restrict__ mask,
                        std::int64_t n, typename OpMath<T>::type multiplier, typename OpMath<T>::type slope) {
  using Op = typename OpMath<T>::type;
  using P = Pack<T, kWidth>;
  using M = MaskPack<kWidth>;
  constexpr int kUnroll = unroll<kWidth>();
  auto apply = [&](T in, T& out, std::uint8_t& positive) {
    Op v = to_opmath(in);
    if (kMultiply) v = v * multiplier;
    positive = v > Op(0);
    out = from_opmath<T>(positive ? v : v * slope);
  };
  for_each_pack<kWidth, unroll<kWidth>()>(
      n,
      [&](const std::int64_t (&index)[kUnroll]) {
        P packs[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k)
          if (index[k] >= 0) packs[k] = reinterpret_cast<const P*>(x)[index[k]];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          if (index[k] < 0) continue;
          P out;
          M positive;
#pragma unroll
          for (int j = 0; j < kWidth; ++j) apply(packs[k].v[j], out.v[j], positive.v[j]);
          reinterpret_cast<P*>(y)[index[k]] = out;
          if (kMask) reinterpret_cast<M*>(mask)[index[k]] = positive;
        }
      },
      [&](std::int64_t i) {
        std::uint8_t positive;
        apply(x[i], y[i], positive);
        if (kMask) mask[i] = positive;
      });
}

template <typename T, int kWidth, bool kMultiply, bool kMask>
__global__ void __launch_bounds__(kThreads)
leaky_relu_backward_kernel(const T* __restrict__ grad_out, const T* __restrict__ saved,
                           const std::uint8_t* __restrict__ mask, T* __restrict__ grad_in, std::int64_t n,
                           typename OpMath<T>::type multiplier, typename OpMath<T>::type slope) {
  using Op = typename OpMath<T>::type;
  using P = Pack<T, kWidth>;
  using M = MaskPack<kWidth>;
  constexpr int kUnroll = unroll<kWidth>();
  auto apply = [&](T g, bool positive) {
    Op v = to_opmath(g);
    v = positive ? v : v * slope;
    if (kMultiply) v = v * multiplier;
    return from_opmath<T>(v);
  };
  for_each_pack<kWidth, unroll<kWidth>()>(
      n,
      [&](const std::int64_t (&index)[kUnroll]) {
        P grads[kUnroll];
        P saved_packs[kUnroll];
        M mask_packs[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          if (index[k] < 0) continue;
          grads[k] = reinterpret_cast<const P*>(grad_out)[index[k]];
          if (kMask) {
            mask_packs[k] = reinterpret_cast<const M*>(mask)[index[k]];
          } else {
            saved_packs[k] = reinterpret_cast<const P*>(saved)[index[k]];
          }
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          if (index[k] < 0) continue;
          P out;
#pragma unroll
          for (int j = 0; j < kWidth; ++j) {
            const bool positive = kMask ? mask_packs[k].v[j] != 0 : to_opmath(saved_packs[k].v[j]) > Op(0);
            out.v[j] = apply(grads[k].v[j], positive);
          }
          reinterpret_cast<P*>(grad_in)[index[k]] = out;
        }
      },
      [&](std::int64_t i) {
        const bool positive = kMask ? mask[i] != 0 : to_opmath(saved[i]) > Op(0);
        grad_in[i] = apply(grad_out[i], positive);
      });
}


template <int kWidth> unsigned int grid_for(std::int64_t n) {
  return common::elementwise_grid<kWidth, unroll<kWidth>()>(n);
}

template <typename T, int kWidth>
cudaError_t multiply_leaky_relu_width(const void* x, void* y, std::uint8_t* mask, std::int64_t n,
                                      double multiplier, double slope, cudaStream_t stream) {
  using Op = typename OpMath<T>::type;
  const T* in = static_cast<const T*>(x);
  T* out = static_cast<T*>(y);
  const unsigned int grid = grid_for<kWidth>(n);
  const Op s = static_cast<Op>(multiplier), ns = static_cast<Op>(slope);
  const auto launch = [&](auto kernel) { kernel<<<grid, kThreads, 0, stream>>>(in, out, mask, n, s, ns); };
  // Multiplying by 1 is exact except for NaN payloads; skipping it keeps the plain activation bitwise F.leaky_relu.
  if (multiplier == 1.0) {
    if (mask) launch(multiply_leaky_relu_kernel<T, kWidth, false, true>);
    else launch(multiply_leaky_relu_kernel<T, kWidth, false, false>);
  } else {
    if (mask) launch(multiply_leaky_relu_kernel<T, kWidth, true, true>);
    else launch(multiply_leaky_relu_kernel<T, kWidth, true, false>);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t multiply_leaky_relu_typed(const void* x, void* y, std::uint8_t* mask, std::int64_t n,
                                      double multiplier, double slope, cudaStream_t stream) {
  constexpr int kWidth = vector_width<T>();
  if (aligned(x, 16) && aligned(y, 16) && aligned(mask, kWidth))
    return multiply_leaky_relu_width<T, kWidth>(x, y, mask, n, multiplier, slope, stream);
  return multiply_leaky_relu_width<T, 1>(x, y, mask, n, multiplier, slope, stream);
}

template <typename T, int kWidth>
cudaError_t leaky_relu_backward_width(const void* grad_out, const void* saved, const std::uint8_t* mask,
                                      void* grad_in, std::int64_t n, double multiplier, double slope,
                                      cudaStream_t stream) {
  using Op = typename OpMath<T>::type;
  const T* g = static_cast<const T*>(grad_out);
  const T* s_in = static_cast<const T*>(saved);
  T* out = static_cast<T*>(grad_in);
  const unsigned int grid = grid_for<kWidth>(n);
  const Op s = static_cast<Op>(multiplier), ns = static_cast<Op>(slope);
  const auto launch = [&](auto kernel) { kernel<<<grid, kThreads, 0, stream>>>(g, s_in, mask, out, n, s, ns); };
  if (multiplier == 1.0) {
    if (mask) launch(leaky_relu_backward_kernel<T, kWidth, false, true>);
    else launch(leaky_relu_backward_kernel<T, kWidth, false, false>);
  } else {
    if (mask) launch(leaky_relu_backward_kernel<T, kWidth, true, true>);
    else launch(leaky_relu_backward_kernel<T, kWidth, true, false>);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t leaky_relu_backward_typed(const void* grad_out, const void* saved, const std::uint8_t* mask,
                                      void* grad_in, std::int64_t n, double multiplier, double slope,
                                      cudaStream_t stream) {
  constexpr int kWidth = vector_width<T>();
  if (aligned(grad_out, 16) && aligned(saved, 16) && aligned(grad_in, 16) && aligned(mask, kWidth))
    return leaky_relu_backward_width<T, kWidth>(grad_out, saved, mask, grad_in, n, multiplier, slope, stream);
  return leaky_relu_backward_width<T, 1>(grad_out, saved, mask, grad_in, n, multiplier, slope, stream);
}

}  // namespace

cudaError_t launch_multiply_leaky_relu(ElementType type, const void* x, void* y, std::uint8_t* positive,
                                       std::int64_t n, double multiplier, double negative_slope,
                                       cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (type) {
    case ElementType::kFloat32:
      return multiply_leaky_relu_typed<float>(x, y, positive, n, multiplier, negative_slope, stream);
    case ElementType::kFloat64:
      return multiply_leaky_relu_typed<double>(x, y, positive, n, multiplier, negative_slope, stream);
    case ElementType::kFloat16:
      return multiply_leaky_relu_typed<__half>(x, y, positive, n, multiplier, negative_slope, stream);
    case ElementType::kBFloat16:
      return multiply_leaky_relu_typed<__nv_bfloat16>(x, y, positive, n, multiplier, negative_slope, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_leaky_relu_backward(ElementType type, const void* grad_out, const void* saved,
                                       const std::uint8_t* mask, void* grad_in, std::int64_t n, double multiplier,
                                       double negative_slope, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  switch (type) {
    case ElementType::kFloat32:
      return leaky_relu_backward_typed<float>(grad_out, saved, mask, grad_in, n, multiplier, negative_slope, stream);
    case ElementType::kFloat64:
      return leaky_relu_backward_typed<double>(grad_out, saved, mask, grad_in, n, multiplier, negative_slope, stream);
    case ElementType::kFloat16:
      return leaky_relu_backward_typed<__half>(grad_out, saved, mask, grad_in, n, multiplier, negative_slope, stream);
    case ElementType::kBFloat16:
      return leaky_relu_backward_typed<__nv_bfloat16>(grad_out, saved, mask, grad_in, n, multiplier, negative_slope,
                                                      stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kernels::leaky_relu
