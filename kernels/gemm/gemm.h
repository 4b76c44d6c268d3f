// Host launchers of the GEMM family's kernels (gemm_split.cu, gemm_sm90.cu, gemm_sm80.cu): the only interface between
// them and the torch side (gemm_path.cpp, gemm_products.cpp, gemm_weight_split.cpp). Plain C++ and the CUDA runtime
// only (no torch headers); fp16 arrays are passed as void pointers, so this header needs no CUDA half type. Every
// launcher returns the launch's cudaError_t and never synchronizes.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace kernels::gemm {

// The exponent launch_split_rows writes for a row holding a non-finite value (far outside any real row exponent,
// which lies within +-300, and small enough that sums of two do not overflow).
constexpr std::int32_t kNonFiniteRow = 1 << 20;

#ifdef __CUDACC__
#define KERNELS_GEMM_HOST_DEVICE __host__ __device__
#else
#define KERNELS_GEMM_HOST_DEVICE
#endif

// The activation of the GEMM's fused epilogue, applied to v = (product + bias) * multiplier (split_numerics.cuh,
// apply_epilogue).
enum class Activation : std::int32_t {
  kLeakyReLU,  // v where v > 0, else v * negative_slope; `positive` (the backward's mask) gets v > 0
  kGeluErf,    // v * Phi(v), nn.GELU()'s function, as eager computes it: v * 0.5 * (1 + erf(v / sqrt(2)))
  kGeluTanh,   // the tanh approximation, kernels/gelu_tanh's formula (gelu_tanh_math.h)
};

// The fused epilogue's parameters: y = activation((product + bias) * multiplier). No launcher writes a mask for the
// GELU activations. `pre`, where not null, gets the value before a GELU as well, (product + bias) * multiplier, dense
// (m x n): a training forward's, for the GELU's backward. Only the Hopper kernel that reads w's split writes it
// (launch_split_gemm_presplit_multiply_leaky_relu), with K whole and by TMA stores (split_gemm_writes_pre); the other
// launchers return cudaErrorNotSupported for it.
struct Epilogue {
  float multiplier = 1.0f;
  float negative_slope = 1.0f;
  Activation activation = Activation::kLeakyReLU;
  float* pre = nullptr;
};

// Whether the epilogue leaves (product + bias) as it is: a plain linear layer's.
KERNELS_GEMM_HOST_DEVICE constexpr bool is_identity_epilogue(const Epilogue& epilogue) {
  return epilogue.activation == Activation::kLeakyReLU && epilogue.multiplier == 1.0f &&
         epilogue.negative_slope == 1.0f;
}

// The split GEMM's unit along K: w is scaled per row and chunk of kSplitChunk, the accumulator promoted once a chunk.
constexpr int kSplitChunk = 64;

// The length of a row of x's split: k rounded up to whole chunks (the pad is zeros).
KERNELS_GEMM_HOST_DEVICE constexpr std::int64_t split_row_length(std::int64_t k) {
  return (k + kSplitChunk - 1) / kSplitChunk * kSplitChunk;
}

// The distance between chunks in a split of w's chunk exponents (launch_split_chunks): its rows rounded up to a
// multiple of 4, so that each chunk's exponents start 16-byte aligned (TMA's rule) whatever w's row count.
KERNELS_GEMM_HOST_DEVICE constexpr std::int64_t split_exponent_stride(std::int64_t rows) { return (rows + 3) / 4 * 4; }

// The split of x, a float32 matrix, into row-scaled fp16 pairs, for fp32-accurate products on fp16 tensor cores.
// For each row r of src (rows x cols, element (r, c) at src[r * row_stride + c]):
//   exponent[r] = e, the power of two that puts the row's largest finite |value| in [2^13, 2^14) (0 for a row with
//                 no finite nonzero value); exact for any float32, subnormals and the largest values included;
//                 kNonFiniteRow where the row holds an infinity or NaN;
//   hi = fp16(v * 2^e), lo = fp16(v * 2^e - hi), so hi + lo carries about 22 bits of v; a non-finite v gives
//   hi = lo = 0 (launch_nonfinite_outputs then writes the outputs it reaches).
// hi and lo are dense (rows x split_row_length(cols)) fp16 arrays in the order along K that the GEMM reads: k's own
// order (natural_order, for a GEMM given w transposed), else split_numerics.cuh's split_position; the pad zeros.
// Any cols and row_stride: rows of up to 16384 floats, a multiple of 4 and 16-byte aligned, held in registers; other
// rows staged in shared memory where a block's holds one, else (or where staged is false: the generic kernels, for
// tests) read twice.
cudaError_t launch_split_rows(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                              bool natural_order, void* hi, void* lo, std::int32_t* exponent, cudaStream_t stream,
                              bool staged = true);

