// Causal softmax kernels, forward and backward (contract: causal_softmax.h): the attention scores' scale, causal mask
// and softmax of a hand-written attention block in one pass over memory. Memory-bound: a row reads its unmasked columns
// only and writes all of them, aiming at the copy rate of those bytes.
// - Register path, rows up to kBlockTeam * kMaxPerThread elements: a team per row (a warp, or a 256-thread block past a
//   warp's reach) holds the row in registers, kChunks packs of kVec per thread, so a warp's access covers 32 contiguous
//   packs. Packs are 16 bytes where every row and pointer is 16-byte aligned, else single elements.
// - Long rows: a block per row streams it, three passes forward (max, sum, write) and two backward.
// The multiply by scale is __fmul_rn, never fused into the subtraction of the max: eager rounds it on its own.
#include "causal_softmax.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace kernels::causal_softmax {
namespace {

constexpr int kBlockTeam = 256;  // threads per row on the block paths
constexpr int kMinBlockThreads = 128;
// Elements of a row per thread on the register paths: a 256-thread block holds rows of up to 8192.
constexpr int kMaxPerThread = 32;
constexpr std::int64_t kMaxBlocks = 0x7fffffff;

template <typename T> __device__ __forceinline__ float to_float(T v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T, int kVec> struct alignas(sizeof(T) * kVec) Pack { T v[kVec]; };

struct Rows {
  std::int64_t rows, query_rows, columns;
  float scale;
};

__device__ __forceinline__ std::int64_t visible_columns(std::int64_t row, const Rows& p) {
  const std::int64_t visible = row % p.query_rows + p.columns - p.query_rows + 1;
  return visible < 0 ? 0 : (visible > p.columns ? p.columns : visible);
}

struct Max {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct Add {
  __device__ __forceinline__ double operator()(double a, double b) const { return a + b; }
};

// a / b as IEEE division rounds it, from reciprocal = 1 / b (rounded; computed once per row): one Markstein
// correction of a * reciprocal. Exact but for quotients under about 2^-100 (the remainder underflows: one ulp there).
__device__ __forceinline__ float divide(float a, float b, float reciprocal) {
  const float q = __fmul_rn(a, reciprocal);
  return __fmaf_rn(__fmaf_rn(-q, b, a), reciprocal, q);
}

// a * b exactly, for a and b converted from T: in float where T has 16 bits (their significands' product fits), else
// in double.
template <typename T> __device__ __forceinline__ double exact_product(float a, float b) {
  if constexpr (sizeof(T) == 2) return static_cast<double>(a * b);
  return static_cast<double>(a) * static_cast<double>(b);
}

// v reduced over a team of kTeam threads (a warp, or the whole block), every thread getting the result. The block's
// partials are combined in one fixed order, so every thread gets the same bits. `shared`: kTeam / 32 slots.
template <int kTeam, typename R, typename Op>
__device__ __forceinline__ R team_reduce(R v, Op op, R* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if constexpr (kTeam > 32) {
    __syncthreads();  // every thread has read the slots' previous use
    if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = v;
    __syncthreads();
    v = shared[0];
#pragma unroll
    for (int w = 1; w < kTeam / 32; ++w) v = op(v, shared[w]);
  }
  return v;
}

// One row per team of kTeam threads, the row in registers (kChunks packs of kVec per thread). Forward: a = scores,
// out = output. Backward: a = grad_output, b = output, out = grad_scores. A chunk (one pack per thread) with no
// unmasked column is neither read nor computed (a test uniform across the team); the rest of the work is branch-free.
template <typename T, int kVec, int kChunks, int kTeam, bool kBackward>
__global__ void __launch_bounds__(kTeam > kMinBlockThreads ? kTeam : kMinBlockThreads, 1)
rows_in_registers_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, Rows p) {
  constexpr int kThreads = kTeam > kMinBlockThreads ? kTeam : kMinBlockThreads;
  constexpr int kTeams = kThreads / kTeam;
  constexpr int kChunkColumns = kTeam * kVec;
  using P = Pack<T, kVec>;
  __shared__ float shared_max[kTeam / 32];
  __shared__ double shared_sum[kTeam / 32];
  const int lane = threadIdx.x % kTeam;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * kTeams + threadIdx.x / kTeam;
  // Every thread of a block takes the same number of turns (kTeams == 1 where the team is the block).
  for (std::int64_t row = first; row < p.rows; row += static_cast<std::int64_t>(gridDim.x) * kTeams) {
    const int visible = static_cast<int>(visible_columns(row, p));  // <= kChunks * kChunkColumns
    const P* pa = reinterpret_cast<const P*>(a + row * p.columns) + lane;
    const P* pb = reinterpret_cast<const P*>(b + row * p.columns) + lane;
    P* po = reinterpret_cast<P*>(out + row * p.columns) + lane;
    float u[kChunks][kVec];  // forward: t = scores * scale (masked: -inf), then exp(t - max); backward: output
    float g[kBackward ? kChunks : 1][kVec];  // backward: grad_output
    const auto shown = [&](int c, int k) { return (c * kTeam + lane) * kVec + k < visible; };
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (c * kChunkColumns >= visible) continue;
      P ya, yb;
      if (shown(c, 0)) {
        ya = pa[c * kTeam];
        if (kBackward) yb = pb[c * kTeam];
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        if (kBackward) {
          g[c][k] = shown(c, k) ? to_float(ya.v[k]) : 0.0f;
          u[c][k] = shown(c, k) ? to_float(yb.v[k]) : 0.0f;
        } else {
          u[c][k] = shown(c, k) ? __fmul_rn(to_float(ya.v[k]), p.scale) : -INFINITY;
        }
      }
    }
    if constexpr (kBackward) {
      double dot = 0.0;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if (c * kChunkColumns >= visible) continue;
#pragma unroll
        for (int k = 0; k < kVec; ++k) dot += exact_product<T>(g[c][k], u[c][k]);
      }
      const float dot_f = static_cast<float>(team_reduce<kTeam>(dot, Add(), shared_sum));
      const float masked_value = 0.0f * p.scale;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if ((c * kTeam + lane) * kVec >= p.columns) continue;
        P result;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float grad = shown(c, k) ? (u[c][k] * (g[c][k] - dot_f)) * p.scale : masked_value;
          result.v[k] = from_float<T>(grad);
        }
        po[c * kTeam] = result;
      }
    } else {
      float max = -INFINITY;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if (c * kChunkColumns >= visible) continue;
#pragma unroll
        for (int k = 0; k < kVec; ++k) max = fmaxf(max, u[c][k]);
      }
      max = team_reduce<kTeam>(max, Max(), shared_max);
      // Masked entries give exp(-inf - max): 0 where the row is finite, as eager's masked_fill + softmax.
      double sum = 0.0;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if (c * kChunkColumns >= visible) continue;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          u[c][k] = expf(u[c][k] - max);
          sum += u[c][k];
        }
      }
      const float sum_f = static_cast<float>(team_reduce<kTeam>(sum, Add(), shared_sum));
      const float reciprocal = 1.0f / sum_f;
      const float masked_value = divide(expf(-INFINITY - max), sum_f, reciprocal);
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        if ((c * kTeam + lane) * kVec >= p.columns) continue;
        P result;
