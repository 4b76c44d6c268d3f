// Host launchers of the LayerNorm kernels (layer_norm.cu): the only interface between them and the torch side
// (layer_norm.cpp). Plain C++ and the CUDA runtime only (no torch headers). Every launcher returns the launch's
// cudaError_t; it never synchronizes.
//
// Both operate on `rows` contiguous rows of `columns` elements, normalized over each row (nn.LayerNorm's formula with
// a weight and a bias): mean = sum(x) / columns, var = sum((x - mean)^2) / columns, rstd = 1 / sqrt(var + eps),
// y = (x - mean) rstd weight + bias. Sums, mean, rstd and each result are computed in double, each result rounded to
// x's type once (float16 and bfloat16 through a float rounded to odd).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/element_type.h"

namespace kernels::layer_norm {

// The kernels take kFloat32, kFloat16 and kBFloat16 (float64 takes the torch side's ATen path).
using common::ElementType;

// Whether the kernels take rows of `columns` elements: a row is held in registers, up to 4096 elements where the
// columns are a multiple of 16 bytes and every pointer 16-byte aligned (`aligned`), else 2048.
bool layer_norm_fits(ElementType type, std::int64_t columns, bool aligned);

// y's row split as the GEMM family's row pass makes it for split_fp16's kernel (gemm/gemm.h, launch_split_rows, in
// split_position's order): hi and lo, rows x split_row_length(columns) fp16 each, and each row's power of two
// (kNonFiniteRow where the row holds an infinity or NaN), the same bits.
struct RowSplitOut {
  void* hi = nullptr;
  void* lo = nullptr;
  std::int32_t* exponent = nullptr;
};

// Whether the forward writes y's row split beside y (launch_layer_norm's split): float32 rows of a multiple of 4
// elements that the kernels hold in 16-byte packs (`aligned`).
bool layer_norm_leaves_row_split(ElementType type, std::int64_t columns, bool aligned);

// y = (x - mean) rstd weight + bias per row, as above. With a residual (else both nullptr): sum = x + residual,
// rounded to x's type as an elementwise add rounds it, is written, and y is the LayerNorm of sum. With split (where
// layer_norm_leaves_row_split holds; else cudaErrorInvalidValue), y's row split is written too.
cudaError_t launch_layer_norm(ElementType type, const void* x, const void* residual, const void* weight,
                              const void* bias, void* sum, void* y, std::int64_t rows, std::int64_t columns,
                              double eps, cudaStream_t stream, const RowSplitOut* split = nullptr);

// The blocks of launch_layer_norm_backward on `device`: each writes one row of `partials`, 2 x columns doubles.
int layer_norm_backward_blocks(int device, std::int64_t rows);

// With g = grad_y, h = (x - mean) rstd: grad_x = rstd (g w - mean(g w) - h mean(g w h)) per row, in double and rounded
// once; grad_weight = the sum over rows of g h, grad_bias = the sum over rows of g: each block's rows summed in double
// into its row of `partials` (layer_norm_backward_blocks(device, rows) rows of 2 x columns doubles: g h, then g), then
// those rows added in order: the same bits every run. Where grad_residual is not nullptr (the gradient x gets through
// its other uses, a residual connection), it is added to grad_x in double before the one rounding.
// cudaErrorNotSupported, before any launch, where the rows' partial sums and staged rows take more shared memory than
// a block of the device holds, or than shared_limit where that is not 0 (tests: the refusal on any GPU); the torch
// side then takes the ATen formulas.
cudaError_t launch_layer_norm_backward(ElementType type, const void* grad_y, const void* x, const void* weight,
                                       const void* grad_residual, void* grad_x, void* grad_weight, void* grad_bias,
                                       double* partials, int blocks, std::int64_t rows, std::int64_t columns,
                                       double eps, std::size_t shared_limit, cudaStream_t stream);

}  // namespace kernels::layer_norm
