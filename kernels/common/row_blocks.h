// Rows a block of the norms' ATen formulas takes at a time (their path below autograd): the formulas' float64
// temporaries are then a block's size (at least one row), whatever x's.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>

namespace kernels::common {

// About 2^18 elements on the CPU (the temporaries stay in cache), 2^22 on a GPU (kernels long enough that their
// launches do not dominate).
inline int64_t rows_per_block(const at::Tensor& x, int64_t columns) {
  const int64_t elements = x.is_cpu() ? int64_t{1} << 18 : int64_t{1} << 22;
  return std::max<int64_t>(1, elements / std::max<int64_t>(columns, 1));
}

// f(x), for an f that maps a (rows, columns) block to a result of its shape, a block of rows at a time.
template <typename F>
at::Tensor by_row_blocks(const at::Tensor& x, F&& f) {
  const int64_t columns = x.size(-1), rows = columns > 0 ? x.numel() / columns : 0;
  const int64_t block = rows_per_block(x, columns);
  if (rows <= block) return f(x);
  const at::Tensor x2 = x.reshape({rows, columns});
  at::Tensor y = at::empty({rows, columns}, x.options());
  for (int64_t start = 0; start < rows; start += block) {
    const int64_t n = std::min(block, rows - start);
    y.narrow(0, start, n).copy_(f(x2.narrow(0, start, n)));
  }
  return y.view(x.sizes());
}

}  // namespace kernels::common
