// Each path's products on the host side: the cuBLAS path's forward (at::linear, then the epilogue in place), and the
// split paths' passes and GEMM launches (gemm.h): who splits w, K slices, the transposed forward, the non-finite
// fix-up; stand-ins that raise where the library is built without CUDA.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <string>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "common/torch_checks.h"
#include "gemm_internal.h"
#include "gemm_op.h"
#include "leaky_relu/leaky_relu_op.h"

#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "gemm.h"
#endif

namespace kernels::gemm {
namespace {

// The cuBLAS path: at::linear, then the epilogue op in place (none for the identity epilogue).
std::tuple<at::Tensor, at::Tensor> cublas_gemm_multiply_leaky_relu(const at::Tensor& x, const at::Tensor& weight,
                                                                   const at::Tensor& bias, double multiplier,
                                                                   double negative_slope, bool return_mask) {
  at::Tensor y = at::linear(x, weight, bias).contiguous();
  if (is_identity_epilogue(multiplier, negative_slope) && !return_mask)  // a plain linear: nothing more to do
    return {y, at::empty({0}, x.options().dtype(at::kBool))};
  at::Tensor mask = leaky_relu::multiply_leaky_relu_op().call(y, multiplier, negative_slope, return_mask);
  return {y, mask};
}

// The slices of K every later product on split_fp16 takes (0: split_gemm_k_slices's choice; n >= 1: at most n,
// fewer where K has fewer chunks; -1, kStreamK: stream-K); returns the previous setting. For tests and
// tools/gemm_sweep.py.
std::atomic<int64_t> forced_k_slices{0};

int64_t force_k_slices(int64_t slices) {
  // -1 is gemm.h's kStreamK, which a build without CUDA does not include.
  TORCH_CHECK(slices >= -1 && slices <= 1024, "kernels._gemm_force_k_slices: slices must be 0 (the automatic "
              "choice), 1 to 1024, or -1 (stream-K), got ", std::to_string(slices));
  return forced_k_slices.exchange(slices);
}

// The orientation of every later forward on split_fp16 with the weight as it is (0: split_product_transposed's rule;
// 1: computed transposed, y^T = w x^T; -1: not); returns the previous setting. For tests (both orientations of one
// shape) and tools/gemm_sweep.py.
std::atomic<int64_t> forced_orientation{0};

int64_t force_transposed(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "kernels._gemm_force_transposed: mode must be 0 (the automatic choice), 1 "
              "(transposed) or -1 (not), got ", std::to_string(mode));
  return forced_orientation.exchange(mode);
}

#ifdef KERNELS_WITH_CUDA
// A float32 matrix the split kernels read: rows with unit column stride, 16-byte aligned rows (a copy otherwise).
at::Tensor split_operand(const at::Tensor& t) {
  const bool aligned = t.stride(1) == 1 && t.stride(0) % 4 == 0 && t.stride(0) >= t.size(1) &&
                       reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % 16 == 0;
  return aligned ? t : t.clone(at::MemoryFormat::Contiguous);  // a fresh allocation: aligned
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "kernels.gemm_multiply_leaky_relu: the ", what, " kernel failed to launch: ",
              cudaGetErrorString(err));
}

// New tensors for w's split per row and chunk of 64 (launch_split_chunks's outputs, n rows of k), not yet written.
WeightSplit chunk_split_tensors(const at::Tensor& w2, int64_t n, int64_t k) {
  const int64_t split_k = split_row_length(k);
  const auto half = w2.options().dtype(at::kHalf);
  const auto int32 = w2.options().dtype(at::kInt);
  return WeightSplit{at::empty({n, split_k}, half), at::empty({n, split_k}, half),
                     at::empty({split_k / kSplitChunk, split_exponent_stride(n)}, int32), at::empty({n}, int32)};
}

