// Which path each product of the GEMM family takes (split_fp16, split_fp16_sm80, cublas_bf16x9 or cublas), chosen per
// call from x's device and dtype, the GPU, the shape and the float32 matmul precision; why a fast float32 path refuses
// a product; the path tests force (_gemm_force_path). The paths' products: gemm_products.cpp.
#include <ATen/core/Tensor.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "gemm_internal.h"

#ifdef KERNELS_WITH_CUDA
#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/device_queries.h"
#include "common/once_per_device.h"
#include "gemm.h"
#endif

namespace kernels::gemm {
namespace {

// M of the GEMM: the rows of x over all its leading dimensions (whatever k is, 0 included).
int64_t gemm_rows(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

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

// The compute capability of `device` as 10 * major + minor, read once per device; 0 where the query fails.
int capability_of(int device) {
  return once_per_device(device, [](int d) { return compute_capability(d); }).value_or(0);
}
#endif

// Whether a weight (out_features x in_features) is the transpose of a row-major (in_features x out_features) matrix,
// as F.linear(x, w.t()), x @ w and transformers' Conv1D give it: the split path then reads that matrix as it is.
bool is_transposed_weight(const at::Tensor& weight) {
  return weight.size(0) > 1 && weight.size(1) > 1 && weight.stride(0) == 1 && weight.stride(1) != 1;
}

ProductShape linear_shape(const at::Tensor& x, const at::Tensor& weight) {
  return {gemm_rows(x), weight.size(0), weight.size(1), is_transposed_weight(weight)};
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
  const Path table = fp32_path_for_capability(capability_of(x.device().index()));
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
// K from a moderate output size, a medium K from a larger one. Below 2^22 outputs a K under 1024 saves less GPU time
// than a split call's extra host time costs a model whose host is the bottleneck.
constexpr int64_t kSplitMinSide = 128;  // one tile; narrower outputs were not measured
constexpr int64_t kSplitMinOutputs = int64_t{1} << 20;
constexpr int64_t kSplitMinReduction = 1024;
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
Path choose_path(const at::Tensor& x, ProductShape shape, bool strict) {
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

}  // namespace
}  // namespace kernels::gemm
