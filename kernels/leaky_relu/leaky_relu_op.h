// The LeakyReLU family's ops as C++ code calls them: through the dispatcher, so that a call takes the op's Autograd
// kernel where a gradient can flow and the tensor's device kernel below it, like any op call. Used by this family's
// autograd and the GEMM family (its cuBLAS path's epilogue, and the epilogue's gradient).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace kernels::leaky_relu {

using LeakyReLU = at::Tensor(const at::Tensor& x, double negative_slope);

// kernels::leaky_relu, looked up once.
inline const c10::TypedOperatorHandle<LeakyReLU>& leaky_relu_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kernels::leaky_relu", "").typed<LeakyReLU>();
  return op;
}

using LeakyReLUInPlace = void(const at::Tensor& x, double negative_slope);

// kernels::leaky_relu_ (in place), looked up once.
inline const c10::TypedOperatorHandle<LeakyReLUInPlace>& leaky_relu_inplace_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernels::leaky_relu_", "").typed<LeakyReLUInPlace>();
  return op;
}

using MultiplyLeakyReLU = at::Tensor(const at::Tensor& x, double multiplier, double negative_slope, bool return_mask);

// kernels::multiply_leaky_relu_ (in place; returns the mask where return_mask), looked up once.
inline const c10::TypedOperatorHandle<MultiplyLeakyReLU>& multiply_leaky_relu_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernels::multiply_leaky_relu_", "").typed<MultiplyLeakyReLU>();
  return op;
}

using LeakyReLUBackward = at::Tensor(const at::Tensor& grad_output, const at::Tensor& saved, double negative_slope,
                                     double multiplier);

// kernels::leaky_relu_backward, looked up once.
inline const c10::TypedOperatorHandle<LeakyReLUBackward>& leaky_relu_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernels::leaky_relu_backward", "").typed<LeakyReLUBackward>();
  return op;
}

}  // namespace kernels::leaky_relu
