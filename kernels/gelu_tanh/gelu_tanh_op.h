// The GELU (tanh) family's op as C++ code calls it: through the dispatcher, so that a call takes the op's Autograd
// kernel where a gradient can flow and the tensor's device kernel below it. Used by the GEMM family (gemm_gelu's
// activation where its epilogue does not apply it, and its backward) and the family's own autograd.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace kernels::gelu_tanh {

using GeluTanh = at::Tensor(const at::Tensor& x);

// kernels::gelu_tanh, looked up once.
inline const c10::TypedOperatorHandle<GeluTanh>& gelu_tanh_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kernels::gelu_tanh", "").typed<GeluTanh>();
  return op;
}

using GeluTanhBackward = at::Tensor(const at::Tensor& grad_output, const at::Tensor& x);

// kernels::gelu_tanh_backward, looked up once.
inline const c10::TypedOperatorHandle<GeluTanhBackward>& gelu_tanh_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernels::gelu_tanh_backward", "").typed<GeluTanhBackward>();
  return op;
}

}  // namespace kernels::gelu_tanh