#pragma unroll
        for (int k = 0; k < kVec; ++k)
          result.v[k] = from_float<T>(c * kChunkColumns < visible ? divide(u[c][k], sum_f, reciprocal) : masked_value);
        po[c * kTeam] = result;
      }
    }
  }
}

// One row per block, streamed from memory: rows longer than the register path holds.
template <typename T, int kVec, bool kBackward>
__global__ void __launch_bounds__(kBlockTeam)
long_rows_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ out, Rows p) {
  using P = Pack<T, kVec>;
  __shared__ float shared_max[kBlockTeam / 32];
  __shared__ double shared_sum[kBlockTeam / 32];
  constexpr std::int64_t kStride = std::int64_t{kBlockTeam} * kVec;
  const std::int64_t start = std::int64_t{threadIdx.x} * kVec;
  for (std::int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const std::int64_t visible = visible_columns(row, p);
    const P* pa = reinterpret_cast<const P*>(a + row * p.columns);
    const P* pb = reinterpret_cast<const P*>(b + row * p.columns);
    P* po = reinterpret_cast<P*>(out + row * p.columns);
    if constexpr (kBackward) {
      double dot = 0.0;
      for (std::int64_t column = start; column < visible; column += kStride) {
        const P ga = pa[column / kVec], yb = pb[column / kVec];
#pragma unroll
        for (int k = 0; k < kVec; ++k)
          if (column + k < visible) dot += exact_product<T>(to_float(ga.v[k]), to_float(yb.v[k]));
      }
      const float dot_f = static_cast<float>(team_reduce<kBlockTeam>(dot, Add(), shared_sum));
      const float masked_value = 0.0f * p.scale;
      for (std::int64_t column = start; column < p.columns; column += kStride) {
        P ga, yb, result;
        if (column < visible) {
          ga = pa[column / kVec];
          yb = pb[column / kVec];
        }
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float y = to_float(yb.v[k]);
          result.v[k] = from_float<T>(column + k < visible ? (y * (to_float(ga.v[k]) - dot_f)) * p.scale : masked_value);
        }
        po[column / kVec] = result;
      }
    } else {
      float max = -INFINITY;
      for (std::int64_t column = start; column < visible; column += kStride) {
        const P s = pa[column / kVec];
#pragma unroll
        for (int k = 0; k < kVec; ++k)
          if (column + k < visible) max = fmaxf(max, __fmul_rn(to_float(s.v[k]), p.scale));
      }
      max = team_reduce<kBlockTeam>(max, Max(), shared_max);
      double sum = 0.0;
      for (std::int64_t column = start; column < visible; column += kStride) {
        const P s = pa[column / kVec];
#pragma unroll
        for (int k = 0; k < kVec; ++k)
          if (column + k < visible) sum += expf(__fmul_rn(to_float(s.v[k]), p.scale) - max);
      }
      const float sum_f = static_cast<float>(team_reduce<kBlockTeam>(sum, Add(), shared_sum));
      const float reciprocal = 1.0f / sum_f;
      const float masked_value = divide(expf(-INFINITY - max), sum_f, reciprocal);
      for (std::int64_t column = start; column < p.columns; column += kStride) {
        P s, result;
        if (column < visible) s = pa[column / kVec];
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float t = __fmul_rn(to_float(s.v[k]), p.scale);
          result.v[k] = from_float<T>(column + k < visible ? divide(expf(t - max), sum_f, reciprocal) : masked_value);
        }
        po[column / kVec] = result;
      }
    }
  }
}

