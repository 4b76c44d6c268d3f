// The autograd of the GEMM family: the Autograd kernels of kernels::gemm_multiply_leaky_relu and kernels::gemm_gelu
// (defined in gemm.cpp, which this file is joined after: kernels/loader.py) and
// the graph node it records: reverse mode (the backward op, or differentiable ops where the backward is itself
// recorded, for a double backward) and forward mode. Recording in C++ keeps a training step's host time below eager's
// three ops (a Python autograd.Function costs tens of us a step, which a host-bound step pays in GPU idle time). It
// reaches the ops through the dispatcher only.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <c10/core/SymInt.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/autograd_node.h"
#include "gemm_op.h"
#include "leaky_relu/leaky_relu_op.h"

namespace kernels::gemm {
namespace {

// The gradients the backward op returned (empty where not asked for) as a node's outputs 0, 1, 2 (x, w, b).
torch::autograd::variable_list node_outputs(std::tuple<at::Tensor, at::Tensor, at::Tensor>&& grads, bool x_grad,
                                            bool weight_grad, bool bias_grad) {
  torch::autograd::variable_list grad_inputs(3);
  if (x_grad) grad_inputs[0] = std::move(std::get<0>(grads));
  if (weight_grad) grad_inputs[1] = std::move(std::get<1>(grads));
  if (bias_grad) grad_inputs[2] = std::move(std::get<2>(grads));
  return grad_inputs;
}

// Which of a product node's outputs 0, 1, 2 (x, w, b) its backward is asked for.
std::tuple<bool, bool, bool> wanted_gradients(const torch::autograd::Node& node) {
  return {node.should_compute_output(0), node.should_compute_output(1), node.should_compute_output(2)};
}

// A product's operand as its node keeps it. Eager's linear keeps x only where w's gradient is needed, and w only where
// x's is, so that a frozen layer holds no activation; the same here. An operand not kept gives the backward op a
// stand-in of its shape and options (one element, expanded), which only its checks and shapes read. Tensor subclasses
// and functorch's wrappers are kept as they are: a plain stand-in would not mix with them.
class SavedOperand {
 public:
  SavedOperand(const at::Tensor& t, bool needed)
      : saved_(needed || !is_plain(t) ? t : at::Tensor(), /*is_output=*/false),
        sizes_(t.sym_sizes().vec()),
        options_(t.options()) {}

  at::Tensor unpack() const {
    at::Tensor t = saved_.unpack();
    return t.defined() ? t : at::empty_symint({}, options_).expand_symint(sizes_);
  }

  void reset_data() { saved_.reset_data(); }

 private:
  static bool is_plain(const at::Tensor& t) {
    return !t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::FuncTorchBatched,
                                                     c10::DispatchKey::FuncTorchGradWrapper,
                                                     c10::DispatchKey::BatchedNestedTensor}));
  }

  torch::autograd::SavedVariable saved_;
  std::vector<c10::SymInt> sizes_;
  at::TensorOptions options_;
};

// A double backward's gradients of a product from its pre-activation gradient, by differentiable ops (so that the
// backward has a backward of its own), as a node's outputs 0, 1, 2 (x, w, b) where asked for.
torch::autograd::variable_list differentiable_product_gradients(const at::Tensor& grad_pre_in, const at::Tensor& x,
                                                                const at::Tensor& weight, bool x_grad,
                                                                bool weight_grad, bool bias_grad) {
  torch::autograd::variable_list grad_inputs(3);
  const at::Tensor grad_pre = grad_pre_in.reshape({-1, weight.size(0)});
  if (x_grad) grad_inputs[0] = grad_pre.mm(weight).reshape(x.sizes());
  if (weight_grad) grad_inputs[1] = grad_pre.t().mm(x.reshape({-1, weight.size(1)}));
  if (bias_grad) grad_inputs[2] = grad_pre.sum(0);
  return grad_inputs;
}

