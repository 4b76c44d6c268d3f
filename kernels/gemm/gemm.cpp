// The torch side of the GEMM family: gemm_multiply_leaky_relu's schema, checks and implementations (fakes, Python
// function: gemm.py; autograd: gemm_autograd.cpp). Four paths, chosen per call from device, dtype, shape, GPU and the
// float32 matmul precision (tests force one with _gemm_force_path):
// - split_fp16 (Hopper, float32 at "highest"): x split into row-scaled fp16 hi/lo pairs, three tensor-core products and
//   the epilogue (gemm_split.cu, gemm_sm90.cu); W split in registers or by a pass (kSplitWAheadRows,
//   gemm_weight_split); tall, narrow forwards compute y^T; small plain products split K.
// - split_fp16_sm80 (sm_80 on, per fp32_path_for_capability): the same method on mma.sync (gemm_sm80.cu).
// - cublas_bf16x9 (sm_100/103): cuBLAS's FP32 emulation on bf16 tensor cores (gemm_cublas_bf16x9.cpp).
// - cublas otherwise: at::linear as nn.Linear (so precision settings apply), then multiply_leaky_relu_ in place.
// Under torch.autocast the Autocast kernels (end of file) cast inputs as eager autocast casts nn.Linear's.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "common/torch_checks.h"
#include "gemm_op.h"
#include "leaky_relu/leaky_relu_op.h"

#ifdef KERNELS_WITH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "gemm.h"
#endif

namespace kernels::gemm {
namespace {

using common::check_float_tensor;
using common::check_same;
using common::shape_str;

void check_gemm_arguments(const char* op, const at::Tensor& x, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias) {
  check_float_tensor(op, "x", x);
  check_float_tensor(op, "weight", weight);
  check_same(op, "weight", weight, "x", x);
  TORCH_CHECK(weight.dim() == 2, "kernels.", op, ": weight must be 2-D (out_features, in_features), got shape ",
              shape_str(weight.sizes()));
  TORCH_CHECK(x.dim() >= 1, "kernels.", op, ": x must have at least 1 dimension (..., in_features), got a scalar");
  TORCH_CHECK(x.size(-1) == weight.size(1), "kernels.", op, ": x's last dimension is ", std::to_string(x.size(-1)),
              " but in_features is ", std::to_string(weight.size(1)), " (x has shape ", shape_str(x.sizes()),
              ", weight ", shape_str(weight.sizes()), ")");
  if (bias.has_value() && bias->defined()) {
    check_same(op, "bias", *bias, "x", x);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "kernels.", op,
                ": bias must have shape [out_features] = [", std::to_string(weight.size(0)), "], got ",
                shape_str(bias->sizes()));
  }
}

// M of the GEMM: the rows of x over all its leading dimensions.
int64_t gemm_rows(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t k = weight.size(1);
  return k == 0 ? 0 : x.numel() / k;
}

enum class Path : int { kAuto = 0, kCublas = 1, kSplitFp16 = 2, kSplitFp16Sm80 = 3, kCublasBf16x9 = 4 };

const char* path_name(Path path) {
  switch (path) {
    case Path::kCublas: return "cublas";
    case Path::kSplitFp16: return "split_fp16";
    case Path::kSplitFp16Sm80: return "split_fp16_sm80";
    case Path::kCublasBf16x9: return "cublas_bf16x9";
    default: return "auto";
  }
}

bool is_split(Path path) { return path == Path::kSplitFp16 || path == Path::kSplitFp16Sm80; }

// The paths a float32 product takes instead of cuBLAS's IEEE SGEMM where they can: the split kernels and cuBLAS's
// emulation.
bool is_fast_fp32(Path path) { return is_split(path) || path == Path::kCublasBf16x9; }

// The path named `name`; kAuto, with ok = false, for an unknown name.
Path path_named(const std::string& name, bool& ok) {
  ok = true;
  for (const Path path : {Path::kAuto, Path::kCublas, Path::kSplitFp16, Path::kSplitFp16Sm80, Path::kCublasBf16x9})
    if (name == path_name(path)) return path;
  ok = false;
  return Path::kAuto;
}

std::atomic<int> forced_path{static_cast<int>(Path::kAuto)};

// Sets the path every later call takes ("auto", "cublas", "split_fp16", "split_fp16_sm80" or "cublas_bf16x9");
// returns the previous setting. For tests and bench.py; a forced path that cannot run raises instead of falling back.
std::string force_path(const std::string& name) {
  bool ok = false;
  const Path path = path_named(name, ok);
  TORCH_CHECK(ok, "kernels._gemm_force_path: unknown path '", name, "'; expected auto, cublas, split_fp16, "
              "split_fp16_sm80 or cublas_bf16x9");
  return path_name(static_cast<Path>(forced_path.exchange(static_cast<int>(path))));
}

// The slices of K every later plain product on split_fp16 takes (0: split_gemm_k_slices's choice; n >= 1: at most n,
// fewer where K has fewer chunks); returns the previous setting. For tests and tools/gemm_sweep.py.
std::atomic<int64_t> forced_k_slices{0};

int64_t force_k_slices(int64_t slices) {
  TORCH_CHECK(slices >= 0 && slices <= 1024, "kernels._gemm_force_k_slices: slices must be 0 (the automatic "
              "choice) or 1 to 1024, got ", slices);
  return forced_k_slices.exchange(slices);
}

#ifdef KERNELS_WITH_CUDA
// split_gemm_supported or split_gemm_sm80_supported (by `path`), asked once per device, kernel and shape: they read
// device and kernel attributes.
bool split_supported(Path path, int device, int64_t m, int64_t n, int64_t k, bool w_transposed) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int, int64_t, int64_t, int64_t, bool>, bool> answers;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(static_cast<int>(path), device, m, n, k, w_transposed);
  const auto found = answers.find(key);
  if (found != answers.end()) return found->second;
  if (answers.size() > 4096) answers.clear();  // a bound for programs that see ever new shapes
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));  // kernel attributes are per device
  return answers[key] = path == Path::kSplitFp16 ? split_gemm_supported(device, m, n, k, w_transposed)
                                                 : split_gemm_sm80_supported(device, m, n, k);
}