// launch_split_rows of x (m x k) and launch_split_chunks of w (n x k, as it is, not transposed) in one launch, in the
// same order along K: the two passes before a product whose w is split ahead, without the second's launch and tail.
// Takes rows the in-register kernels hold (k a multiple of 4, split length up to 16384, both 16-byte aligned, rows
// below 2^31); cudaErrorNotSupported else (the two launchers then), launching nothing; cudaErrorInvalidValue where
// x_hi, x_lo, w_hi or w_lo is not 4-byte aligned.
cudaError_t launch_split_rows_and_chunks(const float* x, std::int64_t m, std::int64_t x_stride, void* x_hi, void* x_lo,
                                         std::int32_t* x_exponent, const float* w, std::int64_t n,
                                         std::int64_t w_stride, void* w_hi, void* w_lo,
                                         std::int32_t* w_chunk_exponent, std::int32_t* w_flags, std::int64_t k,
                                         bool natural_order, cudaStream_t stream);

// launch_split_rows of grad_pre = grad_y * gelu'(pre) (split_numerics.cuh, gelu_backward; `gelu` kGeluErf or
// kGeluTanh), the input gradient of a GELU that follows a product (gemm_gelu's backward), made from grad_y and pre
// (rows x cols, rows grad_y_stride and pre_stride floats apart) as the rows are read, and written to grad_pre (dense
// rows x cols, 16-byte aligned) beside its split: one pass instead of the GELU's backward and then the split.
// Returns cudaErrorNotSupported where split_rows_gelu_backward_supported() is false.
cudaError_t launch_split_rows_gelu_backward(const float* grad_y, std::int64_t grad_y_stride, const float* pre,
                                            std::int64_t pre_stride, Activation gelu, std::int64_t rows,
                                            std::int64_t cols, float* grad_pre, bool natural_order, void* hi,
                                            void* lo, std::int32_t* exponent, cudaStream_t stream);

// Whether launch_split_rows_gelu_backward takes these rows: rows the split holds in registers (a multiple of 4
// floats, split length up to 16384), 16-byte aligned in both operands.
bool split_rows_gelu_backward_supported(std::int64_t rows, std::int64_t cols, const float* grad_y,
                                        std::int64_t grad_y_stride, const float* pre, std::int64_t pre_stride);

// The split of src's columns, as launch_split_rows splits rows, in natural order: for each column c of src (rows x
// cols, element (r, c) at src[r * row_stride + c]), row c of hi and lo (cols x split_row_length(rows)) and
// exponent[c]; column_sums[c] (if not null) gets the column's float32 sum (compensated, in a fixed order: the same
// bits on every run). For the products of the backward, whose reduction runs down the columns of grad_pre.
// workspace: split_columns_workspace_bytes(rows, cols) bytes of device memory, 16-byte aligned, any contents, not used
// by another launch on another stream meanwhile. hi and lo 4-byte aligned (cudaErrorInvalidValue else). Each element
// read once from DRAM where the matrix is 16-byte aligned and its tiles fit the device's resident grid, else (or where
// staged is false: for tests) twice, the second time from L2; the same bits either way.
cudaError_t launch_split_columns(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                                 void* hi, void* lo, std::int32_t* exponent, float* column_sums, void* workspace,
                                 cudaStream_t stream, bool staged = true);

// The bytes of workspace launch_split_columns needs for a rows x cols matrix (about 1/32 of its float32 bytes).
std::int64_t split_columns_workspace_bytes(std::int64_t rows, std::int64_t cols);

