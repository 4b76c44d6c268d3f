// Host launcher of the attention kernels (attention.cu): the only interface between them and the torch side
// (attention.cpp). Plain C++ and the CUDA runtime only (no torch headers); it returns the launches' cudaError_t and
// never synchronizes.
//
// softmax(q k^T * scale, causal mask) v for float32 q (batch, heads, query rows, head dim), k and v (batch,
// kv_heads, key rows, head dim), head h reading kv head h / (heads / kv_heads), on the GEMM family's split method
// (gemm/split_numerics.cuh): each operand split into fp16 hi/lo with powers of two (per row of q and k over the head
// dim, per column of v over the keys), three fp16 products per product, accumulated in fp32. Heads whose k or v holds
// a non-finite value, or a row or column whose largest |value| lies outside [2^-40, 2^40] (the range in which the
// scores' powers of two are exact floats), and tiles of 64 query rows whose q does, are computed in plain fp32
// instead (IEEE arithmetic, as eager's sum).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#ifdef __CUDACC__
#define KERNELS_ATTENTION_HOST_DEVICE __host__ __device__
#else
#define KERNELS_ATTENTION_HOST_DEVICE
#endif

namespace kernels::attention {

constexpr int kAttentionTile = 64;  // query rows per CTA and keys per step; rows and keys padded to it

// The head dim the kernels take. The kernel is written for any multiple of 64; at 128 its registers spill
// (kernels/attention/NOTES.md), so such heads take the torch side's ATen path.
KERNELS_ATTENTION_HOST_DEVICE constexpr bool supported_head_dim(std::int64_t d) { return d == 64; }

KERNELS_ATTENTION_HOST_DEVICE constexpr std::int64_t padded(std::int64_t rows) {
  return (rows + kAttentionTile - 1) / kAttentionTile * kAttentionTile;
}

// The strides, in elements, of a (batch, heads, rows, head dim) operand whose head dim is contiguous.
struct OperandStrides {
  std::int64_t batch, head, row;
};

struct AttentionShape {
  std::int64_t batch, heads, kv_heads, query_rows, key_rows, head_dim;
};

// The workspace of one call: k's and v's splits, their powers of two and the kv heads' flags, in one allocation (q is
// split by the kernel that reads it).
struct AttentionWorkspace {
  std::int64_t k_split, v_split;  // byte offsets of each operand's hi then lo (fp16, one after the other)
  std::int64_t k_exponent, v_exponent, flags;  // int32 arrays
  std::int64_t bytes;
};

inline AttentionWorkspace attention_workspace(const AttentionShape& s) {
  const std::int64_t kv_heads = s.batch * s.kv_heads;
  const std::int64_t kv_values = kv_heads * padded(s.key_rows) * s.head_dim;
  AttentionWorkspace w{};
  std::int64_t at = 0;
  const auto take = [&at](std::int64_t bytes) {
    const std::int64_t start = at;
    at += (bytes + 255) / 256 * 256;
    return start;
  };
  w.k_split = take(2 * 2 * kv_values);
  w.v_split = take(2 * 2 * kv_values);
  w.k_exponent = take(4 * kv_heads * padded(s.key_rows));
  w.v_exponent = take(4 * kv_heads * s.head_dim);
  w.flags = take(4 * kv_heads);
  w.bytes = at;
  return w;
}

// The logsumexp rows' stride: query rows rounded up to 32, as PyTorch's memory-efficient attention lays it out.
KERNELS_ATTENTION_HOST_DEVICE constexpr std::int64_t logsumexp_stride(std::int64_t query_rows) {
  return (query_rows + 31) / 32 * 32;
}

// Whether the kernels run on `device`: sm_80 or later, with the shared memory the head dim's kernel asks for.
// Asked once per device and head dim.
bool attention_supported(int device, std::int64_t head_dim);

// out (batch, query rows, heads, head dim; out_strides over batch, head, row) = attention; logsumexp (batch, heads,
// logsumexp_stride(query rows)), if not null, the log of each row's sum of exp(scores * scale), in natural-log units.
// workspace: attention_workspace(shape).bytes bytes, 256-byte aligned. Requires sm_80 or later and
// supported_head_dim. The split kernel's products run on wgmma where the GPU is sm_90 and the library holds its sm_90a
// code, else on mma.sync; mma_sync_only: on mma.sync everywhere (the sm_80 kernel, which tests force on Hopper).
// plain_only: every head on the plain kernel (the generic path, which tests force).
cudaError_t launch_attention(const float* q, OperandStrides q_strides, const float* k, OperandStrides k_strides,
                             const float* v, OperandStrides v_strides, float* out, OperandStrides out_strides,
                             float* logsumexp, const AttentionShape& shape, bool causal, float scale,
                             bool mma_sync_only, bool plain_only, void* workspace, cudaStream_t stream);

}  // namespace kernels::attention