template <int kTeam> unsigned int grid_for(std::int64_t rows) {
  constexpr int kTeams = (kTeam > kMinBlockThreads ? kTeam : kMinBlockThreads) / kTeam;
  const std::int64_t blocks = (rows + kTeams - 1) / kTeams;
  return static_cast<unsigned int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

template <typename T, int kVec, int kChunks, int kTeam, bool kBackward>
cudaError_t launch_in_registers(const T* a, const T* b, T* out, const Rows& p, cudaStream_t stream) {
  constexpr int kThreads = kTeam > kMinBlockThreads ? kTeam : kMinBlockThreads;
  rows_in_registers_kernel<T, kVec, kChunks, kTeam, kBackward><<<grid_for<kTeam>(p.rows), kThreads, 0, stream>>>(
      a, b, out, p);
  return cudaGetLastError();
}

// The smallest register configuration that holds a row: a warp with 1, 2, 4, ... packs per thread, then a
// 256-thread block, up to kMaxPerThread elements per thread either way (rows of up to 8192 elements); longer rows
// stream.
template <typename T, int kVec, int kChunks, bool kBackward>
cudaError_t launch_block_fitting(const T* a, const T* b, T* out, const Rows& p, cudaStream_t stream) {
  if constexpr (kChunks * kVec <= kMaxPerThread) {
    constexpr std::int64_t kCapacity = std::int64_t{kBlockTeam} * kVec * kChunks;
    if constexpr (kCapacity > 32 * kMaxPerThread) {  // rows a warp cannot hold
      if (p.columns <= kCapacity) return launch_in_registers<T, kVec, kChunks, kBlockTeam, kBackward>(a, b, out, p, stream);
    }
    return launch_block_fitting<T, kVec, kChunks * 2, kBackward>(a, b, out, p, stream);
  } else {
    const std::int64_t blocks = p.rows < kMaxBlocks ? p.rows : kMaxBlocks;
    long_rows_kernel<T, kVec, kBackward><<<static_cast<unsigned int>(blocks), kBlockTeam, 0, stream>>>(a, b, out, p);
    return cudaGetLastError();
  }
}

template <typename T, int kVec, int kChunks, bool kBackward>
cudaError_t launch_fitting(const T* a, const T* b, T* out, const Rows& p, cudaStream_t stream) {
  if constexpr (kChunks * kVec <= kMaxPerThread) {
    if (p.columns <= 32 * kVec * kChunks) return launch_in_registers<T, kVec, kChunks, 32, kBackward>(a, b, out, p, stream);
    return launch_fitting<T, kVec, kChunks * 2, kBackward>(a, b, out, p, stream);
  } else {
    return launch_block_fitting<T, kVec, 1, kBackward>(a, b, out, p, stream);
  }
}

bool aligned(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0; }

template <typename T, bool kBackward>
cudaError_t launch_typed(const void* a, const void* b, void* out, const Rows& p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T* ta = static_cast<const T*>(a);
  const T* tb = static_cast<const T*>(b);
  T* tout = static_cast<T*>(out);
  if (p.columns % kVec == 0 && aligned(a) && (!kBackward || aligned(b)) && aligned(out))
    return launch_fitting<T, kVec, 1, kBackward>(ta, tb, tout, p, stream);
  return launch_fitting<T, 1, 1, kBackward>(ta, tb, tout, p, stream);
}

template <bool kBackward>
cudaError_t launch(ElementType type, const void* a, const void* b, void* out, const Rows& p, cudaStream_t stream) {
  if (p.rows <= 0 || p.columns <= 0) return cudaSuccess;
  if (p.query_rows <= 0) return cudaErrorInvalidValue;
  switch (type) {
    case ElementType::kFloat32: return launch_typed<float, kBackward>(a, b, out, p, stream);
    case ElementType::kFloat16: return launch_typed<__half, kBackward>(a, b, out, p, stream);
    case ElementType::kBFloat16: return launch_typed<__nv_bfloat16, kBackward>(a, b, out, p, stream);
    case ElementType::kFloat64: break;  // the torch side's ATen path
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_causal_softmax(ElementType type, const void* scores, void* output, std::int64_t rows,
                                  std::int64_t query_rows, std::int64_t columns, float scale, cudaStream_t stream) {
  return launch<false>(type, scores, nullptr, output, Rows{rows, query_rows, columns, scale}, stream);
}

cudaError_t launch_causal_softmax_backward(ElementType type, const void* grad_output, const void* output,
                                           void* grad_scores, std::int64_t rows, std::int64_t query_rows,
                                           std::int64_t columns, float scale, cudaStream_t stream) {
  return launch<true>(type, grad_output, output, grad_scores, Rows{rows, query_rows, columns, scale}, stream);
}

}  // namespace kernels::causal_softmax
