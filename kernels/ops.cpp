// The torch side of the op library `torch.ops.kernels`: schemas, argument checks, dtype dispatch, and the CPU and
// CUDA implementations. CUDA work goes through the plain launchers of kernels/*.cu (launchers.h), on the current
// stream of the tensor's own device. Fake (meta) implementations and the autograd formulas are registered in
// kernels/ops.py; leaky_relu's Autograd kernel, which skips autograd where no gradient can flow, is here.
//
// Built with KERNELS_WITH_CUDA where torch has CUDA and a GPU is visible; without it, the library is CPU-only.
// Headers are kept to the few ATen pieces used, which keeps the JIT build short.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "launchers.h"
#endif

namespace {

// ---- argument checks -------------------------------------------------------------------------------------------

// Messages format numbers, shapes and devices as std::string here: on the GPU machine (library built by another
// g++ than torch's) streaming an int64_t, an IntArrayRef or a Device into TORCH_CHECK's message crashed the
// process; strings and ScalarType names stream safely.
std::string shape_str(at::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

void check_float_tensor(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "kernels.", op, ": ", name, " is an undefined tensor");
  TORCH_CHECK(is_supported_float(t.scalar_type()), "kernels.", op, ": ", name,
              " must be a float32, float64, float16 or bfloat16 tensor, got ", t.scalar_type());
}

void check_same(const char* op, const char* name, const at::Tensor& t, const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), "kernels.", op, ": expected ", name, " and ", ref_name,
              " on the same device, got ", name, " on ", t.device().str(), " and ", ref_name, " on ", ref.device().str());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "kernels.", op, ": expected ", name, " and ", ref_name,
              " to have the same dtype, got ", name, " ", t.scalar_type(), " and ", ref_name, " ", ref.scalar_type());
}

// The kernels walk memory linearly, so their operands must cover one dense block of memory in one shared layout.
// Returns t itself where it already has layout's strides, else a copy of t in that layout. `layout` must be dense
// (as at::empty_like makes it: same strides as a dense input, contiguous for any other).
at::Tensor in_layout_of(const at::Tensor& t, const at::Tensor& layout) {
  if (t.strides() == layout.strides()) return t;
  return at::empty_like(layout, t.options()).copy_(t);
}

// ---- CPU loops: branch-free, one instantiation per flag combination, so the compiler vectorizes them (a branch
// on the sign of random data mispredicts half the time: 10x slower) ---------------------------------------------

constexpr int64_t kCpuGrain = 1 << 14;

template <typename F>
void with_flags(bool a, bool b, F f) {
  using T = std::true_type;
  using N = std::false_type;
  if (a) {
    if (b) f(T{}, T{}); else f(T{}, N{});
  } else {
    if (b) f(N{}, T{}); else f(N{}, N{});
  }
}

// The loops take everything by value: captured references could alias the output, which stops vectorization.
template <typename scalar_t, bool kScaled, bool kMask>
void scale_leaky_relu_range(const scalar_t* in, scalar_t* out, bool* positive, int64_t begin, int64_t end,
                            at::opmath_type<scalar_t> scale, at::opmath_type<scalar_t> slope) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = begin; i < end; ++i) {
    opmath_t v = static_cast<opmath_t>(in[i]);
    if constexpr (kScaled) v = v * scale;
    const opmath_t negative = v * slope;  // computed unconditionally: a select, not a branch
    const bool pos = v > opmath_t(0);
    out[i] = static_cast<scalar_t>(pos ? v : negative);
    if constexpr (kMask) positive[i] = pos;
  }
}

template <typename scalar_t, bool kScaled, bool kMask>
void leaky_relu_backward_range(const scalar_t* grad_out, const scalar_t* saved, const bool* mask, scalar_t* grad_in,
                               int64_t begin, int64_t end, at::opmath_type<scalar_t> scale,
                               at::opmath_type<scalar_t> slope) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = begin; i < end; ++i) {
    bool pos;
    if constexpr (kMask) pos = mask[i]; else pos = static_cast<opmath_t>(saved[i]) > opmath_t(0);
    const opmath_t g = static_cast<opmath_t>(grad_out[i]);
    const opmath_t negative = g * slope;
    opmath_t v = pos ? g : negative;
    if constexpr (kScaled) v = v * scale;
    grad_in[i] = static_cast<scalar_t>(v);
  }
}

