// The torch side of the GEMM family: gemm_multiply_leaky_relu's and gemm_gelu's schemas, checks, forward and
// backward (each product on the path gemm_path.cpp chooses, computed by gemm_products.cpp), the Autocast kernels and
// the registrations (fakes and Python functions: gemm.py; autograd: gemm_autograd.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/out_of_memory.h"
#include "common/torch_checks.h"
#include "gemm_internal.h"
#include "gemm_op.h"
#include "gelu_tanh/gelu_tanh_op.h"
#include "leaky_relu/leaky_relu_op.h"

namespace kernels::gemm {
namespace {

using common::check_float_tensor;
using common::check_same;
using common::shape_str;
// A split product's temporaries (the operands' splits, K slices' partials) are memory eager's product does not take:
// where they cannot be had, the product runs eager's way.
using common::unless_out_of_memory;

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
// sign then no longer tells); else an empty mask. weight_split: w's split made beforehand (gemm_weight_split), or
// None.
std::tuple<at::Tensor, at::Tensor> gemm_multiply_leaky_relu(const at::Tensor& x, const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& bias, double multiplier,
                                                            double negative_slope, bool return_mask,
                                                            const std::optional<at::TensorList>& weight_split) {
  check_gemm_arguments("gemm_multiply_leaky_relu", x, weight, bias);
  const at::Tensor b = bias.has_value() && bias->defined() ? *bias : at::Tensor();
#ifdef KERNELS_WITH_CUDA
  const Path path = choose_path(x, linear_shape(x, weight));
  const std::optional<WeightSplit> w_split = usable_weight_split(weight_split, path, x, weight);
  if (is_split(path)) {
    auto result = unless_out_of_memory([&] {
      return split_fp16_gemm_multiply_leaky_relu(
          path, x, weight, b, Epilogue{static_cast<float>(multiplier), static_cast<float>(negative_slope)},
          return_mask, w_split.has_value() ? &*w_split : nullptr);
    });
    if (result.has_value()) return *result;
  } else if (path == Path::kCublasBf16x9) {
    const int64_t m = gemm_rows(x), k = weight.size(1);
    std::vector<int64_t> out_shape = x.sizes().vec();
    out_shape.back() = weight.size(0);
    at::Tensor y = cublas_bf16x9_addmm(b, x.reshape({m, k}), weight.t()).view(out_shape);
    at::Tensor mask = leaky_relu::multiply_leaky_relu_op().call(y, multiplier, negative_slope, return_mask);
    return {y, mask};
  }
#else
  (void)usable_weight_split(weight_split, Path::kCublas, x, weight);  // a malformed list raises here too
#endif
  return cublas_gemm_multiply_leaky_relu(x, weight, b, multiplier, negative_slope, return_mask);
}

#ifdef KERNELS_WITH_CUDA
// x @ weight^T + bias on cuBLAS: a GELU's product where the memory for its split could not be had.
at::Tensor cublas_product(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return std::get<0>(cublas_gemm_multiply_leaky_relu(x, weight, bias.has_value() ? *bias : at::Tensor(), 1.0, 1.0,
                                                     /*return_mask=*/false));
}
#endif

// gemm_gelu's activation where its epilogue does not apply it: at::gelu ("none"), kernels::gelu_tanh ("tanh").
at::Tensor gelu_of(const at::Tensor& pre, c10::string_view approximate) {
  return approximate == "tanh" ? gelu_tanh::gelu_tanh_op().call(pre) : at::gelu(pre, "none");
}

void check_approximate(c10::string_view approximate) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh",
              "kernels.gemm_gelu: approximate must be 'none' or 'tanh', got '", approximate, "'");
}