// The compute capability of `device` as 10 * major + minor, read once per device.
int compute_capability(int device) {
  static std::mutex mutex;
  static std::map<int, int> capabilities;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = capabilities.find(device);
  if (found != capabilities.end()) return found->second;
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return capabilities[device] = 10 * major + minor;
}
#endif

// w's split made beforehand (gemm_weight_split, kept by the module that owns the weight): the tensors the GEMM reads
// instead of splitting w (launch_split_chunks's hi, lo, chunk exponents and flags).
struct WeightSplit {
  at::Tensor hi, lo, exponent, flags;
};

// The sizes of a product y (m x n) = x (m x k) times w (n x k)^T, and whether w comes as its transpose (k x n).
struct ProductShape {
  int64_t m, n, k;
  bool w_transposed = false;
};

// Whether a weight (out_features x in_features) is the transpose of a row-major (in_features x out_features) matrix,
// as F.linear(x, w.t()), x @ w and transformers' Conv1D give it: the split path then reads that matrix as it is.
bool is_transposed_weight(const at::Tensor& weight) {
  return weight.size(0) > 1 && weight.size(1) > 1 && weight.stride(0) == 1 && weight.stride(1) != 1;
}

ProductShape linear_shape(const at::Tensor& x, const at::Tensor& weight) {
  return {gemm_rows(x, weight), weight.size(0), weight.size(1), is_transposed_weight(weight)};
}

// Why the fast float32 path `path` (a split path or cublas_bf16x9) cannot take a product of this shape on x's device
// and dtype, or nullptr if it can.
const char* fast_fp32_refusal(Path path, const at::Tensor& x, ProductShape shape) {
#ifdef KERNELS_WITH_CUDA
  if (!x.is_cuda()) return "the tensors are not on a CUDA device";
  if (x.scalar_type() != at::kFloat) return "it computes float32 only";
  if (at::globalContext().allowTF32CuBLAS())
    return "TF32 is allowed (float32 matmul precision 'high' or 'medium'), and cuBLAS's TF32 is faster";
  if (path == Path::kCublasBf16x9) return cublas_bf16x9_refusal(shape.m, shape.n, shape.k);
  if (path == Path::kSplitFp16 &&
      !split_supported(path, x.device().index(), shape.m, shape.n, shape.k, shape.w_transposed))
    return "the GPU is not sm_90 or the library was not built for sm_90a, or the shape is one the kernel does not take";
  if (path == Path::kSplitFp16Sm80 &&
      !split_supported(path, x.device().index(), shape.m, shape.n, shape.k, shape.w_transposed))
    return "the GPU is older than sm_80 or allows less shared memory per block than two pipeline stages take "
           "(129 KB: sm_86, sm_89 and sm_120 allow 99-100 KB), or the shape is one the kernel does not take "
           "(in_features not a multiple of 4)";
  return nullptr;
#else
  (void)path;
  (void)x;
  (void)shape;
  return "the library was built without CUDA";
#endif
}

// The float32 path the automatic choice uses per architecture: a split kernel where the fp16 tensor-core rate (fp32
// accumulation) is well over three times the fp32 rate (sm_80, sm_87, sm_90; Hopper falls back to the sm_80 kernel for
// shapes wgmma refuses), cuBLAS's bf16x9 emulation where the bf16 rate dwarfs fp32 (sm_100, sm_103), else cuBLAS, where
// three products would not win. Datasheet rates and what was run: kernels/gemm/NOTES.md.
Path fp32_path_for_capability(int64_t capability) {
  switch (capability) {
    case 80:
    case 87: return Path::kSplitFp16Sm80;
    case 90: return Path::kSplitFp16;
    case 100:
    case 103: return Path::kCublasBf16x9;
    default: return Path::kCublas;
  }
}

std::string gemm_fp32_path_for_capability(int64_t capability) {
  return path_name(fp32_path_for_capability(capability));
}

// The table's path for x's GPU where it takes the product; on Hopper the sm_80 kernel where the wgmma kernel refuses
// the shape; else cuBLAS.
Path automatic_fast_fp32_path(const at::Tensor& x, ProductShape shape) {
#ifdef KERNELS_WITH_CUDA
  if (!x.is_cuda()) return Path::kCublas;
  const Path table = fp32_path_for_capability(compute_capability(x.device().index()));
  if (table == Path::kCublas) return Path::kCublas;
  if (fast_fp32_refusal(table, x, shape) == nullptr) return table;
  const bool sm80_kernel_takes_it = fast_fp32_refusal(Path::kSplitFp16Sm80, x, shape) == nullptr;
  return table == Path::kSplitFp16 && sm80_kernel_takes_it ? Path::kSplitFp16Sm80 : Path::kCublas;
#endif
  (void)x;
  (void)shape;
  return Path::kCublas;
}

