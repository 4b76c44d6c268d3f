// The autograd of the rotary embedding family: the Autograd kernels of rotary_embedding and rotary_embedding_backward
// (defined in rotary.cpp; this file is joined after it) and rotary_embedding's graph node. A first-order backward runs
// the kernel with the map transposed; where a graph of the backward is asked for (create_graph), a forward-mode
// tangent is given or the angles need a gradient, the ATen formulas of rotary_op.h run at autograd's level instead,
// so ATen's own derivatives record the higher orders, carry the tangents and reach cos and sin.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <mutex>
#include <string>
#include <tuple>

#include "common/autograd_node.h"
#include "rotary_op.h"

namespace kernels::rotary {
namespace {

bool has_tangent(const at::Tensor& t) { return t._fw_grad(/*level=*/0).defined(); }

// rotary_embedding's node: the gradients of q and k from the saved angles (eager's products keep cos and sin too, and
// neither q nor k).
class RotaryEmbeddingGrad final : public torch::autograd::Node {
 public:
  RotaryEmbeddingGrad(const at::Tensor& cos, const at::Tensor& sin)
      : cos_(cos, /*is_output=*/false), sin_(sin, /*is_output=*/false) {}

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    torch::autograd::variable_list grad_inputs(2);
    if (!grads[0].defined() && !grads[1].defined()) return grad_inputs;
    // An output without a gradient (unused) lends the other's in its place; only the used one is kept.
    const at::Tensor& grad_q = grads[0].defined() ? grads[0] : grads[1];
    const at::Tensor& grad_k = grads[1].defined() ? grads[1] : grads[0];
    const at::Tensor cos = cos_.unpack(), sin = sin_.unpack();
    // Under create_graph the backward is itself differentiated: the ATen formulas, recorded by autograd.
    auto [to_q, to_k] = c10::GradMode::is_enabled()
                            ? rotary_embedding_aten(grad_q, grad_k, cos, sin, /*transposed=*/true)
                            : rotary_embedding_backward_op().call(grad_q, grad_k, cos, sin);
    if (grads[0].defined() && should_compute_output(0)) grad_inputs[0] = to_q;
    if (grads[1].defined() && should_compute_output(1)) grad_inputs[1] = to_k;
    return grad_inputs;
  }

  std::string name() const override { return "kernels::RotaryEmbeddingBackward"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    cos_.reset_data();
    sin_.reset_data();
  }

 private:
  torch::autograd::SavedVariable cos_;
  torch::autograd::SavedVariable sin_;
};

std::tuple<at::Tensor, at::Tensor> rotary_embedding_autograd(c10::DispatchKeySet keys, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& cos,
                                                             const at::Tensor& sin) {
  const bool grad_mode = c10::GradMode::is_enabled();
  if (has_tangent(q) || has_tangent(k) || has_tangent(cos) || has_tangent(sin) ||
      (grad_mode && (cos.requires_grad() || sin.requires_grad())))
    return rotary_embedding_aten(q, k, cos, sin);
  auto [q_embed, k_embed] = common::redispatch_below_autograd(rotary_embedding_op(), keys, q, k, cos, sin);
  if (grad_mode && (q.requires_grad() || k.requires_grad())) {
    auto node = common::make_node<RotaryEmbeddingGrad>(cos, sin);
    node->set_next_edges(torch::autograd::collect_next_edges(q, k));
    torch::autograd::create_gradient_edge(q_embed, node);
    torch::autograd::create_gradient_edge(k_embed, std::move(node));
  }
  return {q_embed, k_embed};
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding_backward_autograd(c10::DispatchKeySet keys,
                                                                      const at::Tensor& grad_q_embed,
                                                                      const at::Tensor& grad_k_embed,
                                                                      const at::Tensor& cos, const at::Tensor& sin) {
  const bool differentiated =
      (c10::GradMode::is_enabled() && (grad_q_embed.requires_grad() || grad_k_embed.requires_grad() ||
                                       cos.requires_grad() || sin.requires_grad())) ||
      has_tangent(grad_q_embed) || has_tangent(grad_k_embed) || has_tangent(cos) || has_tangent(sin);
  if (differentiated) return rotary_embedding_aten(grad_q_embed, grad_k_embed, cos, sin, /*transposed=*/true);
  return common::redispatch_below_autograd(rotary_embedding_backward_op(), keys, grad_q_embed, grad_k_embed, cos,
                                           sin);
}

}  // namespace
}  // namespace kernels::rotary

TORCH_LIBRARY_IMPL(kernels, Autograd, m) {
  m.impl("rotary_embedding", &kernels::rotary::rotary_embedding_autograd);
  m.impl("rotary_embedding_backward", &kernels::rotary::rotary_embedding_backward_autograd);
}
