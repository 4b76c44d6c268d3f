// The torch side of the LeakyReLU family: schemas, argument checks and dispatch. CUDA work goes to leaky_relu.cu's
// launchers (leaky_relu.h) on the current stream of the tensor's device; CPU work to leaky_relu_cpu_loops.h's loops
// (joined before this file). Fakes are in leaky_relu.py; Autograd and ADInplaceOrView kernels in
// leaky_relu_autograd.cpp.
// Ops: leaky_relu, leaky_relu_ (in place), multiply_leaky_relu_ (in place, with the multiply and the branch mask: the
// GEMM family's cuBLAS epilogue), leaky_relu_backward. KERNELS_WITH_CUDA where torch has CUDA and a GPU is visible,
// else CPU-only. Headers kept to the few ATen pieces used, for a short JIT build.
#include <ATen/MemoryOverlap.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "common/torch_checks.h"
#include "leaky_relu_cpu_loops.h"

#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "leaky_relu.h"
#endif

namespace kernels::leaky_relu {
namespace {

using common::check_float_tensor;
using common::element_type;
using common::in_layout_of;
using common::output_like;
using common::shape_str;

// Whether ATen runs its vectorized CPU kernels (ATEN_CPU_CAPABILITY=default holds it to its generic ones): the CPU
// loops take their AVX2 build only then, as eager would.
bool aten_cpu_vectorized() {
  static const bool vectorized = at::get_cpu_capability() != "DEFAULT";
  return vectorized;
}

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
  cpu_multiply_leaky_relu(element_type(x.scalar_type()), x.const_data_ptr(), y.mutable_data_ptr(),
                          mask.defined() ? static_cast<std::uint8_t*>(mask.mutable_data_ptr()) : nullptr, n, multiplier,
                          slope, aten_cpu_vectorized());
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
  cpu_leaky_relu_backward(
      element_type(grad_out.scalar_type()), grad_out.const_data_ptr(), is_mask ? nullptr : saved.const_data_ptr(),
      is_mask ? static_cast<const std::uint8_t*>(saved.const_data_ptr()) : nullptr, grad_in.mutable_data_ptr(), n,
      multiplier, slope, aten_cpu_vectorized());
}

// ---- ops --------------------------------------------------------------------------------------------------------

at::Tensor leaky_relu(const at::Tensor& x, double negative_slope) {
  check_float_tensor("leaky_relu", "x", x);
  // Same layout as F.leaky_relu's output: x's strides if x is dense (a transpose too), contiguous otherwise.
  at::Tensor y = output_like(x);
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
              common::dtype_str(grad_output.scalar_type()), "), got ",
              saved.defined() ? common::dtype_str(saved.scalar_type()) : "undefined");
  TORCH_CHECK(saved.device() == grad_output.device(), "kernels.leaky_relu_backward: expected grad_output and saved on "
              "the same device, got ", grad_output.device().str(), " and ", saved.device().str());
  TORCH_CHECK(saved.sizes() == grad_output.sizes(), "kernels.leaky_relu_backward: grad_output has shape ",
              shape_str(grad_output.sizes()), " but saved has shape ", shape_str(saved.sizes()));
  at::Tensor grad_in = output_like(grad_output);
  run_leaky_relu_backward(in_layout_of(grad_output, grad_in), in_layout_of(saved, grad_in), grad_in,
                          multiplier, negative_slope);
  return grad_in;
}

// The build of the CPU loops that CPU calls take ("avx2" or "generic"): what the tests check the choice by, as
// both builds give the same bits.
std::string leaky_relu_cpu_loops_isa() { return cpu_loops_isa(aten_cpu_vectorized()); }

}  // namespace
}  // namespace kernels::leaky_relu

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("leaky_relu(Tensor x, float negative_slope) -> Tensor");
  m.def("leaky_relu_(Tensor(a!) x, float negative_slope) -> ()");
  m.def("multiply_leaky_relu_(Tensor(a!) x, float multiplier, float negative_slope, bool return_mask) -> Tensor");
  m.def("leaky_relu_backward(Tensor grad_output, Tensor saved, float negative_slope, float multiplier) -> Tensor");
  m.def("_leaky_relu_cpu_loops_isa() -> str");
  m.impl("_leaky_relu_cpu_loops_isa", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd,
                                                      &kernels::leaky_relu::leaky_relu_cpu_loops_isa));
}

// The same functions serve both devices: each picks the CPU loop or the CUDA launch by the tensors' device.
#define KERNELS_LEAKY_RELU_IMPLS(m)                                                  \
  m.impl("leaky_relu", &kernels::leaky_relu::leaky_relu);                            \
  m.impl("leaky_relu_", &kernels::leaky_relu::leaky_relu_);                          \
  m.impl("multiply_leaky_relu_", &kernels::leaky_relu::multiply_leaky_relu_);        \
  m.impl("leaky_relu_backward", &kernels::leaky_relu::leaky_relu_backward)

TORCH_LIBRARY_IMPL(kernels, CPU, m) { KERNELS_LEAKY_RELU_IMPLS(m); }
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) { KERNELS_LEAKY_RELU_IMPLS(m); }
#endif
#undef KERNELS_LEAKY_RELU_IMPLS
