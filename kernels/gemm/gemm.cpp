// The torch side of the GEMM family of `torch.ops.kernels`: gemm_multiply_leaky_relu's schema, argument checks and
// implementations. Fake (meta) implementation, autograd and the Python function are in gemm.py.
//
// Two paths, chosen per call from the inputs' device, dtype, shape and the float32 matmul precision setting:
// - split_fp16 (Hopper, float32 at the default "highest" precision): x and W are split per call into row-scaled
//   fp16 hi/lo pairs (gemm_split.cu), and one kernel computes the three products on the tensor cores with fp32
//   promotion and the fused epilogue (gemm_sm90.cu): more accurate than cuBLAS's IEEE SGEMM, and faster.
// - cublas, for every other case: at::linear, the very call nn.Linear makes (so it follows the user's float32
//   matmul precision setting: IEEE by default, TF32 when allowed, and rounds exactly as eager does), then the
//   LeakyReLU family's kernels::multiply_leaky_relu_ in place over its result (the multiply, the activation and
//   the branch mask in one pass), reached through the dispatcher.
// Tests force either path with kernels::_gemm_force_path; kernels::_gemm_multiply_leaky_relu_path tells which
// path a call would take.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "common/torch_checks.h"

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

enum class Path : int { kAuto = 0, kCublas = 1, kSplitFp16 = 2 };

const char* path_name(Path path) {
  switch (path) {
    case Path::kCublas: return "cublas";
    case Path::kSplitFp16: return "split_fp16";
    default: return "auto";
  }
}

std::atomic<int> forced_path{static_cast<int>(Path::kAuto)};

// Sets the path every later call takes ("auto", "cublas" or "split_fp16"); returns the previous setting. For tests
// and bench.py; a forced split_fp16 path that cannot run raises instead of falling back.
std::string force_path(const std::string& name) {
  Path path = Path::kAuto;
  if (name == "cublas") path = Path::kCublas;
  else if (name == "split_fp16") path = Path::kSplitFp16;
  else TORCH_CHECK(name == "auto", "kernels._gemm_force_path: unknown path '", name, "'; expected auto, cublas or "
                   "split_fp16");
  return path_name(static_cast<Path>(forced_path.exchange(static_cast<int>(path))));
}

#ifdef KERNELS_WITH_CUDA
// split_gemm_supported, asked once per device and shape: it reads device and kernel attributes.
bool split_supported(int device, int64_t m, int64_t n, int64_t k) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int64_t, int64_t, int64_t>, bool> answers;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device, m, n, k);
  const auto found = answers.find(key);
  if (found != answers.end()) return found->second;
  if (answers.size() > 4096) answers.clear();  // a bound for programs that see ever new shapes
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));  // kernel attributes are per device
  return answers[key] = split_gemm_supported(device, m, n, k);
}
#endif

// Why the split_fp16 path cannot take this call, or nullptr if it can.
const char* split_fp16_refusal(const at::Tensor& x, const at::Tensor& weight) {
#ifdef KERNELS_WITH_CUDA
  if (!x.is_cuda()) return "the tensors are not on a CUDA device";
  if (x.scalar_type() != at::kFloat) return "it computes float32 only";
  if (at::globalContext().allowTF32CuBLAS())
    return "TF32 is allowed (float32 matmul precision 'high' or 'medium'), and cuBLAS's TF32 is faster";
  if (!split_supported(x.device().index(), gemm_rows(x, weight), weight.size(0), weight.size(1)))
    return "the GPU is not sm_90 or the library was not built for sm_90a, or the shape is one the kernel does not take";
  return nullptr;
#else
  return "the library was built without CUDA";
#endif
}

// The automatic choice takes the split path only where it was measured to be both faster and more accurate than
// cuBLAS SGEMM (tools/gemm_sweep.py --k-sweep and --shapes, H100; kernels/gemm/NOTES.md). The split represents each
// operand to about 2^-22, so its error has a floor near 2.5e-7 whatever K is, while SGEMM's error grows with K: below
// K = 1024 SGEMM can be the more accurate one (at K = 64 it is, by up to 2.5x). For outputs smaller than about
// 1024 x 1024, cuBLAS splits K across CTAs, which is both faster than one 128 x 128 tile per CTA and more accurate
// (for all-positive inputs, 1.2e-7 against the split's 3e-7 at 512 x 512 x 4096).
constexpr int64_t kSplitMinReduction = 1024;
constexpr int64_t kSplitMinRows = 1024;
constexpr int64_t kSplitMinColumns = 1024;

