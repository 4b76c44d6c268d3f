// The autograd of the causal softmax family: Autograd kernels of causal_softmax and causal_softmax_backward (defined in
// causal_softmax.cpp) and their graph nodes, reaching the ops through the dispatcher only, so higher orders record
// again. With y = causal_softmax(s, scale), g = scale * y * (dy - <dy, y>) on unmasked entries (<.,.> a row's sum):
// - s's gradient is g, and so is y's tangent for ds (softmax's Jacobian is symmetric);
// - dy's gradient is causal_softmax_backward(gg, y, scale) (g is linear in dy by the same map);
// - y's gradient is scale * (gg * dy - <dy, y> gg - <gg, y> dy), and g's tangent for a tangent y_t of y is
//   scale * (y_t * dy - <dy, y> y_t - <dy, y_t> y), both 0 on masked entries.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <mutex>
#include <string>

#include "causal_softmax_op.h"
#include "common/autograd_node.h"

namespace kernels::causal_softmax {
namespace {

// t with its masked entries zeroed.
at::Tensor unmasked(const at::Tensor& t, const at::Tensor& mask) { return t.masked_fill(mask, 0); }

// The gradient of causal_softmax_backward(dy, y, scale) with respect to y, for its gradient gg: scale * (gg * dy -
// <dy, y> gg - <gg, y> dy) on the unmasked entries, 0 on the masked ones (g does not depend on y there).
at::Tensor output_gradient(const at::Tensor& gg, const at::Tensor& dy, const at::Tensor& y, double scale) {
  const at::Tensor mask = masked_entries(y);
  const at::Tensor g = unmasked(gg, mask), d = unmasked(dy, mask), out = unmasked(y, mask);
  const at::Tensor dy_dot_y = d.mul(out).sum(-1, true), gg_dot_y = g.mul(out).sum(-1, true);
  return unmasked(g.mul(d).sub(g.mul(dy_dot_y)).sub(d.mul(gg_dot_y)).mul(scale), mask);
}

// The tangent of causal_softmax_backward(dy, y, scale) for a tangent y_t of y: scale * (y_t * dy - <dy, y> y_t -
// <dy, y_t> y) on the unmasked entries, 0 on the masked ones.
at::Tensor output_tangent(const at::Tensor& y_t, const at::Tensor& dy, const at::Tensor& y, double scale) {
  const at::Tensor mask = masked_entries(y);
  const at::Tensor t = unmasked(y_t, mask), d = unmasked(dy, mask), out = unmasked(y, mask);
  const at::Tensor dy_dot_y = d.mul(out).sum(-1, true), dy_dot_t = d.mul(t).sum(-1, true);
  return unmasked(t.mul(d).sub(t.mul(dy_dot_y)).sub(out.mul(dy_dot_t)).mul(scale), mask);
}

// The node of causal_softmax: the scores' gradient from the saved output.
class CausalSoftmaxGrad final : public torch::autograd::Node {
 public:
  explicit CausalSoftmaxGrad(double scale) : scale_(scale) {}

  // Keeps the op's output, after this node is its grad_fn (autograd's saved-output rules: version checked,
  // saved-tensor hooks applied).
  void save_output(const at::Tensor& output) { output_ = torch::autograd::SavedVariable(output, /*is_output=*/true); }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    torch::autograd::variable_list grad_inputs(1);
    if (grads[0].defined() && should_compute_output(0)) {
      grad_inputs[0] =
          causal_softmax_backward_op().call(grads[0], output_.unpack(common::holder_of(this)), scale_);
    }
    return grad_inputs;
  }

  std::string name() const override { return "kernels::CausalSoftmaxBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    output_.reset_data();
  }

