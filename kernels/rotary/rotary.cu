// The rotary embedding of q and k, forward and backward: one memory-bound pass over both (each element read once and
// written once; the angles, shared by every head, come from L2), where eager's `q * cos + rotate_half(q) * sin` runs
// five element-wise kernels for each of q and k (the halves' negation and concatenation among them) and its backward
// as many. Math in double, each result then rounded to the type: at least as accurate as eager's float roundings.
// Two kernels, one arithmetic (rotate_pair): where every row and the angles are 16-byte aligned and dense along the
// head dim (the projections' outputs viewed as heads are), rotary_rows_kernel takes a token's heads of q and k in
// groups that share the token's angles, each lane 16 bytes of each half of a row, several rows in flight at once;
// elsewhere (any strides) rotary_kernel takes two rows a warp, a lane pairs (i, i + half) of both. Both load every
// value before they store any result.
#include "rotary.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "common/elementwise.cuh"

namespace kernels::rotary {
namespace {

using common::from_double;
using common::vector_width;
using common::to_opmath;
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

template <typename T> __device__ __forceinline__ double in_double(T v) { return static_cast<double>(to_opmath(v)); }

// The rotation of one pair (x[i], x[i + half]) with its angles, in double (products of two float32 or half values
// are exact there: one rounding in the fma, one to the type); the transposed map for the gradient.
template <bool kTransposed>
__device__ __forceinline__ void rotate_pair(double a1, double a2, double cos1, double cos2, double sin1, double sin2,
                                            double& y1, double& y2) {
  y1 = kTransposed ? fma(a1, cos1, a2 * sin2) : fma(a1, cos1, -(a2 * sin1));
  y2 = kTransposed ? fma(a2, cos2, -(a1 * sin1)) : fma(a2, cos2, a1 * sin2);
}

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
        double y1, y2;
        rotate_pair<kTransposed>(in_double(x1[r][p]), in_double(x2[r][p]), in_double(c1[r][p]), in_double(c2[r][p]),
                                 in_double(s1[r][p]), in_double(s2[r][p]), y1, y2);
        out[r][i * os] = from_double<T>(y1);
        out[r][(i + half) * os] = from_double<T>(y2);
      }
    }
  }
}

// (A minimum of one block: otherwise ptxas caps the float16 kernel for sm_80 at 64 registers, which spills.)
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

// ---- the packed kernel: a token's heads in groups sharing its angles, 16 bytes a load --------------------------------

template <typename T>
using Pack = common::Pack<T, common::vector_width<T>()>;  // 16 bytes

template <typename T>
__device__ __forceinline__ const Pack<T>* packed(const T* p) { return reinterpret_cast<const Pack<T>*>(p); }
template <typename T>
__device__ __forceinline__ Pack<T>* packed(T* p) { return reinterpret_cast<Pack<T>*>(p); }

constexpr int kPassesPerGroup = 4;  // rows a lane holds at once (each pass: 32 / packs-per-half rows a warp)

// The shape of a work item: a head group of one (batch, token), q's heads then k's counted as one list of rows.
struct Groups {
  std::int64_t tokens, q_heads, k_heads;
  std::int64_t groups_per_token;  // ceil((q_heads + k_heads) / rows_per_group)
  int packs_per_half;             // half / vector_width<T>(), at most 32
  int rows_per_pass;              // 32 / packs_per_half
};