// The gradients of y = leaky_relu((x w^T + b) * multiplier) for x, w and b (the node's outputs 0, 1, 2), from
// `saved`: y itself where the slope is >= 0 (its sign test is the pre-activation's), else the forward's mask. x is
// kept where w's gradient may be asked for (keep_x), w where x's may (keep_weight).
class GemmMultiplyLeakyReLUGrad final : public torch::autograd::Node {
 public:
  GemmMultiplyLeakyReLUGrad(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& saved, double multiplier,
                            double negative_slope, bool keep_x, bool keep_weight)
      : x_(x, keep_x),
        weight_(weight, keep_weight),
        saved_(saved, /*is_output=*/false),
        multiplier_(multiplier),
        negative_slope_(negative_slope) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor& grad_y = grads[0];
    if (!grad_y.defined()) return torch::autograd::variable_list(3);
    const auto [x_grad, weight_grad, bias_grad] = wanted_gradients(*this);
    const at::Tensor x = x_.unpack(), weight = weight_.unpack(), saved = saved_.unpack();
    if (!c10::GradMode::is_enabled()) {
      // No graph of the backward wanted: one op, which takes the split_fp16 path for each product where the
      // forward would.
      return node_outputs(gemm_multiply_leaky_relu_backward_op().call(grad_y, x, weight, saved, multiplier_,
                                                                      negative_slope_, x_grad, weight_grad,
                                                                      bias_grad),
                          x_grad, weight_grad, bias_grad);
    }
    const at::Tensor grad_pre =
        is_identity_epilogue(multiplier_, negative_slope_)
            ? grad_y
            : leaky_relu::leaky_relu_backward_op().call(grad_y, saved, negative_slope_, multiplier_);
    return differentiable_product_gradients(grad_pre, x, weight, x_grad, weight_grad, bias_grad);
  }

  std::string name() const override { return "kernels::GemmMultiplyLeakyReLUBackward"; }

  // x and w as kept (stand-ins where not), for the GELU node whose pre-activation this node records.
  std::pair<at::Tensor, at::Tensor> operands() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {x_.unpack(), weight_.unpack()};
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    x_.reset_data();
    weight_.reset_data();
    saved_.reset_data();
  }

 private:
  SavedOperand x_, weight_;
  torch::autograd::SavedVariable saved_;
  double multiplier_, negative_slope_;
};

// Where a gradient can flow (grad mode on and an input requiring grad), or a tangent is given, with a negative
// slope, the backward needs the branch mask (the output's sign no longer tells the pre-activation's): the kernel is
// then asked for it whatever the caller asked, and the caller gets the mask only where it asked.
std::tuple<at::Tensor, at::Tensor> gemm_multiply_leaky_relu_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                                                     const at::Tensor& weight,
                                                                     const std::optional<at::Tensor>& bias,
                                                                     double multiplier, double negative_slope,
                                                                     bool return_mask,
                                                                     const std::optional<at::TensorList>&
                                                                         weight_split) {
  const bool has_bias = bias.has_value() && bias->defined();
  const bool needs_grad = c10::GradMode::is_enabled() &&
                          (x.requires_grad() || weight.requires_grad() || (has_bias && bias->requires_grad()));
  const at::Tensor& x_tangent = x._fw_grad(/*level=*/0);
  const at::Tensor& weight_tangent = weight._fw_grad(/*level=*/0);
  const at::Tensor bias_tangent = has_bias ? bias->_fw_grad(/*level=*/0) : at::Tensor();
  const bool has_tangent = x_tangent.defined() || weight_tangent.defined() || bias_tangent.defined();
  const bool mask_needed = (needs_grad || has_tangent) && negative_slope < 0;

  auto [y, mask] = common::redispatch_below_autograd(gemm_multiply_leaky_relu_op(), keys, x, weight, bias, multiplier,
                                                     negative_slope, return_mask || mask_needed, weight_split);
  // The branch test the backward and the tangent read: the mask, or y's sign (the same where the slope is >= 0);
  // nothing for the identity epilogue. y is kept through a detached alias (same data and version counter, no
  // grad_fn): a node holding y itself would hold its own output, a reference cycle.
  const bool identity = is_identity_epilogue(multiplier, negative_slope);
  const at::Tensor saved = mask_needed ? mask : identity ? at::empty({0}, y.options()) : y.detach();
  if (needs_grad) {
    common::NodePtr node = common::make_node<GemmMultiplyLeakyReLUGrad>(
        x, weight, saved, multiplier, negative_slope, /*keep_x=*/weight.requires_grad(),
        /*keep_weight=*/x.requires_grad());
    node->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias));
    torch::autograd::create_gradient_edge(y, std::move(node));
  }
  if (has_tangent) {
    // The pre-activation's tangent is linear in theirs; LeakyReLU scales it by its slope at the pre-activation's sign.
    const at::Tensor x_primal = common::primal_of(x), weight_primal = common::primal_of(weight);
    at::Tensor pre_tangent;
    const auto add = [&](const at::Tensor& term) { pre_tangent = pre_tangent.defined() ? pre_tangent.add(term) : term; };
    if (x_tangent.defined()) add(at::linear(x_tangent, weight_primal));
    if (weight_tangent.defined()) add(at::linear(x_primal, weight_tangent));
    if (bias_tangent.defined()) add(bias_tangent.expand(y.sizes()));
    y._set_fw_grad(identity ? pre_tangent
                            : leaky_relu::leaky_relu_backward_op().call(pre_tangent, saved, negative_slope, multiplier),
                   /*level=*/0, /*is_inplace_op=*/false);
  }
  if (mask_needed && !return_mask) mask = at::empty({0}, mask.options());
  return {y, mask};
}

