// Host launchers of the SwiGLU gate kernels (silu_mul.cu): the only interface between them and the torch side
// (silu_mul.cpp). Plain C++ and the CUDA runtime only (no torch headers). Every launcher returns the launch's
// cudaError_t; it never synchronizes.
//
// Both walk n elements that their operands store in the same order. The arithmetic is in double, each result rounded
// to the element type once: s = gate / (1 + exp(-gate)) (silu), sigma = 1 / (1 + exp(-gate)).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/element_type.h"

namespace kernels::silu_mul {

using common::ElementType;

// y = s * up.
cudaError_t launch_silu_mul(ElementType type, const void* gate, const void* up, void* y, std::int64_t n,
                            cudaStream_t stream);

// grad_gate = grad_y * up * sigma * (1 + gate * (1 - sigma)), grad_up = grad_y * s.
cudaError_t launch_silu_mul_backward(ElementType type, const void* grad_y, const void* gate, const void* up,
                                     void* grad_gate, void* grad_up, std::int64_t n, cudaStream_t stream);

}  // namespace kernels::silu_mul
