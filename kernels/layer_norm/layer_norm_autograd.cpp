// The autograd of the LayerNorm family: the Autograd kernels of layer_norm, add_layer_norm and layer_norm_backward
// (defined in layer_norm.cpp; this file is joined after it) and the forwards' graph nodes. A first-order backward runs
// the layer_norm_backward kernels; where a graph of the backward is asked for (create_graph) or a forward-mode tangent
// is given, the ATen formulas of layer_norm_op.h run at autograd's level instead, so ATen's own derivatives record the
// higher orders and carry the tangents.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
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
        c10::GradMode::is_enabled()
            ? layer_norm_backward_aten(grads[0], x_.unpack(), weight_.unpack(), eps_)
            : layer_norm_backward_op().call(grads[0], x_.unpack(), weight_.unpack(), eps_, std::nullopt);
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

// add_layer_norm's node: with sum = x + residual and y = layer_norm(sum), x and the residual both get grad_sum plus
// layer_norm's grad_x, added by the backward kernel before it rounds (no separate sum of a residual's two gradients).
class AddLayerNormGrad final : public torch::autograd::Node {
 public:
  AddLayerNormGrad(const at::Tensor& weight, double eps) : weight_(weight, /*is_output=*/false), eps_(eps) {}

  // Keeps the op's sum: after this node is its grad_fn (autograd's saved-output rules) where it is this node's output.
  void save_sum(const at::Tensor& sum, bool is_output) { sum_ = torch::autograd::SavedVariable(sum, is_output); }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    torch::autograd::variable_list grad_inputs(4);
    const at::Tensor& grad_sum = grads[0];
    const at::Tensor& grad_y = grads[1];
    at::Tensor grad_input = grad_sum, grad_weight, grad_bias;
    if (grad_y.defined()) {
      const at::Tensor sum = sum_.unpack(common::holder_of(this));
      std::tie(grad_input, grad_weight, grad_bias) =
          c10::GradMode::is_enabled()
              ? layer_norm_backward_aten(grad_y, sum, weight_.unpack(), eps_, grad_sum)
              : layer_norm_backward_op().call(grad_y, sum, weight_.unpack(), eps_,
                                              grad_sum.defined() ? std::optional<at::Tensor>(grad_sum) : std::nullopt);
    }
    if (should_compute_output(0)) grad_inputs[0] = grad_input;
    if (should_compute_output(1)) grad_inputs[1] = grad_input;
    if (should_compute_output(2)) grad_inputs[2] = grad_weight;
    if (should_compute_output(3)) grad_inputs[3] = grad_bias;
    return grad_inputs;
  }

  std::string name() const override { return "kernels::AddLayerNormBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    sum_.reset_data();
    weight_.reset_data();
  }

 private:
  torch::autograd::SavedVariable sum_;
  torch::autograd::SavedVariable weight_;
  double eps_;
};

std::tuple<at::Tensor, at::Tensor> add_layer_norm_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                                           const at::Tensor& residual, const at::Tensor& weight,
                                                           const at::Tensor& bias, double eps) {
  if (has_tangent(x) || has_tangent(residual) || has_tangent(weight) || has_tangent(bias)) {
    at::Tensor sum = x.add(residual).contiguous();  // contiguous, as the kernels' and the fakes' sums
    return {sum, layer_norm_aten(sum, weight, bias, eps)};
  }
  auto [sum, y] = common::redispatch_below_autograd(add_layer_norm_op(), keys, x, residual, weight, bias, eps);
  if (c10::GradMode::is_enabled() &&
      (x.requires_grad() || residual.requires_grad() || weight.requires_grad() || bias.requires_grad())) {
    auto node = common::make_node<AddLayerNormGrad>(weight, eps);
    node->set_next_edges(torch::autograd::collect_next_edges(x, residual, weight, bias));
    // The sum requires grad only where x or the residual does, as eager's x + residual; its slot stays the node's
    // input 0 either way.
    const bool sum_grad = x.requires_grad() || residual.requires_grad();
    if (sum_grad) {
      torch::autograd::create_gradient_edge(sum, node);
    } else {
      node->add_input_metadata(torch::autograd::Node::undefined_input());
    }
    torch::autograd::create_gradient_edge(y, node);
    node->save_sum(sum, /*is_output=*/sum_grad);
  }
  return {sum, y};
}

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

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_autograd(
    c10::DispatchKeySet keys, const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, double eps,
    const std::optional<at::Tensor>& grad_residual) {
  const at::Tensor residual = grad_residual.has_value() ? *grad_residual : at::Tensor();
  const bool residual_differentiated =
      residual.defined() && ((c10::GradMode::is_enabled() && residual.requires_grad()) || has_tangent(residual));
  const bool differentiated = (c10::GradMode::is_enabled() &&
                               (grad_y.requires_grad() || x.requires_grad() || weight.requires_grad())) ||
                              has_tangent(grad_y) || has_tangent(x) || has_tangent(weight) || residual_differentiated;
  if (differentiated) return layer_norm_backward_aten(grad_y, x, weight, eps, residual);
  return common::redispatch_below_autograd(layer_norm_backward_op(), keys, grad_y, x, weight, eps, grad_residual);
}

}  // namespace
}  // namespace kernels::layer_norm

TORCH_LIBRARY_IMPL(kernels, Autograd, m) {
  m.impl("layer_norm", &kernels::layer_norm::layer_norm_autograd);
  m.impl("add_layer_norm", &kernels::layer_norm::add_layer_norm_autograd);
  m.impl("layer_norm_backward", &kernels::layer_norm::layer_norm_backward_autograd);
}