// w's split (launch_split_chunks) into `split` (chunk_split_tensors), for `path`'s GEMM reading x's split in the order
// split_fp16_product gives it: split_position's for split_fp16 with w as it is, else k's. w2 is w (n x k) or, where
// w_transposed, its transpose (k x n), as split_operand returns it.
void launch_w_chunks(Path path, const at::Tensor& w2, bool w_transposed, int64_t n, int64_t k, WeightSplit& split,
                     cudaStream_t stream) {
  check_launch(launch_split_chunks(w2.const_data_ptr<float>(), n, k, w2.stride(0), w_transposed,
                                   /*natural_order=*/w_transposed || path == Path::kSplitFp16Sm80,
                                   split.hi.mutable_data_ptr(), split.lo.mutable_data_ptr(),
                                   split.exponent.mutable_data_ptr<int32_t>(), split.flags.mutable_data_ptr<int32_t>(),
                                   stream),
               "split (w)");
}

// w's split per row and chunk of 64 into new tensors (chunk_split_tensors, launch_w_chunks).
WeightSplit split_w_chunks(Path path, const at::Tensor& w2, bool w_transposed, int64_t n, int64_t k,
                           cudaStream_t stream) {
  WeightSplit split = chunk_split_tensors(w2, n, k);
  launch_w_chunks(path, w2, w_transposed, n, k, split, stream);
  return split;
}

// The row split of a weight (n x k) as a forward computed transposed takes it for its x (launch_split_rows, in
// split_position's order for split_fp16's kernel), into new tensors: a split kept between calls (gemm_weight_split).
WeightSplit split_w_rows(const at::Tensor& w, cudaStream_t stream) {
  const at::Tensor w2 = w.stride(1) == 1 ? w : w.contiguous();  // as split_fp16_product reads its x
  const int64_t n = w2.size(0), k = w2.size(1), split_k = split_row_length(k);
  const auto half = w2.options().dtype(at::kHalf);
  WeightSplit split{at::empty({n, split_k}, half), at::empty({n, split_k}, half),
                    at::empty({n}, w2.options().dtype(at::kInt)), at::Tensor(), /*rows=*/true};
  check_launch(launch_split_rows(w2.const_data_ptr<float>(), n, k, w2.stride(0), /*natural_order=*/false,
                                 split.hi.mutable_data_ptr(), split.lo.mutable_data_ptr(),
                                 split.exponent.mutable_data_ptr<int32_t>(), stream),
               "split (w's rows)");
  return split;
}

// The rows of x from which the Hopper GEMM reads w's split made by a pass (split_w_chunks) instead of splitting w in
// registers once per tile of x it meets; past this the pass is cheaper (measured: kernels/gemm/NOTES.md). Also decides
// grad_W's product, whose x is grad_pre^T (out_features rows).
constexpr int64_t kSplitWAheadRows = 2048;

// Whether split_fp16_product splits w by a pass of its own before the GEMM: always on split_fp16_sm80 (its kernel
// reads only split operands); on split_fp16 from kSplitWAheadRows rows of x on, where the kernel that reads it can
// take the shape.
bool splits_w_ahead(Path path, int64_t m, int64_t n, int64_t k, bool w_transposed) {
  // split_fp16 was chosen where split_gemm_supported holds, which the kernel that reads w's split takes too
  // (split_gemm_presplit_supported); the split of a transposed w takes at most 65535 chunks (its grid).
  return path == Path::kSplitFp16Sm80 ||
         (path == Path::kSplitFp16 && m >= kSplitWAheadRows &&
          (!w_transposed || split_row_length(k) / kSplitChunk <= 65535));
}

// The slices of K a product (m x n, reduction k) on split_fp16 takes on `device`: the forced count where one
// is set (force_k_slices), else split_gemm_k_slices's choice.
int product_k_slices(int device, int64_t m, int64_t n, int64_t k) {
  const int64_t forced = forced_k_slices.load();
  return forced != 0 ? static_cast<int>(forced) : split_gemm_k_slices(device, m, n, k);
}

// Byte offsets of a call's temporaries within one allocation, each part 256-byte aligned (TMA reads 16-byte aligned
// rows and addresses; the caching allocator's blocks start 512-byte aligned). Sizes that overflow raise, as
// at::empty's own check does.
struct TemporariesLayout {
  int64_t bytes = 0;
  int64_t add(int64_t count, int64_t element_bytes) {
    int64_t part = 0, end = 0;
    TORCH_CHECK(!__builtin_mul_overflow(count, element_bytes, &part) && !__builtin_add_overflow(bytes, part, &end) &&
                    end <= std::numeric_limits<int64_t>::max() - 255,
                "kernels.gemm_multiply_leaky_relu: the product's temporaries overflow a 64-bit size");
    const int64_t at = bytes;
    bytes = (end + 255) / 256 * 256;
    return at;
  }
};