// Every row's and the angles' elements dense along the head dim, their starts 16-byte aligned (rotary_rows_fits).
template <typename T, bool kTransposed>
__global__ void __launch_bounds__(kThreads)
rotary_rows_kernel(Rows<T> q, Rows<T> k, AnglesOf<T> angles, Groups groups, std::int64_t items) {
  constexpr int kPack = vector_width<T>();
  const int lane = threadIdx.x % 32;
  const int slot = lane / groups.packs_per_half, pack = lane % groups.packs_per_half;
  if (slot >= groups.rows_per_pass) return;  // lanes past the last whole row of a pass (no barrier below)
  const std::int64_t half = q.dim / 2, column = static_cast<std::int64_t>(pack) * kPack;
  const std::int64_t rows_per_group = static_cast<std::int64_t>(groups.rows_per_pass) * kPassesPerGroup;
  const std::int64_t heads = groups.q_heads + groups.k_heads;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  for (std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; item < items;
       item += warps) {
    const std::int64_t group = item % groups.groups_per_token, bt = item / groups.groups_per_token;
    const std::int64_t token = bt % groups.tokens, batch = bt / groups.tokens;
    const std::int64_t angle_row =
        (angles.batch == 1 ? 0 : batch) * angles.batch_stride + token * angles.token_stride + column;
    const Pack<T> c1 = *packed(angles.cos + angle_row), c2 = *packed(angles.cos + angle_row + half);
    const Pack<T> s1 = *packed(angles.sin + angle_row), s2 = *packed(angles.sin + angle_row + half);
    Pack<T> x1[kPassesPerGroup], x2[kPassesPerGroup];
    T* out[kPassesPerGroup];
#pragma unroll
    for (int r = 0; r < kPassesPerGroup; ++r) {
      const std::int64_t head = group * rows_per_group + r * groups.rows_per_pass + slot;
      out[r] = nullptr;
      if (head >= heads) continue;
      const bool of_q = head < groups.q_heads;
      const Rows<T>& rows = of_q ? q : k;
      const std::int64_t h = of_q ? head : head - groups.q_heads;
      const T* in = rows.in + batch * rows.batch_stride + h * rows.head_stride + token * rows.token_stride + column;
      out[r] = rows.out + batch * rows.out_batch_stride + h * rows.out_head_stride + token * rows.out_token_stride +
               column;
      x1[r] = *packed(in);
      x2[r] = *packed(in + half);
    }
#pragma unroll
    for (int r = 0; r < kPassesPerGroup; ++r) {
      if (out[r] == nullptr) continue;
      Pack<T> y1, y2;
#pragma unroll
      for (int e = 0; e < kPack; ++e) {
        double r1, r2;
        rotate_pair<kTransposed>(in_double(x1[r].v[e]), in_double(x2[r].v[e]), in_double(c1.v[e]),
                                 in_double(c2.v[e]), in_double(s1.v[e]), in_double(s2.v[e]), r1, r2);
        y1.v[e] = from_double<T>(r1);
        y2.v[e] = from_double<T>(r2);
      }
      *packed(out[r]) = y1;
      *packed(out[r] + half) = y2;
    }
  }
}

// Whether a tensor's rows start 16-byte aligned and are dense along the head dim (strides of dims of one element
// are never used: any is fine).
bool rows_are_packed(const void* data, std::int64_t pack, std::initializer_list<std::pair<std::int64_t, std::int64_t>>
                                                                 sizes_and_strides,
                     std::int64_t dim_size, std::int64_t dim_stride) {
  if (reinterpret_cast<std::uintptr_t>(data) % 16 != 0 || (dim_size > 1 && dim_stride != 1)) return false;
  for (const auto& [size, stride] : sizes_and_strides)
    if (size > 1 && stride % pack != 0) return false;
  return true;
}

bool heads_are_packed(const Heads& h, std::int64_t pack) {
  return rows_are_packed(h.data, pack, {{h.batch, h.batch_stride}, {h.heads, h.head_stride}, {h.tokens, h.token_stride}},
                         h.dim, h.dim_stride);
}

// The packed kernel's conditions: halves of whole packs, at most 32 packs a half, and every row packed.
bool rotary_rows_fits(std::int64_t element_bytes, const Heads& q, const Heads& k, const Angles& angles,
                      const Heads& q_out, const Heads& k_out) {
  const std::int64_t pack = 16 / element_bytes, half = q.dim / 2;
  if (half % pack != 0 || half / pack > 32) return false;
  const std::int64_t angle_batch_stride = angles.batch > 1 ? angles.batch_stride : 0;
  return heads_are_packed(q, pack) && heads_are_packed(k, pack) && heads_are_packed(q_out, pack) &&
         heads_are_packed(k_out, pack) &&
         rows_are_packed(angles.cos, pack, {{angles.batch, angle_batch_stride}, {q.tokens, angles.token_stride}}, q.dim,
                         angles.dim_stride) &&
         rows_are_packed(angles.sin, pack, {{angles.batch, angle_batch_stride}, {q.tokens, angles.token_stride}}, q.dim,
                         angles.dim_stride);
}