// The gradients of y = gelu(pre), pre = x w^T + b, for x, w and b (the node's outputs 0, 1, 2), from the saved
// pre-activation (eager's GELU node saves the same tensor) and the x and w its product node keeps (eager's linear node
// keeps them; nothing of b): each tensor saved once, as saved-tensor hooks (offloading) see. One node instead of the
// product's and the activation's: its backward op makes the GELU's input gradient within grad_x's split pass.
class GemmGeluGrad final : public torch::autograd::Node {
 public:
  GemmGeluGrad(const at::Tensor& pre, c10::string_view approximate)
      : pre_(pre, /*is_output=*/false), approximate_(approximate) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const at::Tensor& grad_y = grads[0];
    if (!grad_y.defined()) return torch::autograd::variable_list(3);
    const auto [x_grad, weight_grad, bias_grad] = wanted_gradients(*this);
    const at::Tensor pre = pre_.unpack();
    auto* product = dynamic_cast<GemmMultiplyLeakyReLUGrad*>(pre.grad_fn().get());
    TORCH_CHECK(product != nullptr, "kernels.gemm_gelu: the saved pre-activation lost its product node");
    const auto [x, weight] = product->operands();
    if (!c10::GradMode::is_enabled()) {
      return node_outputs(gemm_gelu_backward_op().call(grad_y, x, weight, pre, approximate_, x_grad, weight_grad,
                                                       bias_grad),
                          x_grad, weight_grad, bias_grad);
    }
    // A double backward: the GELU's gradient is differentiated through the saved pre-activation, whose own graph (the
    // product's node, recorded with it) leads to x, w and b, as eager's GELU node reads its linear node's output.
    const at::Tensor grad_pre = gelu_backward_of(grad_y, pre, approximate_);  // gemm.cpp
    return differentiable_product_gradients(grad_pre, x, weight, x_grad, weight_grad, bias_grad);
  }

  std::string name() const override { return "kernels::GemmGeluBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    pre_.reset_data();
  }

 private:
  torch::autograd::SavedVariable pre_;
  std::string approximate_;
};

// Whether a call of a product on x, w and b records a graph (grad mode on and an input requiring grad), and whether
// it is given forward-mode tangents.
std::pair<bool, bool> differentiation_of(const at::Tensor& x, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  const bool needs_grad = c10::GradMode::is_enabled() &&
                          (x.requires_grad() || weight.requires_grad() || (has_bias && bias->requires_grad()));
  const bool has_tangent = x._fw_grad(/*level=*/0).defined() || weight._fw_grad(/*level=*/0).defined() ||
                           (has_bias && bias->_fw_grad(/*level=*/0).defined());
  return {needs_grad, has_tangent};
}