bool split_pays_off(const at::Tensor& x, const at::Tensor& weight) {
  return weight.size(1) >= kSplitMinReduction && gemm_rows(x, weight) >= kSplitMinRows &&
         weight.size(0) >= kSplitMinColumns;
}

Path choose_path(const at::Tensor& x, const at::Tensor& weight) {
  const Path forced = static_cast<Path>(forced_path.load());
  if (forced == Path::kCublas) return Path::kCublas;
  const char* refusal = split_fp16_refusal(x, weight);
  TORCH_CHECK(forced != Path::kSplitFp16 || refusal == nullptr,
              "kernels.gemm_multiply_leaky_relu: the split_fp16 path was forced but cannot run: ", refusal);
  if (refusal != nullptr) return Path::kCublas;
  return forced == Path::kSplitFp16 || split_pays_off(x, weight) ? Path::kSplitFp16 : Path::kCublas;
}

std::string gemm_multiply_leaky_relu_path(const at::Tensor& x, const at::Tensor& weight) {
  return path_name(choose_path(x, weight));
}

// Why the split_fp16 path cannot take these inputs under the current settings, whatever the automatic choice would
// say; "" if it can (so that a forced split_fp16 path runs).
std::string gemm_split_fp16_refusal(const at::Tensor& x, const at::Tensor& weight) {
  const char* refusal = split_fp16_refusal(x, weight);
  return refusal == nullptr ? "" : refusal;
}

// The cuBLAS path: at::linear, then the epilogue op in place.
std::tuple<at::Tensor, at::Tensor> cublas_gemm_multiply_leaky_relu(const at::Tensor& x, const at::Tensor& weight,
                                                                   const at::Tensor& bias, double multiplier,
                                                                   double negative_slope, bool return_mask) {
  static const auto epilogue =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kernels::multiply_leaky_relu_", "")
          .typed<at::Tensor(const at::Tensor&, double, double, bool)>();
  at::Tensor y = at::linear(x, weight, bias).contiguous();
  at::Tensor mask = epilogue.call(y, multiplier, negative_slope, return_mask);
  return {y, mask};
}

#ifdef KERNELS_WITH_CUDA
// A float32 matrix the split kernels read: rows with unit column stride, 16-byte aligned rows (a copy otherwise).
at::Tensor split_operand(const at::Tensor& t) {
  const bool aligned = t.stride(1) == 1 && t.stride(0) % 4 == 0 &&
                       reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % 16 == 0;
  return aligned ? t : t.clone(at::MemoryFormat::Contiguous);  // a fresh allocation: aligned
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "kernels.gemm_multiply_leaky_relu: the ", what, " kernel failed to launch: ",
              cudaGetErrorString(err));
}

