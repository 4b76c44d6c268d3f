// The rotary embedding family's ops as C++ code calls them (through the dispatcher), and its formulas in ATen ops: the
// path of CPU tensors (rotary.cpp), and the differentiable form the autograd uses for higher orders, forward mode and
// angles that need a gradient (rotary_autograd.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>

#include <tuple>

namespace kernels::rotary {

using RotaryEmbedding = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& cos, const at::Tensor& sin);

// kernels::rotary_embedding, looked up once.
inline const c10::TypedOperatorHandle<RotaryEmbedding>& rotary_embedding_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kernels::rotary_embedding", "")
                             .typed<RotaryEmbedding>();
  return op;
}

// kernels::rotary_embedding_backward, looked up once (its arguments: the outputs' gradients in q's and k's places).
inline const c10::TypedOperatorHandle<RotaryEmbedding>& rotary_embedding_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kernels::rotary_embedding_backward", "")
                             .typed<RotaryEmbedding>();
  return op;
}

// x (batch, heads, tokens, dim) rotated by the angles (batch or 1, tokens, dim), rotary.h's formulas (transposed: the
// gradient's map), in double, then rounded to x's type and laid out as x (empty_like), as the kernels' results and the
// fakes' are. float16 and bfloat16 through float: rounding to nearest twice can land an ulp from the kernels' rounding
// to odd.
inline at::Tensor rotate_aten(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool transposed) {
  const int64_t half = x.size(-1) / 2;
  const at::Tensor xd = x.to(at::kDouble), c = cos.to(at::kDouble).unsqueeze(1), s = sin.to(at::kDouble).unsqueeze(1);
  const at::Tensor x1 = xd.narrow(-1, 0, half), x2 = xd.narrow(-1, half, half);
  const at::Tensor c1 = c.narrow(-1, 0, half), c2 = c.narrow(-1, half, half);
  const at::Tensor s1 = s.narrow(-1, 0, half), s2 = s.narrow(-1, half, half);
  const at::Tensor y1 = transposed ? x1.mul(c1).add(x2.mul(s2)) : x1.mul(c1).sub(x2.mul(s1));
  const at::Tensor y2 = transposed ? x2.mul(c2).sub(x1.mul(s1)) : x2.mul(c2).add(x1.mul(s2));
  return at::empty_like(x).copy_(at::cat({y1, y2}, -1).to(x.scalar_type()));
}

inline std::tuple<at::Tensor, at::Tensor> rotary_embedding_aten(const at::Tensor& q, const at::Tensor& k,
                                                                const at::Tensor& cos, const at::Tensor& sin,
                                                                bool transposed = false) {
  return {rotate_aten(q, cos, sin, transposed), rotate_aten(k, cos, sin, transposed)};
}

}  // namespace kernels::rotary
