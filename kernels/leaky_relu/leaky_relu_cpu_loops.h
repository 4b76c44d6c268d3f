// The CPU loops of the LeakyReLU family (leaky_relu_cpu_loops.cpp): the CPU's counterpart of leaky_relu.h's
// launchers, with the same contracts, over raw pointers, called by the torch side (leaky_relu.cpp).
#pragma once

#include <cstdint>

#include "common/element_type.h"

namespace kernels::leaky_relu {

using common::ElementType;

// Each loop runs over ATen's intra-op threads (at::parallel_for). aten_vectorized: whether ATen runs its own vectorized
// CPU kernels (at::get_cpu_capability() is not "DEFAULT"); only then, and where the CPU has AVX2, FMA and F16C, do the
// loops take their AVX2 build. The caller reads it, so that the loops need no more of ATen than its vector headers.
// y[i] = leaky_relu(x[i] * multiplier, negative_slope); positive[i] = x[i] * multiplier > 0 where positive is not
// null (leaky_relu.h, launch_multiply_leaky_relu). x may equal y.
void cpu_multiply_leaky_relu(ElementType type, const void* x, void* y, std::uint8_t* positive, std::int64_t n,
                             double multiplier, double negative_slope, bool aten_vectorized);
// grad_in[i] = (positive(i) ? grad_out[i] : grad_out[i] * negative_slope) * multiplier, positive(i) from mask
// where it is not null, else saved[i] > 0 (leaky_relu.h, launch_leaky_relu_backward).
void cpu_leaky_relu_backward(ElementType type, const void* grad_out, const void* saved, const std::uint8_t* mask,
                             void* grad_in, std::int64_t n, double multiplier, double negative_slope,
                             bool aten_vectorized);
// The build of the loops that the two above take: "avx2" or "generic".
const char* cpu_loops_isa(bool aten_vectorized);

}  // namespace kernels::leaky_relu
