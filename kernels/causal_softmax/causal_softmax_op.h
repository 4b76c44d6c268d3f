// The causal softmax family's ops as C++ code calls them (through the dispatcher, so that a call takes the op's
// Autograd kernel where a gradient can flow), and the causal mask as a tensor, for the ATen paths of causal_softmax.cpp
// and the autograd's formulas (causal_softmax_autograd.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/ones.h>

namespace kernels::causal_softmax {

using CausalSoftmax = at::Tensor(const at::Tensor& scores, double scale);

// kernels::causal_softmax, looked up once.
inline const c10::TypedOperatorHandle<CausalSoftmax>& causal_softmax_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernels::causal_softmax", "").typed<CausalSoftmax>();
  return op;
}

using CausalSoftmaxBackward = at::Tensor(const at::Tensor& grad_output, const at::Tensor& output, double scale);

// kernels::causal_softmax_backward, looked up once.
inline const c10::TypedOperatorHandle<CausalSoftmaxBackward>& causal_softmax_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kernels::causal_softmax_backward", "")
                             .typed<CausalSoftmaxBackward>();
  return op;
}

// The masked entries of t's last two dimensions (query rows, key columns) as a bool (rows, columns) tensor on t's
// device: column j of row i where j > i + columns - rows (the causal mask aligned on the last column).
inline at::Tensor masked_entries(const at::Tensor& t) {
  const int64_t rows = t.size(-2), columns = t.size(-1);
  return at::ones({rows, columns}, t.options().dtype(at::kBool)).triu(columns - rows + 1);
}

}  // namespace kernels::causal_softmax