// The automatic choice splits only where measured both faster and more accurate than cuBLAS SGEMM (tools/gemm_sweep.py;
// kernels/gemm/NOTES.md): the split's error has a floor whatever K is while SGEMM's grows with K, so short reductions
// favour SGEMM's accuracy, and small outputs cuBLAS's speed. Hence two regions, both from 128 rows and columns: a long
// K from a moderate output size, a medium K from a larger one.
constexpr int64_t kSplitMinSide = 128;  // one tile; narrower outputs were not measured
constexpr int64_t kSplitMinOutputs = int64_t{1} << 20;
constexpr int64_t kSplitMinReduction = 512;
constexpr int64_t kSplitMinOutputsShortReduction = int64_t{1} << 22;
constexpr int64_t kSplitMinShortReduction = 256;

bool split_pays_off(ProductShape shape) {
  const int64_t outputs = shape.m * shape.n;
  return shape.m >= kSplitMinSide && shape.n >= kSplitMinSide &&
         ((shape.k >= kSplitMinReduction && outputs >= kSplitMinOutputs) ||
          (shape.k >= kSplitMinShortReduction && outputs >= kSplitMinOutputsShortReduction));
}

// split_pays_off's thresholds, for gemm.py's check that skips the op where no split can pay: [min_side, min_outputs,
// min_reduction, min_outputs_short_reduction, min_short_reduction].
std::vector<int64_t> gemm_split_thresholds() {
  return {kSplitMinSide, kSplitMinOutputs, kSplitMinReduction, kSplitMinOutputsShortReduction,
          kSplitMinShortReduction};
}

// The path of one product (the forward's, or one of the backward's), chosen from x's device and dtype, the GPU,
// the shape and the settings. Empty products take the cuBLAS path. A forced split path that cannot run raises where
// `strict` (the forward), and falls back to cuBLAS elsewhere (a backward product whose reduction the kernel does not
// take, e.g. a batch of rows not a multiple of 4).
Path choose_path(const at::Tensor& x, ProductShape shape, bool strict = true) {
  const Path forced = static_cast<Path>(forced_path.load());
  if (forced == Path::kCublas) return Path::kCublas;
  const bool empty = shape.m == 0 || shape.n == 0 || shape.k == 0;
  if (is_fast_fp32(forced)) {
    // An empty product has nothing to compute and takes cuBLAS's path (which returns at once), wherever the forced
    // path could take tensors like these: its device, dtype and settings are checked at a nominal shape.
    const char* refusal = fast_fp32_refusal(forced, x, empty ? ProductShape{64, 64, 64, shape.w_transposed} : shape);
    TORCH_CHECK(!strict || refusal == nullptr, "kernels.gemm_multiply_leaky_relu: the ", path_name(forced),
                " path was forced but cannot run: ", refusal);
    return refusal != nullptr || empty ? Path::kCublas : forced;
  }
  if (empty) return Path::kCublas;
  const Path path = automatic_fast_fp32_path(x, shape);
  // cuBLAS's emulation decides by itself where it pays (its default strategy); the split kernels by measurement.
  return path == Path::kCublasBf16x9 || split_pays_off(shape) ? path : Path::kCublas;
}

std::string gemm_multiply_leaky_relu_path(const at::Tensor& x, const at::Tensor& weight) {
  return path_name(choose_path(x, linear_shape(x, weight)));
}

// Why the fast float32 path `path` ("split_fp16", "split_fp16_sm80" or "cublas_bf16x9") cannot take these inputs
// under the current settings, whatever the automatic choice would say; "" if it can (so that the path forced runs).
std::string gemm_path_refusal(const at::Tensor& x, const at::Tensor& weight, const std::string& path) {
  bool ok = false;
  const Path named = path_named(path, ok);
  TORCH_CHECK(ok && is_fast_fp32(named), "kernels._gemm_path_refusal: '", path, "' is not a fast float32 path; "
              "expected split_fp16, split_fp16_sm80 or cublas_bf16x9");
  const char* refusal = fast_fp32_refusal(named, x, linear_shape(x, weight));
  return refusal == nullptr ? "" : refusal;
}

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

// w's split per row and chunk of 64 (launch_split_chunks) into new tensors, for `path`'s GEMM reading x's split in
// the order split_fp16_product gives it: split_position's for split_fp16 with w as it is, else k's. w2 is w (n x k)
// or, where w_transposed, its transpose (k x n), as split_operand returns it.
WeightSplit split_w_chunks(Path path, const at::Tensor& w2, bool w_transposed, int64_t n, int64_t k,
                           cudaStream_t stream) {
  const int64_t split_k = split_row_length(k);
  const auto half = w2.options().dtype(at::kHalf);
  const auto int32 = w2.options().dtype(at::kInt);
  WeightSplit split{at::empty({n, split_k}, half), at::empty({n, split_k}, half),
                    at::empty({split_k / kSplitChunk, n}, int32), at::empty({n}, int32)};
  check_launch(launch_split_chunks(w2.const_data_ptr<float>(), n, k, w2.stride(0), w_transposed,
                                   /*natural_order=*/w_transposed || path == Path::kSplitFp16Sm80,
                                   split.hi.mutable_data_ptr(), split.lo.mutable_data_ptr(),
                                   split.exponent.mutable_data_ptr<int32_t>(), split.flags.mutable_data_ptr<int32_t>(),
                                   stream),
               "split (w)");
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
  // split_fp16 was chosen where split_gemm_supported holds; the kernel that reads w's split needs n % 4 == 0 besides
  // (split_gemm_presplit_supported), and the split of a transposed w takes at most 65535 chunks (its grid).
  return path == Path::kSplitFp16Sm80 || (path == Path::kSplitFp16 && m >= kSplitWAheadRows && n % 4 == 0 &&
                                          (!w_transposed || split_row_length(k) / kSplitChunk <= 65535));
}

