// The torch side of the RMSNorm family of `torch.ops.kernels`: schemas, argument checks, and the dispatch to the CUDA
// kernels (rms_norm.h, on the current stream of the tensors' own device) or to the ATen formulas of rms_norm_op.h
// (CPU tensors, float64, rows the kernels do not hold). Fake (meta) implementations are registered in rms_norm.py;
// the Autograd kernels are in rms_norm_autograd.cpp, joined after this file.
//
// Ops, over x's last dimension: rms_norm(x, weight, eps) = weight * (x * rsqrt(mean(x^2) + eps)) (LlamaRMSNorm's
// formula); rms_norm_backward(grad_y, x, weight, eps) = (grad_x, grad_weight).
//
// Built with KERNELS_WITH_CUDA where torch has CUDA and a GPU is visible; without it, the library is CPU-only.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "common/torch_checks.h"
#include "rms_norm_op.h"

#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "rms_norm.h"
#endif

namespace kernels::rms_norm {
namespace {

using common::check_float_tensor;
using common::check_same;
using common::element_type;
using common::shape_str;

void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  check_float_tensor(op, "x", x);
  check_float_tensor(op, "weight", weight);
  check_same(op, "weight", weight, "x", x);
  TORCH_CHECK(x.dim() >= 1, "kernels.", op, ": x must have at least 1 dimension (..., normalized), got a scalar");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "kernels.", op, ": weight must have shape [",
              std::to_string(x.size(-1)), "] (x's last dimension), got ", shape_str(weight.sizes()));
}

#ifdef KERNELS_WITH_CUDA
bool aligned(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % 16 == 0; }

// Whether the kernels take x: a CUDA tensor of float32, float16 or bfloat16 whose rows fit (rms_norm_fits).
bool takes_kernel(const at::Tensor& x) { return x.is_cuda() && x.scalar_type() != at::kDouble && x.numel() > 0; }

cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

// ---- ops --------------------------------------------------------------------------------------------------------

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_inputs("rms_norm", x, weight);
#ifdef KERNELS_WITH_CUDA
  if (takes_kernel(x)) {
    const at::Tensor in = x.contiguous(), w = weight.contiguous();  // the kernels read rows of contiguous memory
    const int64_t columns = x.size(-1);
    if (rms_norm_fits(element_type(x.scalar_type()), columns, aligned(in) && aligned(w))) {
      const c10::cuda::CUDAGuard guard(x.device());
      at::Tensor y = at::empty(x.sizes(), x.options());
      const cudaError_t err = launch_rms_norm(element_type(x.scalar_type()), in.const_data_ptr(), w.const_data_ptr(),
                                              y.mutable_data_ptr(), x.numel() / columns, columns, eps, stream_of(x));
      TORCH_CHECK(err == cudaSuccess, "kernels: the rms_norm kernel failed to launch: ", cudaGetErrorString(err));
      return y;
    }
  }
#endif
  TORCH_CHECK(x.is_cpu() || x.is_cuda(), "kernels.rms_norm: no implementation for tensors on ", x.device().str());
  return rms_norm_blocked(x, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const at::Tensor& weight, double eps) {
  check_inputs("rms_norm_backward", x, weight);
  check_float_tensor("rms_norm_backward", "grad_y", grad_y);
  check_same("rms_norm_backward", "grad_y", grad_y, "x", x);
  TORCH_CHECK(grad_y.sizes() == x.sizes(), "kernels.rms_norm_backward: grad_y has shape ", shape_str(grad_y.sizes()),
              " but x has shape ", shape_str(x.sizes()));
#ifdef KERNELS_WITH_CUDA
  if (takes_kernel(x)) {
    const at::Tensor g = grad_y.contiguous(), in = x.contiguous(), w = weight.contiguous();
    const int64_t columns = x.size(-1), rows = x.numel() / columns;
    if (rms_norm_fits(element_type(x.scalar_type()), columns, aligned(g) && aligned(in) && aligned(w))) {
      const c10::cuda::CUDAGuard guard(x.device());
      const int blocks = rms_norm_backward_blocks(x.device().index(), rows);
      at::Tensor grad_x = at::empty(x.sizes(), x.options()), grad_weight = at::empty({columns}, weight.options());
      at::Tensor partials = at::empty({blocks, columns}, x.options().dtype(at::kDouble));
      const cudaError_t err = launch_rms_norm_backward(
          element_type(x.scalar_type()), g.const_data_ptr(), in.const_data_ptr(), w.const_data_ptr(),
          grad_x.mutable_data_ptr(), grad_weight.mutable_data_ptr(), partials.mutable_data_ptr<double>(), blocks, rows,
          columns, eps, stream_of(x));
      TORCH_CHECK(err == cudaSuccess, "kernels: the rms_norm backward kernels failed to launch: ",
                  cudaGetErrorString(err));
      return {grad_x, grad_weight};
    }
  }
#endif
  TORCH_CHECK(x.is_cpu() || x.is_cuda(), "kernels.rms_norm_backward: no implementation for tensors on ",
              x.device().str());
  return rms_norm_backward_blocked(grad_y, x, weight, eps);
}

}  // namespace
}  // namespace kernels::rms_norm

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
}

// The same functions serve both devices: each picks the CUDA kernels or the ATen formulas by the tensors' device,
// dtype and row length.
#define KERNELS_RMS_NORM_IMPLS(m)                                  \
  m.impl("rms_norm", &kernels::rms_norm::rms_norm);                \
  m.impl("rms_norm_backward", &kernels::rms_norm::rms_norm_backward)

TORCH_LIBRARY_IMPL(kernels, CPU, m) { KERNELS_RMS_NORM_IMPLS(m); }
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) { KERNELS_RMS_NORM_IMPLS(m); }
#endif
#undef KERNELS_RMS_NORM_IMPLS