template <typename T>
Rows<T> rows_of(const Heads& h, const Heads& out) {
  return Rows<T>{static_cast<const T*>(h.data), static_cast<T*>(const_cast<void*>(out.data)), h.heads, h.tokens,
                 h.dim, h.batch_stride, h.head_stride, h.token_stride, h.dim_stride, out.batch_stride,
                 out.head_stride, out.token_stride, out.dim_stride};
}

unsigned blocks_for(std::int64_t items) {
  const std::int64_t needed = (items + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(needed < (1 << 20) ? needed : (1 << 20));  // the rest by the kernels' loops
}

template <typename T, bool kTransposed>
cudaError_t launch_typed(const Heads& q, const Heads& k, const Angles& angles, const Heads& q_out,
                         const Heads& k_out, bool generic, cudaStream_t stream) {
  const std::int64_t q_rows = q.batch * q.heads * q.tokens, k_rows = k.batch * k.heads * k.tokens;
  if (q_rows + k_rows <= 0 || q.dim <= 0) return cudaSuccess;
  const AnglesOf<T> a{static_cast<const T*>(angles.cos), static_cast<const T*>(angles.sin), angles.batch,
                      angles.batch_stride, angles.token_stride, angles.dim_stride};
  if (!generic && rotary_rows_fits(sizeof(T), q, k, angles, q_out, k_out)) {
    const int packs_per_half = static_cast<int>(q.dim / 2 / vector_width<T>());
    Groups groups{q.tokens, q.heads, k.heads, 0, packs_per_half, 32 / packs_per_half};
    const std::int64_t rows_per_group = static_cast<std::int64_t>(groups.rows_per_pass) * kPassesPerGroup;
    groups.groups_per_token = (q.heads + k.heads + rows_per_group - 1) / rows_per_group;
    const std::int64_t items = q.batch * q.tokens * groups.groups_per_token;
    rotary_rows_kernel<T, kTransposed><<<blocks_for(items), kThreads, 0, stream>>>(
        rows_of<T>(q, q_out), rows_of<T>(k, k_out), a, groups, items);
    return cudaGetLastError();
  }
  const std::int64_t items = (q_rows + kRowsPerWarp - 1) / kRowsPerWarp + (k_rows + kRowsPerWarp - 1) / kRowsPerWarp;
  rotary_kernel<T, kTransposed><<<blocks_for(items), kThreads, 0, stream>>>(rows_of<T>(q, q_out),
                                                                            rows_of<T>(k, k_out), a, q_rows, k_rows);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const Heads& q, const Heads& k, const Angles& angles, const Heads& q_out,
                         const Heads& k_out, bool transposed, bool generic, cudaStream_t stream) {
  return transposed ? launch_typed<T, true>(q, k, angles, q_out, k_out, generic, stream)
                    : launch_typed<T, false>(q, k, angles, q_out, k_out, generic, stream);
}

}  // namespace

cudaError_t launch_rotary_embedding(ElementType type, const Heads& q, const Heads& k, const Angles& angles,
                                    const Heads& q_out, const Heads& k_out, bool transposed, bool generic,
                                    cudaStream_t stream) {
  if (q.dim % 2 != 0 || k.dim != q.dim || k.batch != q.batch || k.tokens != q.tokens ||
      (angles.batch != 1 && angles.batch != q.batch))
    return cudaErrorInvalidValue;
  switch (type) {
    case ElementType::kFloat32: return launch_typed<float>(q, k, angles, q_out, k_out, transposed, generic, stream);
    case ElementType::kFloat64: return launch_typed<double>(q, k, angles, q_out, k_out, transposed, generic, stream);
    case ElementType::kFloat16: return launch_typed<__half>(q, k, angles, q_out, k_out, transposed, generic, stream);
    case ElementType::kBFloat16:
      return launch_typed<__nv_bfloat16>(q, k, angles, q_out, k_out, transposed, generic, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kernels::rotary
