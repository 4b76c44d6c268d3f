// The torch side of the LeakyReLU family of `torch.ops.kernels`: schemas, argument checks, dtype dispatch, and the
// CPU and CUDA implementations. CUDA work goes through the plain launchers of leaky_relu.cu (leaky_relu.h), on the
// current stream of the tensor's own device. Fake (meta) implementations and the autograd formulas are registered
// in leaky_relu.py; leaky_relu's Autograd kernel, which skips autograd where no gradient can flow, is here.
//
// Ops: leaky_relu, leaky_relu_ (in place), multiply_leaky_relu_ (in place, with the multiply and the branch mask:
// the epilogue of the GEMM family's cuBLAS path), leaky_relu_backward, and _leaky_relu_with_grad (leaky_relu where
// a graph is recorded).
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
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include "common/torch_checks.h"

#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "leaky_relu.h"
#endif

namespace kernels::leaky_relu {
namespace {

using common::check_float_tensor;
using common::in_layout_of;
using common::shape_str;

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
template <typename scalar_t, bool kMultiplied, bool kMask>
void multiply_leaky_relu_range(const scalar_t* in, scalar_t* out, bool* positive, int64_t begin, int64_t end,
                            at::opmath_type<scalar_t> multiplier, at::opmath_type<scalar_t> slope) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = begin; i < end; ++i) {
    opmath_t v = static_cast<opmath_t>(in[i]);
    if constexpr (kMultiplied) v = v * multiplier;
    const opmath_t negative = v * slope;  // computed unconditionally: a select, not a branch
    const bool pos = v > opmath_t(0);
    out[i] = static_cast<scalar_t>(pos ? v : negative);
    if constexpr (kMask) positive[i] = pos;
  }
}

template <typename scalar_t, bool kMultiplied, bool kMask>
void leaky_relu_backward_range(const scalar_t* grad_out, const scalar_t* saved, const bool* mask, scalar_t* grad_in,
                               int64_t begin, int64_t end, at::opmath_type<scalar_t> multiplier,
                               at::opmath_type<scalar_t> slope) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = begin; i < end; ++i) {
    bool pos;
    if constexpr (kMask) pos = mask[i]; else pos = static_cast<opmath_t>(saved[i]) > opmath_t(0);
    const opmath_t g = static_cast<opmath_t>(grad_out[i]);
    const opmath_t negative = g * slope;
    opmath_t v = pos ? g : negative;
    if constexpr (kMultiplied) v = v * multiplier;
    grad_in[i] = static_cast<scalar_t>(v);
  }
}

#ifdef KERNELS_WITH_CUDA
ElementType element_type(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return ElementType::kFloat64;
    case at::kHalf: return ElementType::kFloat16;
    case at::kBFloat16: return ElementType::kBFloat16;
    default: return ElementType::kFloat32;  // the checks admit no other type
  }
}
#endif

// ---- element-wise runners: one function per kernel, CPU loop or CUDA launch --------------------------------------

// y = leaky_relu(x * multiplier, slope), mask = x * multiplier > 0 (if defined). x, y and mask share one dense
// layout.
void run_multiply_leaky_relu(const at::Tensor& x, const at::Tensor& y, const at::Tensor& mask, double multiplier,
                             double slope) {
  const int64_t n = x.numel();
  if (n == 0) return;
#ifdef KERNELS_WITH_CUDA
  if (x.is_cuda()) {
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaError_t err = launch_multiply_leaky_relu(
        element_type(x.scalar_type()), x.const_data_ptr(), y.mutable_data_ptr(),
        mask.defined() ? static_cast<std::uint8_t*>(mask.mutable_data_ptr()) : nullptr, n, multiplier, slope,
        c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    TORCH_CHECK(err == cudaSuccess, "kernels: the leaky_relu kernel failed to launch: ", cudaGetErrorString(err));
    return;
  }
#endif
  TORCH_CHECK(x.is_cpu(), "kernels: no implementation for tensors on ", x.device().str());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "multiply_leaky_relu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    bool* positive = mask.defined() ? mask.mutable_data_ptr<bool>() : nullptr;
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    scalar_t* out = y.mutable_data_ptr<scalar_t>();
    const opmath_t s = static_cast<opmath_t>(multiplier), ns = static_cast<opmath_t>(slope);
    with_flags(multiplier != 1.0, positive != nullptr, [&](auto multiplied, auto masked) {
      at::parallel_for(0, n, kCpuGrain, [=](int64_t begin, int64_t end) {
        multiply_leaky_relu_range<scalar_t, decltype(multiplied)::value, decltype(masked)::value>(
            in, out, positive, begin, end, s, ns);
      });
    });
  });
}