// The slices of K a plain product (m x n, reduction k) on split_fp16 takes on `device`: the forced count where one
// is set (force_k_slices), else split_gemm_k_slices's choice.
int product_k_slices(int device, int64_t m, int64_t n, int64_t k) {
  const int64_t forced = forced_k_slices.load();
  return forced > 0 ? static_cast<int>(forced) : split_gemm_k_slices(device, m, n, k);
}

// The split product y (m x n) = epilogue(x (m x k) times w (n x k)^T) on `path`, float32 on one GPU; x_transposed (x as
// k x m) needs w_transposed (w as k x n). x is split by a pass (x_column_sums, if not null, gets its columns' sums); w
// in the kernel, by a pass (sm80, splits_w_ahead) or not at all (w_split given). y and the mask (positive) are dense.
// Temporary memory: ~4 bytes per element of x and of any w split by a pass, plus K slices' partials (4 per output
// each).
void split_fp16_product(Path path, const at::Tensor& x, bool x_transposed, const at::Tensor& w, bool w_transposed,
                        const at::Tensor& bias, double multiplier, double negative_slope, at::Tensor& y,
                        std::uint8_t* positive, float* x_column_sums = nullptr,
                        const WeightSplit* w_split = nullptr) {
  TORCH_CHECK(w_transposed || !x_transposed, "kernels: the split of x's columns comes in natural order only");
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const int64_t m = x.size(x_transposed ? 1 : 0), k = x.size(x_transposed ? 0 : 1), n = w.size(w_transposed ? 1 : 0);
  // x's split pass reads rows of any alignment; w goes to TMA (split_operand).
  const at::Tensor x2 = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor w2 = split_operand(w);
  const int64_t split_k = split_row_length(k);
  const auto half = x.options().dtype(at::kHalf);
  const auto int32 = x.options().dtype(at::kInt);
  at::Tensor x_hi = at::empty({m, split_k}, half), x_lo = at::empty({m, split_k}, half);
  at::Tensor x_exponent = at::empty({m}, int32);
  WeightSplit w_split_made;
  if (w_split == nullptr && splits_w_ahead(path, m, n, k, w_transposed)) {
    w_split_made = split_w_chunks(path, w2, w_transposed, n, k, stream);
    w_split = &w_split_made;
  }
  at::Tensor w_flags = w_split != nullptr ? w_split->flags : at::empty({n}, int32);
  // The Hopper kernel reads x's split in its own order along K unless w comes transposed; the sm_80 kernel in k's.
  const bool natural_order = w_transposed || path == Path::kSplitFp16Sm80;
  // The column split's workspace: its counters (zeroed by the launcher) and per-slab column sums.
  const at::Tensor column_workspace =
      at::empty({x_transposed ? split_columns_workspace_bytes(k, m) : 0}, x.options().dtype(at::kByte));
  check_launch(x_transposed ? launch_split_columns(x2.const_data_ptr<float>(), k, m, x2.stride(0),
                                                   x_hi.mutable_data_ptr(), x_lo.mutable_data_ptr(),
                                                   x_exponent.mutable_data_ptr<int32_t>(), x_column_sums,
                                                   column_workspace.mutable_data_ptr(), stream)
                            : launch_split_rows(x2.const_data_ptr<float>(), m, k, x2.stride(0), natural_order,
                                                x_hi.mutable_data_ptr(), x_lo.mutable_data_ptr(),
                                                x_exponent.mutable_data_ptr<int32_t>(), stream),
               "split (x)");
  const at::Tensor b = bias.defined() ? bias.contiguous() : bias;
  const float* bias_data = b.defined() ? b.const_data_ptr<float>() : nullptr;
  const float multiplier_f = static_cast<float>(multiplier), slope_f = static_cast<float>(negative_slope);
  // A plain product (the backward's: no bias, multiplier and slope 1, no mask) on split_fp16 splits K where its output
  // has too few tiles for the multiprocessors (grad_W's, whose reduction is the batch).
  const bool plain = !b.defined() && multiplier_f == 1.0f && slope_f == 1.0f && positive == nullptr;
  const int k_slices = path == Path::kSplitFp16 && plain ? product_k_slices(x.device().index(), m, n, k) : 1;
  if (k_slices > 1) {
    at::Tensor k_workspace = at::empty({split_gemm_k_workspace_bytes(m, n, k_slices) / 4}, x.options());
    float* const workspace = k_workspace.mutable_data_ptr<float>();
    check_launch(w_split != nullptr
                     ? launch_split_gemm_presplit_split_k(
                           x_hi.const_data_ptr(), x_lo.const_data_ptr(), x_exponent.const_data_ptr<int32_t>(),
                           w_split->hi.const_data_ptr(), w_split->lo.const_data_ptr(),
                           w_split->exponent.const_data_ptr<int32_t>(), y.mutable_data_ptr<float>(), m, n, k, k_slices,
                           workspace, stream)
                     : launch_split_gemm_split_k(x_hi.const_data_ptr(), x_lo.const_data_ptr(),
                                                 x_exponent.const_data_ptr<int32_t>(), w2.const_data_ptr<float>(),
                                                 w2.stride(0), w_transposed, w_flags.mutable_data_ptr<int32_t>(),
                                                 y.mutable_data_ptr<float>(), m, n, k, k_slices, workspace, stream),
                 "split GEMM (K split)");
  } else if (w_split != nullptr) {
    SplitGemmFromSplits* const launch = path == Path::kSplitFp16 ? launch_split_gemm_presplit_multiply_leaky_relu
                                                                 : launch_split_gemm_sm80_multiply_leaky_relu;
    check_launch(launch(x_hi.const_data_ptr(), x_lo.const_data_ptr(), x_exponent.const_data_ptr<int32_t>(),
                        w_split->hi.const_data_ptr(), w_split->lo.const_data_ptr(),
                        w_split->exponent.const_data_ptr<int32_t>(), bias_data, y.mutable_data_ptr<float>(), positive,
                        m, n, k, multiplier_f, slope_f, stream),
                 "split GEMM (w's split given)");
  } else {
    check_launch(launch_split_gemm_multiply_leaky_relu(
                     x_hi.const_data_ptr(), x_lo.const_data_ptr(), x_exponent.const_data_ptr<int32_t>(),
                     w2.const_data_ptr<float>(), w2.stride(0), w_transposed, w_flags.mutable_data_ptr<int32_t>(),
                     bias_data, y.mutable_data_ptr<float>(), positive, m, n, k, multiplier_f, slope_f, stream),
                 "split GEMM");
  }
  // Row i of x, element k: x2[i][k], or x2[k][i] where x came transposed; likewise for w.
  const int64_t x_row_stride = x_transposed ? 1 : x2.stride(0), x_element_stride = x_transposed ? x2.stride(0) : 1;
  const int64_t w_row_stride = w_transposed ? 1 : w2.stride(0), w_element_stride = w_transposed ? w2.stride(0) : 1;
  check_launch(launch_nonfinite_outputs(x2.const_data_ptr<float>(), x_row_stride, x_element_stride,
                                        w2.const_data_ptr<float>(), w_row_stride, w_element_stride,
                                        x_exponent.const_data_ptr<int32_t>(), w_flags.const_data_ptr<int32_t>(),
                                        bias_data, y.mutable_data_ptr<float>(), positive, m, n, k, multiplier_f,
                                        slope_f, stream),
               "non-finite outputs");
}