// y = gelu(x @ weight^T + bias): approximate "none" is nn.GELU()'s function, "tanh" kernels.gelu_tanh's formula. On a
// split path the GEMM's epilogue applies it (the pre-activation is never written); else the product as
// gemm_multiply_leaky_relu computes it, then the activation's op. weight_split as there.
at::Tensor gemm_gelu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     c10::string_view approximate, const std::optional<at::TensorList>& weight_split) {
  check_gemm_arguments("gemm_gelu", x, weight, bias);
  check_approximate(approximate);
#ifdef KERNELS_WITH_CUDA
  const Path path = choose_path(x, linear_shape(x, weight));
  if (is_split(path)) {
    const std::optional<WeightSplit> w_split = usable_weight_split(weight_split, path, x, weight);
    const Epilogue epilogue{1.0f, 1.0f, approximate == "tanh" ? Activation::kGeluTanh : Activation::kGeluErf};
    auto y = unless_out_of_memory([&] {
      return std::get<0>(split_fp16_gemm_multiply_leaky_relu(path, x, weight, bias.has_value() ? *bias : at::Tensor(),
                                                             epilogue, /*return_mask=*/false,
                                                             w_split.has_value() ? &*w_split : nullptr));
    });
    if (y.has_value()) return *y;
    return gelu_of(cublas_product(x, weight, bias), approximate);
  }
#endif
  return gelu_of(std::get<0>(gemm_multiply_leaky_relu(x, weight, bias, 1.0, 1.0, /*return_mask=*/false,
                                                      weight_split)),
                 approximate);
}

#ifdef KERNELS_WITH_CUDA
// input_gradient's product on a split path where w is a transposed view or gelu_rows is given (below).
at::Tensor split_input_gradient(Path path, const at::Tensor& grad_pre, const at::Tensor& weight,
                                const GeluBackwardRows* gelu_rows) {
  at::Tensor grad_x = at::empty({grad_pre.size(0), weight.size(1)}, grad_pre.options());
  const bool w_view = is_transposed_weight(weight);
  split_fp16_product(path, grad_pre, /*x_transposed=*/false, w_view ? weight.t() : weight, /*w_transposed=*/!w_view,
                     at::Tensor(), Epilogue{}, grad_x, /*positive=*/nullptr, /*x_column_sums=*/nullptr,
                     /*w_split=*/nullptr, gelu_rows);
  return grad_x;
}
#endif

// grad_x = grad_pre w (grad_pre m x n, w n x k) on `path`: w read as it is (n x k), or, where it is a transposed view,
// as the row-major (k x n) matrix it views, whose rows are then the product's. With gelu_rows (a split path, on
// which gelu_backward_rows_supported held), grad_pre is the GELU's output gradient, and x's split pass makes the
// GELU's input gradient, gelu_rows->grad_pre, on the way.
at::Tensor input_gradient(Path path, const at::Tensor& grad_pre, const at::Tensor& weight,
                          const GeluBackwardRows* gelu_rows = nullptr) {
#ifdef KERNELS_WITH_CUDA
  if (is_split(path)) {
    // With gelu_rows an out-of-memory error goes to the caller, whose fallback makes grad_pre too.
    if (gelu_rows != nullptr) return split_input_gradient(path, grad_pre, weight, gelu_rows);
    auto grad_x = unless_out_of_memory([&] {
      return is_transposed_weight(weight) ? split_input_gradient(path, grad_pre, weight, nullptr)
                                          : split_fp16_matmul(path, grad_pre, /*a_transposed=*/false, weight);
    });
    if (grad_x.has_value()) return *grad_x;
  }
#endif
  TORCH_CHECK(gelu_rows == nullptr, "kernels: a GELU's backward is made by the split paths' row split only");
  return path == Path::kCublasBf16x9 ? cublas_bf16x9_matmul(grad_pre, weight) : grad_pre.mm(weight);
}

// The path grad_x = grad_pre (m x n) w takes, as a forward of its shape would.
Path input_gradient_path(const at::Tensor& grad_pre, const at::Tensor& weight) {
  return choose_path(grad_pre, {grad_pre.size(0), weight.size(1), weight.size(0), !is_transposed_weight(weight)},
                     /*strict=*/false);
}