// Whether launch_split_rows_gelu_backward takes grad_y and pre (2-D, rows with unit column stride) as they lie.
bool gelu_backward_rows_supported(const at::Tensor& grad_y, const at::Tensor& pre) {
  return grad_y.dim() == 2 && pre.sizes() == grad_y.sizes() && grad_y.stride(1) == 1 && pre.stride(1) == 1 &&
         split_rows_gelu_backward_supported(grad_y.size(0), grad_y.size(1), grad_y.const_data_ptr<float>(),
                                            grad_y.stride(0), pre.const_data_ptr<float>(), pre.stride(0));
}

// The split product y (m x n) = epilogue(x (m x k) times w (n x k)^T) on `path`, float32 on one GPU; x_transposed (x as
// k x m) needs w_transposed (w as k x n). x is split by a pass (x_column_sums, if not null, gets its columns' sums); w
// in the kernel, by a pass (sm80, splits_w_ahead) or not at all (w_split given). y and the mask (positive) are dense.
// With gelu_rows (gelu_backward_rows_supported(x, pre), x not transposed), x's pass makes and writes the product's x,
// gelu_rows->grad_pre, from x, the GELU's output gradient. With y_transposed (writes_y_transposed), y and the mask
// are (n x m), y[j, i] the output of x row i and w row j, bias indexed by i: a forward computed transposed, written
// as the layer's output. x_rows: x's row split made beforehand (split_w_rows: a forward computed transposed, whose x
// is the layer's weight), read instead of splitting x.
// Temporary memory: ~4 bytes per element of x and of any w split by a pass, plus K slices' partials (4 per output
// each).
void split_fp16_product(Path path, const at::Tensor& x, bool x_transposed, const at::Tensor& w, bool w_transposed,
                        const at::Tensor& bias, const Epilogue& epilogue, at::Tensor& y,
                        std::uint8_t* positive, float* x_column_sums, const WeightSplit* w_split,
                        const GeluBackwardRows* gelu_rows, bool y_transposed, const WeightSplit* x_rows) {
  TORCH_CHECK(w_transposed || !x_transposed, "kernels: the split of x's columns comes in natural order only");
  TORCH_CHECK(x_rows == nullptr || (x_rows->rows && path == Path::kSplitFp16 && !x_transposed && !w_transposed &&
                                    gelu_rows == nullptr && x_column_sums == nullptr),
              "kernels: a row split of x made beforehand serves split_fp16 with x and w as they are");
  TORCH_CHECK(gelu_rows == nullptr || !x_transposed, "kernels: a GELU's backward is made by the row split only");
  TORCH_CHECK(!y_transposed || (path == Path::kSplitFp16 && !x_transposed && !w_transposed && w_split == nullptr &&
                                gelu_rows == nullptr),
              "kernels: y is written transposed only from x and w as they are, w split in the kernel");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const int64_t m = x.size(x_transposed ? 1 : 0), k = x.size(x_transposed ? 0 : 1), n = w.size(w_transposed ? 1 : 0);
  // x's split pass reads rows of any alignment; w goes to TMA (split_operand).
  const at::Tensor x2 = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor w2 = split_operand(w);
  const int64_t split_k = split_row_length(k);
  // A product on split_fp16 splits K where its output has too few tiles for the multiprocessors (grad_W's, whose
  // reduction is the batch; a forward over few rows).
  // (y written transposed keeps K whole: writes_y_transposed.)
  int k_slices = path == Path::kSplitFp16 && !y_transposed ? product_k_slices(x.device().index(), m, n, k) : 1;
  // The temporaries of K split: none where the count leaves K whole (a forced count over fewer chunks, a forced
  // stream-K that does not fit), which then is K whole for every choice below.
  const int64_t partials_bytes =
      k_slices != 1 ? split_gemm_k_workspace_bytes(x.device().index(), m, n, k, k_slices) : 0;
  if (partials_bytes == 0) k_slices = 1;
  WeightSplit w_split_made;
  // A GELU on split_fp16 takes w's split made ahead where w is not transposed and K is whole (the kernel that reads
  // the float32 w untransposed has no GELU epilogue: launch_split_gemm_multiply_leaky_relu; with K split the sum
  // applies it).
  const bool gelu_needs_w_split = path == Path::kSplitFp16 && !w_transposed && k_slices == 1 &&
                                  epilogue.activation != Activation::kLeakyReLU;
  // w split by a pass of this call: with x's rows in one launch where w is as it is and x is split by rows (below),
  // else here, before x's pass.
  const bool w_split_here =
      w_split == nullptr && !y_transposed && (splits_w_ahead(path, m, n, k, w_transposed) || gelu_needs_w_split);
  const bool w_split_with_x =
      w_split_here && !w_transposed && !x_transposed && gelu_rows == nullptr && x_rows == nullptr;
  if (w_split_here) {
    w_split_made =
        w_split_with_x ? chunk_split_tensors(w2, n, k) : split_w_chunks(path, w2, w_transposed, n, k, stream);
    w_split = &w_split_made;
  }
  const at::Tensor b = bias.defined() ? bias.contiguous() : bias;
  const float* bias_data = b.defined() ? b.const_data_ptr<float>() : nullptr;
  // The call's temporaries in one allocation (each costs the host time a small product is short of): x's split, w's
  // row flags where no split of w holds them, the column split's counters and sums, K slices' partials.
  TemporariesLayout layout;
  const int64_t x_parts = x_rows == nullptr ? m : 0;  // x's split in the temporaries unless made beforehand
  const int64_t x_hi_at = layout.add(x_parts * split_k, 2), x_lo_at = layout.add(x_parts * split_k, 2);
  const int64_t x_exponent_at = layout.add(x_parts, 4);
  const int64_t w_flags_at = w_split == nullptr ? layout.add(n, 4) : 0;
  const int64_t column_at = x_transposed ? layout.add(split_columns_workspace_bytes(k, m), 1) : 0;
  const int64_t partials_at = partials_bytes > 0 ? layout.add(partials_bytes, 1) : 0;
  const at::Tensor temporaries = at::empty({layout.bytes}, x.options().dtype(at::kByte));
  std::uint8_t* const base = temporaries.mutable_data_ptr<std::uint8_t>();
  void* const x_hi = x_rows != nullptr ? x_rows->hi.mutable_data_ptr() : base + x_hi_at;
  void* const x_lo = x_rows != nullptr ? x_rows->lo.mutable_data_ptr() : base + x_lo_at;
  auto* const x_exponent = x_rows != nullptr ? x_rows->exponent.mutable_data_ptr<int32_t>()
                                             : reinterpret_cast<int32_t*>(base + x_exponent_at);
  auto* const w_flags = w_split != nullptr ? w_split->flags.mutable_data_ptr<int32_t>()
                                           : reinterpret_cast<int32_t*>(base + w_flags_at);
  // The Hopper kernel reads x's split in its own order along K unless w comes transposed; the sm_80 kernel in k's.
  const bool natural_order = w_transposed || path == Path::kSplitFp16Sm80;
  bool x_split_made = x_rows != nullptr;
  if (w_split_with_x) {
    const cudaError_t err = launch_split_rows_and_chunks(
        x2.const_data_ptr<float>(), m, x2.stride(0), x_hi, x_lo, x_exponent, w2.const_data_ptr<float>(), n,
        w2.stride(0), w_split_made.hi.mutable_data_ptr(), w_split_made.lo.mutable_data_ptr(),
        w_split_made.exponent.mutable_data_ptr<int32_t>(), w_split_made.flags.mutable_data_ptr<int32_t>(), k,
        natural_order, stream);
    if (err == cudaErrorNotSupported) {  // rows the in-register kernels do not hold: w's pass, then x's
      launch_w_chunks(path, w2, w_transposed, n, k, w_split_made, stream);
    } else {
      check_launch(err, "split (x and w)");
      x_split_made = true;
    }
  }
  if (!x_split_made) {
    check_launch(x_transposed ? launch_split_columns(x2.const_data_ptr<float>(), k, m, x2.stride(0), x_hi, x_lo,
                                                     x_exponent, x_column_sums, base + column_at, stream)
                 : gelu_rows != nullptr
                     ? launch_split_rows_gelu_backward(x2.const_data_ptr<float>(), x2.stride(0),
                                                       gelu_rows->pre.const_data_ptr<float>(), gelu_rows->pre.stride(0),
                                                       gelu_rows->tanh ? Activation::kGeluTanh : Activation::kGeluErf,
                                                       m, k, gelu_rows->grad_pre.mutable_data_ptr<float>(),
                                                       natural_order, x_hi, x_lo, x_exponent, stream)
                     : launch_split_rows(x2.const_data_ptr<float>(), m, k, x2.stride(0), natural_order, x_hi, x_lo,
                                         x_exponent, stream),
                 "split (x)");
  }
  // The product's float32 x from here on (the fix-up's operand): the pass's grad_pre where it made one.
  const at::Tensor& x_read = gelu_rows != nullptr ? gelu_rows->grad_pre : x2;
  if (k_slices != 1) {
    float* const partials = reinterpret_cast<float*>(base + partials_at);
    check_launch(w_split != nullptr
                     ? launch_split_gemm_presplit_split_k(
                           x_hi, x_lo, x_exponent, w_split->hi.const_data_ptr(), w_split->lo.const_data_ptr(),
                           w_split->exponent.const_data_ptr<int32_t>(), bias_data, y.mutable_data_ptr<float>(),
                           positive, m, n, k, epilogue, k_slices, partials, stream)
                     : launch_split_gemm_split_k(x_hi, x_lo, x_exponent, w2.const_data_ptr<float>(), w2.stride(0),
                                                 w_transposed, w_flags, bias_data, y.mutable_data_ptr<float>(),
                                                 positive, m, n, k, epilogue, k_slices, partials,
                                                 stream),
                 "split GEMM (K split)");
  } else if (w_split != nullptr) {
    SplitGemmFromSplits* const launch = path == Path::kSplitFp16 ? launch_split_gemm_presplit_multiply_leaky_relu
                                                                 : launch_split_gemm_sm80_multiply_leaky_relu;
    check_launch(launch(x_hi, x_lo, x_exponent, w_split->hi.const_data_ptr(), w_split->lo.const_data_ptr(),
                        w_split->exponent.const_data_ptr<int32_t>(), bias_data, y.mutable_data_ptr<float>(), positive,
                        m, n, k, epilogue, stream),
                 "split GEMM (w's split given)");
  } else {
    check_launch(launch_split_gemm_multiply_leaky_relu(x_hi, x_lo, x_exponent, w2.const_data_ptr<float>(), w2.stride(0),
                                                       w_transposed, w_flags, bias_data, y.mutable_data_ptr<float>(),
                                                       positive, m, n, k, epilogue, stream, y_transposed),
                 "split GEMM");
  }
  if (y_transposed) {  // the fix-up in y's orientation: w's rows (flags: w_flags) are y's rows
    check_launch(launch_nonfinite_outputs(w2.const_data_ptr<float>(), w2.stride(0), 1, x_read.const_data_ptr<float>(),
                                          x_read.stride(0), 1, w_flags, x_exponent, bias_data,
                                          y.mutable_data_ptr<float>(), positive, n, m, k, epilogue, stream),
                 "non-finite outputs");
    return;
  }
  // Row i of x, element k: x2[i][k], or x2[k][i] where x came transposed; likewise for w.
  const int64_t x_row_stride = x_transposed ? 1 : x_read.stride(0);
  const int64_t x_element_stride = x_transposed ? x_read.stride(0) : 1;
  const int64_t w_row_stride = w_transposed ? 1 : w2.stride(0), w_element_stride = w_transposed ? w2.stride(0) : 1;
  check_launch(launch_nonfinite_outputs(x_read.const_data_ptr<float>(), x_row_stride, x_element_stride,
                                        w2.const_data_ptr<float>(), w_row_stride, w_element_stride,
                                        x_exponent, w_flags, bias_data, y.mutable_data_ptr<float>(), positive, m, n, k,
                                        epilogue, stream),
               "non-finite outputs");
}

