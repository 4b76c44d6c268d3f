// The GEMM family's ops as C++ code calls them: through the dispatcher, so that a call takes every layer below the
// caller's (autograd, the device kernel). Used by the family's Autograd kernel and graph node (gemm_autograd.cpp)
// and its Autocast kernels (gemm.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace kernels::gemm {

// Multiplier 1 and slope 1 leave the product as it is: a plain linear layer, whose backward passes grad_y through.
inline bool is_identity_epilogue(double multiplier, double negative_slope) {
  return multiplier == 1.0 && negative_slope == 1.0;
}

using GemmMultiplyLeakyReLU = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& x, const at::Tensor& weight,
                                                                 const std::optional<at::Tensor>& bias,
                                                                 double multiplier, double negative_slope,
                                                                 bool return_mask,
                                                                 const std::optional<at::TensorList>& weight_split);

// kernels::gemm_multiply_leaky_relu, looked up once.
inline const c10::TypedOperatorHandle<GemmMultiplyLeakyReLU>& gemm_multiply_leaky_relu_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kernels::gemm_multiply_leaky_relu", "")
                             .typed<GemmMultiplyLeakyReLU>();
  return op;
}

using GemmGelu = at::Tensor(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            c10::string_view approximate, const std::optional<at::TensorList>& weight_split);

// kernels::gemm_gelu, looked up once.
inline const c10::TypedOperatorHandle<GemmGelu>& gemm_gelu_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kernels::gemm_gelu", "").typed<GemmGelu>();
  return op;
}

using GemmMultiplyLeakyReLUBackward = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& saved,
    double multiplier, double negative_slope, bool x_grad, bool weight_grad, bool bias_grad);

// kernels::gemm_multiply_leaky_relu_backward, looked up once.
inline const c10::TypedOperatorHandle<GemmMultiplyLeakyReLUBackward>& gemm_multiply_leaky_relu_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kernels::gemm_multiply_leaky_relu_backward", "")
                             .typed<GemmMultiplyLeakyReLUBackward>();
  return op;
}

using GemmGeluWithPre = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& x, const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& bias,
                                                            c10::string_view approximate,
                                                            const std::optional<at::TensorList>& weight_split);

// kernels::_gemm_gelu_with_pre (gemm_gelu's training forward: y and its pre-activation), looked up once.
inline const c10::TypedOperatorHandle<GemmGeluWithPre>& gemm_gelu_with_pre_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kernels::_gemm_gelu_with_pre", "")
                             .typed<GemmGeluWithPre>();
  return op;
}

using GemmGeluBackward = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& pre,
    c10::string_view approximate, bool x_grad, bool weight_grad, bool bias_grad);

// kernels::gemm_gelu_backward, looked up once.
inline const c10::TypedOperatorHandle<GemmGeluBackward>& gemm_gelu_backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kernels::gemm_gelu_backward", "")
                             .typed<GemmGeluBackward>();
  return op;
}

}  // namespace kernels::gemm