// A product's gradients from its pre-activation gradient grad_pre (m x n), each where asked for (else empty):
// grad_x = grad_pre w (given, where the caller made it already), grad_w = grad_pre^T x, grad_b = grad_pre's column
// sums. Each product chooses its own path from its shape, as the forward's does.
std::tuple<at::Tensor, at::Tensor, at::Tensor> product_gradients(const at::Tensor& grad_pre, const at::Tensor& x,
                                                                 const at::Tensor& weight, at::Tensor grad_x,
                                                                 bool x_grad, bool weight_grad, bool bias_grad) {
  const int64_t m = grad_pre.size(0), n = weight.size(0), k = weight.size(1);
  const at::Tensor x2 = x.reshape({m, k});
  at::Tensor grad_weight = at::empty({0}, x.options()), grad_bias = at::empty({0}, x.options());
  if (x_grad) {
    if (!grad_x.defined()) grad_x = input_gradient(input_gradient_path(grad_pre, weight), grad_pre, weight);
    grad_x = grad_x.reshape(x.sizes());
  } else {
    grad_x = at::empty({0}, x.options());
  }
  bool bias_done = false;
  if (weight_grad) {
    const Path path = choose_path(grad_pre, {n, k, m, true}, /*strict=*/false);
    std::optional<std::tuple<at::Tensor, at::Tensor>> split_made;
    if (is_split(path)) {
      // grad_pre's columns are split as they are read; their sums, made on the way, are grad_bias.
      split_made = unless_out_of_memory([&] {
        at::Tensor sums = bias_grad ? at::empty({n}, x.options()) : at::Tensor();
        at::Tensor product = split_fp16_matmul(path, grad_pre, /*a_transposed=*/true, x2,
                                               bias_grad ? sums.mutable_data_ptr<float>() : nullptr);
        return std::make_tuple(product, sums);
      });
    }
    if (split_made.has_value()) {
      grad_weight = std::get<0>(*split_made);
      if (bias_grad) grad_bias = std::get<1>(*split_made);
      bias_done = bias_grad;
    } else if (path == Path::kCublasBf16x9) {
      grad_weight = cublas_bf16x9_matmul(grad_pre.t(), x2);
    } else {
      grad_weight = grad_pre.t().mm(x2);
    }
  }
  if (bias_grad && !bias_done) grad_bias = grad_pre.sum(0);
  return {grad_x, grad_weight, grad_bias};
}

// The output's shape of a product of x and weight (x's leading dimensions, out_features), which grad_y must have.
void check_output_gradient(const char* op, const char* name, const at::Tensor& grad_y, const at::Tensor& x,
                           const at::Tensor& weight) {
  check_same(op, name, grad_y, "x", x);
  std::vector<int64_t> y_shape = x.sizes().vec();
  y_shape.back() = weight.size(0);
  TORCH_CHECK(grad_y.sizes() == at::IntArrayRef(y_shape), "kernels.", op, ": ", name, " must have the output's shape ",
              shape_str(y_shape), ", got ", shape_str(grad_y.sizes()));
}

