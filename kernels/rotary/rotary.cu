// The rotary embedding of q and k, forward and backward: one memory-bound pass over both (each element read once and
// written once; the angles, shared by every head, come from L2), where eager's `q * cos + rotate_half(q) * sin` runs
// five element-wise kernels for each of q and k (the halves' negation and concatenation among them) and its backward
// as many. Math in double, each result rounded once: at least as accurate as eager's float roundings.
// A warp a row (a head's token: dim elements), a lane a pair (i, i + half), rows of q then rows of k.
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
constexpr int kRowsPerBlock = kThreads / 32;

template <typename T> __device__ __forceinline__ double in_double(T v) { return static_cast<double>(to_opmath(v)); }

// One operand's rows as the kernel walks them: its input (any strides) and its dense output.
template <typename T>
struct Rows {
  const T* in;
  T* out;
  std::int64_t heads, tokens, dim;
  std::int64_t batch_stride, head_stride, token_stride, dim_stride;
};

template <typename T>
struct AnglesOf {
  const T* cos;
  const T* sin;
  std::int64_t batch, batch_stride, token_stride, dim_stride;
};

// Row `row` of `rows` (batch, head, token in that order) rotated into its output row.
template <typename T, bool kTransposed>
__device__ __forceinline__ void rotate_row(const Rows<T>& rows, const AnglesOf<T>& angles, std::int64_t row,
                                           int lane) {
  const std::int64_t token = row % rows.tokens, bh = row / rows.tokens;
  const std::int64_t head = bh % rows.heads, batch = bh / rows.heads;
  const T* in = rows.in + batch * rows.batch_stride + head * rows.head_stride + token * rows.token_stride;
  T* out = rows.out + row * rows.dim;
  const std::int64_t angle_row = (angles.batch == 1 ? 0 : batch) * angles.batch_stride + token * angles.token_stride;
  const T* cos = angles.cos + angle_row;
  const T* sin = angles.sin + angle_row;
  const std::int64_t half = rows.dim / 2, ds = rows.dim_stride, as = angles.dim_stride;
  for (std::int64_t i = lane; i < half; i += 32) {
    const double x1 = in_double(in[i * ds]), x2 = in_double(in[(i + half) * ds]);
    const double c1 = in_double(cos[i * as]), c2 = in_double(cos[(i + half) * as]);
    const double s1 = in_double(sin[i * as]), s2 = in_double(sin[(i + half) * as]);
    // Products of two float32 (or half) values are exact in double: one rounding in the fma, one to T.
    const double y1 = kTransposed ? fma(x1, c1, x2 * s2) : fma(x1, c1, -(x2 * s1));
    const double y2 = kTransposed ? fma(x2, c2, -(x1 * s1)) : fma(x2, c2, x1 * s2);
    out[i] = from_double<T>(y1);
    out[i + half] = from_double<T>(y2);
  }
}

// (A minimum of one block: without it ptxas kept the float16 kernel for sm_80 at 64 registers and spilled.)
template <typename T, bool kTransposed>
__global__ void __launch_bounds__(kThreads, 1)
rotary_kernel(Rows<T> q, Rows<T> k, AnglesOf<T> angles, std::int64_t q_rows, std::int64_t rows) {
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kRowsPerBlock;
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32; row < rows;
       row += warps) {
    if (row < q_rows)
      rotate_row<T, kTransposed>(q, angles, row, lane);
    else
      rotate_row<T, kTransposed>(k, angles, row - q_rows, lane);
  }
}

template <typename T>
Rows<T> rows_of(const Heads& h, void* out) {
  return Rows<T>{static_cast<const T*>(h.data), static_cast<T*>(out), h.heads, h.tokens, h.dim,
                 h.batch_stride, h.head_stride, h.token_stride, h.dim_stride};
}

template <typename T>
cudaError_t launch_typed(const Heads& q, const Heads& k, const Angles& angles, void* q_out, void* k_out,
                         bool transposed, cudaStream_t stream) {
  const std::int64_t q_rows = q.batch * q.heads * q.tokens, rows = q_rows + k.batch * k.heads * k.tokens;
  if (rows <= 0 || q.dim <= 0) return cudaSuccess;
  const std::int64_t needed = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  const unsigned blocks = static_cast<unsigned>(needed < (1 << 20) ? needed : (1 << 20));  // the rest by the loop
  const AnglesOf<T> a{static_cast<const T*>(angles.cos), static_cast<const T*>(angles.sin), angles.batch,
                      angles.batch_stride, angles.token_stride, angles.dim_stride};
  if (transposed)
    rotary_kernel<T, true><<<blocks, kThreads, 0, stream>>>(rows_of<T>(q, q_out), rows_of<T>(k, k_out), a, q_rows,
                                                            rows);
  else
    rotary_kernel<T, false><<<blocks, kThreads, 0, stream>>>(rows_of<T>(q, q_out), rows_of<T>(k, k_out), a, q_rows,
                                                             rows);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rotary_embedding(ElementType type, const Heads& q, const Heads& k, const Angles& angles,
                                    void* q_out, void* k_out, bool transposed, cudaStream_t stream) {
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