// Whether the forward on `path` computes y^T = w x^T: on split_fp16 where x has more elements than w and y together
// (tall, narrow products), so the row pass moves w's bytes instead of x's, at the cost of y^T written and read once
// more. The numerics are the method's with the operands' roles exchanged.
bool split_product_transposed(Path path, int64_t m, int64_t n, int64_t k) {
  return path == Path::kSplitFp16 && m * k > n * k + m * n;
}

// The forward on a split path, with w's split made beforehand where w_split is not null (never for a transposed
// product: gemm_weight_split makes none there). A transposed product holds w's split and y^T (4 bytes per element
// each).
std::tuple<at::Tensor, at::Tensor> split_fp16_gemm_multiply_leaky_relu(Path path, const at::Tensor& x,
                                                                       const at::Tensor& weight,
                                                                       const at::Tensor& bias, double multiplier,
                                                                       double negative_slope, bool return_mask,
                                                                       const WeightSplit* w_split) {
  const int64_t m = gemm_rows(x, weight), k = weight.size(1), n = weight.size(0);
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, x.options());
  at::Tensor mask = at::empty(return_mask ? out_shape : std::vector<int64_t>{0}, x.options().dtype(at::kBool));
  std::uint8_t* positive = return_mask ? static_cast<std::uint8_t*>(mask.mutable_data_ptr()) : nullptr;
  if (is_transposed_weight(weight)) {  // read as the (k x n) matrix it is a view of, without a copy
    split_fp16_product(path, x.reshape({m, k}), /*x_transposed=*/false, weight.t(), /*w_transposed=*/true, bias,
                       multiplier, negative_slope, y, positive);
    return {y, mask};
  }
  if (!split_product_transposed(path, m, n, k)) {
    split_fp16_product(path, x.reshape({m, k}), /*x_transposed=*/false, weight, /*w_transposed=*/false, bias,
                       multiplier, negative_slope, y, positive, /*x_column_sums=*/nullptr, w_split);
    return {y, mask};
  }
  // y^T = w x^T as the plain product (no bias, multiplier 1, slope 1: the non-finite fix-up writes its raw values),
  // then the epilogue on the way back to y.
  at::Tensor product_t = at::empty({n, m}, x.options());
  split_fp16_product(path, weight, /*x_transposed=*/false, x.reshape({m, k}), /*w_transposed=*/false, at::Tensor(),
                     1.0, 1.0, product_t, nullptr);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor b = bias.defined() ? bias.contiguous() : bias;
  check_launch(launch_transposed_epilogue(product_t.const_data_ptr<float>(),
                                          b.defined() ? b.const_data_ptr<float>() : nullptr,
                                          y.mutable_data_ptr<float>(), positive, m, n, static_cast<float>(multiplier),
                                          static_cast<float>(negative_slope),
                                          c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
               "transposed epilogue");
  return {y, mask};
}

// a (m x k) times b (k x n) on a split path, a plain product (no bias, multiplier 1, slope 1), b read as it is (the
// GEMM's w given transposed); a given as itself or, where a_transposed, as its transpose (k x m), whose column sums
// then go to a_column_sums if not null.
at::Tensor split_fp16_matmul(Path path, const at::Tensor& a, bool a_transposed, const at::Tensor& b,
                             float* a_column_sums = nullptr) {
  at::Tensor y = at::empty({a.size(a_transposed ? 1 : 0), b.size(1)}, a.options());
  split_fp16_product(path, a, a_transposed, b, /*w_transposed=*/true, at::Tensor(), 1.0, 1.0, y, nullptr,
                     a_column_sums);
  return y;
}
#endif

// The slices of K a plain product (m x n, reduction k) on split_fp16 takes on the current GPU (product_k_slices); 1
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

