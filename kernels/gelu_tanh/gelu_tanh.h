// Host launchers of the GELU (tanh approximation) kernels (gelu_tanh.cu): the only interface between them and the
// torch side (gelu_tanh.cpp). Plain C++ and the CUDA runtime only (no torch headers). Every launcher returns the
// launch's cudaError_t; it never synchronizes.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/element_type.h"

namespace kernels::gelu_tanh {

using common::ElementType;

// y[i] = gelu_tanh(x[i]) over n elements that x and y store in the same order, computed in float (double for
// kFloat64) and rounded once. Any alignment works; 16-byte aligned pointers take the vectorized path.
cudaError_t launch_gelu_tanh(ElementType type, const void* x, void* y, std::int64_t n, cudaStream_t stream);

// grad_input[i] = grad_output[i] * gelu_tanh'(x[i]), the same way; the three share one element order.
cudaError_t launch_gelu_tanh_backward(ElementType type, const void* grad_output, const void* x, void* grad_input,
                                      std::int64_t n, cudaStream_t stream);

}  // namespace kernels::gelu_tanh
