// The autograd of the LeakyReLU family: Autograd kernels of leaky_relu, leaky_relu_backward, leaky_relu_ and
// multiply_leaky_relu_ (defined in leaky_relu.cpp), the in-place ops' ADInplaceOrView kernels (version bumps) and the
// graph node they record; reaches the ops through the dispatcher only (joined after leaky_relu.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>  // check_inplace, rebase_history
#include <torch/library.h>

#include <mutex>
#include <string>

#include "common/autograd_node.h"
#include "common/torch_checks.h"
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
  // `name` is the node's name in grad_fn.
  LeakyReLUGrad(const char* name, double negative_slope, double multiplier)
      : name_(name), negative_slope_(negative_slope), multiplier_(multiplier) {}

  // Keeps `saved` as autograd keeps an op's input or, with is_output, its output (an in-place op's written tensor,
  // after the node is its grad_fn): its version checked when the backward reads it, saved-tensor hooks applied.
  void save(const at::Tensor& saved, bool is_output = false, bool is_inplace_on_view = false) {
    saved_ = torch::autograd::SavedVariable(saved, is_output, is_inplace_on_view);
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    torch::autograd::variable_list grad_inputs(num_outputs());
    if (!grads[0].defined()) return grad_inputs;
    if (should_compute_output(0)) {
      grad_inputs[0] = leaky_relu_backward_op().call(grads[0], saved_.unpack(common::holder_of(this)),
                                                     negative_slope_, multiplier_);
    }
    // saved's gradient, where it has an edge (leaky_relu_backward's `saved` requiring grad): zeros, as eager's.
    if (num_outputs() > 1 && should_compute_output(1)) grad_inputs[1] = at::zeros_like(grads[0]);
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
    auto node = common::make_node<LeakyReLUGrad>(node_name, negative_slope, multiplier);
    node->save(saved);
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
  at::Tensor y = common::redispatch_below_autograd(leaky_relu_op(), keys, x, negative_slope);
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

// ---- in place ---------------------------------------------------------------------------------------------------
// x = leaky_relu(x * multiplier, negative_slope) written into x, as VariableType runs ATen's in-place ops: the checks
// of an in-place op on a tensor that requires grad (a leaf, or a view of one, is an error), x's next edges taken
// before the kernel (on a view, after it would rebuild the view's grad_fn past the node), the kernel below autograd
// but through the ADInplaceOrView kernel (x's version bumped, so a backward that saved x before sees the change), x's
// history rebased onto the node (a view's base too, through CopySlices), and x after the op saved as the node's
// output: its sign is that of x * multiplier where the slope is >= 0. With a negative slope only the kernel's mask
// tells: multiply_leaky_relu_ asks for it, leaky_relu_ (which returns nothing) raises, before x is written, where
// eager's backward would. `run_kernel(mask_needed)` runs the kernel and returns its mask (empty where not asked for).
template <typename RunKernel>
at::Tensor in_place_with_autograd(const char* op, const char* node_name, const at::Tensor& x, double negative_slope,
                                  double multiplier, bool mask_available, const RunKernel& run_kernel) {
  const bool needs_grad = c10::GradMode::is_enabled() && x.requires_grad();
  const at::Tensor tangent = x._fw_grad(/*level=*/0);
  const bool mask_needed = (needs_grad || tangent.defined()) && negative_slope < 0;
  torch::autograd::check_inplace(x, needs_grad);
  TORCH_CHECK_VALUE(!mask_needed || mask_available, "kernels.", op, ": in place, LeakyReLU cannot be differentiated "
                    "with a negative slope (", common::number_str(negative_slope), "), as its output no longer tells the input's sign; "
                    "use the out-of-place leaky_relu (inplace=False)");
  torch::autograd::edge_list next_edges;
  if (needs_grad) next_edges = torch::autograd::collect_next_edges(x);
  at::Tensor mask = run_kernel(mask_needed);
  if (needs_grad) {
    auto node = common::make_node<LeakyReLUGrad>(node_name, negative_slope, multiplier);
    node->set_next_edges(std::move(next_edges));
    torch::autograd::rebase_history(x, node);
    if (mask_needed) node->save(mask);
    else node->save(x, /*is_output=*/true, /*is_inplace_on_view=*/x.is_view());
  }
  if (tangent.defined()) {
    // In place, as ATen's in-place ops update theirs, so a view's tangent stays a view of its base's.
    tangent.copy_(leaky_relu_backward_op().call(tangent, mask_needed ? mask : common::primal_of(x), negative_slope,
                                                multiplier));
  }
  return mask;
}

void leaky_relu_inplace_autograd(c10::DispatchKeySet keys, const at::Tensor& x, double negative_slope) {
  in_place_with_autograd("leaky_relu_", "kernels::LeakyReLUBackward", x, negative_slope, 1.0,
                         /*mask_available=*/false, [&](bool) {
                           common::redispatch_in_place_below_autograd(leaky_relu_inplace_op(), keys, x, negative_slope);
                           return at::Tensor();
                         });
}

at::Tensor multiply_leaky_relu_inplace_autograd(c10::DispatchKeySet keys, const at::Tensor& x, double multiplier,
                                                double negative_slope, bool return_mask) {
  const at::Tensor mask = in_place_with_autograd(
      "multiply_leaky_relu_", "kernels::MultiplyLeakyReLUBackward", x, negative_slope, multiplier,
      /*mask_available=*/true, [&](bool mask_needed) {
        return common::redispatch_in_place_below_autograd(multiply_leaky_relu_op(), keys, x, multiplier,
                                                          negative_slope, return_mask || mask_needed);
      });
  return return_mask || mask.numel() == 0 ? mask : at::empty({0}, mask.options());
}

// Below autograd: the kernel, then x's version bumped.
void leaky_relu_inplace_or_view(c10::DispatchKeySet keys, const at::Tensor& x, double negative_slope) {
  common::redispatch_bumping_version(leaky_relu_inplace_op(), keys, x, negative_slope);
}

at::Tensor multiply_leaky_relu_inplace_or_view(c10::DispatchKeySet keys, const at::Tensor& x, double multiplier,
                                               double negative_slope, bool return_mask) {
  return common::redispatch_bumping_version(multiply_leaky_relu_op(), keys, x, multiplier, negative_slope,
                                            return_mask);
}

}  // namespace
}  // namespace kernels::leaky_relu

TORCH_LIBRARY_IMPL(kernels, Autograd, m) {
  m.impl("leaky_relu", &kernels::leaky_relu::leaky_relu_autograd);
  m.impl("leaky_relu_backward", &kernels::leaky_relu::leaky_relu_backward_autograd);
  m.impl("leaky_relu_", &kernels::leaky_relu::leaky_relu_inplace_autograd);
  m.impl("multiply_leaky_relu_", &kernels::leaky_relu::multiply_leaky_relu_inplace_autograd);
}

TORCH_LIBRARY_IMPL(kernels, ADInplaceOrView, m) {
  m.impl("leaky_relu_", &kernels::leaky_relu::leaky_relu_inplace_or_view);
  m.impl("multiply_leaky_relu_", &kernels::leaky_relu::multiply_leaky_relu_inplace_or_view);
}