#ifdef KERNELS_WITH_CUDA
kernels::ElementType element_type(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return kernels::ElementType::kFloat64;
    case at::kHalf: return kernels::ElementType::kFloat16;
    case at::kBFloat16: return kernels::ElementType::kBFloat16;
    default: return kernels::ElementType::kFloat32;  // the checks admit no other type
  }
}
#endif

// ---- element-wise runners: one function per kernel, CPU loop or CUDA launch --------------------------------------

// y = leaky_relu(x * scale, slope), mask = x * scale > 0 (if defined). x, y and mask share one dense layout.
void run_scale_leaky_relu(const at::Tensor& x, const at::Tensor& y, const at::Tensor& mask, double scale,
                          double slope) {
  const int64_t n = x.numel();
  if (n == 0) return;
#ifdef KERNELS_WITH_CUDA
  if (x.is_cuda()) {
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaError_t err = kernels::launch_scale_leaky_relu(
        element_type(x.scalar_type()), x.const_data_ptr(), y.mutable_data_ptr(),
        mask.defined() ? static_cast<std::uint8_t*>(mask.mutable_data_ptr()) : nullptr, n, scale, slope,
        c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    TORCH_CHECK(err == cudaSuccess, "kernels: the leaky_relu kernel failed to launch: ", cudaGetErrorString(err));
    return;
  }
#endif
  TORCH_CHECK(x.is_cpu(), "kernels: no implementation for tensors on ", x.device().str());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "scale_leaky_relu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    bool* positive = mask.defined() ? mask.mutable_data_ptr<bool>() : nullptr;
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    scalar_t* out = y.mutable_data_ptr<scalar_t>();
    const opmath_t s = static_cast<opmath_t>(scale), ns = static_cast<opmath_t>(slope);
    with_flags(scale != 1.0, positive != nullptr, [&](auto scaled, auto masked) {
      at::parallel_for(0, n, kCpuGrain, [=](int64_t begin, int64_t end) {
        scale_leaky_relu_range<scalar_t, decltype(scaled)::value, decltype(masked)::value>(in, out, positive, begin,
                                                                                           end, s, ns);
      });
    });
  });
}

// grad_in = (positive ? grad_out : grad_out * slope) * scale, positive = mask if `saved` is bool, else saved > 0.
void run_leaky_relu_backward(const at::Tensor& grad_out, const at::Tensor& saved, const at::Tensor& grad_in,
                             double scale, double slope) {
  const int64_t n = grad_out.numel();
  if (n == 0) return;
  const bool is_mask = saved.scalar_type() == at::kBool;
#ifdef KERNELS_WITH_CUDA
  if (grad_out.is_cuda()) {
    const c10::cuda::CUDAGuard guard(grad_out.device());
    const cudaError_t err = kernels::launch_leaky_relu_backward(
        element_type(grad_out.scalar_type()), grad_out.const_data_ptr(), is_mask ? nullptr : saved.const_data_ptr(),
        is_mask ? static_cast<const std::uint8_t*>(saved.const_data_ptr()) : nullptr, grad_in.mutable_data_ptr(),
        n, scale, slope, c10::cuda::getCurrentCUDAStream(grad_out.device().index()).stream());
    TORCH_CHECK(err == cudaSuccess, "kernels: the leaky_relu backward kernel failed to launch: ",
                cudaGetErrorString(err));
    return;
  }
#endif
  TORCH_CHECK(grad_out.is_cpu(), "kernels: no implementation for tensors on ", grad_out.device().str());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_out.scalar_type(), "leaky_relu_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* g = grad_out.const_data_ptr<scalar_t>();
    const scalar_t* activation = is_mask ? nullptr : saved.const_data_ptr<scalar_t>();
    const bool* positive = is_mask ? saved.const_data_ptr<bool>() : nullptr;
    scalar_t* out = grad_in.mutable_data_ptr<scalar_t>();
    const opmath_t s = static_cast<opmath_t>(scale), ns = static_cast<opmath_t>(slope);
    with_flags(scale != 1.0, is_mask, [&](auto scaled, auto masked) {
      at::parallel_for(0, n, kCpuGrain, [=](int64_t begin, int64_t end) {
        leaky_relu_backward_range<scalar_t, decltype(scaled)::value, decltype(masked)::value>(
            g, activation, positive, out, begin, end, s, ns);
      });
    });
  });
}

