// What the element-wise kernel families (leaky_relu.cu, gelu_tanh.cu) share: each element type's math type (float
// for float, half and bfloat16; double for double) and the conversions to and from it, 16-byte packs, and the loop
// that hands a block's packs to the kernel, kUnroll per thread at a time, then the n % kWidth tail to block 0.
// 64-bit indices (2^31 elements and more); blocks stride over tiles where the grid is capped. No torch headers.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace kernels::common {

constexpr int kElementwiseThreads = 128;
constexpr std::int64_t kMaxBlocks = 0x7fffffff;

template <typename T> struct OpMath { using type = float; };
template <> struct OpMath<double> { using type = double; };

template <typename T> __device__ __forceinline__ typename OpMath<T>::type to_opmath(T v) { return v; }
template <> __device__ __forceinline__ float to_opmath<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_opmath<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_opmath(typename OpMath<T>::type v) { return v; }
template <> __device__ __forceinline__ __half from_opmath<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_opmath<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// v rounded to float toward zero, its last bit set where that dropped anything (round to odd): rounding this float
// to a type of at most 22 bits rounds v itself, once. NaN stays NaN; a finite v past float's range keeps float's
// largest value, whose narrower rounding overflows as v's would.
__device__ __forceinline__ float round_to_odd_float(double v) {
  const float toward_zero = __double2float_rz(v);
  return static_cast<double>(toward_zero) == v ? toward_zero : __uint_as_float(__float_as_uint(toward_zero) | 1u);
}

// A double rounded to T once: float and double directly, float16 and bfloat16 through round_to_odd_float.
template <typename T> __device__ __forceinline__ T from_double(double v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half from_double<__half>(double v) {
  return __float2half_rn(round_to_odd_float(v));
}
template <> __device__ __forceinline__ __nv_bfloat16 from_double<__nv_bfloat16>(double v) {
  return __float2bfloat16_rn(round_to_odd_float(v));
}

// kWidth consecutive elements moved by one load or store.
template <typename T, int kWidth> struct alignas(sizeof(T) * kWidth) Pack { T v[kWidth]; };

template <typename T> __host__ __device__ constexpr int vector_width() { return 16 / sizeof(T); }

// Calls visit(index) with the kUnroll pack indices of each tile of this block (out-of-range ones are -1), so that a
// kernel can issue all its loads before any store; then block 0 calls visit_tail(i) for the n % kWidth elements past
// the last pack.
template <int kWidth, int kUnroll, typename Visit, typename VisitTail>
__device__ __forceinline__ void for_each_pack(std::int64_t n, Visit visit, VisitTail visit_tail) {
  constexpr int kThreads = kElementwiseThreads;
  const std::int64_t packs = n / kWidth;
  const std::int64_t tiles = (packs + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  for (std::int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    std::int64_t index[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const std::int64_t i = tile * kThreads * kUnroll + k * kThreads + threadIdx.x;
      index[k] = i < packs ? i : -1;
    }
    visit(index);
  }
  if (kWidth > 1 && blockIdx.x == 0) {
    const std::int64_t i = packs * kWidth + threadIdx.x;
    if (i < n) visit_tail(i);
  }
}

// The blocks for n elements at kWidth elements a pack and kUnroll packs a thread, capped (blocks then stride).
template <int kWidth, int kUnroll> unsigned int elementwise_grid(std::int64_t n) {
  const std::int64_t per_block = std::int64_t{kElementwiseThreads} * kUnroll * kWidth;
  const std::int64_t blocks = (n + per_block - 1) / per_block;
  return static_cast<unsigned int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Whether p is null or a multiple of `bytes`.
inline bool aligned(const void* p, std::uintptr_t bytes) {
  return p == nullptr || reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

}  // namespace kernels::common