// Whether the forward on `path` computes y^T = w x^T: on split_fp16 where x has more elements than w and y together
// (tall, narrow products), so the row pass moves w's bytes instead of x's, at the cost of y^T written and read once
// more where the kernel cannot write y itself (writes_y_transposed; the rule weighs that cost everywhere: where the
// kernel writes y, narrower outputs gain too little to take a second rule, GEMM NOTES). The numerics are the
// method's with the operands' roles exchanged. forced_orientation overrides it.
bool split_product_transposed(Path path, int64_t m, int64_t n, int64_t k) {
  const int64_t forced = forced_orientation.load();
  return path == Path::kSplitFp16 && (forced != 0 ? forced > 0 : m * k > n * k + m * n);
}

// Whether a forward computed transposed (split_product_transposed: y^T = w x^T, m x n the layer's output, K = k)
// writes y itself from the GEMM's epilogue instead of y^T and a pass that transposes it: LeakyReLU's epilogue (or
// none), TMA stores (split_gemm_writes_y_transposed), K whole, and the layer's input split in the kernel (not ahead).
bool writes_y_transposed(Path path, int device, int64_t m, int64_t n, int64_t k, const Epilogue& epilogue) {
  return path == Path::kSplitFp16 && epilogue.activation == Activation::kLeakyReLU && epilogue.pre == nullptr &&
         split_gemm_writes_y_transposed(n) && !splits_w_ahead(path, n, m, k, /*w_transposed=*/false) &&
         product_k_slices(device, n, m, k) == 1;
}