// The split of w for the sm_80 GEMM (launch_split_gemm_sm80_multiply_leaky_relu): for each row j of w (rows x cols,
// element (j, c) at src[j * row_stride + c]; or, where transposed, w given as its transpose: cols x rows, element
// (j, c) at src[c * row_stride + j]) and each chunk q of kSplitChunk along c, the power of two e that puts the
// chunk's largest finite |value| in [2^13, 2^14) (split_numerics.cuh, scale_exponent), at chunk_exponent[q *
// split_exponent_stride(rows) + j] (the padding columns unwritten); hi = fp16(v 2^e), lo = fp16(v 2^e - hi), dense
// (rows x split_row_length(cols)), the pad zeros, in c's natural order (natural_order; the sm_80 GEMM's) or in
// split_position's (the Hopper GEMM's given split,
// launch_split_gemm_presplit_multiply_leaky_relu); flags[j] = kNonFiniteRow where row j holds an infinity or NaN
// (split as 0), else 0. The same scales and split as the Hopper kernel makes in its registers. Transposed requires
// natural_order; not transposed, cols % 4 == 0, row_stride % 4 == 0 and src 16-byte aligned (cudaErrorInvalidValue
// else).
cudaError_t launch_split_chunks(const float* src, std::int64_t rows, std::int64_t cols, std::int64_t row_stride,
                                bool transposed, bool natural_order, void* hi, void* lo, std::int32_t* chunk_exponent,
                                std::int32_t* flags, cudaStream_t stream);

// y[i, j] = activation((acc[i, j] * 2^-x_exponent[i] + bias[j]) * multiplier) (Epilogue), acc = sum over k of
// x[i, k] w[j, k], from x's split (launch_split_rows) and the float32 w, which the kernel splits itself with a power
// of two per row and chunk of 64 of k: three fp16 tensor-core products (lo_w hi_x + hi_w lo_x + hi_w hi_x), added
// into fp32 registers every 64 of k. w is (n x k) with rows w_stride floats apart, or, where w_transposed, given as
// its transpose (k x n, rows w_stride apart; then n % 4 == 0 and x's split is in natural order); w_stride % 4 == 0,
// w 16-byte aligned. w_flags[j] gets kNonFiniteRow where row j of w holds an infinity or NaN, else 0 (for
// launch_nonfinite_outputs). bias may be null (no bias); positive, if not null, gets 1 where the value before the
// activation is > 0, else 0. y and positive are dense (m x n). Returns cudaErrorNotSupported where
// split_gemm_supported() is false, and for a GELU where w is not transposed (the kernel that reads
// the float32 w untransposed has no room for the GELUs: w's split made ahead takes them,
// launch_split_gemm_presplit_multiply_leaky_relu). With y_transposed, y and positive are (n x m) instead, y[j, i]
// the output of x row i and w row j, bias indexed by i (a forward computed transposed, its x the layer's weight and
// its w the layer's input, written as the layer's output); for w not transposed, LeakyReLU's epilogue (or none) and
// split_gemm_writes_y_transposed(m), y 16-byte aligned (cudaErrorNotSupported else).
cudaError_t launch_split_gemm_multiply_leaky_relu(const void* x_hi, const void* x_lo, const std::int32_t* x_exponent,
                                                  const float* w, std::int64_t w_stride, bool w_transposed,
                                                  std::int32_t* w_flags, const float* bias, float* y,
                                                  std::uint8_t* positive, std::int64_t m, std::int64_t n,
                                                  std::int64_t k, Epilogue epilogue, cudaStream_t stream,
                                                  bool y_transposed = false);

// Whether launch_split_gemm_multiply_leaky_relu writes an output of m columns with y_transposed: by TMA stores, for
// m % 4 == 0, unless KERNELS_GEMM_PLAIN_STORES is set.
bool split_gemm_writes_y_transposed(std::int64_t m);

// The signature of the launchers that take both operands' splits (x's from launch_split_rows, w's from
// launch_split_chunks: w_hi, w_lo and w_exponent its chunk_exponent): one for sm_80 instructions and one for Hopper's,
// declared below; gemm_products.cpp picks one of the two where w's split is made before the GEMM.
using SplitGemmFromSplits = cudaError_t(const void* x_hi, const void* x_lo, const std::int32_t* x_exponent,
                                        const void* w_hi, const void* w_lo, const std::int32_t* w_exponent,
                                        const float* bias, float* y, std::uint8_t* positive, std::int64_t m,
                                        std::int64_t n, std::int64_t k, Epilogue epilogue, cudaStream_t stream);

