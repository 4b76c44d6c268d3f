// The LayerNorm family's ops as C++ code calls them (through the dispatcher), and its formulas in ATen ops: the path
// of CPU tensors, float64 and rows the kernels do not take (layer_norm.cpp), and the differentiable form the autograd
// uses for higher orders and forward mode (layer_norm_autograd.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

#include "common/leading_sum.h"

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
// (contiguous); grad_weight = the sum over rows of g h, grad_bias of g, in double.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_aten(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, double eps,
    const at::Tensor& grad_residual = at::Tensor()) {
  const at::Tensor x64 = x.to(at::kDouble), g64 = grad_y.to(at::kDouble);
  const at::Tensor deviation = x64.sub(x64.mean(-1, true));
  const at::Tensor rstd = deviation.square().mean(-1, true).add(eps).rsqrt();
  const at::Tensor h = deviation.mul(rstd), gw = g64.mul(weight.to(at::kDouble));
  at::Tensor grad_x64 = rstd.mul(gw.sub(gw.mean(-1, true)).sub(h.mul(gw.mul(h).mean(-1, true))));
  if (grad_residual.defined()) grad_x64 = grad_x64.add(grad_residual.to(at::kDouble));
  const at::Tensor grad_x = grad_x64.to(x.scalar_type()).contiguous();
  const at::Tensor grad_weight = common::leading_sum(g64.mul(h)).to(weight.scalar_type());
  const at::Tensor grad_bias = common::leading_sum(g64).to(weight.scalar_type());
  return {grad_x, grad_weight, grad_bias};
}

}  // namespace kernels::layer_norm
