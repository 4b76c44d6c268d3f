// Host launchers of the LeakyReLU kernels (leaky_relu.cu): the only interface between them and the torch side
// (leaky_relu.cpp). Plain C++ and the CUDA runtime only (no torch headers), so leaky_relu.cu compiles on its own
// with nvcc. Every launcher returns the launch's cudaError_t; it never synchronizes.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/element_type.h"

namespace kernels::leaky_relu {

using common::ElementType;

// y[i] = leaky_relu(x[i] * multiplier, negative_slope) over n elements that x and y store in the same order.
// The arithmetic is done in float (double for kFloat64); multiplier == 1 skips the multiply, so that path is
// exactly F.leaky_relu. If positive is not null, positive[i] = 1 where x[i] * multiplier > 0, else 0 (the branch
// the backward needs). x may equal y (in place). Any alignment works; 16-byte aligned pointers take the
// vectorized path.
cudaError_t launch_multiply_leaky_relu(ElementType type, const void* x, void* y, std::uint8_t* positive,
                                       std::int64_t n, double multiplier, double negative_slope,
                                       cudaStream_t stream);

// grad_in[i] = (positive(i) ? grad_out[i] : grad_out[i] * negative_slope) * multiplier, with the multiply
// skipped when multiplier == 1. positive(i) is mask[i] != 0 if mask is not null, else saved[i] > 0, where saved
// is the activation's input (or its output, when negative_slope >= 0: then the two have the same sign test).
cudaError_t launch_leaky_relu_backward(ElementType type, const void* grad_out, const void* saved,
                                       const std::uint8_t* mask, void* grad_in, std::int64_t n,
                                       double multiplier, double negative_slope, cudaStream_t stream);

}  // namespace kernels::leaky_relu
