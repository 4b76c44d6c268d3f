// The sum of a (..., columns) tensor over its rows (every dimension but the last), 0-size dimensions included: a
// norm's weight and bias gradients from per-element terms.
#pragma once

#include <ATen/core/Tensor.h>

#include <numeric>
#include <vector>

namespace kernels::common {

inline at::Tensor leading_sum(const at::Tensor& t) {
  std::vector<int64_t> rows(t.dim() - 1);
  std::iota(rows.begin(), rows.end(), int64_t{0});
  return rows.empty() ? t : t.sum(rows);
}

}  // namespace kernels::common
