// The autograd of the SwiGLU gate family: the Autograd kernels of silu_mul and silu_mul_backward (defined in
// silu_mul.cpp; this file is joined after it) and silu_mul's graph node. A first-order backward runs the backward
// kernel; where a graph of the backward is asked for (create_graph) or a forward-mode tangent is given, the ATen
// formulas of silu_mul_op.h run at autograd's level instead, so ATen's own derivatives record the higher orders and
// carry the tangents.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <mutex>
#include <string>
#include <tuple>

#include "common/autograd_node.h"
#include "silu_mul_op.h"

namespace kernels::silu_mul {
namespace {

bool has_tangent(const at::Tensor& t) { return t._fw_grad(/*level=*/0).defined(); }

// silu_mul's node: grad_gate and grad_up from the saved gate and up (eager's `act_fn(gate) * up` keeps a third
// tensor, the activation's output). up is kept only where gate's gradient may be asked for, as eager's product keeps
// it; grad_up alone needs gate only.
class SiluMulGrad final : public torch::autograd::Node {
 public:
  SiluMulGrad(const at::Tensor& gate, const at::Tensor& up)
      : gate_(gate, /*is_output=*/false), up_(gate.requires_grad() ? up : at::Tensor(), /*is_output=*/false) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    torch::autograd::variable_list grad_inputs(2);
    if (!grads[0].defined()) return grad_inputs;
    if (!should_compute_output(0)) {
      // grad_up alone: it reads gate only, so the backward op takes gate in up's place (its grad_gate unused).
      if (should_compute_output(1)) {
        const at::Tensor gate = gate_.unpack();
        grad_inputs[1] = c10::GradMode::is_enabled()
                             ? silu_mul_up_gradient_aten(grads[0], gate)
                             : std::get<1>(silu_mul_backward_op().call(grads[0], gate, gate));
      }
      return grad_inputs;
    }
    // Under create_graph the backward is itself differentiated: the ATen formulas, recorded by autograd.
    auto [grad_gate, grad_up] = c10::GradMode::is_enabled()
                                    ? silu_mul_backward_aten(grads[0], gate_.unpack(), up_.unpack())
                                    : silu_mul_backward_op().call(grads[0], gate_.unpack(), up_.unpack());
    if (should_compute_output(0)) grad_inputs[0] = grad_gate;
    if (should_compute_output(1)) grad_inputs[1] = grad_up;
    return grad_inputs;
  }

  std::string name() const override { return "kernels::SiluMulBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    gate_.reset_data();
    up_.reset_data();
  }

 private:
  torch::autograd::SavedVariable gate_;
  torch::autograd::SavedVariable up_;
};

at::Tensor silu_mul_autograd(c10::DispatchKeySet keys, const at::Tensor& gate, const at::Tensor& up) {
  if (has_tangent(gate) || has_tangent(up)) return silu_mul_aten(gate, up);
  at::Tensor y = common::redispatch_below_autograd(silu_mul_op(), keys, gate, up);
  if (c10::GradMode::is_enabled() && (gate.requires_grad() || up.requires_grad())) {
    auto node = common::make_node<SiluMulGrad>(gate, up);
    node->set_next_edges(torch::autograd::collect_next_edges(gate, up));
    torch::autograd::create_gradient_edge(y, std::move(node));
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward_autograd(c10::DispatchKeySet keys, const at::Tensor& grad_y,
                                                              const at::Tensor& gate, const at::Tensor& up) {
  const bool differentiated =
      (c10::GradMode::is_enabled() && (grad_y.requires_grad() || gate.requires_grad() || up.requires_grad())) ||
      has_tangent(grad_y) || has_tangent(gate) || has_tangent(up);
  if (differentiated) return silu_mul_backward_aten(grad_y, gate, up);
  return common::redispatch_below_autograd(silu_mul_backward_op(), keys, grad_y, gate, up);
}

}  // namespace
}  // namespace kernels::silu_mul

TORCH_LIBRARY_IMPL(kernels, Autograd, m) {
  m.impl("silu_mul", &kernels::silu_mul::silu_mul_autograd);
  m.impl("silu_mul_backward", &kernels::silu_mul::silu_mul_backward_autograd);
}