// The same product and epilogue as launch_split_gemm_multiply_leaky_relu on sm_80 instructions (mma.sync, ldmatrix,
// cp.async), for GPUs from sm_80 on whose blocks may take 129 KB of shared memory (A100, A30, Orin, Hopper, datacenter
// Blackwell; not sm_86, sm_89 or sm_120, whose 99-100 KB is too little): x's split from launch_split_rows in natural
// order, w's from launch_split_chunks (w_exponent: its chunk_exponent). Three fp16 products per 16 of k (hi_x lo_w,
// lo_x hi_w, hi_x hi_w), promoted into fp32 registers every chunk with w's power of two per row and chunk, the epilogue
// fused; y and positive as there. Returns cudaErrorNotSupported where split_gemm_sm80_supported() is false.
SplitGemmFromSplits launch_split_gemm_sm80_multiply_leaky_relu;

// Whether launch_split_gemm_sm80_multiply_leaky_relu can run on `device` for this shape: a GPU of compute capability
// 8.0 or newer whose blocks may take two pipeline stages of shared memory (129 KB), the library built for it,
// k % 4 == 0 (x's split reads 16-byte packs) and sizes whose indices fit its ints.
bool split_gemm_sm80_supported(int device, std::int64_t m, std::int64_t n, std::int64_t k);

// After launch_split_gemm_multiply_leaky_relu (or its sm_80 twin), on the same stream: rewrites the outputs y[i, j]
// (and positive[i, j]) whose row i of x or row j of w is flagged as holding a non-finite value (x_exponent from
// launch_split_rows, w_exponent: the GEMM's w_flags) with eager's non-finite result (NaN, +inf or -inf) through the
// same epilogue. x (m x k) and w (n x k) are the float32 operands the GEMM's were made from: element k of x's row i at
// x[i * x_stride + k * x_element_stride], of w's row j at w[j * w_stride + k * w_element_stride] (element strides > 1
// where an operand was given transposed). Reads only the flags where nothing is flagged. Epilogue::pre, where given,
// gets those outputs' values before the activation too.
cudaError_t launch_nonfinite_outputs(const float* x, std::int64_t x_stride, std::int64_t x_element_stride,
                                     const float* w, std::int64_t w_stride,
                                     std::int64_t w_element_stride, const std::int32_t* x_exponent,
                                     const std::int32_t* w_exponent, const float* bias, float* y,
                                     std::uint8_t* positive, std::int64_t m, std::int64_t n, std::int64_t k,
                                     Epilogue epilogue, cudaStream_t stream);

// y (m x n, dense) = activation((product_t^T + bias) * multiplier) (Epilogue), from product_t (n x m, dense),
// a product computed transposed; bias may be null; positive, if not null, gets 1 where the value before the
// activation is > 0, else 0. The epilogue of split_numerics.cuh, as the GEMM kernels' own.
cudaError_t launch_transposed_epilogue(const float* product_t, const float* bias, float* y, std::uint8_t* positive,
                                      std::int64_t m, std::int64_t n, Epilogue epilogue,
                                      cudaStream_t stream);

// Whether launch_split_gemm_presplit_multiply_leaky_relu, with a GELU and K whole, writes Epilogue::pre for an output
// of n columns: by TMA stores, for n % 4 == 0 (y and pre 16-byte aligned, as fresh allocations are; the launcher
// checks), unless KERNELS_GEMM_PLAIN_STORES is set.
bool split_gemm_writes_pre(std::int64_t n);

// Whether launch_split_gemm_multiply_leaky_relu can run on `device` for this shape: an sm_90 GPU, the library
// built for sm_90a, and a shape its TMA descriptors take (16-byte row strides of w: k % 4 == 0, or, where w comes
// transposed, n % 4 == 0; m, n, k > 0).
bool split_gemm_supported(int device, std::int64_t m, std::int64_t n, std::int64_t k, bool w_transposed = false);

// launch_split_gemm_multiply_leaky_relu's product and epilogue from w's split made beforehand by launch_split_chunks
// (not transposed, in split_position's order: w_hi, w_lo, w_exponent its chunk_exponent; 16-byte aligned) instead of
// the float32 w: the kernel skips its own split of w, and its results are the same, bit for bit. w's non-finite
// rows were flagged by that pass (its flags, for launch_nonfinite_outputs). Returns cudaErrorNotSupported where
// split_gemm_presplit_supported() is false.
SplitGemmFromSplits launch_split_gemm_presplit_multiply_leaky_relu;

