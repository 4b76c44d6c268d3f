// The torch side of the GELU (tanh approximation) family of `torch.ops.kernels`: schemas, argument checks, and the
// dispatch to the CPU loop (here) or the CUDA kernels (the plain launchers of gelu_tanh.cu, gelu_tanh.h), on the
// current stream of the tensor's own device. Both evaluate the formula of gelu_tanh_math.h. Fake (meta)
// implementations are registered in gelu_tanh.py; the Autograd kernels are in gelu_tanh_autograd.cpp.
//
// Ops: gelu_tanh(x) -> y, gelu_tanh_backward(grad_output, x) -> grad_input.
//
// Built with KERNELS_WITH_CUDA where torch has CUDA and a GPU is visible; without it, the library is CPU-only.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>

#include "common/torch_checks.h"
#include "gelu_tanh_math.h"

#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "gelu_tanh.h"
#endif

namespace kernels::gelu_tanh {
namespace {

using common::check_float_tensor;
using common::element_type;
using common::check_same;
using common::in_layout_of;
using common::output_like;
using common::shape_str;

// ---- CPU: a plain loop over the elements, in float (double for double), rounded once ------------------------------

template <typename T> struct CpuOpMath { using type = float; };
template <> struct CpuOpMath<double> { using type = double; };

constexpr int64_t kCpuGrain = 1 << 14;  // elements per at::parallel_for chunk

template <typename T>
void cpu_forward(const T* x, T* y, int64_t n) {
  using Op = typename CpuOpMath<T>::type;
  at::parallel_for(0, n, kCpuGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) y[i] = static_cast<T>(gelu_tanh_element<Op>(static_cast<Op>(x[i])));
  });
}

template <typename T>
void cpu_backward(const T* grad_output, const T* x, T* grad_input, int64_t n) {
  using Op = typename CpuOpMath<T>::type;
  at::parallel_for(0, n, kCpuGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      grad_input[i] =
          static_cast<T>(gelu_tanh_backward_element<Op>(static_cast<Op>(grad_output[i]), static_cast<Op>(x[i])));
  });
}

// Calls fn(T{}) with T the C++ type of `type` (one of the four the checks admit).
template <typename Fn>
void with_element_type(at::ScalarType type, const Fn& fn) {
  switch (type) {
    case at::kDouble: return fn(double{});
    case at::kHalf: return fn(c10::Half{});
    case at::kBFloat16: return fn(c10::BFloat16{});
    default: return fn(float{});
  }
}

#ifdef KERNELS_WITH_CUDA
#endif

// ---- runners: the operands share one dense layout -----------------------------------------------------------------

void run_forward(const at::Tensor& x, const at::Tensor& y) {
  const int64_t n = x.numel();
  if (n == 0) return;
#ifdef KERNELS_WITH_CUDA
  if (x.is_cuda()) {
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaError_t err = launch_gelu_tanh(element_type(x.scalar_type()), x.const_data_ptr(), y.mutable_data_ptr(),
                                             n, c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    TORCH_CHECK(err == cudaSuccess, "kernels: the gelu_tanh kernel failed to launch: ", cudaGetErrorString(err));
    return;
  }
#endif
  TORCH_CHECK(x.is_cpu(), "kernels.gelu_tanh: no implementation for tensors on ", x.device().str());
  with_element_type(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    cpu_forward(static_cast<const T*>(x.const_data_ptr()), static_cast<T*>(y.mutable_data_ptr()), n);
  });
}

void run_backward(const at::Tensor& grad_output, const at::Tensor& x, const at::Tensor& grad_input) {
  const int64_t n = grad_output.numel();
  if (n == 0) return;
#ifdef KERNELS_WITH_CUDA
  if (x.is_cuda()) {
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaError_t err = launch_gelu_tanh_backward(
        element_type(x.scalar_type()), grad_output.const_data_ptr(), x.const_data_ptr(),
        grad_input.mutable_data_ptr(), n, c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    TORCH_CHECK(err == cudaSuccess, "kernels: the gelu_tanh backward kernel failed to launch: ",
                cudaGetErrorString(err));
    return;
  }
#endif
  TORCH_CHECK(x.is_cpu(), "kernels.gelu_tanh_backward: no implementation for tensors on ", x.device().str());
  with_element_type(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    cpu_backward(static_cast<const T*>(grad_output.const_data_ptr()), static_cast<const T*>(x.const_data_ptr()),
                 static_cast<T*>(grad_input.mutable_data_ptr()), n);
  });
}

// ---- ops --------------------------------------------------------------------------------------------------------

at::Tensor gelu_tanh(const at::Tensor& x) {
  check_float_tensor("gelu_tanh", "x", x);
  // Eager's output layout: x's strides if x is dense (a transpose too), contiguous otherwise.
  at::Tensor y = output_like(x);
  run_forward(in_layout_of(x, y), y);
  return y;
}

at::Tensor gelu_tanh_backward(const at::Tensor& grad_output, const at::Tensor& x) {
  check_float_tensor("gelu_tanh_backward", "grad_output", grad_output);
  TORCH_CHECK(x.defined(), "kernels.gelu_tanh_backward: x is an undefined tensor");
  check_same("gelu_tanh_backward", "x", x, "grad_output", grad_output);
  TORCH_CHECK(x.sizes() == grad_output.sizes(), "kernels.gelu_tanh_backward: grad_output has shape ",
              shape_str(grad_output.sizes()), " but x has shape ", shape_str(x.sizes()));
  at::Tensor grad_input = output_like(grad_output);
  run_backward(in_layout_of(grad_output, grad_input), in_layout_of(x, grad_input), grad_input);
  return grad_input;
}

}  // namespace
}  // namespace kernels::gelu_tanh

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("gelu_tanh(Tensor x) -> Tensor");
  m.def("gelu_tanh_backward(Tensor grad_output, Tensor x) -> Tensor");
}

// The same functions serve both devices: each picks the CPU loop or the CUDA launch by the tensors' device.
TORCH_LIBRARY_IMPL(kernels, CPU, m) {
  m.impl("gelu_tanh", &kernels::gelu_tanh::gelu_tanh);
  m.impl("gelu_tanh_backward", &kernels::gelu_tanh::gelu_tanh_backward);
}
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) {
  m.impl("gelu_tanh", &kernels::gelu_tanh::gelu_tanh);
  m.impl("gelu_tanh_backward", &kernels::gelu_tanh::gelu_tanh_backward);
}
#endif