// gemm_gelu's training forward: (y, pre), pre = x @ weight^T + bias, the GELU's input its backward reads. Where the
// split GEMM can write pre beside y from its epilogue (split_product_writes_pre), one kernel writes both; else the
// product, then the activation's op.
std::tuple<at::Tensor, at::Tensor> gemm_gelu_with_pre(const at::Tensor& x, const at::Tensor& weight,
                                                      const std::optional<at::Tensor>& bias,
                                                      c10::string_view approximate,
                                                      const std::optional<at::TensorList>& weight_split) {
  check_gemm_arguments("_gemm_gelu_with_pre", x, weight, bias);
  check_approximate(approximate);
#ifdef KERNELS_WITH_CUDA
  const Path path = choose_path(x, linear_shape(x, weight));
  if (split_product_writes_pre(path, x, weight)) {
    const std::optional<WeightSplit> w_split = usable_weight_split(weight_split, path, x, weight);
    std::vector<int64_t> out_shape = x.sizes().vec();
    out_shape.back() = weight.size(0);
    auto made = unless_out_of_memory([&] {
      at::Tensor pre = at::empty(out_shape, x.options());
      const Epilogue epilogue{1.0f, 1.0f, approximate == "tanh" ? Activation::kGeluTanh : Activation::kGeluErf,
                              pre.mutable_data_ptr<float>()};
      at::Tensor y = std::get<0>(split_fp16_gemm_multiply_leaky_relu(path, x, weight,
                                                                     bias.has_value() ? *bias : at::Tensor(),
                                                                     epilogue, /*return_mask=*/false,
                                                                     w_split.has_value() ? &*w_split : nullptr));
      return std::make_tuple(y, pre);
    });
    if (made.has_value()) return *made;
    const at::Tensor pre = cublas_product(x, weight, bias);
    return {gelu_of(pre, approximate), pre};
  }
#endif
  at::Tensor pre = std::get<0>(gemm_multiply_leaky_relu(x, weight, bias, 1.0, 1.0, /*return_mask=*/false,
                                                        weight_split));
  return {gelu_of(pre, approximate), pre};
}

// The gradients of gemm_multiply_leaky_relu, each where asked for (else empty): with grad_pre = leaky_relu'(pre) *
// multiplier * grad_y (from `saved`: the output where slope >= 0, else the mask), product_gradients.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gemm_multiply_leaky_relu_backward(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& saved,
    double multiplier, double negative_slope, bool x_grad, bool weight_grad, bool bias_grad) {
  check_gemm_arguments("gemm_multiply_leaky_relu_backward", x, weight, std::nullopt);
  check_output_gradient("gemm_multiply_leaky_relu_backward", "grad_y", grad_y, x, weight);
  const int64_t m = gemm_rows(x), n = weight.size(0);
  // The identity epilogue passes grad_y through (its `saved` is empty: gemm_autograd.cpp keeps nothing).
  const at::Tensor grad_pre =
      is_identity_epilogue(multiplier, negative_slope)
          ? grad_y.reshape({m, n})
          : leaky_relu::leaky_relu_backward_op().call(grad_y, saved, negative_slope, multiplier).reshape({m, n});
  return product_gradients(grad_pre, x, weight, at::Tensor(), x_grad, weight_grad, bias_grad);
}

// A GELU's input gradient grad_y * gelu'(pre) by the activation's own backward: at::gelu_backward ("none"),
// kernels::gelu_tanh_backward ("tanh").
at::Tensor gelu_backward_of(const at::Tensor& grad_y, const at::Tensor& pre, c10::string_view approximate) {
  return approximate == "tanh" ? gelu_tanh::gelu_tanh_backward_op().call(grad_y, pre)
                               : at::gelu_backward(grad_y, pre, "none");
}

// The gradients of gemm_gelu, y = gelu(pre), pre = x w^T + b, from grad_y and the saved pre-activation, each where
// asked for (else empty). Where grad_x's product takes a split path and its rows allow, x's split pass makes the
// GELU's input gradient from grad_y and pre as it reads them (launch_split_rows_gelu_backward), which grad_w's and
// grad_b's products then read; else the activation's backward op makes it first.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gemm_gelu_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                                  const at::Tensor& weight, const at::Tensor& pre,
                                                                  c10::string_view approximate, bool x_grad,
                                                                  bool weight_grad, bool bias_grad) {
  check_gemm_arguments("gemm_gelu_backward", x, weight, std::nullopt);
  check_approximate(approximate);
  check_output_gradient("gemm_gelu_backward", "grad_y", grad_y, x, weight);
  check_output_gradient("gemm_gelu_backward", "pre", pre, x, weight);
  const int64_t m = gemm_rows(x), n = weight.size(0);
  at::Tensor grad_pre, grad_x;
#ifdef KERNELS_WITH_CUDA
  if (x_grad) {
    const at::Tensor grad_y2 = grad_y.reshape({m, n}), pre2 = pre.reshape({m, n});
    const Path path = input_gradient_path(grad_y2, weight);
    if (is_split(path) && gelu_backward_rows_supported(grad_y2, pre2)) {
      // Out of memory for the split: grad_pre by the activation's backward and grad_x by eager's product, below.
      auto made = unless_out_of_memory([&] {
        at::Tensor gradient = at::empty({m, n}, grad_y.options());
        const GeluBackwardRows rows{pre2, approximate == "tanh", gradient};
        return std::make_tuple(gradient, input_gradient(path, grad_y2, weight, &rows));
      });
      if (made.has_value()) std::tie(grad_pre, grad_x) = *made;
    }
  }
#endif
  if (!grad_pre.defined()) grad_pre = gelu_backward_of(grad_y, pre, approximate).reshape({m, n});
  return product_gradients(grad_pre, x, weight, grad_x, x_grad, weight_grad, bias_grad);
}

}  // namespace
}  // namespace kernels::gemm

