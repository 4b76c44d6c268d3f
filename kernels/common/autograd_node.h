// Autograd graph nodes for the families' C++ Autograd kernels, across torch versions. A kernel that records a graph
// runs the op below autograd, makes a node (a torch::autograd::Node subclass holding what the backward needs), links
// it to the inputs (collect_next_edges) and to the outputs (create_gradient_edge), as VariableType does for ATen's
// own ops.
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace kernels::common {

// How this torch holds nodes: std::shared_ptr<Node>, or c10::intrusive_ptr<Node> in newer versions.
using NodePtr = decltype(torch::autograd::Edge::function);

// A new node of type T, held as this torch holds nodes (the holder converts to NodePtr). Shared-pointer nodes are
// deleted through deleteNode, which frees a long chain of nodes without recursing through it (looked up by
// argument-dependent lookup, so only where this torch has it).
template <typename T, typename... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...), [](auto* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

// A holder of `node` itself: what a node passes to SavedVariable::unpack for a saved output of its own (kept without
// its grad_fn, the node, which would be a reference cycle).
template <typename Ptr = NodePtr, typename T>
Ptr holder_of(T* node) {
  if constexpr (std::is_same_v<Ptr, std::shared_ptr<torch::autograd::Node>>) {
    return node->shared_from_this();
  } else {
    return Ptr::reclaim_copy(node);
  }
}

// op(args...) run by an Autograd kernel as VariableType runs ATen's kernels: redispatched past the Autograd keys, and
// with the calls the kernel makes itself (at::linear, a copy) below autograd too, so that they record no graph and
// set no tangent of their own.
template <typename Op, typename... Args>
auto redispatch_below_autograd(const Op& op, c10::DispatchKeySet keys, Args&&... args) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.redispatch(keys & c10::after_autograd_keyset, std::forward<Args>(args)...);
}

// The same for an in-place op, as VariableType runs ATen's: through the ADInplaceOrView kernel below autograd, which
// bumps the written tensor's version.
template <typename Op, typename... Args>
auto redispatch_in_place_below_autograd(const Op& op, c10::DispatchKeySet keys, Args&&... args) {
  at::AutoDispatchBelowAutograd below_autograd;
  return op.redispatch(keys & c10::after_autograd_keyset, std::forward<Args>(args)...);
}

// An in-place op's ADInplaceOrView kernel, as ATen's: op(x, args...) redispatched below that key, then x's version
// bumped, so that a backward which saved x sees the write.
template <typename Op, typename... Args>
auto redispatch_bumping_version(const Op& op, c10::DispatchKeySet keys, const at::Tensor& x, const Args&... args) {
  const auto run = [&] {
    at::AutoDispatchBelowADInplaceOrView below_inplace_or_view;
    return op.redispatch(keys & c10::after_ADInplaceOrView_keyset, x, args...);
  };
  if constexpr (std::is_void_v<decltype(run())>) {
    run();
    torch::autograd::impl::bump_version(x);
  } else {
    auto result = run();
    torch::autograd::impl::bump_version(x);
    return result;
  }
}

// t without its forward-mode tangent, so that computing a tangent from it is not itself forward-differentiated; t
// itself where it has none.
inline at::Tensor primal_of(const at::Tensor& t) {
  return t._fw_grad(/*level=*/0).defined() ? t._fw_primal(/*level=*/0) : t;
}

}  // namespace kernels::common