 private:
  torch::autograd::SavedVariable output_;
  double scale_;
};

// The node of causal_softmax_backward: the gradients of grad_output and output.
class CausalSoftmaxBackwardGrad final : public torch::autograd::Node {
 public:
  CausalSoftmaxBackwardGrad(const at::Tensor& grad_output, const at::Tensor& output, double scale)
      : grad_output_(grad_output, /*is_output=*/false), output_(output, /*is_output=*/false), scale_(scale) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    torch::autograd::variable_list grad_inputs(2);
    if (!grads[0].defined()) return grad_inputs;
    const at::Tensor output = output_.unpack();
    if (should_compute_output(0)) grad_inputs[0] = causal_softmax_backward_op().call(grads[0], output, scale_);
    if (should_compute_output(1)) grad_inputs[1] = output_gradient(grads[0], grad_output_.unpack(), output, scale_);
    return grad_inputs;
  }

  std::string name() const override { return "kernels::CausalSoftmaxBackwardBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    grad_output_.reset_data();
    output_.reset_data();
  }

 private:
  torch::autograd::SavedVariable grad_output_;
  torch::autograd::SavedVariable output_;
  double scale_;
};

at::Tensor causal_softmax_autograd(c10::DispatchKeySet keys, const at::Tensor& scores, double scale) {
  at::Tensor output = common::redispatch_below_autograd(causal_softmax_op(), keys, scores, scale);
  common::NodePtr node;
  if (c10::GradMode::is_enabled() && scores.requires_grad()) {
    node = common::make_node<CausalSoftmaxGrad>(scale);
    node->set_next_edges(torch::autograd::collect_next_edges(scores));
    torch::autograd::create_gradient_edge(output, node);
  }
  const at::Tensor& tangent = scores._fw_grad(/*level=*/0);
  if (tangent.defined()) {
    output._set_fw_grad(causal_softmax_backward_op().call(tangent, common::primal_of(output), scale), /*level=*/0,
                        /*is_inplace_op=*/false);
  }
  // Saved once its tangent is set, as ATen's nodes save outputs: a backward run under forward mode (a forward-over-
  // reverse Hessian) then reads the output with its tangent.
  if (node) static_cast<CausalSoftmaxGrad*>(node.get())->save_output(output);
  return output;
}

at::Tensor causal_softmax_backward_autograd(c10::DispatchKeySet keys, const at::Tensor& grad_output,
                                            const at::Tensor& output, double scale) {
  at::Tensor grad_scores =
      common::redispatch_below_autograd(causal_softmax_backward_op(), keys, grad_output, output, scale);
  if (c10::GradMode::is_enabled() && (grad_output.requires_grad() || output.requires_grad())) {
    auto node = common::make_node<CausalSoftmaxBackwardGrad>(grad_output, output, scale);
    node->set_next_edges(torch::autograd::collect_next_edges(grad_output, output));
    torch::autograd::create_gradient_edge(grad_scores, std::move(node));
  }
  const at::Tensor& dy_tangent = grad_output._fw_grad(/*level=*/0);
  const at::Tensor& y_tangent = output._fw_grad(/*level=*/0);
  if (dy_tangent.defined() || y_tangent.defined()) {
    const at::Tensor dy = common::primal_of(grad_output), y = common::primal_of(output);
    at::Tensor tangent;
    if (dy_tangent.defined()) tangent = causal_softmax_backward_op().call(dy_tangent, y, scale);
    if (y_tangent.defined()) {
      const at::Tensor term = output_tangent(y_tangent, dy, y, scale);
      tangent = tangent.defined() ? tangent.add(term) : term;
    }
    grad_scores._set_fw_grad(tangent, /*level=*/0, /*is_inplace_op=*/false);
  }
  return grad_scores;
}

}  // namespace
}  // namespace kernels::causal_softmax

TORCH_LIBRARY_IMPL(kernels, Autograd, m) {
  m.impl("causal_softmax", &kernels::causal_softmax::causal_softmax_autograd);
  m.impl("causal_softmax_backward", &kernels::causal_softmax::causal_softmax_backward_autograd);
}