// ---- autocast -----------------------------------------------------------------------------------------------------
// Two functions of ATen's autocast, declared as ATen/autocast_mode.h declares them: that header includes ATen/ATen.h,
// every op's declaration, which is slow to parse.
namespace at::autocast {
at::ScalarType get_autocast_dtype(at::DeviceType device_type);
at::Tensor cached_cast(at::ScalarType to_type, const at::Tensor& arg, c10::DeviceType device_type);
}  // namespace at::autocast

namespace kernels::gemm {
namespace {

// The op under torch.autocast on `kDevice`, by eager's policy for the composite it replaces: at::linear casts to the
// autocast dtype (float64 left as is, leaf tensors through autocast's cache; autograd records the casts), the epilogue
// runs in the product's dtype. Then the op runs with autocast off, as ATen's autocast kernels do.
template <c10::DeviceType kDevice, c10::DispatchKey kAutocastKey>
std::tuple<at::Tensor, at::Tensor> gemm_multiply_leaky_relu_autocast(const at::Tensor& x, const at::Tensor& weight,
                                                                     const std::optional<at::Tensor>& bias,
                                                                     double multiplier, double negative_slope,
                                                                     bool return_mask,
                                                                     const std::optional<at::TensorList>&
                                                                         weight_split) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocastKey);
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [&](const at::Tensor& t) { return at::autocast::cached_cast(dtype, t, kDevice); };
  const std::optional<at::Tensor> cast_bias =
      bias.has_value() && bias->defined() ? std::optional<at::Tensor>(cast(*bias)) : bias;
  // A split of the float32 weight is of no use to the cast one: the op ignores it (its stamp no longer matches).
  return gemm_multiply_leaky_relu_op().call(cast(x), cast(weight), cast_bias, multiplier, negative_slope,
                                            return_mask, weight_split);
}

