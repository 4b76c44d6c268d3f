// The element types of the LeakyReLU family's plain launchers: the CUDA kernels' (leaky_relu.h) and the CPU loops'
// (leaky_relu_cpu_loops.h). No torch or CUDA headers: the torch side maps at::ScalarType onto it.
#pragma once

namespace kernels::leaky_relu {

// Element types the element-wise kernels and loops are instantiated for.
enum class ElementType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

}  // namespace kernels::leaky_relu