// Whether launch_split_gemm_presplit_multiply_leaky_relu can run: split_gemm_supported for w's split rows (any n: the
// chunk exponents' rows are split_exponent_stride(n) apart).
bool split_gemm_presplit_supported(int device, std::int64_t m, std::int64_t n, std::int64_t k);

// Split-K, for products whose output has too few 128 x 128 tiles to fill the multiprocessors and whose K is long
// (grad_W's product, whose reduction runs over the batch; a forward over few rows): each tile's product is computed
// over k_slices slices of K's chunks of kSplitChunk by as many CTAs, each with the kernel's per-chunk promotion, and
// its plain outputs (scaled back by x's row power of two: a true partial of y) written to a workspace; a second kernel
// then adds the slices' partials in slice order (0, 1, ...) into y, so that every run gives the same bits, and applies
// the epilogue (bias, multiplier, activation, mask) to the sum. launch_nonfinite_outputs runs after it as after the
// other launchers. With k_slices 1 these launchers are the launchers above, bit for bit. With k_slices kStreamK
// (stream-K), the whole rounds' tiles are computed whole, and the last round's tiles are cut along K so that every
// multiprocessor takes an equal share of them instead of idling through a partial round (gemm_sm90_tile_scheduler.cuh,
// StreamK); each tile's parts are its slices.
constexpr int kStreamK = -1;

// The slices the Hopper GEMM's (m x n) product of reduction k takes on `device` (1: K not split): the count from 1 to
// 16, each slice of at least 16 chunks, or kStreamK, that minimises a model of the product's time, in chunk-times of
// a CTA: the rounds of (tile, slice) units over the multiprocessors, times a slice's chunks plus a unit's fixed cost
// (its epilogue and pipeline start), plus the sum's pass over the partials (gemm_sm90.cu, split_k_cost,
// stream_k_cost).
int split_gemm_k_slices(int device, std::int64_t m, std::int64_t n, std::int64_t k);

// The bytes of workspace a split-K launch of an (m x n) output of reduction k over k_slices slices (or kStreamK) needs
// on `device` (0 for one slice): a slice per slice (stream-K: per part of the tile with the most) of m rows rounded
// up to whole tiles of 128, n floats a row.
std::int64_t split_gemm_k_workspace_bytes(int device, std::int64_t m, std::int64_t n, std::int64_t k, int k_slices);

// launch_split_gemm_multiply_leaky_relu with K split into at most k_slices slices of whole chunks (as evenly as whole
// chunks allow; fewer where K has fewer chunks), or by stream-K (kStreamK; K whole where StreamK does not fit: no
// partial last round, or fewer chunks in it than multiprocessors), through `workspace`
// (split_gemm_k_workspace_bytes(device, m, n, k, k_slices) bytes, 16-byte aligned, any contents, not used by another
// launch meanwhile). w_flags as there: the rows of w flagged over all of K. Returns cudaErrorInvalidValue where
// k_slices < 1 (not kStreamK) or the workspace is missing or misaligned, cudaErrorNotSupported where
// split_gemm_supported() is false.
cudaError_t launch_split_gemm_split_k(const void* x_hi, const void* x_lo, const std::int32_t* x_exponent,
                                      const float* w, std::int64_t w_stride, bool w_transposed, std::int32_t* w_flags,
                                      const float* bias, float* y, std::uint8_t* positive, std::int64_t m,
                                      std::int64_t n, std::int64_t k, Epilogue epilogue,
                                      int k_slices, float* workspace, cudaStream_t stream);

// launch_split_gemm_presplit_multiply_leaky_relu, K split as launch_split_gemm_split_k splits it.
cudaError_t launch_split_gemm_presplit_split_k(const void* x_hi, const void* x_lo, const std::int32_t* x_exponent,
                                               const void* w_hi, const void* w_lo, const std::int32_t* w_exponent,
                                               const float* bias, float* y, std::uint8_t* positive, std::int64_t m,
                                               std::int64_t n, std::int64_t k, Epilogue epilogue, int k_slices,
                                               float* workspace, cudaStream_t stream);

}  // namespace kernels::gemm
