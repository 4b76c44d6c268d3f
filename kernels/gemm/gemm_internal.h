// What the C++ files of the GEMM family's op library share: the path and shape types, and the functions one file
// defines for another. The loader joins these files into one translation unit (kernels/manifest.py), so these
// declarations and their definitions are in the same anonymous namespace.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#ifdef KERNELS_WITH_CUDA
#include <cuda_runtime_api.h>

#include "gemm.h"
#endif

namespace kernels::gemm {
namespace {

// ---- gemm.cpp: the op's entries ---------------------------------------------------------------------------------
// Raises, naming `op`, unless x, weight and bias are float tensors alike with matching shapes.
void check_gemm_arguments(const char* op, const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias);

// ---- gemm_path.cpp: which path a product takes ------------------------------------------------------------------
// The paths (path_name's names); kAuto: the automatic choice, where no path is forced.
enum class Path : int { kAuto = 0, kCublas = 1, kSplitFp16 = 2, kSplitFp16Sm80 = 3, kCublasBf16x9 = 4 };

// The sizes of a product y (m x n) = x (m x k) times w (n x k)^T, and whether w comes as its transpose (k x n).
struct ProductShape {
  int64_t m, n, k;
  bool w_transposed = false;
};

const char* path_name(Path path);
bool is_split(Path path);
int64_t gemm_rows(const at::Tensor& x);
bool is_transposed_weight(const at::Tensor& weight);
ProductShape linear_shape(const at::Tensor& x, const at::Tensor& weight);
Path choose_path(const at::Tensor& x, ProductShape shape, bool strict = true);
std::string force_path(const std::string& name);
std::string gemm_fp32_path_for_capability(int64_t capability);
std::vector<int64_t> gemm_split_thresholds();
std::string gemm_multiply_leaky_relu_path(const at::Tensor& x, const at::Tensor& weight);
std::string gemm_path_refusal(const at::Tensor& x, const at::Tensor& weight, const std::string& path);

// ---- gemm_products.cpp: each path's products --------------------------------------------------------------------
// w's split made beforehand (gemm_weight_split, kept by the module that owns the weight): the tensors the GEMM reads
// instead of splitting w (launch_split_chunks's hi, lo, chunk exponents and flags); or, for a forward computed
// transposed (rows), the weight's row split (launch_split_rows's hi, lo and row exponents; flags undefined), which that
// product takes as its x's split.
struct WeightSplit {
  at::Tensor hi, lo, exponent, flags;
  bool rows = false;
};

std::tuple<at::Tensor, at::Tensor> cublas_gemm_multiply_leaky_relu(const at::Tensor& x, const at::Tensor& weight,
                                                                   const at::Tensor& bias, double multiplier,
                                                                   double negative_slope, bool return_mask);
at::Tensor split_fp16_matmul(Path path, const at::Tensor& a, bool a_transposed, const at::Tensor& b,
                             float* a_column_sums = nullptr);
at::Tensor cublas_bf16x9_matmul(const at::Tensor& a, const at::Tensor& b);
int64_t force_k_slices(int64_t slices);
int64_t force_transposed(int64_t mode);
int64_t gemm_k_slices(int64_t m, int64_t n, int64_t k);
std::vector<at::Tensor> gemm_split_sweep(const at::Tensor& src, const std::string& sweep);
// x's rows made by its split pass as a GELU's input gradient (launch_split_rows_gelu_backward): the product's x is
// then the GELU's output gradient, and the pass writes grad_pre = x * gelu'(pre) (dense, as x's shape) and splits it.
struct GeluBackwardRows {
  at::Tensor pre;       // the GELU's input, x's shape
  bool tanh;            // the tanh form (gemm_gelu's "tanh"), else the erf form
  at::Tensor grad_pre;  // written by the pass; the product's x from then on (the non-finite fix-up reads it)
};

#ifdef KERNELS_WITH_CUDA
at::Tensor split_operand(const at::Tensor& t);
WeightSplit split_w_chunks(Path path, const at::Tensor& w2, bool w_transposed, int64_t n, int64_t k,
                           cudaStream_t stream);
WeightSplit split_w_rows(const at::Tensor& w, cudaStream_t stream);
void split_fp16_product(Path path, const at::Tensor& x, bool x_transposed, const at::Tensor& w, bool w_transposed,
                        const at::Tensor& bias, const Epilogue& epilogue, at::Tensor& y,
                        std::uint8_t* positive, float* x_column_sums = nullptr,
                        const WeightSplit* w_split = nullptr, const GeluBackwardRows* gelu_rows = nullptr,
                        bool y_transposed = false, const WeightSplit* x_rows = nullptr);
bool gelu_backward_rows_supported(const at::Tensor& grad_y, const at::Tensor& pre);
bool split_product_transposed(Path path, int64_t m, int64_t n, int64_t k);
bool split_product_writes_pre(Path path, const at::Tensor& x, const at::Tensor& weight);
std::tuple<at::Tensor, at::Tensor> split_fp16_gemm_multiply_leaky_relu(Path path, const at::Tensor& x,
                                                                       const at::Tensor& weight,
                                                                       const at::Tensor& bias,
                                                                       const Epilogue& epilogue, bool return_mask,
                                                                       const WeightSplit* w_split);
#endif

// ---- gemm_weight_split.cpp: w's split kept between calls ----------------------------------------------------------
std::vector<at::Tensor> gemm_weight_split(const at::Tensor& x, const at::Tensor& weight);
std::optional<WeightSplit> usable_weight_split(const std::optional<at::TensorList>& weight_split, Path path,
                                               const at::Tensor& x, const at::Tensor& weight);
#ifdef KERNELS_WITH_CUDA
void gemm_leave_row_split(const at::Tensor& y, const at::Tensor& hi, const at::Tensor& lo, const at::Tensor& exponent);
// x's row split left by the op that wrote x (gemm_leave_row_split) where x is that tensor, unchanged; else nullopt.
std::optional<WeightSplit> left_row_split(const at::Tensor& x);
#endif

// ---- gemm_cublas_bf16x9.cpp: the cublas_bf16x9 path's products (CUDA only) ----------------------------------------
#ifdef KERNELS_WITH_CUDA
const char* cublas_bf16x9_refusal(int64_t m, int64_t n, int64_t k);
at::Tensor cublas_bf16x9_addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b);
#endif

}  // namespace
}  // namespace kernels::gemm
