// The rotary embedding of q and k, forward and backward: one memory-bound pass over both (each element read once and
// written once; the angles, shared by every head, come from L2), where eager's `q * cos + rotate_half(q) * sin` runs
// five element-wise kernels for each of q and k (the halves' negation and concatenation among them) and its backward
// as many. Math in double, each result then rounded to the type: at least as accurate as eager's float roundings.
// A warp takes two rows (a head's token: dim elements each) at once, a lane pairs (i, i + half) of both, every value
// loaded before any result is stored; rows of q, then rows of k.
#include "rotary.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common/elementwise.cuh"

namespace kernels::rotary {
namespace {

using common::from_double;
using common::to_opmath;
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

template <typename T> __device__ __forceinline__ double in_double(T v) { return static_cast<double>(to_opmath(v)); }

// One operand's rows as the kernel walks them: its input and its output, each with its own strides.
template <typename T>
struct Rows {
  const T* in;
  T* out;
  std::int64_t heads, tokens, dim;
  std::int64_t batch_stride, head_stride, token_stride, dim_stride;
  std::int64_t out_batch_stride, out_head_stride, out_token_stride, out_dim_stride;
};

template <typename T>
struct AnglesOf {
  const T* cos;
  const T* sin;
  std::int64_t batch, batch_stride, token_stride, dim_stride;
};

constexpr int kRowsPerWarp = 2;   // rows a warp takes at once
constexpr int kPairsPerLane = 2;  // pairs a lane loads from each of them before it stores any (64 pairs: dim 128)

// Rows first .. first + kRowsPerWarp - 1 of `rows` (those below `end`; batch, head, token in that order) rotated into
// their output rows. Every value is loaded before any result is stored, so that a lane has all its loads in flight
// at once (the outputs may alias nothing, but the compiler cannot know it).
template <typename T, bool kTransposed>
__device__ __forceinline__ void rotate_rows(const Rows<T>& rows, const AnglesOf<T>& angles, std::int64_t first,
                                            std::int64_t end, int lane) {
  const T* in[kRowsPerWarp];
  const T* cos[kRowsPerWarp];
  const T* sin[kRowsPerWarp];
  T* out[kRowsPerWarp];
  bool live[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const std::int64_t row = first + r;
    live[r] = row < end;
    const std::int64_t token = row % rows.tokens, bh = row / rows.tokens;
    const std::int64_t head = bh % rows.heads, batch = bh / rows.heads;
    in[r] = rows.in + batch * rows.batch_stride + head * rows.head_stride + token * rows.token_stride;
    out[r] = rows.out + batch * rows.out_batch_stride + head * rows.out_head_stride + token * rows.out_token_stride;
    const std::int64_t angle_row = (angles.batch == 1 ? 0 : batch) * angles.batch_stride + token * angles.token_stride;
    cos[r] = angles.cos + angle_row;
    sin[r] = angles.sin + angle_row;
  }
  const std::int64_t half = rows.dim / 2, ds = rows.dim_stride, os = rows.out_dim_stride, as = angles.dim_stride;
  for (std::int64_t base = 0; base < half; base += 32 * kPairsPerLane) {
    T x1[kRowsPerWarp][kPairsPerLane], x2[kRowsPerWarp][kPairsPerLane], c1[kRowsPerWarp][kPairsPerLane],
        c2[kRowsPerWarp][kPairsPerLane], s1[kRowsPerWarp][kPairsPerLane], s2[kRowsPerWarp][kPairsPerLane];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
      for (int p = 0; p < kPairsPerLane; ++p) {
        const std::int64_t i = base + lane + 32 * p;
        if (!live[r] || i >= half) continue;
        x1[r][p] = in[r][i * ds];
        x2[r][p] = in[r][(i + half) * ds];
        c1[r][p] = cos[r][i * as];
        c2[r][p] = cos[r][(i + half) * as];
        s1[r][p] = sin[r][i * as];
        s2[r][p] = sin[r][(i + half) * as];
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
      for (int p = 0; p < kPairsPerLane; ++p) {
        const std::int64_t i = base + lane + 32 * p;
        if (!live[r] || i >= half) continue;
        const double a1 = in_double(x1[r][p]), a2 = in_double(x2[r][p]);
        const double cos1 = in_double(c1[r][p]), cos2 = in_double(c2[r][p]);
        const double sin1 = in_double(s1[r][p]), sin2 = in_double(s2[r][p]);
        // Products of two float32 (or half) values are exact in double: one rounding in the fma, one to T.
        const double y1 = kTransposed ? fma(a1, cos1, a2 * sin2) : fma(a1, cos1, -(a2 * sin1));
        const double y2 = kTransposed ? fma(a2, cos2, -(a1 * sin1)) : fma(a2, cos2, a1 * sin2);
        out[r][i * os] = from_double<T>(y1);
        out[r][(i + half) * os] = from_double<T>(y2);
      }
    }
  }
}

// (A minimum of one block: without it ptxas kept the float16 kernel for sm_80 at 64 registers and spilled.)
template <typename T, bool kTransposed>
__global__ void __launch_bounds__(kThreads, 1)
rotary_kernel(Rows<T> q, Rows<T> k, AnglesOf<T> angles, std::int64_t q_rows, std::int64_t k_rows) {
  // Work items: q's rows kRowsPerWarp at a time, then k's.
  const std::int64_t q_items = (q_rows + kRowsPerWarp - 1) / kRowsPerWarp;
  const std::int64_t items = q_items + (k_rows + kRowsPerWarp - 1) / kRowsPerWarp;
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  for (std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; item < items;
       item += warps) {
    if (item < q_items)
      rotate_rows<T, kTransposed>(q, angles, item * kRowsPerWarp, q_rows, lane);
    else
      rotate_rows<T, kTransposed>(k, angles, (item - q_items) * kRowsPerWarp, k_rows, lane);
  }
}

template <typename T>
Rows<T> rows_of(const Heads& h, const Heads& out) {
  return Rows<T>{static_cast<const T*>(h.data), static_cast<T*>(const_cast<void*>(out.data)), h.heads, h.tokens,
                 h.dim, h.batch_stride, h.head_stride, h.token_stride, h.dim_stride, out.batch_stride,
                 out.head_stride, out.token_stride, out.dim_stride};
}

template <typename T>
cudaError_t launch_typed(const Heads& q, const Heads& k, const Angles& angles, const Heads& q_out,
                         const Heads& k_out, bool transposed, cudaStream_t stream) {
  const std::int64_t q_rows = q.batch * q.heads * q.tokens, k_rows = k.batch * k.heads * k.tokens;
  if (q_rows + k_rows <= 0 || q.dim <= 0) return cudaSuccess;
  const std::int64_t items = (q_rows + kRowsPerWarp - 1) / kRowsPerWarp + (k_rows + kRowsPerWarp - 1) / kRowsPerWarp;
  const std::int64_t needed = (items + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const unsigned blocks = static_cast<unsigned>(needed < (1 << 20) ? needed : (1 << 20));  // the rest by the loop
  const AnglesOf<T> a{static_cast<const T*>(angles.cos), static_cast<const T*>(angles.sin), angles.batch,
                      angles.batch_stride, angles.token_stride, angles.dim_stride};
  if (transposed)
    rotary_kernel<T, true><<<blocks, kThreads, 0, stream>>>(rows_of<T>(q, q_out), rows_of<T>(k, k_out), a, q_rows,
                                                            k_rows);
  else
    rotary_kernel<T, false><<<blocks, kThreads, 0, stream>>>(rows_of<T>(q, q_out), rows_of<T>(k, k_out), a, q_rows,
                                                             k_rows);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rotary_embedding(ElementType type, const Heads& q, const Heads& k, const Angles& angles,
                                    const Heads& q_out, const Heads& k_out, bool transposed, cudaStream_t stream) {
  if (q.dim % 2 != 0 || k.dim != q.dim || k.batch != q.batch || k.tokens != q.tokens ||
      (angles.batch != 1 && angles.batch != q.batch))
    return cudaErrorInvalidValue;
  switch (type) {
    case ElementType::kFloat32: return launch_typed<float>(q, k, angles, q_out, k_out, transposed, stream);
    case ElementType::kFloat64: return launch_typed<double>(q, k, angles, q_out, k_out, transposed, stream);
    case ElementType::kFloat16: return launch_typed<__half>(q, k, angles, q_out, k_out, transposed, stream);
    case ElementType::kBFloat16:
      return launch_typed<__nv_bfloat16>(q, k, angles, q_out, k_out, transposed, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kernels::rotary
