// The element types of every family's plain launchers and loops (CUDA kernels, CPU loops), one enum for all. No torch
// or CUDA headers: the torch side maps at::ScalarType onto it (torch_checks.h, element_type).
#pragma once

namespace kernels::common {

enum class ElementType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

}  // namespace kernels::common
