// The cublas_bf16x9 path's products (gemm_path.cpp chooses it; on Blackwell, sm_100 and sm_103, by default): float32
// GEMMs on cuBLAS's FP32 emulation, CUBLAS_COMPUTE_32F_EMULATED_16BFX9 (cuBLAS 12.9 and later): each operand split into
// three bf16 terms, nine products on the bf16 tensor cores with fp32 accumulation, float32's accuracy at a rate the
// fp32 units lack. cuBLAS's default strategy emulates only where it expects a gain (IEEE fp32 kernels elsewhere).
// The classic cublasGemmEx on torch's handle (stream, workspace, math mode, as at::mm's) rather than cuBLASLt: the same
// numerics, and PyTorch's own comparison on GB200 found its kernel choice the less shape-sensitive.
#ifdef KERNELS_WITH_CUDA
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <cstdint>

namespace kernels::gemm {
namespace {

// The compute type of this path, and whether the cuBLAS headers built against have it.
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120900
constexpr bool kBf16x9Compiled = true;
constexpr cublasComputeType_t kBf16x9ComputeType = CUBLAS_COMPUTE_32F_EMULATED_16BFX9;
#else
constexpr bool kBf16x9Compiled = false;
constexpr cublasComputeType_t kBf16x9ComputeType = CUBLAS_COMPUTE_32F;  // never used: cublas_bf16x9_refusal refuses
#endif

// Why the cublas_bf16x9 path cannot run a float32 product of this size, or nullptr if it can: the library built
// against a cuBLAS older than 12.9, a cuBLAS older than 12.9 loaded, or a dimension past cuBLAS's int.
const char* cublas_bf16x9_refusal(int64_t m, int64_t n, int64_t k) {
  if (!kBf16x9Compiled) return "the library was built against a cuBLAS older than 12.9 (no FP32 emulation)";
  // The loaded library's version in CUBLAS_VERSION's encoding, read without a handle: a handle is made on the current
  // device, which need not be the tensors' (a process that uses only cuda:1 would get a context on cuda:0).
  static const int loaded_version = [] {
    int major = 0, minor = 0, patch = 0;
    if (cublasGetProperty(MAJOR_VERSION, &major) != CUBLAS_STATUS_SUCCESS ||
        cublasGetProperty(MINOR_VERSION, &minor) != CUBLAS_STATUS_SUCCESS ||
        cublasGetProperty(PATCH_LEVEL, &patch) != CUBLAS_STATUS_SUCCESS)
      return 0;
    return major * 10000 + minor * 100 + patch;
  }();
  if (loaded_version < 120900) return "the cuBLAS loaded is older than 12.9 (no FP32 emulation)";
  if (m > INT_MAX || n > INT_MAX || k > INT_MAX) return "a dimension is past cuBLAS's int range";
  return nullptr;
}

// A float32 matrix t (r x c) as cuBLAS's column-major operand op(t^T): where t is row-major (unit column stride),
// its memory read column-major is t^T itself; where t is column-major, it is t, to be transposed; else a copy.
struct ColumnMajorOperand {
  at::Tensor owner;  // t, or its row-major copy
  cublasOperation_t op;
  int64_t ld;
};

ColumnMajorOperand column_major_transpose(const at::Tensor& t) {
  const int64_t rows = t.size(0), columns = t.size(1);
  if (t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(1, columns)) return {t, CUBLAS_OP_N, t.stride(0)};
  if (t.stride(0) == 1 && t.stride(1) >= std::max<int64_t>(1, rows)) return {t, CUBLAS_OP_T, t.stride(1)};
  const at::Tensor copy = t.contiguous();
  return {copy, CUBLAS_OP_N, std::max<int64_t>(1, columns)};
}

// y (m x n, row-major) = a (m x k) b (k x n) + bias (broadcast over rows; none where undefined), float32 on one GPU,
// no dimension 0, computed as y^T = b^T a^T in cuBLAS's column-major terms. Raises where cuBLAS refuses.
at::Tensor cublas_bf16x9_addmm(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b) {
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  // The handle and stream of the tensors' GPU: custom ops get no device guard from the dispatcher, and the current
  // device may be another (cuBLAS would then run on that device's handle with this one's pointers).
  const c10::cuda::CUDAGuard guard(a.device());
  // No determinism alert under torch.use_deterministic_algorithms, as at::mm raises none (tests/test_modes.py checks):
  // cuBLAS is deterministic on the fixed workspace torch gives each stream's handle, which this call uses too.
  at::Tensor y = at::empty({m, n}, a.options());
  if (bias.defined()) y.copy_(bias.expand({m, n}));
  const ColumnMajorOperand a_t = column_major_transpose(a), b_t = column_major_transpose(b);
  const float alpha = 1.0f, beta = bias.defined() ? 1.0f : 0.0f;
  const cublasStatus_t status = cublasGemmEx(
      at::cuda::getCurrentCUDABlasHandle(), b_t.op, a_t.op, static_cast<int>(n), static_cast<int>(m),
      static_cast<int>(k), &alpha, b_t.owner.const_data_ptr<float>(), CUDA_R_32F, static_cast<int>(b_t.ld),
      a_t.owner.const_data_ptr<float>(), CUDA_R_32F, static_cast<int>(a_t.ld), &beta, y.mutable_data_ptr<float>(),
      CUDA_R_32F, static_cast<int>(n), kBf16x9ComputeType, CUBLAS_GEMM_DEFAULT);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "kernels.gemm_multiply_leaky_relu: cuBLAS refused its FP32 emulation "
              "(cublas_bf16x9 path) for a ", std::to_string(m), " x ", std::to_string(k), " by ", std::to_string(k),
              " x ", std::to_string(n), " product: ",
              cublasGetStatusString(status));
  return y;
}

}  // namespace
}  // namespace kernels::gemm
#endif
