// Host launchers of the RMSNorm kernels (rms_norm.cu): the only interface between them and the torch side
// (rms_norm.cpp). Plain C++ and the CUDA runtime only (no torch headers). Every launcher returns the launch's
// cudaError_t; it never synchronizes.
//
// Both operate on `rows` contiguous rows of `columns` elements, normalized over each row (LlamaRMSNorm's formula):
// r = 1 / sqrt(mean(x^2) + eps), h = x r rounded to x's type, y = weight h. The mean of squares is summed in double and
// r rounded to float once; the arithmetic is in float (kFloat16, kBFloat16: each result rounded to the type once).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "common/element_type.h"

namespace kernels::rms_norm {

// The kernels take kFloat32, kFloat16 and kBFloat16 (float64 takes the torch side's ATen path).
using common::ElementType;

// Whether the kernels take rows of `columns` elements: a row is held in registers, up to 8192 elements where the
// columns are a multiple of 16 bytes and every pointer 16-byte aligned (`aligned`), else 2048.
bool rms_norm_fits(ElementType type, std::int64_t columns, bool aligned);

// y = weight * (x r) per row, as above.
cudaError_t launch_rms_norm(ElementType type, const void* x, const void* weight, void* y, std::int64_t rows,
                            std::int64_t columns, double eps, cudaStream_t stream);

// The blocks of launch_rms_norm_backward on `device`: each writes one row of `partials`, columns doubles.
int rms_norm_backward_blocks(int device, std::int64_t rows);

// grad_x = r (g w - x r^2 mean(g w x)) per row, in double and rounded once (g = grad_y); grad_weight = sum over rows
// of g h, each block's rows summed in double into its row of `partials` (rms_norm_backward_blocks(device, rows) rows
// of `columns` doubles), then those rows added in order: the same bits every run.
cudaError_t launch_rms_norm_backward(ElementType type, const void* grad_y, const void* x, const void* weight,
                                     void* grad_x, void* grad_weight, double* partials, int blocks, std::int64_t rows,
                                     std::int64_t columns, double eps, cudaStream_t stream);

}  // namespace kernels::rms_norm
