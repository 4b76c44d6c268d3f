// Host launchers of the causal softmax kernels (causal_softmax.cu): the only interface between them and the torch
// side (causal_softmax.cpp). Plain C++ and the CUDA runtime only (no torch headers), so causal_softmax.cu compiles
// on its own with nvcc. Every launcher returns the launch's cudaError_t; it never synchronizes.
//
// Both operate on `rows` contiguous rows of `columns` elements, row r being row r % query_rows of its matrix. In
// matrix row i, column j is masked where j > i + columns - query_rows (the causal mask, aligned on the last column:
// j > i for square matrices); a row has visible_columns(i) = clamp(i + columns - query_rows + 1, 0, columns)
// unmasked columns, the first ones. Masked inputs are never read.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/element_type.h"

namespace kernels::causal_softmax {

// The kernels take kFloat32, kFloat16 and kBFloat16 (float64 takes the torch side's ATen path).
using common::ElementType;

// output = softmax(scores * scale) over each row, masked entries as -inf: t = scores * scale rounded to float once,
// then max, exp(t - max), the sum, exp(t - max) / sum, as eager's softmax; the sum accumulated in double. Masked
// outputs are exp(-inf - max) / sum: 0, or NaN in a row whose result is NaN (as eager's masked_fill + softmax).
cudaError_t launch_causal_softmax(ElementType type, const void* scores, void* output, std::int64_t rows,
                                  std::int64_t query_rows, std::int64_t columns, float scale, cudaStream_t stream);

// grad_scores = scale * output * (grad_output - sum(grad_output * output)) over each row's unmasked columns, the
// exact products summed in double; masked entries 0 * scale (grad_output there is not read).
cudaError_t launch_causal_softmax_backward(ElementType type, const void* grad_output, const void* output,
                                           void* grad_scores, std::int64_t rows, std::int64_t query_rows,
                                           std::int64_t columns, float scale, cudaStream_t stream);

}  // namespace kernels::causal_softmax