// gemm_gelu under torch.autocast, by the same policy: the product in the autocast dtype, the activation in its dtype.
template <c10::DeviceType kDevice, c10::DispatchKey kAutocastKey>
at::Tensor gemm_gelu_autocast(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              c10::string_view approximate, const std::optional<at::TensorList>& weight_split) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocastKey);
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [&](const at::Tensor& t) { return at::autocast::cached_cast(dtype, t, kDevice); };
  const std::optional<at::Tensor> cast_bias =
      bias.has_value() && bias->defined() ? std::optional<at::Tensor>(cast(*bias)) : bias;
  return gemm_gelu_op().call(cast(x), cast(weight), cast_bias, approximate, weight_split);
}

}  // namespace
}  // namespace kernels::gemm

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("gemm_multiply_leaky_relu(Tensor x, Tensor weight, Tensor? bias, float multiplier, float negative_slope, "
        "bool return_mask, Tensor[]? weight_split=None) -> (Tensor, Tensor)");
  m.def("gemm_gelu(Tensor x, Tensor weight, Tensor? bias, str approximate, Tensor[]? weight_split=None) -> Tensor");
  m.def("gemm_weight_split(Tensor x, Tensor weight) -> Tensor[]");
  m.def("_gemm_leave_row_split(Tensor y, Tensor hi, Tensor lo, Tensor exponent) -> ()");
  m.def("gemm_multiply_leaky_relu_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor saved, float multiplier, "
        "float negative_slope, bool x_grad, bool weight_grad, bool bias_grad) -> (Tensor, Tensor, Tensor)");
  m.def("_gemm_gelu_with_pre(Tensor x, Tensor weight, Tensor? bias, str approximate, Tensor[]? weight_split=None) "
        "-> (Tensor, Tensor)");
  m.def("gemm_gelu_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor pre, str approximate, bool x_grad, "
        "bool weight_grad, bool bias_grad) -> (Tensor, Tensor, Tensor)");
  m.def("_gemm_multiply_leaky_relu_path(Tensor x, Tensor weight) -> str");
  m.def("_gemm_path_refusal(Tensor x, Tensor weight, str path) -> str");
  m.def("_gemm_force_path(str path) -> str");
  m.impl("_gemm_force_path", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &kernels::gemm::force_path));
  m.def("_gemm_force_k_slices(int slices) -> int");
  m.impl("_gemm_force_k_slices",
         torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &kernels::gemm::force_k_slices));
  m.def("_gemm_force_transposed(int mode) -> int");
  m.impl("_gemm_force_transposed",
         torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &kernels::gemm::force_transposed));
  m.def("_gemm_k_slices(int m, int n, int k) -> int");
  m.impl("_gemm_k_slices", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &kernels::gemm::gemm_k_slices));
  m.def("_gemm_fp32_path_for_capability(int capability) -> str");
  m.def("_gemm_split_thresholds() -> int[]");
  m.def("_gemm_split_sweep(Tensor src, str sweep) -> Tensor[]");
  m.impl("_gemm_split_thresholds",
         torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &kernels::gemm::gemm_split_thresholds));
  m.impl("_gemm_fp32_path_for_capability", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd,
                                                           &kernels::gemm::gemm_fp32_path_for_capability));
}

#define KERNELS_GEMM_IMPLS(m)                                                                     \
  m.impl("gemm_multiply_leaky_relu", &kernels::gemm::gemm_multiply_leaky_relu);                   \
  m.impl("gemm_gelu", &kernels::gemm::gemm_gelu);                                                 \
  m.impl("gemm_multiply_leaky_relu_backward", &kernels::gemm::gemm_multiply_leaky_relu_backward); \
  m.impl("gemm_gelu_backward", &kernels::gemm::gemm_gelu_backward);                               \
  m.impl("_gemm_gelu_with_pre", &kernels::gemm::gemm_gelu_with_pre);                              \
  m.impl("_gemm_multiply_leaky_relu_path", &kernels::gemm::gemm_multiply_leaky_relu_path);                 \
  m.impl("_gemm_path_refusal", &kernels::gemm::gemm_path_refusal);                               \
  m.impl("_gemm_split_sweep", &kernels::gemm::gemm_split_sweep);                                   \
  m.impl("gemm_weight_split", &kernels::gemm::gemm_weight_split)

TORCH_LIBRARY_IMPL(kernels, AutocastCPU, m) {
  m.impl("gemm_multiply_leaky_relu",
         &kernels::gemm::gemm_multiply_leaky_relu_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
  m.impl("gemm_gelu", &kernels::gemm::gemm_gelu_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}
TORCH_LIBRARY_IMPL(kernels, AutocastCUDA, m) {
  m.impl("gemm_multiply_leaky_relu",
         &kernels::gemm::gemm_multiply_leaky_relu_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
  m.impl("gemm_gelu", &kernels::gemm::gemm_gelu_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

TORCH_LIBRARY_IMPL(kernels, CPU, m) { KERNELS_GEMM_IMPLS(m); }
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) {
  KERNELS_GEMM_IMPLS(m);
  m.impl("_gemm_leave_row_split", &kernels::gemm::gemm_leave_row_split);
}
#endif
#undef KERNELS_GEMM_IMPLS