// Whether a GELU's forward on `path` writes its pre-activation beside y from the GEMM's epilogue (Epilogue::pre):
// on split_fp16 with the weight as it is (a GELU's w split ahead: the kernel that reads the split), K whole, the
// product not computed transposed, and TMA stores (split_gemm_writes_pre).
bool split_product_writes_pre(Path path, const at::Tensor& x, const at::Tensor& weight) {
  const int64_t m = gemm_rows(x), n = weight.size(0), k = weight.size(1);
  return path == Path::kSplitFp16 && !is_transposed_weight(weight) && !split_product_transposed(path, m, n, k) &&
         product_k_slices(x.device().index(), m, n, k) == 1 && split_gemm_writes_pre(n);
}

// The forward on a split path, with w's split made beforehand where given_split is not null (gemm_weight_split: its
// chunk split, or, for a product computed transposed, its row split, that product's x split). A transposed product
// holds w's split unless given, and y^T where the kernel does not write y (4 bytes per element each).
std::tuple<at::Tensor, at::Tensor> split_fp16_gemm_multiply_leaky_relu(Path path, const at::Tensor& x,
                                                                       const at::Tensor& weight,
                                                                       const at::Tensor& bias,
                                                                       const Epilogue& epilogue, bool return_mask,
                                                                       const WeightSplit* given_split) {
  const int64_t m = gemm_rows(x), k = weight.size(1), n = weight.size(0);
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, x.options());
  at::Tensor mask = at::empty(return_mask ? out_shape : std::vector<int64_t>{0}, x.options().dtype(at::kBool));
  std::uint8_t* positive = return_mask ? static_cast<std::uint8_t*>(mask.mutable_data_ptr()) : nullptr;
  if (is_transposed_weight(weight)) {  // read as the (k x n) matrix it is a view of, without a copy
    split_fp16_product(path, x.reshape({m, k}), /*x_transposed=*/false, weight.t(), /*w_transposed=*/true, bias,
                       epilogue, y, positive);
    return {y, mask};
  }
  // A row split serves the product computed transposed, a chunk split the other (usable_weight_split matched the
  // orientation; a forced orientation changed since by another thread leaves the split unread).
  const bool transposed = split_product_transposed(path, m, n, k);
  const WeightSplit* const w_split = given_split != nullptr && given_split->rows == transposed ? given_split : nullptr;
  if (!transposed) {
    // x's row split where the op that wrote x left it (in split_position's order: split_fp16's kernel reads that)
    const std::optional<WeightSplit> x_rows = path == Path::kSplitFp16 ? left_row_split(x) : std::nullopt;
    split_fp16_product(path, x.reshape({m, k}), /*x_transposed=*/false, weight, /*w_transposed=*/false, bias,
                       epilogue, y, positive, /*x_column_sums=*/nullptr, w_split, /*gelu_rows=*/nullptr,
                       /*y_transposed=*/false, x_rows.has_value() ? &*x_rows : nullptr);
    return {y, mask};
  }
  if (writes_y_transposed(path, x.device().index(), m, n, k, epilogue)) {
    split_fp16_product(path, weight, /*x_transposed=*/false, x.reshape({m, k}), /*w_transposed=*/false, bias,
                       epilogue, y, positive, /*x_column_sums=*/nullptr, /*w_split=*/nullptr, /*gelu_rows=*/nullptr,
                       /*y_transposed=*/true, /*x_rows=*/w_split);
    return {y, mask};
  }
  // y^T = w x^T as the plain product (no bias, multiplier 1, slope 1: the non-finite fix-up writes its raw values),
  // then the epilogue on the way back to y.
  at::Tensor product_t = at::empty({n, m}, x.options());
  split_fp16_product(path, weight, /*x_transposed=*/false, x.reshape({m, k}), /*w_transposed=*/false, at::Tensor(),
                     Epilogue{}, product_t, nullptr, /*x_column_sums=*/nullptr, /*w_split=*/nullptr,
                     /*gelu_rows=*/nullptr, /*y_transposed=*/false, /*x_rows=*/w_split);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor b = bias.defined() ? bias.contiguous() : bias;
  check_launch(launch_transposed_epilogue(product_t.const_data_ptr<float>(),
                                          b.defined() ? b.const_data_ptr<float>() : nullptr,
                                          y.mutable_data_ptr<float>(), positive, m, n, epilogue,
                                          c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
               "transposed epilogue");
  return {y, mask};
}