// The split_fp16 path. Temporary memory per call: x's split, 4 bytes per element of x (its fp16 hi and lo, rows
// padded to whole chunks of 64), and 4 bytes per row of x and of W (exponents, flags); W is read as it is.
std::tuple<at::Tensor, at::Tensor> split_fp16_gemm_multiply_leaky_relu(const at::Tensor& x, const at::Tensor& weight,
                                                                       const at::Tensor& bias, double multiplier,
                                                                       double negative_slope, bool return_mask) {
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const int64_t n = weight.size(0), k = weight.size(1), m = gemm_rows(x, weight);
  const at::Tensor x2 = split_operand(x.reshape({m, k}));
  const at::Tensor w2 = split_operand(weight);
  const int64_t split_k = split_row_length(k);
  const auto half = x.options().dtype(at::kHalf);
  const auto int32 = x.options().dtype(at::kInt);
  at::Tensor x_hi = at::empty({m, split_k}, half), x_lo = at::empty({m, split_k}, half);
  at::Tensor x_exponent = at::empty({m}, int32), w_flags = at::empty({n}, int32);
  check_launch(launch_split_rows(x2.const_data_ptr<float>(), m, k, x2.stride(0), x_hi.mutable_data_ptr(),
                                 x_lo.mutable_data_ptr(), x_exponent.mutable_data_ptr<int32_t>(), stream),
               "split (x)");
  std::vector<int64_t> out_shape = x.sizes().vec();
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, x.options());
  at::Tensor mask = at::empty(return_mask ? out_shape : std::vector<int64_t>{0}, x.options().dtype(at::kBool));
  const at::Tensor b = bias.defined() ? bias.contiguous() : bias;
  const float* bias_data = b.defined() ? b.const_data_ptr<float>() : nullptr;
  std::uint8_t* positive = return_mask ? static_cast<std::uint8_t*>(mask.mutable_data_ptr()) : nullptr;
  const float multiplier_f = static_cast<float>(multiplier), slope_f = static_cast<float>(negative_slope);
  check_launch(launch_split_gemm_multiply_leaky_relu(
                   x_hi.const_data_ptr(), x_lo.const_data_ptr(), x_exponent.const_data_ptr<int32_t>(),
                   w2.const_data_ptr<float>(), w2.stride(0), w_flags.mutable_data_ptr<int32_t>(), bias_data,
                   y.mutable_data_ptr<float>(), positive, m, n, k, multiplier_f, slope_f, stream),
               "split GEMM");
  check_launch(launch_nonfinite_outputs(x2.const_data_ptr<float>(), x2.stride(0), w2.const_data_ptr<float>(),
                                        w2.stride(0), x_exponent.const_data_ptr<int32_t>(),
                                        w_flags.const_data_ptr<int32_t>(), bias_data, y.mutable_data_ptr<float>(),
                                        positive, m, n, k, multiplier_f, slope_f, stream),
               "non-finite outputs");
  return {y, mask};
}
#endif

// y = leaky_relu((x @ weight^T + bias) * multiplier, negative_slope), and, if return_mask, the bool mask of the
// elements whose pre-activation is positive (the backward needs it when the slope is negative, as the output's
// sign then no longer tells); else an empty mask.
std::tuple<at::Tensor, at::Tensor> gemm_multiply_leaky_relu(const at::Tensor& x, const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& bias, double multiplier,
                                                            double negative_slope, bool return_mask) {
  check_gemm_arguments("gemm_multiply_leaky_relu", x, weight, bias);
  const at::Tensor b = bias.has_value() && bias->defined() ? *bias : at::Tensor();
#ifdef KERNELS_WITH_CUDA
  if (choose_path(x, weight) == Path::kSplitFp16 && x.numel() > 0 && weight.numel() > 0)
    return split_fp16_gemm_multiply_leaky_relu(x, weight, b, multiplier, negative_slope, return_mask);
#endif
  return cublas_gemm_multiply_leaky_relu(x, weight, b, multiplier, negative_slope, return_mask);
}

}  // namespace
}  // namespace kernels::gemm

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("gemm_multiply_leaky_relu(Tensor x, Tensor weight, Tensor? bias, float multiplier, float negative_slope, "
        "bool return_mask) -> (Tensor, Tensor)");
  m.def("_gemm_multiply_leaky_relu_path(Tensor x, Tensor weight) -> str");
  m.def("_gemm_split_fp16_refusal(Tensor x, Tensor weight) -> str");
  m.def("_gemm_force_path(str path) -> str");
  m.impl("_gemm_force_path", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, &kernels::gemm::force_path));
}

#define KERNELS_GEMM_IMPLS(m)                                                                     \
  m.impl("gemm_multiply_leaky_relu", &kernels::gemm::gemm_multiply_leaky_relu);                   \
  m.impl("_gemm_multiply_leaky_relu_path", &kernels::gemm::gemm_multiply_leaky_relu_path);                 \
  m.impl("_gemm_split_fp16_refusal", &kernels::gemm::gemm_split_fp16_refusal)

TORCH_LIBRARY_IMPL(kernels, CPU, m) { KERNELS_GEMM_IMPLS(m); }
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) { KERNELS_GEMM_IMPLS(m); }
#endif
#undef KERNELS_GEMM_IMPLS