// ---- w's split made beforehand ---------------------------------------------------------------------------------
// gemm_weight_split(x, weight): where x's forward takes a split path that splits w by a pass, [hi, lo, exponent, flags,
// stamp, weight]: w's split in that path's order, a CPU int64 stamp of what it was made from and for, and an alias
// keeping the weight's storage alive; else [] (cuBLAS paths, CPU or inference tensors, transposed products or views,
// under kKeptSplitMinProducts), or [empty tensor] where memory ran out. Given back as weight_split, it is used only
// where the storage and whole stamp match (path, data address, version counter, sizes, strides, device, current
// stream), else w is split as without it; changes PyTorch does not count (.data) are not seen. Bitwise the same results
// either way. Memory: about the weight's own size, while the caller keeps the list.
enum StampField : int {
  kStampPath, kStampData, kStampVersion, kStampRows, kStampColumns, kStampRowStride, kStampColumnStride, kStampDevice,
  kStampStream, kStampFields
};

#ifdef KERNELS_WITH_CUDA
std::vector<int64_t> weight_stamp(Path path, const at::Tensor& weight) {
  std::vector<int64_t> stamp(kStampFields);
  stamp[kStampPath] = static_cast<int64_t>(path);
  stamp[kStampData] = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(weight.const_data_ptr()));
  stamp[kStampVersion] = static_cast<int64_t>(weight._version());
  stamp[kStampRows] = weight.size(0);
  stamp[kStampColumns] = weight.size(1);
  stamp[kStampRowStride] = weight.stride(0);
  stamp[kStampColumnStride] = weight.stride(1);
  stamp[kStampDevice] = weight.device().index();
  stamp[kStampStream] = c10::cuda::getCurrentCUDAStream(weight.device().index()).id();
  return stamp;
}

// Whether the forward of this shape on `path` can read w's split made beforehand: a split path whose product is not
// computed transposed, and a weight with a version counter (an inference tensor has none).
bool reads_weight_split(Path path, const ProductShape& shape, const at::Tensor& weight) {
  return is_split(path) && !shape.w_transposed && !split_product_transposed(path, shape.m, shape.n, shape.k) &&
         !weight.is_inference();
}
#endif

// Products below this many multiply-adds get no kept split: their calls are host-bound, and reading a kept split
// lengthens them (measured: kernels/gemm/NOTES.md). gemm.py's KEPT_SPLIT_MIN_PRODUCTS is the same number.
constexpr int64_t kKeptSplitMinProducts = int64_t{1} << 32;

std::vector<at::Tensor> gemm_weight_split(const at::Tensor& x, const at::Tensor& weight) {
  check_gemm_arguments("gemm_weight_split", x, weight, std::nullopt);
#ifdef KERNELS_WITH_CUDA
  const ProductShape shape = linear_shape(x, weight);
  const Path path = choose_path(x, shape, /*strict=*/false);
  if (!reads_weight_split(path, shape, weight) || shape.m * shape.n * shape.k < kKeptSplitMinProducts) return {};
  // A split path: CUDA tensors. The guard comes before the support check, which reads kernel attributes on the
  // current device.
  const c10::cuda::CUDAGuard guard(weight.device());
  if (path == Path::kSplitFp16 && !split_gemm_presplit_supported(x.device().index(), shape.m, shape.n, shape.k))
    return {};
  // A split to keep is an optimization: where its memory cannot be had, the caller goes on without one.
  WeightSplit split;
  try {
    split = split_w_chunks(path, split_operand(weight), /*w_transposed=*/false, shape.n, shape.k,
                           c10::cuda::getCurrentCUDAStream(weight.device().index()).stream());
  } catch (const c10::OutOfMemoryError&) {
    return {at::empty({0}, at::TensorOptions().dtype(at::kLong))};  // the caller's sign to make room
  }
  const std::vector<int64_t> stamp = weight_stamp(path, weight);
  at::Tensor stamp_tensor = at::empty({kStampFields}, at::TensorOptions().dtype(at::kLong));
  std::copy(stamp.begin(), stamp.end(), stamp_tensor.mutable_data_ptr<int64_t>());
  // The weight itself (an alias, sharing its storage) goes with the split: while the split lives, the weight's
  // memory cannot be freed and handed to another tensor at the same address with a version counter that matches
  // (module.to(...) and back swaps a parameter's data and keeps its counter), and the use checks that storage.
  return {split.hi, split.lo, split.exponent, split.flags, stamp_tensor, weight.detach()};
#else
  return {};
#endif
}

// The split in weight_split where its stamp matches this call on `path` (see gemm_weight_split); else nullopt. A list
// that is not one gemm_weight_split made raises.
std::optional<WeightSplit> usable_weight_split(const std::optional<at::TensorList>& weight_split, Path path,
                                               const at::Tensor& x, const at::Tensor& weight) {
  if (!weight_split.has_value() || weight_split->empty()) return std::nullopt;
  const at::TensorList list = *weight_split;
  TORCH_CHECK(list.size() == 6 && list[4].defined() && list[4].device().is_cpu() &&
                  list[4].scalar_type() == at::kLong && list[4].numel() == kStampFields && list[5].defined(),
              "kernels.gemm_multiply_leaky_relu: weight_split must be a list that kernels.gemm_weight_split returned "
              "(or None)");
#ifdef KERNELS_WITH_CUDA
  const ProductShape shape = linear_shape(x, weight);
  if (!reads_weight_split(path, shape, weight) || !weight.is_cuda()) return std::nullopt;
  if (!weight.is_alias_of(list[5])) return std::nullopt;  // another storage: the weight's data was swapped
  const int64_t* stamp = list[4].const_data_ptr<int64_t>();
  const std::vector<int64_t> now = weight_stamp(path, weight);
  for (int field = 0; field < kStampFields; ++field)
    if (stamp[field] != now[field]) return std::nullopt;
  return WeightSplit{list[0], list[1], list[2], list[3]};
#else
  (void)path;
  (void)x;
  return std::nullopt;
#endif
}