// a (m x k) times b (k x n) on a split path, a plain product (no bias, multiplier 1, slope 1), b read as it is (the
// GEMM's w given transposed); a given as itself or, where a_transposed, as its transpose (k x m), whose column sums
// then go to a_column_sums if not null.
at::Tensor split_fp16_matmul(Path path, const at::Tensor& a, bool a_transposed, const at::Tensor& b,
                             float* a_column_sums) {
  at::Tensor y = at::empty({a.size(a_transposed ? 1 : 0), b.size(1)}, a.options());
  split_fp16_product(path, a, a_transposed, b, /*w_transposed=*/true, at::Tensor(), Epilogue{}, y, nullptr,
                     a_column_sums);
  return y;
}
#endif

// The slices of K a product (m x n, reduction k) on split_fp16 takes on the current GPU (product_k_slices); 1
// without CUDA. For tests and tools.
int64_t gemm_k_slices(int64_t m, int64_t n, int64_t k) {
#ifdef KERNELS_WITH_CUDA
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 1;
  }
  return product_k_slices(device, m, n, k);
#else
  (void)m;
  (void)n;
  (void)k;
  return 1;
#endif
}

// One split sweep alone, into new tensors (tests, and bench.py's split-sweep rows against a copy of the same bytes):
//   "rows", "rows_natural": launch_split_rows of src (x's split; split_position's order or k's) -> hi, lo, exponent;
//   "rows_read_twice", "rows_natural_read_twice": the same by the generic kernels for rows not held in registers
//   "columns": launch_split_columns of src (grad_pre's for grad_W) -> hi, lo, exponent, column sums
//   "columns_read_twice": the same by the kernel that reads each element twice (the one for matrices the staged
//   kernel does not take)
//   "chunks", "chunks_natural": launch_split_chunks of src as w (n x k) -> hi, lo, chunk exponents, row flags
//   "chunks_transposed": launch_split_chunks of w given as its transpose (src k x n) -> the same
std::vector<at::Tensor> gemm_split_sweep(const at::Tensor& src, const std::string& sweep) {
  static const char* const kSweeps[] = {"rows", "rows_natural", "rows_read_twice", "rows_natural_read_twice",
                                        "columns", "columns_read_twice", "chunks", "chunks_natural",
                                        "chunks_transposed"};
  TORCH_CHECK(std::find(std::begin(kSweeps), std::end(kSweeps), sweep) != std::end(kSweeps),
              "kernels._gemm_split_sweep: sweep must be one of rows, rows_natural, rows_read_twice, "
              "rows_natural_read_twice, columns, columns_read_twice, chunks, chunks_natural, chunks_transposed, got '",
              sweep, "'");
  TORCH_CHECK(src.dim() == 2 && src.scalar_type() == at::kFloat,
              "kernels._gemm_split_sweep: src must be a 2-D float32 matrix, got a ", std::to_string(src.dim()),
              "-D ", common::dtype_str(src.scalar_type()), " tensor");
  TORCH_CHECK(src.size(0) > 0 && src.size(1) > 0, "kernels._gemm_split_sweep: src must not be empty, got ",
              std::to_string(src.size(0)), " x ", std::to_string(src.size(1)));
#ifdef KERNELS_WITH_CUDA
  TORCH_CHECK(src.is_cuda(), "kernels._gemm_split_sweep: src must be a CUDA tensor, got one on ",
              src.device().str());
  const c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(src.device().index()).stream();
  const auto half = src.options().dtype(at::kHalf);
  const auto int32 = src.options().dtype(at::kInt);
  if (sweep.rfind("rows", 0) == 0 || sweep.rfind("columns", 0) == 0) {
    const at::Tensor s = src.stride(1) == 1 ? src : src.contiguous();  // as split_fp16_product gives it
    const bool columns = sweep.rfind("columns", 0) == 0;
    const int64_t rows = s.size(columns ? 1 : 0), length = split_row_length(s.size(columns ? 0 : 1));
    at::Tensor hi = at::empty({rows, length}, half), lo = at::empty({rows, length}, half);
    at::Tensor exponent = at::empty({rows}, int32);
    if (!columns) {
      check_launch(launch_split_rows(s.const_data_ptr<float>(), s.size(0), s.size(1), s.stride(0),
                                     sweep.rfind("rows_natural", 0) == 0, hi.mutable_data_ptr(),
                                     lo.mutable_data_ptr(), exponent.mutable_data_ptr<int32_t>(), stream,
                                     sweep.find("read_twice") == std::string::npos),
                   "split (rows)");
      return {hi, lo, exponent};
    }
    at::Tensor sums = at::empty({rows}, src.options());
    const at::Tensor workspace =
        at::empty({split_columns_workspace_bytes(s.size(0), s.size(1))}, src.options().dtype(at::kByte));
    check_launch(launch_split_columns(s.const_data_ptr<float>(), s.size(0), s.size(1), s.stride(0),
                                      hi.mutable_data_ptr(), lo.mutable_data_ptr(),
                                      exponent.mutable_data_ptr<int32_t>(), sums.mutable_data_ptr<float>(),
                                      workspace.mutable_data_ptr(), stream, sweep == "columns"),
                 "split (columns)");
    return {hi, lo, exponent, sums};
  }
  const bool transposed = sweep == "chunks_transposed";
  TORCH_CHECK(transposed || src.size(1) % 4 == 0, "kernels._gemm_split_sweep: the chunks sweeps take rows of a "
              "multiple of 4 floats (w's rows, as the GEMM reads them), got ", std::to_string(src.size(1)), " columns");
  const WeightSplit split =
      split_w_chunks(sweep == "chunks" ? Path::kSplitFp16 : Path::kSplitFp16Sm80, split_operand(src), transposed,
                     src.size(transposed ? 1 : 0), src.size(transposed ? 0 : 1), stream);
  return {split.hi, split.lo, split.exponent, split.flags};
#else
  TORCH_CHECK(false, "kernels._gemm_split_sweep: the split sweeps need the library built with CUDA");
#endif
}

#ifdef KERNELS_WITH_CUDA
at::Tensor cublas_bf16x9_matmul(const at::Tensor& a, const at::Tensor& b) { return cublas_bf16x9_addmm({}, a, b); }
#else
at::Tensor split_fp16_matmul(Path, const at::Tensor&, bool, const at::Tensor&, float*) {
  TORCH_CHECK(false, "kernels: the split_fp16 path needs the library built with CUDA");
}
at::Tensor cublas_bf16x9_matmul(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "kernels: the cublas_bf16x9 path needs the library built with CUDA");
}
#endif

}  // namespace
}  // namespace kernels::gemm
