// The torch side of the SwiGLU gate family of `torch.ops.kernels`: schemas, argument checks, and the dispatch to the
// CUDA kernels (silu_mul.h, on the current stream of the tensors' own device) or to the ATen formulas of
// silu_mul_op.h (CPU tensors). Fake (meta) implementations are registered in silu_mul.py; the Autograd kernels are in
// silu_mul_autograd.cpp, joined after this file.
//
// Ops: silu_mul(gate, up) = silu(gate) * up (LLaMA's MLP gate, `act_fn(gate_proj(x)) * up_proj(x)`);
// silu_mul_backward(grad_y, gate, up) = (grad_gate, grad_up).
//
// Built with KERNELS_WITH_CUDA where torch has CUDA and a GPU is visible; without it, the library is CPU-only.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

#include "common/torch_checks.h"
#include "silu_mul_op.h"

#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "silu_mul.h"
#endif

namespace kernels::silu_mul {
namespace {

using common::check_float_tensor;
using common::check_same;
using common::element_type;
using common::shape_str;

void check_operand(const char* op, const char* name, const at::Tensor& t, const at::Tensor& gate) {
  check_float_tensor(op, name, t);
  check_same(op, name, t, "gate", gate);
  TORCH_CHECK(t.sizes() == gate.sizes(), "kernels.", op, ": ", name, " has shape ", shape_str(t.sizes()),
              " but gate has shape ", shape_str(gate.sizes()));
}

#ifdef KERNELS_WITH_CUDA
cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

// ---- ops --------------------------------------------------------------------------------------------------------

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_float_tensor("silu_mul", "gate", gate);
  check_operand("silu_mul", "up", up, gate);
#ifdef KERNELS_WITH_CUDA
  if (gate.is_cuda()) {
    const c10::cuda::CUDAGuard guard(gate.device());
    const at::Tensor g = gate.contiguous(), u = up.contiguous();  // the kernels walk one dense order
    at::Tensor y = at::empty(gate.sizes(), gate.options());
    const cudaError_t err = launch_silu_mul(element_type(gate.scalar_type()), g.const_data_ptr(), u.const_data_ptr(),
                                            y.mutable_data_ptr(), gate.numel(), stream_of(gate));
    TORCH_CHECK(err == cudaSuccess, "kernels: the silu_mul kernel failed to launch: ", cudaGetErrorString(err));
    return y;
  }
#endif
  TORCH_CHECK(gate.is_cpu() || gate.is_cuda(), "kernels.silu_mul: no implementation for tensors on ",
              gate.device().str());
  return silu_mul_aten(gate, up);
}

std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad_y, const at::Tensor& gate,
                                                     const at::Tensor& up) {
  check_float_tensor("silu_mul_backward", "gate", gate);
  check_operand("silu_mul_backward", "up", up, gate);
  check_operand("silu_mul_backward", "grad_y", grad_y, gate);
#ifdef KERNELS_WITH_CUDA
  if (gate.is_cuda()) {
    const c10::cuda::CUDAGuard guard(gate.device());
    const at::Tensor dy = grad_y.contiguous(), g = gate.contiguous(), u = up.contiguous();
    at::Tensor grad_gate = at::empty(gate.sizes(), gate.options()), grad_up = at::empty(gate.sizes(), gate.options());
    const cudaError_t err = launch_silu_mul_backward(
        element_type(gate.scalar_type()), dy.const_data_ptr(), g.const_data_ptr(), u.const_data_ptr(),
        grad_gate.mutable_data_ptr(), grad_up.mutable_data_ptr(), gate.numel(), stream_of(gate));
    TORCH_CHECK(err == cudaSuccess, "kernels: the silu_mul backward kernel failed to launch: ",
                cudaGetErrorString(err));
    return {grad_gate, grad_up};
  }
#endif
  TORCH_CHECK(gate.is_cpu() || gate.is_cuda(), "kernels.silu_mul_backward: no implementation for tensors on ",
              gate.device().str());
  return silu_mul_backward_aten(grad_y, gate, up);
}

}  // namespace
}  // namespace kernels::silu_mul

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_mul_backward(Tensor grad_y, Tensor gate, Tensor up) -> (Tensor, Tensor)");
}

// The same functions serve both devices: each picks the CUDA kernels or the ATen formulas by the tensors' device.
#define KERNELS_SILU_MUL_IMPLS(m)                                  \
  m.impl("silu_mul", &kernels::silu_mul::silu_mul);                \
  m.impl("silu_mul_backward", &kernels::silu_mul::silu_mul_backward)

TORCH_LIBRARY_IMPL(kernels, CPU, m) { KERNELS_SILU_MUL_IMPLS(m); }
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) { KERNELS_SILU_MUL_IMPLS(m); }
#endif
#undef KERNELS_SILU_MUL_IMPLS
