// The autograd of the GELU (tanh approximation) family: the Autograd kernels of kernels::gelu_tanh and
// kernels::gelu_tanh_backward (defined in gelu_tanh.cpp; this file is joined after it) and the graph nodes they
// record. It reaches the ops through the dispatcher only. As the LeakyReLU family's autograd: the kernel runs below
// autograd, then a node is recorded where a gradient can flow (reverse mode) and the tangent is set where one is
// given (forward mode).
//
// gelu_tanh's gradient is gelu_tanh_backward(grad, x). gelu_tanh_backward(g, x) = g f'(x) is linear in g, with
// gradient gelu_tanh_backward(grad, x) there, and its gradient in x is grad g f''(x), computed with ATen's
// differentiable ops, so a backward of any order records a graph again.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/sigmoid.h>
#include <c10/core/GradMode.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include <mutex>
#include <string>

#include "common/autograd_node.h"
#include "gelu_tanh_math.h"
#include "gelu_tanh_op.h"

namespace kernels::gelu_tanh {
namespace {

// f''(x) of y = x sigmoid(t), t = x (kT0 + kT1 x^2): with s = sigmoid(t), w = dt/dx = kT0 + kT3 x^2,
// f'' = s (1 - s) (2 w + x w^2 (1 - 2 s) + 2 kT3 x^2). In float for float16 and bfloat16 (then x's dtype), with
// 1 - s as sigmoid(-t), which does not cancel.
at::Tensor second_derivative(const at::Tensor& x_in) {
  const bool low_precision = x_in.scalar_type() == at::kHalf || x_in.scalar_type() == at::kBFloat16;
  const at::Tensor x = low_precision ? x_in.to(at::kFloat) : x_in;
  const at::Tensor xx = x * x;
  const at::Tensor t = x * (xx * kT1 + kT0);
  const at::Tensor w = xx * kT3 + kT0;
  const at::Tensor s = at::sigmoid(t), one_minus_s = at::sigmoid(-t);
  const at::Tensor f2 = s * one_minus_s * (w * 2.0 + x * w * w * (one_minus_s - s) + xx * (2.0 * kT3));
  return low_precision ? f2.to(x_in.scalar_type()) : f2;
}

// gelu_tanh's node: grad_x = gelu_tanh_backward(grad, x).
class GeluTanhGrad final : public torch::autograd::Node {
 public:
  explicit GeluTanhGrad(const at::Tensor& x) : x_(x, /*is_output=*/false) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    torch::autograd::variable_list grad_inputs(1);
    if (grads[0].defined() && should_compute_output(0)) {
      grad_inputs[0] = gelu_tanh_backward_op().call(grads[0], x_.unpack());
    }
    return grad_inputs;
  }

  std::string name() const override { return "kernels::GeluTanhBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    x_.reset_data();
  }

 private:
  torch::autograd::SavedVariable x_;
};

// gelu_tanh_backward's node: grad_grad_output = gelu_tanh_backward(grad, x), grad_x = grad * grad_output * f''(x).
class GeluTanhBackwardGrad final : public torch::autograd::Node {
 public:
  GeluTanhBackwardGrad(const at::Tensor& grad_output, const at::Tensor& x)
      : grad_output_(grad_output, /*is_output=*/false), x_(x, /*is_output=*/false) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    torch::autograd::variable_list grad_inputs(2);
    if (!grads[0].defined()) return grad_inputs;
    const at::Tensor x = x_.unpack();
    if (should_compute_output(0)) grad_inputs[0] = gelu_tanh_backward_op().call(grads[0], x);
    if (should_compute_output(1)) grad_inputs[1] = grads[0] * grad_output_.unpack() * second_derivative(x);
    return grad_inputs;
  }

  std::string name() const override { return "kernels::GeluTanhBackwardBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    grad_output_.reset_data();
    x_.reset_data();
  }

 private:
  torch::autograd::SavedVariable grad_output_;
  torch::autograd::SavedVariable x_;
};

at::Tensor gelu_tanh_autograd(c10::DispatchKeySet keys, const at::Tensor& x) {
  at::Tensor y = common::redispatch_below_autograd(gelu_tanh_op(), keys, x);
  if (c10::GradMode::is_enabled() && x.requires_grad()) {
    auto node = common::make_node<GeluTanhGrad>(x);
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::create_gradient_edge(y, std::move(node));
  }
  const at::Tensor& tangent = x._fw_grad(/*level=*/0);
  if (tangent.defined()) {
    y._set_fw_grad(gelu_tanh_backward_op().call(tangent, common::primal_of(x)), /*level=*/0, /*is_inplace_op=*/false);
  }
  return y;
}

at::Tensor gelu_tanh_backward_autograd(c10::DispatchKeySet keys, const at::Tensor& grad_output, const at::Tensor& x) {
  at::Tensor grad_input = common::redispatch_below_autograd(gelu_tanh_backward_op(), keys, grad_output, x);
  if (c10::GradMode::is_enabled() && (grad_output.requires_grad() || x.requires_grad())) {
    auto node = common::make_node<GeluTanhBackwardGrad>(grad_output, x);
    node->set_next_edges(torch::autograd::collect_next_edges(grad_output, x));
    torch::autograd::create_gradient_edge(grad_input, std::move(node));
  }
  const at::Tensor& grad_output_tangent = grad_output._fw_grad(/*level=*/0);
  const at::Tensor& x_tangent = x._fw_grad(/*level=*/0);
  if (grad_output_tangent.defined() || x_tangent.defined()) {
    const at::Tensor x_primal = common::primal_of(x);
    at::Tensor tangent;
    if (grad_output_tangent.defined()) tangent = gelu_tanh_backward_op().call(grad_output_tangent, x_primal);
    if (x_tangent.defined()) {
      const at::Tensor through_x = x_tangent * common::primal_of(grad_output) * second_derivative(x_primal);
      tangent = tangent.defined() ? tangent + through_x : through_x;
    }
    grad_input._set_fw_grad(tangent, /*level=*/0, /*is_inplace_op=*/false);
  }
  return grad_input;
}

}  // namespace
}  // namespace kernels::gelu_tanh

TORCH_LIBRARY_IMPL(kernels, Autograd, m) {
  m.impl("gelu_tanh", &kernels::gelu_tanh::gelu_tanh_autograd);
  m.impl("gelu_tanh_backward", &kernels::gelu_tanh::gelu_tanh_backward_autograd);
}
