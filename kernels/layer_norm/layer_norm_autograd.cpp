// The autograd of the LayerNorm family: the Autograd kernels of layer_norm and layer_norm_backward (defined in
// layer_norm.cpp; this file is joined after it) and layer_norm's graph node. A first-order backward runs the
// layer_norm_backward kernels; where a graph of the backward is asked for (create_graph) or a forward-mode tangent is
// given, the ATen formulas of layer_norm_op.h run at autograd's level instead, so ATen's own derivatives record the
// higher orders and carry the tangents.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <mutex>
#include <string>
#include <tuple>

#include "common/autograd_node.h"
#include "layer_norm_op.h"

namespace kernels::layer_norm {
namespace {

bool has_tangent(const at::Tensor& t) { return t._fw_grad(/*level=*/0).defined(); }

// layer_norm's node: grad_x, grad_weight and grad_bias from the saved x and weight.
class LayerNormGrad final : public torch::autograd::Node {
 public:
  LayerNormGrad(const at::Tensor& x, const at::Tensor& weight, double eps)
      : x_(x, /*is_output=*/false), weight_(weight, /*is_output=*/false), eps_(eps) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    torch::autograd::variable_list grad_inputs(3);
    if (!grads[0].defined()) return grad_inputs;
    // Under create_graph the backward is itself differentiated: the ATen formulas, recorded by autograd.
    auto [grad_x, grad_weight, grad_bias] =
        c10::GradMode::is_enabled() ? layer_norm_backward_aten(grads[0], x_.unpack(), weight_.unpack(), eps_)
                                    : layer_norm_backward_op().call(grads[0], x_.unpack(), weight_.unpack(), eps_);
    if (should_compute_output(0)) grad_inputs[0] = grad_x;
    if (should_compute_output(1)) grad_inputs[1] = grad_weight;
    if (should_compute_output(2)) grad_inputs[2] = grad_bias;
    return grad_inputs;
  }

  std::string name() const override { return "kernels::LayerNormBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    x_.reset_data();
    weight_.reset_data();
  }

 private:
  torch::autograd::SavedVariable x_;
  torch::autograd::SavedVariable weight_;
  double eps_;
};

at::Tensor layer_norm_autograd(c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, double eps) {
  if (has_tangent(x) || has_tangent(weight) || has_tangent(bias)) return layer_norm_aten(x, weight, bias, eps);
  at::Tensor y = common::redispatch_below_autograd(layer_norm_op(), keys, x, weight, bias, eps);
  if (c10::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad() || bias.requires_grad())) {
    auto node = common::make_node<LayerNormGrad>(x, weight, eps);
    node->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias));
    torch::autograd::create_gradient_edge(y, std::move(node));
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_autograd(c10::DispatchKeySet keys,
                                                                            const at::Tensor& grad_y,
                                                                            const at::Tensor& x,
                                                                            const at::Tensor& weight, double eps) {
  const bool differentiated = (c10::GradMode::is_enabled() &&
                               (grad_y.requires_grad() || x.requires_grad() || weight.requires_grad())) ||
                              has_tangent(grad_y) || has_tangent(x) || has_tangent(weight);
  if (differentiated) return layer_norm_backward_aten(grad_y, x, weight, eps);
  return common::redispatch_below_autograd(layer_norm_backward_op(), keys, grad_y, x, weight, eps);
}

}  // namespace
}  // namespace kernels::layer_norm

TORCH_LIBRARY_IMPL(kernels, Autograd, m) {
  m.impl("layer_norm", &kernels::layer_norm::layer_norm_autograd);
  m.impl("layer_norm_backward", &kernels::layer_norm::layer_norm_backward_autograd);
}