// y = leaky_relu((x @ weight^T + bias) * multiplier, negative_slope), and, if return_mask, the bool mask of the
// elements whose pre-activation is positive (the backward needs it when the slope is negative, as the output's
// sign then no longer tells); else an empty mask. weight_split: w's split made beforehand (gemm_weight_split), or
// None.
std::tuple<at::Tensor, at::Tensor> gemm_multiply_leaky_relu(const at::Tensor& x, const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& bias, double multiplier,
                                                            double negative_slope, bool return_mask,
                                                            const std::optional<at::TensorList>& weight_split) {
  check_gemm_arguments("gemm_multiply_leaky_relu", x, weight, bias);
  const at::Tensor b = bias.has_value() && bias->defined() ? *bias : at::Tensor();
#ifdef KERNELS_WITH_CUDA
  const Path path = choose_path(x, linear_shape(x, weight));
  const std::optional<WeightSplit> w_split = usable_weight_split(weight_split, path, x, weight);
  if (is_split(path))
    return split_fp16_gemm_multiply_leaky_relu(path, x, weight, b, multiplier, negative_slope, return_mask,
                                               w_split.has_value() ? &*w_split : nullptr);
  if (path == Path::kCublasBf16x9) {
    const int64_t m = gemm_rows(x, weight), k = weight.size(1);
    std::vector<int64_t> out_shape = x.sizes().vec();
    out_shape.back() = weight.size(0);
    at::Tensor y = cublas_bf16x9_addmm(b, x.reshape({m, k}), weight.t()).view(out_shape);
    at::Tensor mask = leaky_relu::multiply_leaky_relu_op().call(y, multiplier, negative_slope, return_mask);
    return {y, mask};
  }
#else
  (void)usable_weight_split(weight_split, Path::kCublas, x, weight);  // a malformed list raises here too
#endif
  return cublas_gemm_multiply_leaky_relu(x, weight, b, multiplier, negative_slope, return_mask);
}

#ifdef KERNELS_WITH_CUDA
at::Tensor cublas_bf16x9_matmul(const at::Tensor& a, const at::Tensor& b) { return cublas_bf16x9_addmm({}, a, b); }
#else
at::Tensor split_fp16_matmul(Path, const at::Tensor&, bool, const at::Tensor&, float* = nullptr) {
  TORCH_CHECK(false, "kernels: the split_fp16 path needs the library built with CUDA");
}
at::Tensor cublas_bf16x9_matmul(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "kernels: the cublas_bf16x9 path needs the library built with CUDA");
}
#endif

// The gradients of gemm_multiply_leaky_relu, each where asked for (else empty): with grad_pre = leaky_relu'(pre) *
// multiplier * grad_y (from `saved`: the output where slope >= 0, else the mask), grad_x = grad_pre w, grad_w =
// grad_pre^T x, grad_b = grad_pre's column sums. Each product chooses its own path from its shape, as the forward's
// does.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gemm_multiply_leaky_relu_backward(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& saved,
    double multiplier, double negative_slope, bool x_grad, bool weight_grad, bool bias_grad) {
  check_gemm_arguments("gemm_multiply_leaky_relu_backward", x, weight, std::nullopt);
  check_same("gemm_multiply_leaky_relu_backward", "grad_y", grad_y, "x", x);
  const int64_t m = gemm_rows(x, weight), n = weight.size(0), k = weight.size(1);
  std::vector<int64_t> y_shape = x.sizes().vec();
  y_shape.back() = n;
  TORCH_CHECK(grad_y.sizes() == at::IntArrayRef(y_shape), "kernels.gemm_multiply_leaky_relu_backward: grad_y must have "
              "the output's shape ", shape_str(y_shape), ", got ", shape_str(grad_y.sizes()));
  // The identity epilogue passes grad_y through (its `saved` is empty: gemm_autograd.cpp keeps nothing).
  const at::Tensor grad_pre =
      is_identity_epilogue(multiplier, negative_slope)
          ? grad_y.reshape({m, n})
          : leaky_relu::leaky_relu_backward_op().call(grad_y, saved, negative_slope, multiplier).reshape({m, n});
  const at::Tensor x2 = x.reshape({m, k});
  at::Tensor grad_x = at::empty({0}, x.options()), grad_weight = at::empty({0}, x.options()),
             grad_bias = at::empty({0}, x.options());
  if (x_grad) {
    // grad_x = grad_pre w: w read as it is (n x k), or, where it is a transposed view, as the row-major (k x n) matrix
    // it views, whose rows are then the product's.
    const bool w_view = is_transposed_weight(weight);
    const Path path = choose_path(grad_pre, {m, k, n, !w_view}, /*strict=*/false);
#ifdef KERNELS_WITH_CUDA
    if (is_split(path) && w_view) {
      grad_x = at::empty({m, k}, x.options());
      split_fp16_product(path, grad_pre, /*x_transposed=*/false, weight.t(), /*w_transposed=*/false, at::Tensor(), 1.0,
                         1.0, grad_x, nullptr);
    } else
#endif
    {
      grad_x = is_split(path)                   ? split_fp16_matmul(path, grad_pre, /*a_transposed=*/false, weight)
               : path == Path::kCublasBf16x9 ? cublas_bf16x9_matmul(grad_pre, weight)
                                             : grad_pre.mm(weight);
    }
    grad_x = grad_x.reshape(x.sizes());
  }
  bool bias_done = false;
  if (weight_grad) {
    const Path path = choose_path(grad_pre, {n, k, m, true}, /*strict=*/false);
    if (is_split(path)) {
      // grad_pre's columns are split as they are read; their sums, made on the way, are grad_bias.
      if (bias_grad) grad_bias = at::empty({n}, x.options());
      grad_weight = split_fp16_matmul(path, grad_pre, /*a_transposed=*/true, x2,
                                      bias_grad ? grad_bias.mutable_data_ptr<float>() : nullptr);
      bias_done = bias_grad;
    } else if (path == Path::kCublasBf16x9) {
      grad_weight = cublas_bf16x9_matmul(grad_pre.t(), x2);
    } else {
      grad_weight = grad_pre.t().mm(x2);
    }
  }
  if (bias_grad && !bias_done) grad_bias = grad_pre.sum(0);
  return {grad_x, grad_weight, grad_bias};
}

}  // namespace
}  // namespace kernels::gemm

