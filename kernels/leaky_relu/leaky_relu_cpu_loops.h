// The CPU loops of the LeakyReLU family (leaky_relu_cpu_loops.cpp): the CPU's counterpart of leaky_relu.h's
// launchers, with the same contracts, over raw pointers. The torch side (leaky_relu.cpp) reaches them through a
// table of function pointers, because the loader may build them into a library of their own: where the machine has
// a CPU for each unit, their code generation (about a third of the family's C++ unit) compiles beside the op library
// instead of inside it, and the loader hands the table to the op library once both are loaded (kernels/loader.py).
// Elsewhere their file is joined into the op library's unit, which then reads the table directly.
#pragma once

#include <cstdint>

#include "common/element_type.h"

namespace kernels::leaky_relu {

using common::ElementType;

struct CpuLoops {
  // y[i] = leaky_relu(x[i] * multiplier, negative_slope); positive[i] = x[i] * multiplier > 0 where positive is not
  // null (leaky_relu.h, launch_multiply_leaky_relu). x may equal y.
  void (*multiply_leaky_relu)(ElementType type, const void* x, void* y, std::uint8_t* positive, std::int64_t n,
                              double multiplier, double negative_slope, bool aten_vectorized);
  // grad_in[i] = (positive(i) ? grad_out[i] : grad_out[i] * negative_slope) * multiplier, positive(i) from mask
  // where it is not null, else saved[i] > 0 (leaky_relu.h, launch_leaky_relu_backward).
  void (*leaky_relu_backward)(ElementType type, const void* grad_out, const void* saved, const std::uint8_t* mask,
                              void* grad_in, std::int64_t n, double multiplier, double negative_slope,
                              bool aten_vectorized);
  // The build of the loops that the two above take: "avx2" or "generic".
  const char* (*isa)(bool aten_vectorized);
};
// Both take the work over ATen's intra-op threads (at::parallel_for). aten_vectorized: whether ATen runs its own
// vectorized CPU kernels (at::get_cpu_capability() is not "DEFAULT", which ATEN_CPU_CAPABILITY=default forces); only
// then, and where the CPU has AVX2, FMA and F16C, do the loops take their AVX2 build. The torch side reads it, so
// that this file needs no more of ATen than its vector and parallel headers.

}  // namespace kernels::leaky_relu

// This build's loops. A C name, so that the loader finds it in the loops' library with ctypes.
extern "C" const kernels::leaky_relu::CpuLoops* kernels_leaky_relu_cpu_loops();
