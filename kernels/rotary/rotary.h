// Host launchers of the rotary embedding kernels (rotary.cu): the only interface between them and the torch side
// (rotary.cpp). Plain C++ and the CUDA runtime only (no torch headers). Every launcher returns the launch's
// cudaError_t; it never synchronizes.
//
// The rotation of LLaMA-style attention (transformers' apply_rotary_pos_emb with unsqueeze_dim 1): for each row x of
// q and of k (batch b, head h, token t; head dim D, half = D / 2) and the angles' row c, s (cos and sin of batch b,
// or of batch 0 where they hold one, token t):
//   y[i] = x[i] c[i] - x[i + half] s[i],  y[i + half] = x[i + half] c[i + half] + x[i] s[i + half]   (forward)
//   y[i] = x[i] c[i] + x[i + half] s[i + half],  y[i + half] = x[i + half] c[i + half] - x[i] s[i]   (its gradient)
// for i < half: q * cos + rotate_half(q) * sin, and that map's transpose. The arithmetic is in double, each result
// then rounded to the element type (2-byte types through a float rounded to odd).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/element_type.h"

namespace kernels::rotary {

using common::ElementType;

// A (batch, heads, tokens, dim) tensor's sizes and strides in elements (any strides), at `data`.
struct Heads {
  const void* data;
  std::int64_t batch, heads, tokens, dim;
  std::int64_t batch_stride, head_stride, token_stride, dim_stride;
};

// cos and sin, (batch or 1, tokens, dim), the same strides in elements for both.
struct Angles {
  const void* cos;
  const void* sin;
  std::int64_t batch;
  std::int64_t batch_stride, token_stride, dim_stride;
};

// q_out and k_out: the results, of q's and k's sizes (any strides that do not overlap), written through their data.
// transposed: the gradient's map (from the outputs' gradients to the inputs'). k may have fewer heads than q
// (grouped heads); batch, tokens and dim equal, dim even. The launcher takes the packed kernel where the operands'
// layout allows (rows dense along the head dim, 16-byte aligned) and the generic one elsewhere, or always where
// `generic` (for tests: both give the same bits).
cudaError_t launch_rotary_embedding(ElementType type, const Heads& q, const Heads& k, const Angles& angles,
                                    const Heads& q_out, const Heads& k_out, bool transposed, bool generic,
                                    cudaStream_t stream);

}  // namespace kernels::rotary