// _gemm_gelu_with_pre (y = gelu(pre), pre = x w^T + b) where a gradient can flow: both below autograd (one kernel where
// the split GEMM writes both), y recorded by one GemmGeluGrad node, pre by the product's node (as eager's linear
// output: only a double backward, which differentiates the GELU's gradient through it, reaches that node; it keeps
// nothing of b, so b's in-place edits pass as in eager). Where a tangent is given: the two steps, each recorded by its
// own op (the product by gemm_multiply_leaky_relu's node, the activation by at::gelu's or kernels::gelu_tanh's).
std::tuple<at::Tensor, at::Tensor> gemm_gelu_with_pre_autograd(c10::DispatchKeySet keys, const at::Tensor& x,
                                                               const at::Tensor& weight,
                                                               const std::optional<at::Tensor>& bias,
                                                               c10::string_view approximate,
                                                               const std::optional<at::TensorList>& weight_split) {
  const auto [needs_grad, has_tangent] = differentiation_of(x, weight, bias);
  if (!needs_grad && !has_tangent)
    return common::redispatch_below_autograd(gemm_gelu_with_pre_op(), keys, x, weight, bias, approximate,
                                             weight_split);
  check_approximate(approximate);  // gemm.cpp
  if (has_tangent) {
    at::Tensor pre = std::get<0>(
        gemm_multiply_leaky_relu_op().call(x, weight, bias, 1.0, 1.0, /*return_mask=*/false, weight_split));
    return {gelu_of(pre, approximate), pre};  // gemm.cpp
  }
  auto [y, pre] = common::redispatch_below_autograd(gemm_gelu_with_pre_op(), keys, x, weight, bias, approximate,
                                                    weight_split);
  const torch::autograd::edge_list edges = torch::autograd::collect_next_edges(x, weight, bias);
  common::NodePtr product = common::make_node<GemmMultiplyLeakyReLUGrad>(
      x, weight, at::empty({0}, pre.options()), 1.0, 1.0, /*keep_x=*/weight.requires_grad(),
      /*keep_weight=*/x.requires_grad());
  product->set_next_edges(torch::autograd::edge_list(edges));
  torch::autograd::create_gradient_edge(pre, std::move(product));
  common::NodePtr node = common::make_node<GemmGeluGrad>(pre, approximate);
  node->set_next_edges(torch::autograd::edge_list(edges));
  torch::autograd::create_gradient_edge(y, std::move(node));
  return {y, pre};
}

// gemm_gelu where a gradient can flow or a tangent is given: _gemm_gelu_with_pre through its own Autograd kernel,
// which records the graph; under torch.func each level records its own, as that op is what reaches the levels below.
// Else the op below autograd (the activation in the GEMM's epilogue, no pre-activation written).
at::Tensor gemm_gelu_autograd(c10::DispatchKeySet keys, const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, c10::string_view approximate,
                              const std::optional<at::TensorList>& weight_split) {
  const auto [needs_grad, has_tangent] = differentiation_of(x, weight, bias);
  if (!needs_grad && !has_tangent)
    return common::redispatch_below_autograd(gemm_gelu_op(), keys, x, weight, bias, approximate, weight_split);
  return std::get<0>(gemm_gelu_with_pre_op().call(x, weight, bias, approximate, weight_split));
}

}  // namespace
}  // namespace kernels::gemm

TORCH_LIBRARY_IMPL(kernels, Autograd, m) {
  m.impl("gemm_multiply_leaky_relu", &kernels::gemm::gemm_multiply_leaky_relu_autograd);
  m.impl("gemm_gelu", &kernels::gemm::gemm_gelu_autograd);
  m.impl("_gemm_gelu_with_pre", &kernels::gemm::gemm_gelu_with_pre_autograd);
}
