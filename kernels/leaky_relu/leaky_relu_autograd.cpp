// The autograd of the LeakyReLU family: the Autograd kernels of kernels::leaky_relu and kernels::leaky_relu_backward
// (defined in leaky_relu.cpp, joined after it into the family's unit) and the graph node they record. It reaches
// the ops through the dispatcher only. Its header, torch/csrc/autograd/function.h (common/autograd_node.h), is the
// unit's heaviest: with ATen's per-operator headers (the loader's build flags) it adds about 4 s of parsing on a
// 2-core machine.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <mutex>
#include <string>

#include "common/autograd_node.h"
#include "leaky_relu_op.h"

namespace kernels::leaky_relu {
namespace {

// Both differentiable ops map one input through the same slopes: leaky_relu maps x, leaky_relu_backward maps
// grad_output, each scaled by the slope (and the multiplier) at the sign of `saved` (x itself for leaky_relu; the
// saved activation or mask for leaky_relu_backward). Each is linear in that input, so its gradient and its tangent
// are leaky_relu_backward(., saved, negative_slope, multiplier) of the incoming gradient or tangent, and saved's
// own gradient is zero (it only picks the branch). The Autograd kernels run the kernel below autograd, then record
// that node where a gradient can flow and set the tangent where one is given, as VariableType does for ATen's own
// ops: recording in C++ keeps a small call with x requiring grad near eager's host time (a Python
// autograd.Function costs more than eager's whole call). The node calls the op through the dispatcher, so a
// double backward records the same node again, to any order.

class LeakyReLUGrad final : public torch::autograd::Node {
 public:
  // `name` is the node's name in grad_fn; `saved` is kept as autograd keeps an op's inputs (its version checked
  // when the backward reads it, saved-tensor hooks applied).
  LeakyReLUGrad(const char* name, const at::Tensor& saved, double negative_slope, double multiplier)
      : name_(name), saved_(saved, /*is_output=*/false), negative_slope_(negative_slope), multiplier_(multiplier) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    // saved's gradient, where it has an edge, stays undefined (zero).
    torch::autograd::variable_list grad_inputs(num_outputs());
    if (grads[0].defined() && should_compute_output(0))
      grad_inputs[0] = leaky_relu_backward_op().call(grads[0], saved_.unpack(), negative_slope_, multiplier_);
    return grad_inputs;
  }

  std::string name() const override { return name_; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    saved_.reset_data();
  }

 private:
  const char* name_;
  torch::autograd::SavedVariable saved_;
  double negative_slope_;
  double multiplier_;
};

// Records `result`'s node (next edges: `inputs`, `linear_input` first) where grad mode is on and an input requires
// grad, and sets its tangent where `linear_input` has one.
template <typename... Inputs>
void record_autograd(const char* node_name, at::Tensor& result, const at::Tensor& linear_input, const at::Tensor& saved,
                     double negative_slope, double multiplier, const Inputs&... inputs) {
  if (c10::GradMode::is_enabled() && (inputs.requires_grad() || ...)) {
    common::NodePtr node = common::make_node<LeakyReLUGrad>(node_name, saved, negative_slope, multiplier);
    node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
    torch::autograd::create_gradient_edge(result, std::move(node));
  }
  const at::Tensor& tangent = linear_input._fw_grad(/*level=*/0);
  if (tangent.defined()) {
    result._set_fw_grad(leaky_relu_backward_op().call(tangent, common::primal_of(saved), negative_slope, multiplier),
                        /*level=*/0, /*is_inplace_op=*/false);
  }
}

at::Tensor leaky_relu_autograd(c10::DispatchKeySet keys, const at::Tensor& x, double negative_slope) {
  static const auto kernel = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("kernels::leaky_relu", "")
                                 .typed<at::Tensor(const at::Tensor&, double)>();
  at::Tensor y = common::redispatch_below_autograd(kernel, keys, x, negative_slope);
  record_autograd("kernels::LeakyReLUBackward", y, x, x, negative_slope, 1.0, x);
  return y;
}

at::Tensor leaky_relu_backward_autograd(c10::DispatchKeySet keys, const at::Tensor& grad_output,
                                        const at::Tensor& saved, double negative_slope, double multiplier) {
  at::Tensor grad_input =
      common::redispatch_below_autograd(leaky_relu_backward_op(), keys, grad_output, saved, negative_slope, multiplier);
  record_autograd("kernels::LeakyReLUBackwardBackward", grad_input, grad_output, saved, negative_slope, multiplier,
                  grad_output, saved);
  return grad_input;
}

}  // namespace
}  // namespace kernels::leaky_relu

TORCH_LIBRARY_IMPL(kernels, Autograd, m) {
  m.impl("leaky_relu", &kernels::leaky_relu::leaky_relu_autograd);
  m.impl("leaky_relu_backward", &kernels::leaky_relu::leaky_relu_backward_autograd);
}
