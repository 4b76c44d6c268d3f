// The torch side of the causal softmax family of `torch.ops.kernels`: schemas, argument checks, and the dispatch to
// the CUDA kernels (causal_softmax.h, on the current stream of the tensor's own device) or to ATen's ops (CPU
// tensors, float64 on either device). Fake (meta) implementations are registered in causal_softmax.py; the ops'
// Autograd kernels are in causal_softmax_autograd.cpp, joined after this file.
//
// Ops: causal_softmax(scores, scale) = softmax(scores * scale with the entries above the causal diagonal as -inf,
// dim=-1), over the last two dimensions (query rows, key columns), in the scores' dtype; causal_softmax_backward.
//
// Built with KERNELS_WITH_CUDA where torch has CUDA and a GPU is visible; without it, the library is CPU-only.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_softmax.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "causal_softmax_op.h"
#include "common/torch_checks.h"

#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "causal_softmax.h"
#endif

namespace kernels::causal_softmax {
namespace {

using common::check_float_tensor;
using common::element_type;
using common::shape_str;

void check_scores(const char* op, const char* name, const at::Tensor& t) {
  check_float_tensor(op, name, t);
  TORCH_CHECK(t.dim() >= 2, "kernels.", op, ": ", name, " must have at least 2 dimensions (..., query rows, key "
              "columns), got shape ", shape_str(t.sizes()));
}

// The type the arithmetic is done in: float, or double for double.
at::ScalarType compute_type(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// What a masked entry of the gradient is: 0 * scale, in the arithmetic's type (NaN for an infinite scale, as eager's
// multiply gives).
double masked_gradient(const at::Tensor& t, double scale) {
  return t.scalar_type() == at::kDouble ? 0.0 * scale : static_cast<double>(0.0f * static_cast<float>(scale));
}

// ---- the ATen paths: CPU tensors, and float64 on any device ----------------------------------------------------

at::Tensor causal_softmax_aten(const at::Tensor& scores, double scale) {
  const at::Tensor scaled = scores.to(compute_type(scores)).mul(scale);
  const at::Tensor masked = scaled.masked_fill(masked_entries(scores), -std::numeric_limits<double>::infinity());
  return at::_softmax(masked, -1, false).to(scores.scalar_type()).contiguous();
}

at::Tensor causal_softmax_backward_aten(const at::Tensor& grad_output, const at::Tensor& output, double scale) {
  const at::Tensor mask = masked_entries(output);
  const at::Tensor dy = grad_output.to(compute_type(output)), y = output.to(compute_type(output));
  // The row's sum(dy * y) over its unmasked entries, in double (the kernels' too).
  const at::Tensor dot =
      grad_output.to(at::kDouble).mul(output.to(at::kDouble)).masked_fill(mask, 0).sum(-1, true).to(y.scalar_type());
  const at::Tensor grad = y.mul(dy.sub(dot)).mul(scale).masked_fill(mask, masked_gradient(output, scale));
  return grad.to(output.scalar_type()).contiguous();
}

#ifdef KERNELS_WITH_CUDA

bool takes_kernel(const at::Tensor& t) { return t.is_cuda() && t.scalar_type() != at::kDouble; }
#endif

// ---- ops --------------------------------------------------------------------------------------------------------

at::Tensor causal_softmax(const at::Tensor& scores, double scale) {
  check_scores("causal_softmax", "scores", scores);
  if (scores.numel() == 0) return at::empty(scores.sizes(), scores.options());
#ifdef KERNELS_WITH_CUDA
  if (takes_kernel(scores)) {
    const c10::cuda::CUDAGuard guard(scores.device());
    const at::Tensor x = scores.contiguous();  // the kernels read rows of contiguous memory
    at::Tensor y = at::empty(scores.sizes(), scores.options());
    const cudaError_t err = launch_causal_softmax(
        element_type(x.scalar_type()), x.const_data_ptr(), y.mutable_data_ptr(), x.numel() / x.size(-1),
        x.size(-2), x.size(-1), static_cast<float>(scale),
        c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    TORCH_CHECK(err == cudaSuccess, "kernels: the causal_softmax kernel failed to launch: ", cudaGetErrorString(err));
    return y;
  }
#endif
  TORCH_CHECK(scores.is_cpu() || scores.is_cuda(), "kernels.causal_softmax: no implementation for tensors on ",
              scores.device().str());
  return causal_softmax_aten(scores, scale);
}

at::Tensor causal_softmax_backward(const at::Tensor& grad_output, const at::Tensor& output, double scale) {
  check_scores("causal_softmax_backward", "grad_output", grad_output);
  check_scores("causal_softmax_backward", "output", output);
  common::check_same("causal_softmax_backward", "grad_output", grad_output, "output", output);
  TORCH_CHECK(grad_output.sizes() == output.sizes(), "kernels.causal_softmax_backward: grad_output has shape ",
              shape_str(grad_output.sizes()), " but output has shape ", shape_str(output.sizes()));
  if (output.numel() == 0) return at::empty(output.sizes(), output.options());
#ifdef KERNELS_WITH_CUDA
  if (takes_kernel(output)) {
    const c10::cuda::CUDAGuard guard(output.device());
    const at::Tensor dy = grad_output.contiguous(), y = output.contiguous();
    at::Tensor grad = at::empty(output.sizes(), output.options());
    const cudaError_t err = launch_causal_softmax_backward(
        element_type(y.scalar_type()), dy.const_data_ptr(), y.const_data_ptr(), grad.mutable_data_ptr(),
        y.numel() / y.size(-1), y.size(-2), y.size(-1), static_cast<float>(scale),
        c10::cuda::getCurrentCUDAStream(y.device().index()).stream());
    TORCH_CHECK(err == cudaSuccess, "kernels: the causal_softmax backward kernel failed to launch: ",
                cudaGetErrorString(err));
    return grad;
  }
#endif
  TORCH_CHECK(output.is_cpu() || output.is_cuda(), "kernels.causal_softmax_backward: no implementation for tensors "
              "on ", output.device().str());
  return causal_softmax_backward_aten(grad_output, output, scale);
}

}  // namespace
}  // namespace kernels::causal_softmax

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("causal_softmax(Tensor scores, float scale) -> Tensor");
  m.def("causal_softmax_backward(Tensor grad_output, Tensor output, float scale) -> Tensor");
}

// The same functions serve both devices: each picks the CUDA kernel or ATen's ops by the tensors' device and dtype.
#define KERNELS_CAUSAL_SOFTMAX_IMPLS(m)                                                   \
  m.impl("causal_softmax", &kernels::causal_softmax::causal_softmax);                     \
  m.impl("causal_softmax_backward", &kernels::causal_softmax::causal_softmax_backward)

TORCH_LIBRARY_IMPL(kernels, CPU, m) { KERNELS_CAUSAL_SOFTMAX_IMPLS(m); }
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) { KERNELS_CAUSAL_SOFTMAX_IMPLS(m); }
#endif
#undef KERNELS_CAUSAL_SOFTMAX_IMPLS