// ---- autocast -----------------------------------------------------------------------------------------------------
// Two functions of ATen's autocast, declared as ATen/autocast_mode.h declares them: that header includes ATen/ATen.h,
// every op's declaration, which is slow to parse.
namespace at::autocast {
at::ScalarType get_autocast_dtype(at::DeviceType device_type);
at::Tensor cached_cast(at::ScalarType to_type, const at::Tensor& arg, c10::DeviceType device_type);
}  // namespace at::autocast

namespace kernels::gemm {
namespace {

// The op under torch.autocast on `kDevice`, by eager's policy for the composite it replaces: at::linear casts to the
// autocast dtype (float64 left as is, leaf tensors through autocast's cache; autograd records the casts), the epilogue
// runs in the product's dtype. Then the op runs with autocast off, as ATen's autocast kernels do.
template <c10::DeviceType kDevice, c10::DispatchKey kAutocastKey>
std::tuple<at::Tensor, at::Tensor> gemm_multiply_leaky_relu_autocast(const at::Tensor& x, const at::Tensor& weight,
                                                                     const std::optional<at::Tensor>& bias,
                                                                     double multiplier, double negative_slope,
                                                                     bool return_mask,
                                                                     const std::optional<at::TensorList>&
                                                                         weight_split) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocastKey);
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [&](const at::Tensor& t) { return at::autocast::cached_cast(dtype, t, kDevice); };
  const std::optional<at::Tensor> cast_bias =
      bias.has_value() && bias->defined() ? std::optional<at::Tensor>(cast(*bias)) : bias;
  // A split of the float32 weight is of no use to the cast one: the op ignores it (its stamp no longer matches).
  return gemm_multiply_leaky_relu_op().call(cast(x), cast(weight), cast_bias, multiplier, negative_slope,
                                            return_mask, weight_split);
}

}  // namespace
}  // namespace kernels::gemm

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("gemm_multiply_leaky_relu(Tensor x, Tensor weight, Tensor? bias, float multiplier, float negative_slope, "
        "bool return_mask, Tensor[]? weight_split=None) -> (Tensor, Tensor)");
  m.def("gemm_weight_split(Tensor x, Tensor weight) -> Tensor[]");
  m.def("gemm_multiply_leaky_relu_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor saved, float multiplier, "
        "float negative_slope, bool x_grad, bool weight_grad, bool bias_grad) -> (Tensor, Tensor, Tensor)");
  m.def("_gemm_multiply_leaky_relu_path(Tensor x, Tensor weight) -> str");
  m.def("_gemm_path_refusal(Tensor x, Tensor weight, str path) -> str");
  m.def("_gemm_force_path(str path) -> str");
  m.impl("_gemm_force_path", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &kernels::gemm::force_path));
  m.def("_gemm_force_k_slices(int slices) -> int");
  m.impl("_gemm_force_k_slices",
         torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &kernels::gemm::force_k_slices));
  m.def("_gemm_k_slices(int m, int n, int k) -> int");
  m.impl("_gemm_k_slices", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &kernels::gemm::gemm_k_slices));
  m.def("_gemm_fp32_path_for_capability(int capability) -> str");
  m.def("_gemm_split_thresholds() -> int[]");
  m.impl("_gemm_split_thresholds",
         torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &kernels::gemm::gemm_split_thresholds));
  m.impl("_gemm_fp32_path_for_capability", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd,
                                                           &kernels::gemm::gemm_fp32_path_for_capability));
}

#define KERNELS_GEMM_IMPLS(m)                                                                     \
  m.impl("gemm_multiply_leaky_relu", &kernels::gemm::gemm_multiply_leaky_relu);                   \
  m.impl("gemm_multiply_leaky_relu_backward", &kernels::gemm::gemm_multiply_leaky_relu_backward); \
  m.impl("_gemm_multiply_leaky_relu_path", &kernels::gemm::gemm_multiply_leaky_relu_path);                 \
  m.impl("_gemm_path_refusal", &kernels::gemm::gemm_path_refusal);                               \
  m.impl("gemm_weight_split", &kernels::gemm::gemm_weight_split)

TORCH_LIBRARY_IMPL(kernels, AutocastCPU, m) {
  m.impl("gemm_multiply_leaky_relu",
         &kernels::gemm::gemm_multiply_leaky_relu_autocast<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>);
}
TORCH_LIBRARY_IMPL(kernels, AutocastCUDA, m) {
  m.impl("gemm_multiply_leaky_relu",
         &kernels::gemm::gemm_multiply_leaky_relu_autocast<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>);
}

TORCH_LIBRARY_IMPL(kernels, CPU, m) { KERNELS_GEMM_IMPLS(m); }
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) { KERNELS_GEMM_IMPLS(m); }
#endif
#undef KERNELS_GEMM_IMPLS
