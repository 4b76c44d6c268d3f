// The SwiGLU gate family's ops as C++ code calls them (through the dispatcher), and its formulas in ATen ops: the path
// of CPU tensors (silu_mul.cpp), and the differentiable form the autograd uses for higher orders and forward mode
// (silu_mul_autograd.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/sigmoid.h>

#include <tuple>

namespace kernels::silu_mul {

using SiluMul = at::Tensor(const at::Tensor& gate, const at::Tensor& up);
using SiluMulBackward = std::tuple<at::Tensor, at::Tensor>(const at::Tensor& grad_y, const at::Tensor& gate,
                                                           const at::Tensor& up);

// kernels::silu_mul, looked up once.
inline const c10::TypedOperatorHandle<SiluMul>& silu_mul_op() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("kernels::silu_mul", "").typed<SiluMul>();
  return op;
}

// kernels::silu_mul_backward, looked up once.
inline const c10::TypedOperatorHandle<SiluMulBackward>& silu_mul_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kernels::silu_mul_backward", "").typed<SiluMulBackward>();
  return op;
}

// sigma = 1 / (1 + exp(-gate)) in double (the kernels' arithmetic).
inline at::Tensor sigma_of(const at::Tensor& gate) { return at::sigmoid(gate.to(at::kDouble)); }

// y = gate sigma(gate) up, in double, rounded to gate's type (float16 and bfloat16 through float: rounding to nearest
// twice can land an ulp from the kernels' single rounding); contiguous, as the kernels' results and the fakes' are.
inline at::Tensor silu_mul_aten(const at::Tensor& gate, const at::Tensor& up) {
  const at::Tensor g = gate.to(at::kDouble);
  return g.mul(sigma_of(gate)).mul(up.to(at::kDouble)).to(gate.scalar_type()).contiguous();
}

// grad_up = grad_y gate sigma, in double, rounded as y is (contiguous): what a backward needs of gate alone.
inline at::Tensor silu_mul_up_gradient_aten(const at::Tensor& grad_y, const at::Tensor& gate) {
  return grad_y.to(at::kDouble).mul(gate.to(at::kDouble).mul(sigma_of(gate))).to(gate.scalar_type()).contiguous();
}

// grad_gate = grad_y up sigma (1 + gate (1 - sigma)), grad_up = grad_y gate sigma, in double, each rounded as y is
// (contiguous).
inline std::tuple<at::Tensor, at::Tensor> silu_mul_backward_aten(const at::Tensor& grad_y, const at::Tensor& gate,
                                                                 const at::Tensor& up) {
  const at::Tensor dy = grad_y.to(at::kDouble), g = gate.to(at::kDouble), sigma = sigma_of(gate);
  const at::Tensor grad_up = silu_mul_up_gradient_aten(grad_y, gate);
  const at::Tensor grad_gate = dy.mul(up.to(at::kDouble))
                                   .mul(sigma)
                                   .mul(g.mul(sigma.neg().add(1.0)).add(1.0))
                                   .to(gate.scalar_type())
                                   .contiguous();
  return {grad_gate, grad_up};
}

}  // namespace kernels::silu_mul