// ---- ops --------------------------------------------------------------------------------------------------------

at::Tensor leaky_relu(const at::Tensor& x, double negative_slope) {
  check_float_tensor("leaky_relu", "x", x);
  // Same layout as F.leaky_relu's output: x's strides if x is dense (a transpose too), contiguous otherwise.
  at::Tensor y = at::empty_like(x);
  run_scale_leaky_relu(in_layout_of(x, y), y, at::Tensor(), 1.0, negative_slope);
  return y;
}

void leaky_relu_(const at::Tensor& x, double negative_slope) {
  check_float_tensor("leaky_relu_", "x", x);
  if (x.is_non_overlapping_and_dense()) {
    run_scale_leaky_relu(x, x, at::Tensor(), 1.0, negative_slope);
    return;
  }
  TORCH_CHECK(at::has_internal_overlap(x) != at::MemOverlap::Yes,
              "kernels.leaky_relu_: x has elements that share memory (an expanded view), which an in-place "
              "operation cannot write; pass x.clone()");
  const at::Tensor tmp = x.contiguous();
  run_scale_leaky_relu(tmp, tmp, at::Tensor(), 1.0, negative_slope);
  x.copy_(tmp);
}

at::Tensor leaky_relu_backward(const at::Tensor& grad_output, const at::Tensor& saved, double negative_slope,
                               double scale) {
  check_float_tensor("leaky_relu_backward", "grad_output", grad_output);
  TORCH_CHECK(saved.defined() && (saved.scalar_type() == at::kBool || saved.scalar_type() == grad_output.scalar_type()),
              "kernels.leaky_relu_backward: saved must be a bool mask or have grad_output's dtype (",
              grad_output.scalar_type(), "), got ", saved.defined() ? c10::toString(saved.scalar_type()) : "undefined");
  TORCH_CHECK(saved.device() == grad_output.device(), "kernels.leaky_relu_backward: expected grad_output and saved on "
              "the same device, got ", grad_output.device().str(), " and ", saved.device().str());
  TORCH_CHECK(saved.sizes() == grad_output.sizes(), "kernels.leaky_relu_backward: grad_output has shape ",
              shape_str(grad_output.sizes()), " but saved has shape ", shape_str(saved.sizes()));
  at::Tensor grad_in = at::empty_like(grad_output);
  run_leaky_relu_backward(in_layout_of(grad_output, grad_in), in_layout_of(saved, grad_in), grad_in, scale,
                          negative_slope);
  return grad_in;
}

// y = leaky_relu((x @ weight^T + bias) * multiplier, negative_slope), and, if return_mask, the bool mask of the
// elements whose pre-activation is positive (the backward needs it when the slope is negative, as the output's
// sign then no longer tells). The GEMM is at::linear, the very call nn.Linear makes, so it follows the user's
// float32 matmul precision setting (IEEE by default, TF32 when allowed) and rounds exactly as eager does; the
// multiply and the activation are one pass in place over its result.
std::tuple<at::Tensor, at::Tensor> gemm_scale_leaky_relu(const at::Tensor& x, const at::Tensor& weight,
                                                         const std::optional<at::Tensor>& bias, double multiplier,
                                                         double negative_slope, bool return_mask) {
  constexpr const char* op = "gemm_scale_leaky_relu";
  check_float_tensor(op, "x", x);
  check_float_tensor(op, "weight", weight);
  check_same(op, "weight", weight, "x", x);
  TORCH_CHECK(weight.dim() == 2, "kernels.", op, ": weight must be 2-D (out_features, in_features), got shape ",
              shape_str(weight.sizes()));
  TORCH_CHECK(x.dim() >= 1, "kernels.", op, ": x must have at least 1 dimension (..., in_features), got a scalar");
  TORCH_CHECK(x.size(-1) == weight.size(1), "kernels.", op, ": x's last dimension is ", std::to_string(x.size(-1)),
              " but in_features is ", std::to_string(weight.size(1)), " (x has shape ", shape_str(x.sizes()), ", weight ",
              shape_str(weight.sizes()), ")");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check_same(op, "bias", *bias, "x", x);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "kernels.", op,
                ": bias must have shape [out_features] = [", std::to_string(weight.size(0)), "], got ", shape_str(bias->sizes()));
  }
  at::Tensor y = at::linear(x, weight, has_bias ? *bias : at::Tensor()).contiguous();
  const std::vector<int64_t> mask_shape = return_mask ? y.sizes().vec() : std::vector<int64_t>{0};
  at::Tensor mask = at::empty(mask_shape, y.options().dtype(at::kBool));
  run_scale_leaky_relu(y, y, return_mask ? mask : at::Tensor(), multiplier, negative_slope);
  return {y, mask};
}

