// The LayerNorm family's ops as C++ code calls them (through the dispatcher), and its formulas in ATen ops: the path
// of CPU tensors, float64 and rows the kernels do not take (layer_norm.cpp, a block of rows at a time), and the
// differentiable form the autograd uses for higher orders and forward mode (layer_norm_autograd.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>

#include "common/leading_sum.h"
#include "common/row_blocks.h"

namespace kernels::layer_norm {

using LayerNorm = at::Tensor(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps);
using AddLayerNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& x, const at::Tensor& residual,
                                                         const at::Tensor& weight, const at::Tensor& bias, double eps);
using LayerNormBackward = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, double eps,
    const std::optional<at::Tensor>& grad_residual);

// kernels::layer_norm, looked up once.
inline const c10::TypedOperatorHandle<LayerNorm>& layer_norm_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernels::layer_norm", "").typed<LayerNorm>();
  return op;
}

// kernels::add_layer_norm, looked up once.
inline const c10::TypedOperatorHandle<AddLayerNorm>& add_layer_norm_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernels::add_layer_norm", "").typed<AddLayerNorm>();
  return op;
}

// kernels::layer_norm_backward, looked up once.
inline const c10::TypedOperatorHandle<LayerNormBackward>& layer_norm_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernels::layer_norm_backward", "").typed<LayerNormBackward>();
  return op;
}

// h = (x - mean) rstd over the last dimension, in double: the mean first, then the mean of the squared deviations
// from it, as the kernels compute them.
inline at::Tensor normalized64(const at::Tensor& x64, double eps) {
  const at::Tensor deviation = x64.sub(x64.mean(-1, true));
  return deviation.mul(deviation.square().mean(-1, true).add(eps).rsqrt());
}

// y = h weight + bias in double, rounded to x's type (float16 and bfloat16 through float: rounding to nearest twice can
// land an ulp from the kernels' single rounding); contiguous, as the kernels' results and the fakes' are.
inline at::Tensor layer_norm_aten(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  return normalized64(x.to(at::kDouble), eps)
      .mul(weight.to(at::kDouble))
      .add(bias.to(at::kDouble))
      .to(x.scalar_type())
      .contiguous();
}

// grad_x = rstd (g w - mean(g w) - h mean(g w h)) in double, plus grad_residual where it is defined, rounded as y is
// (contiguous); and the sums over rows of g h and of g in double, not yet rounded to the weight's type (so that blocks
// of rows can add theirs first).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_parts(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, double eps,
    const at::Tensor& grad_residual) {
  const at::Tensor x64 = x.to(at::kDouble), g64 = grad_y.to(at::kDouble);
  const at::Tensor deviation = x64.sub(x64.mean(-1, true));
  const at::Tensor rstd = deviation.square().mean(-1, true).add(eps).rsqrt();
  const at::Tensor h = deviation.mul(rstd), gw = g64.mul(weight.to(at::kDouble));
  at::Tensor grad_x64 = rstd.mul(gw.sub(gw.mean(-1, true)).sub(h.mul(gw.mul(h).mean(-1, true))));
  if (grad_residual.defined()) grad_x64 = grad_x64.add(grad_residual.to(at::kDouble));
  const at::Tensor grad_x = grad_x64.to(x.scalar_type()).contiguous();
  return {grad_x, common::leading_sum(g64.mul(h)), common::leading_sum(g64)};
}

// (grad_x, grad_weight, grad_bias): the parts above, the sums rounded to the weight's type.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_aten(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, double eps,
    const at::Tensor& grad_residual = at::Tensor()) {
  auto [grad_x, grad_weight64, grad_bias64] = layer_norm_backward_parts(grad_y, x, weight, eps, grad_residual);
  return {grad_x, grad_weight64.to(weight.scalar_type()), grad_bias64.to(weight.scalar_type())};
}

// ---- the same formulas a block of rows at a time: the ops' path below autograd ------------------------------------
// The formulas above make several float64 temporaries of x's whole size; taken a block of rows at a time, those
// temporaries are a block's size (at least one row), whatever x's.

// layer_norm_aten's result, a block of rows at a time.
inline at::Tensor layer_norm_blocked(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                     double eps) {
  return common::by_row_blocks(x, [&](const at::Tensor& rows) { return layer_norm_aten(rows, weight, bias, eps); });
}

// layer_norm_backward_aten's results, a block of rows at a time: the blocks' parameter sums added in double, then
// rounded once.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_blocked(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, double eps,
    const at::Tensor& grad_residual) {
  const int64_t columns = x.size(-1), rows = columns > 0 ? x.numel() / columns : 0;
  const int64_t block = common::rows_per_block(x, columns);
  if (rows <= block) return layer_norm_backward_aten(grad_y, x, weight, eps, grad_residual);
  const at::Tensor x2 = x.reshape({rows, columns}), g2 = grad_y.reshape({rows, columns});
  const at::Tensor r2 = grad_residual.defined() ? grad_residual.reshape({rows, columns}) : at::Tensor();
  at::Tensor grad_x = at::empty({rows, columns}, x.options()), grad_weight64, grad_bias64;
  for (int64_t start = 0; start < rows; start += block) {
    const int64_t n = std::min(block, rows - start);
    auto [part_x, part_weight, part_bias] =
        layer_norm_backward_parts(g2.narrow(0, start, n), x2.narrow(0, start, n), weight, eps,
                                  r2.defined() ? r2.narrow(0, start, n) : at::Tensor());
    grad_x.narrow(0, start, n).copy_(part_x);
    grad_weight64 = grad_weight64.defined() ? grad_weight64.add_(part_weight) : part_weight;
    grad_bias64 = grad_bias64.defined() ? grad_bias64.add_(part_bias) : part_bias;
  }
  return {grad_x.view(x.sizes()), grad_weight64.to(weight.scalar_type()), grad_bias64.to(weight.scalar_type())};
}

}  // namespace kernels::layer_norm
