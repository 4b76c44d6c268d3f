// Rows a block of the norms' ATen formulas takes at a time (their path below autograd): the formulas' float64
// temporaries are then a block's size (at least one row), whatever x's.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

namespace kernels::common {

// About 2^18 elements on the CPU (the temporaries stay in cache), 2^22 on a GPU (kernels long enough that their
// launches do not dominate).
inline int64_t rows_per_block(const at::Tensor& x, int64_t columns) {
  const int64_t elements = x.is_cpu() ? int64_t{1} << 18 : int64_t{1} << 22;
  return std::max<int64_t>(1, elements / std::max<int64_t>(columns, 1));
}

}  // namespace kernels::common