// The Autograd kernel of kernels::leaky_relu. Where no gradient can flow back (grad mode off, or x not requiring
// grad) it goes straight to the CPU or CUDA kernel: a Python autograd kernel costs about 5 us a call even then,
// most of a small LeakyReLU's time in inference (bench.py's per-call row). Where a graph is to be recorded it calls
// kernels::_leaky_relu_with_grad, the same kernels with their backward formula registered in Python
// (kernels/ops.py). A C++ autograd Function would do that too, but its header doubles the library's build time.
// Forward mode is here: the tangent of y is leaky_relu_backward(tangent of x), which is linear in it.
at::Tensor leaky_relu_autograd(const at::Tensor& x, double negative_slope) {
  using Signature = at::Tensor(const at::Tensor&, double);
  static const auto kernel =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernels::leaky_relu", "").typed<Signature>();
  static const auto with_grad =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernels::_leaky_relu_with_grad", "").typed<Signature>();
  static const auto backward =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kernels::leaky_relu_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, double)>();

  const at::Tensor& tangent = x._fw_grad(/*level=*/0);
  if (!(c10::GradMode::is_enabled() && x.requires_grad()) && !tangent.defined()) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return kernel.call(x, negative_slope);
  }
  // x without its tangent, which the Python autograd formulas do not take.
  const at::Tensor primal = tangent.defined() ? x._fw_primal(/*level=*/0) : x;
  at::Tensor y = with_grad.call(primal, negative_slope);
  if (tangent.defined())
    y._set_fw_grad(backward.call(tangent, primal, negative_slope, 1.0), /*level=*/0, /*is_inplace_op=*/false);
  return y;
}

}  // namespace

TORCH_LIBRARY(kernels, m) {
  m.def("leaky_relu(Tensor x, float negative_slope) -> Tensor");
  m.def("_leaky_relu_with_grad(Tensor x, float negative_slope) -> Tensor");
  m.def("leaky_relu_(Tensor(a!) x, float negative_slope) -> ()");
  m.def("leaky_relu_backward(Tensor grad_output, Tensor saved, float negative_slope, float scale) -> Tensor");
  m.def("gemm_scale_leaky_relu(Tensor x, Tensor weight, Tensor? bias, float multiplier, float negative_slope, "
        "bool return_mask) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kernels, Autograd, m) { m.impl("leaky_relu", &leaky_relu_autograd); }

TORCH_LIBRARY_IMPL(kernels, CPU, m) {
  m.impl("leaky_relu", &leaky_relu);
  m.impl("_leaky_relu_with_grad", &leaky_relu);
  m.impl("leaky_relu_", &leaky_relu_);
  m.impl("leaky_relu_backward", &leaky_relu_backward);
  m.impl("gemm_scale_leaky_relu", &gemm_scale_leaky_relu);
}

#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) {
  m.impl("leaky_relu", &leaky_relu);
  m.impl("_leaky_relu_with_grad", &leaky_relu);
  m.impl("leaky_relu_", &leaky_relu_);
  m.impl("leaky_relu_backward", &leaky_relu_backward);
  m.impl("gemm_scale_leaky_relu", &gemm_scale_leaky_relu);
}
#endif