// grad_in = (positive ? grad_out : grad_out * slope) * multiplier, positive = mask if `saved` is bool, else
// saved > 0.
void run_leaky_relu_backward(const at::Tensor& grad_out, const at::Tensor& saved, const at::Tensor& grad_in,
                             double multiplier, double slope) {
  const int64_t n = grad_out.numel();
  if (n == 0) return;
  const bool is_mask = saved.scalar_type() == at::kBool;
#ifdef KERNELS_WITH_CUDA
  if (grad_out.is_cuda()) {
    const c10::cuda::CUDAGuard guard(grad_out.device());
    const cudaError_t err = launch_leaky_relu_backward(
        element_type(grad_out.scalar_type()), grad_out.const_data_ptr(), is_mask ? nullptr : saved.const_data_ptr(),
        is_mask ? static_cast<const std::uint8_t*>(saved.const_data_ptr()) : nullptr, grad_in.mutable_data_ptr(),
        n, multiplier, slope, c10::cuda::getCurrentCUDAStream(grad_out.device().index()).stream());
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
    const opmath_t s = static_cast<opmath_t>(multiplier), ns = static_cast<opmath_t>(slope);
    with_flags(multiplier != 1.0, is_mask, [&](auto multiplied, auto masked) {
      at::parallel_for(0, n, kCpuGrain, [=](int64_t begin, int64_t end) {
        leaky_relu_backward_range<scalar_t, decltype(multiplied)::value, decltype(masked)::value>(
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
  run_multiply_leaky_relu(in_layout_of(x, y), y, at::Tensor(), 1.0, negative_slope);
  return y;
}

// x = leaky_relu(x * multiplier, negative_slope) in place; returns the bool mask of x * multiplier > 0 where
// return_mask (the backward needs it when the slope is negative, as the output's sign then no longer tells), else
// an empty tensor. `op` names the calling op in error messages.
at::Tensor multiply_leaky_relu_in_place(const char* op, const at::Tensor& x, double multiplier, double negative_slope,
                                        bool return_mask) {
  check_float_tensor(op, "x", x);
  const auto mask_like = [&](const at::Tensor& t) {
    const auto options = t.options().dtype(at::kBool);
    return return_mask ? at::empty_like(t, options) : at::empty({0}, options);
  };
  if (x.is_non_overlapping_and_dense()) {
    at::Tensor mask = mask_like(x);
    run_multiply_leaky_relu(x, x, return_mask ? mask : at::Tensor(), multiplier, negative_slope);
    return mask;
  }
  TORCH_CHECK(at::has_internal_overlap(x) != at::MemOverlap::Yes, "kernels.", op,
              ": x has elements that share memory (an expanded view), which an in-place operation cannot write; "
              "call it on x.clone()");
  const at::Tensor tmp = x.contiguous();
  at::Tensor mask = mask_like(tmp);
  run_multiply_leaky_relu(tmp, tmp, return_mask ? mask : at::Tensor(), multiplier, negative_slope);
  x.copy_(tmp);
  return mask;
}

at::Tensor multiply_leaky_relu_(const at::Tensor& x, double multiplier, double negative_slope, bool return_mask) {
  return multiply_leaky_relu_in_place("multiply_leaky_relu_", x, multiplier, negative_slope, return_mask);
}

void leaky_relu_(const at::Tensor& x, double negative_slope) {
  multiply_leaky_relu_in_place("leaky_relu_", x, 1.0, negative_slope, false);
}

at::Tensor leaky_relu_backward(const at::Tensor& grad_output, const at::Tensor& saved, double negative_slope,
                               double multiplier) {
  check_float_tensor("leaky_relu_backward", "grad_output", grad_output);
  TORCH_CHECK(saved.defined() && (saved.scalar_type() == at::kBool || saved.scalar_type() == grad_output.scalar_type()),
              "kernels.leaky_relu_backward: saved must be a bool mask or have grad_output's dtype (",
              grad_output.scalar_type(), "), got ", saved.defined() ? c10::toString(saved.scalar_type()) : "undefined");
  TORCH_CHECK(saved.device() == grad_output.device(), "kernels.leaky_relu_backward: expected grad_output and saved on "
              "the same device, got ", grad_output.device().str(), " and ", saved.device().str());
  TORCH_CHECK(saved.sizes() == grad_output.sizes(), "kernels.leaky_relu_backward: grad_output has shape ",
              shape_str(grad_output.sizes()), " but saved has shape ", shape_str(saved.sizes()));
  at::Tensor grad_in = at::empty_like(grad_output);
  run_leaky_relu_backward(in_layout_of(grad_output, grad_in), in_layout_of(saved, grad_in), grad_in,
                          multiplier, negative_slope);
  return grad_in;
}

// The Autograd kernel of kernels::leaky_relu. Where no gradient can flow back (grad mode off, or x not requiring
// grad) it goes straight to the CPU or CUDA kernel: a Python autograd kernel costs about 5 us a call even then,
// most of a small LeakyReLU's time in inference (bench.py's per-call row). Where a graph is to be recorded it calls
// kernels::_leaky_relu_with_grad, the same kernels with their backward formula registered in Python
// (leaky_relu.py). A C++ autograd Function would do that too, but its header doubles the library's build time.
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
}  // namespace kernels::leaky_relu

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("leaky_relu(Tensor x, float negative_slope) -> Tensor");
  m.def("_leaky_relu_with_grad(Tensor x, float negative_slope) -> Tensor");
  m.def("leaky_relu_(Tensor(a!) x, float negative_slope) -> ()");
  m.def("multiply_leaky_relu_(Tensor(a!) x, float multiplier, float negative_slope, bool return_mask) -> Tensor");
  m.def("leaky_relu_backward(Tensor grad_output, Tensor saved, float negative_slope, float multiplier) -> Tensor");
}

TORCH_LIBRARY_IMPL(kernels, Autograd, m) { m.impl("leaky_relu", &kernels::leaky_relu::leaky_relu_autograd); }

// The same functions serve both devices: each picks the CPU loop or the CUDA launch by the tensors' device.
#define KERNELS_LEAKY_RELU_IMPLS(m)                                                  \
  m.impl("leaky_relu", &kernels::leaky_relu::leaky_relu);                            \
  m.impl("_leaky_relu_with_grad", &kernels::leaky_relu::leaky_relu);                 \
  m.impl("leaky_relu_", &kernels::leaky_relu::leaky_relu_);                          \
  m.impl("multiply_leaky_relu_", &kernels::leaky_relu::multiply_leaky_relu_);        \
  m.impl("leaky_relu_backward", &kernels::leaky_relu::leaky_relu_backward)

TORCH_LIBRARY_IMPL(kernels, CPU, m) { KERNELS_LEAKY_RELU_IMPLS(m); }
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) { KERNELS_LEAKY_RELU_IMPLS(m); }
#endif
#undef KERNELS_LEAKY_RELU_IMPLS
