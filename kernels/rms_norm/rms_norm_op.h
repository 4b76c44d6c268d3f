// The RMSNorm family's ops as C++ code calls them (through the dispatcher), and its formulas in ATen ops: the path of
// CPU tensors, float64 and rows the kernels do not take (rms_norm.cpp, a block of rows at a time), and the
// differentiable form the autograd uses for higher orders and forward mode (rms_norm_autograd.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "common/leading_sum.h"
#include "common/row_blocks.h"

namespace kernels::rms_norm {

using RmsNorm = at::Tensor(const at::Tensor& x, const at::Tensor& weight, double eps);
using RmsNormBackward = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& grad_y, const at::Tensor& x,
                                                           const at::Tensor& weight, double eps);

// kernels::rms_norm, looked up once.
inline const c10::TypedOperatorHandle<RmsNorm>& rms_norm_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kernels::rms_norm", "").typed<RmsNorm>();
  return op;
}

// kernels::rms_norm_backward, looked up once.
inline const c10::TypedOperatorHandle<RmsNormBackward>& rms_norm_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernels::rms_norm_backward", "").typed<RmsNormBackward>();
  return op;
}

// The type the arithmetic is done in: float, or double for double.
inline at::ScalarType compute_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// r = 1 / sqrt(mean(x^2) + eps) over the last dimension (kept, size 1): the squares summed in double, r rounded to
// the compute type once, as the kernels compute it.
inline at::Tensor reciprocal_rms(const at::Tensor& x, double eps) {
  return x.to(at::kDouble).square().mean(-1, true).add(eps).rsqrt().to(compute_type(x));
}

// y = weight * (x r), x r rounded to x's type first (LlamaRMSNorm's hidden_states.to(input_dtype)); contiguous, as
// the kernels' results and the fakes' are.
inline at::Tensor rms_norm_aten(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return weight.mul(x.to(compute_type(x)).mul(reciprocal_rms(x, eps)).to(x.scalar_type())).contiguous();
}

// grad_x = r (g w - x r^2 mean(g w x)) in double, rounded to x's type (float16 and bfloat16 through float: rounding to
// nearest twice can land an ulp from the kernels' single rounding; contiguous); and the sum over rows of g (x r) in
// double, not yet rounded to the weight's type (so that blocks of rows can add theirs first).
inline std::tuple<at::Tensor, at::Tensor> rms_norm_backward_parts(const at::Tensor& grad_y, const at::Tensor& x,
                                                                  const at::Tensor& weight, double eps) {
  const at::Tensor r = reciprocal_rms(x, eps);
  const at::Tensor r64 = r.to(at::kDouble), x64 = x.to(at::kDouble), g64 = grad_y.to(at::kDouble);
  const at::Tensor gw = g64.mul(weight.to(at::kDouble));
  const at::Tensor c = r64.square().mul(gw.mul(x64).mean(-1, true));
  const at::Tensor grad_x = r64.mul(gw.sub(x64.mul(c))).to(x.scalar_type()).contiguous();
  const at::Tensor h = x.to(compute_type(x)).mul(r).to(x.scalar_type());
  return {grad_x, common::leading_sum(g64.mul(h.to(at::kDouble)))};
}

// (grad_x, grad_weight): the parts above, grad_weight rounded to the weight's type.
inline std::tuple<at::Tensor, at::Tensor> rms_norm_backward_aten(const at::Tensor& grad_y, const at::Tensor& x,
                                                                 const at::Tensor& weight, double eps) {
  auto [grad_x, grad_weight64] = rms_norm_backward_parts(grad_y, x, weight, eps);
  return {grad_x, grad_weight64.to(weight.scalar_type())};
}

// ---- the same formulas a block of rows at a time: the ops' path below autograd ------------------------------------
// The formulas above make several float64 temporaries of x's whole size; taken a block of rows at a time, those
// temporaries are a block's size (at least one row), whatever x's.

// rms_norm_aten's result, a block of rows at a time.
inline at::Tensor rms_norm_blocked(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return common::by_row_blocks(x, [&](const at::Tensor& rows) { return rms_norm_aten(rows, weight, eps); });
}

// rms_norm_backward_aten's results, a block of rows at a time: the blocks' weight sums added in double, then rounded
// once.
inline std::tuple<at::Tensor, at::Tensor> rms_norm_backward_blocked(const at::Tensor& grad_y, const at::Tensor& x,
                                                                    const at::Tensor& weight, double eps) {
  const int64_t columns = x.size(-1), rows = columns > 0 ? x.numel() / columns : 0;
  const int64_t block = common::rows_per_block(x, columns);
  if (rows <= block) return rms_norm_backward_aten(grad_y, x, weight, eps);
  const at::Tensor x2 = x.reshape({rows, columns}), g2 = grad_y.reshape({rows, columns});
  at::Tensor grad_x = at::empty({rows, columns}, x.options()), grad_weight64;
  for (int64_t start = 0; start < rows; start += block) {
    const int64_t n = std::min(block, rows - start);
    auto [part_x, part_weight] = rms_norm_backward_parts(g2.narrow(0, start, n), x2.narrow(0, start, n), weight, eps);
    grad_x.narrow(0, start, n).copy_(part_x);
    grad_weight64 = grad_weight64.defined() ? grad_weight64.add_(part_weight) : part_weight;
  }
  return {grad_x.view(x.sizes()), grad_weight64.to(weight.scalar_type())};
}

}  // namespace kernels::rms_norm
