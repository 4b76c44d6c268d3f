// The torch side of the GEMM family of `torch.ops.kernels`: gemm_multiply_leaky_relu's schema, argument checks and
// implementations. Fake (meta) implementation, autograd and the Python function are in gemm.py.
//
// The generic path, for every device, dtype and shape: at::linear, the very call nn.Linear makes (so it follows
// the user's float32 matmul precision setting: IEEE by default, TF32 when allowed, and rounds exactly as eager
// does), then the LeakyReLU family's kernels::multiply_leaky_relu_ in place over its result (the multiply, the
// activation and the branch mask in one pass), reached through the dispatcher.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "common/torch_checks.h"

namespace kernels::gemm {
namespace {

using common::check_float_tensor;
using common::check_same;
using common::shape_str;

void check_gemm_arguments(const char* op, const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  check_float_tensor(op, "x", x);
  check_float_tensor(op, "weight", weight);
  check_same(op, "weight", weight, "x", x);
  TORCH_CHECK(weight.dim() == 2, "kernels.", op, ": weight must be 2-D (out_features, in_features), got shape ",
              shape_str(weight.sizes()));
  TORCH_CHECK(x.dim() >= 1, "kernels.", op, ": x must have at least 1 dimension (..., in_features), got a scalar");
  TORCH_CHECK(x.size(-1) == weight.size(1), "kernels.", op, ": x's last dimension is ", std::to_string(x.size(-1)),
              " but in_features is ", std::to_string(weight.size(1)), " (x has shape ", shape_str(x.sizes()),
              ", weight ", shape_str(weight.sizes()), ")");
  if (bias.has_value() && bias->defined()) {
    check_same(op, "bias", *bias, "x", x);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "kernels.", op,
                ": bias must have shape [out_features] = [", std::to_string(weight.size(0)), "], got ",
                shape_str(bias->sizes()));
  }
}

// y = leaky_relu((x @ weight^T + bias) * multiplier, negative_slope), and, if return_mask, the bool mask of the
// elements whose pre-activation is positive (the backward needs it when the slope is negative, as the output's
// sign then no longer tells); else an empty mask.
std::tuple<at::Tensor, at::Tensor> gemm_multiply_leaky_relu(const at::Tensor& x, const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& bias, double multiplier,
                                                            double negative_slope, bool return_mask) {
  check_gemm_arguments("gemm_multiply_leaky_relu", x, weight, bias);
  static const auto epilogue =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kernels::multiply_leaky_relu_", "")
          .typed<at::Tensor(const at::Tensor&, double, double, bool)>();
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor y = at::linear(x, weight, has_bias ? *bias : at::Tensor()).contiguous();
  at::Tensor mask = epilogue.call(y, multiplier, negative_slope, return_mask);
  return {y, mask};
}

}  // namespace
}  // namespace kernels::gemm

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("gemm_multiply_leaky_relu(Tensor x, Tensor weight, Tensor? bias, float multiplier, float negative_slope, "
        "bool return_mask) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kernels, CPU, m) {
  m.impl("gemm_multiply_leaky_relu", &kernels::gemm::gemm_multiply_leaky_relu);
}
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) {
  m.impl("gemm_multiply_leaky_relu", &kernels::gemm::gemm_multiply_leaky_relu);
}
#endif
