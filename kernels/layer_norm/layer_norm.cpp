// The torch side of the LayerNorm family of `torch.ops.kernels`: schemas, argument checks, and the dispatch to the
// CUDA kernels (layer_norm.h, on the current stream of the tensors' own device) or to the ATen formulas of
// layer_norm_op.h (CPU tensors, float64, rows the kernels do not hold). Fake (meta) implementations are registered in
// layer_norm.py; the Autograd kernels are in layer_norm_autograd.cpp, joined after this file.
//
// Ops, over x's last dimension: layer_norm(x, weight, bias, eps) = (x - mean) / sqrt(var + eps) * weight + bias
// (nn.LayerNorm's formula, the variance biased); add_layer_norm(x, residual, weight, bias, eps) = (x + residual,
// layer_norm of that sum); layer_norm_backward(grad_y, x, weight, eps, grad_residual=None) = (grad_x + grad_residual,
// grad_weight, grad_bias). _layer_norm_leaving_row_split and _add_layer_norm_leaving_row_split: layer_norm and
// add_layer_norm for calls without a gradient to record, which also leave y's row split for the GEMM whose x y is
// (kernels::_gemm_leave_row_split; the GEMM's row pass is then not run on y).
//
// Built with KERNELS_WITH_CUDA where torch has CUDA and a GPU is visible; without it, the library is CPU-only.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <atomic>
#include <initializer_list>
#include <optional>
#include <cstdint>
#include <string>
#include <tuple>

#include "common/torch_checks.h"
#include "layer_norm_op.h"

#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/stream_capture.h"
#include "gemm/gemm.h"
#include "layer_norm.h"
#endif

namespace kernels::layer_norm {
namespace {

using common::check_float_tensor;
using common::check_same;
using common::element_type;
using common::shape_str;

void check_parameter(const char* op, const char* name, const at::Tensor& parameter, const at::Tensor& x) {
  check_float_tensor(op, name, parameter);
  check_same(op, name, parameter, "x", x);
  TORCH_CHECK(parameter.dim() == 1 && parameter.size(0) == x.size(-1), "kernels.", op, ": ", name,
              " must have shape [", std::to_string(x.size(-1)), "] (x's last dimension), got ",
              shape_str(parameter.sizes()));
}

void check_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  check_float_tensor(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, "kernels.", op, ": x must have at least 1 dimension (..., normalized), got a scalar");
  check_parameter(op, "weight", weight, x);
}

// The most dynamic shared memory the backward's blocks may take (0: the device's); tests set it to run, on any GPU,
// the refusal a GPU with less shared memory a block makes (the ATen formulas then).
std::atomic<int64_t> forced_backward_shared_limit{0};

int64_t force_backward_shared_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "kernels._layer_norm_force_backward_shared_limit: bytes must be >= 0 (0: the device's "
              "limit), got ", std::to_string(bytes));
  return forced_backward_shared_limit.exchange(bytes);
}

#ifdef KERNELS_WITH_CUDA
bool aligned(const at::Tensor& t) { return reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % 16 == 0; }

// Whether the kernels may take x: a non-empty CUDA tensor of float32, float16 or bfloat16 (its rows must also fit:
// layer_norm_fits).
bool takes_kernel(const at::Tensor& x) { return x.is_cuda() && x.scalar_type() != at::kDouble && x.numel() > 0; }

cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }
#endif

// ---- ops --------------------------------------------------------------------------------------------------------

#ifdef KERNELS_WITH_CUDA
// kernels::_gemm_leave_row_split (the GEMM family's), looked up once.
using LeaveRowSplit = void(const at::Tensor& y, const at::Tensor& hi, const at::Tensor& lo, const at::Tensor& exponent);
const c10::TypedOperatorHandle<LeaveRowSplit>& leave_row_split_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kernels::_gemm_leave_row_split", "")
                             .typed<LeaveRowSplit>();
  return op;
}
#endif

// y = layer_norm(x), or with a residual (sum, y) = (x + residual, layer_norm(sum)); `sum` is given where it is asked.
// leave_row_split: where the kernel splits float32 rows (layer_norm_leaves_row_split), y has a version counter (outside
// inference mode) and no CUDA graph is being captured, y's row split is made by the same kernel and left for the GEMM
// (_gemm_leave_row_split).
at::Tensor layer_norm_into(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                           const at::Tensor& bias, double eps, at::Tensor* sum, bool leave_row_split = false) {
#ifdef KERNELS_WITH_CUDA
  if (takes_kernel(x)) {
    // The kernels read rows of contiguous memory.
    const at::Tensor in = x.contiguous(), w = weight.contiguous(), b = bias.contiguous();
    const at::Tensor other = residual != nullptr ? residual->contiguous() : at::Tensor();
    const int64_t columns = x.size(-1), rows = x.numel() / columns;
    const bool all_aligned = aligned(in) && aligned(w) && aligned(b) && (residual == nullptr || aligned(other));
    if (layer_norm_fits(element_type(x.scalar_type()), columns, all_aligned)) {
      const c10::cuda::CUDAGuard guard(x.device());
      at::Tensor y = at::empty(x.sizes(), x.options());
      if (residual != nullptr) *sum = at::empty(x.sizes(), x.options());
      const bool splits = leave_row_split && !c10::InferenceMode::is_enabled() &&
                          layer_norm_leaves_row_split(element_type(x.scalar_type()), columns, all_aligned) &&
                          !common::stream_capturing(x);
      at::Tensor hi, lo, exponent;
      RowSplitOut split;
      if (splits) {
        const int64_t length = gemm::split_row_length(columns);
        hi = at::empty({rows, length}, x.options().dtype(at::kHalf));
        lo = at::empty({rows, length}, x.options().dtype(at::kHalf));
        exponent = at::empty({rows}, x.options().dtype(at::kInt));
        split = RowSplitOut{hi.mutable_data_ptr(), lo.mutable_data_ptr(), exponent.mutable_data_ptr<int32_t>()};
      }
      const cudaError_t err = launch_layer_norm(
          element_type(x.scalar_type()), in.const_data_ptr(), residual != nullptr ? other.const_data_ptr() : nullptr,
          w.const_data_ptr(), b.const_data_ptr(), residual != nullptr ? sum->mutable_data_ptr() : nullptr,
          y.mutable_data_ptr(), rows, columns, eps, stream_of(x), splits ? &split : nullptr);
      TORCH_CHECK(err == cudaSuccess, "kernels: the layer_norm kernel failed to launch: ", cudaGetErrorString(err));
      if (splits) leave_row_split_op().call(y, hi, lo, exponent);
      return y;
    }
  }
#else
  (void)leave_row_split;
#endif
  TORCH_CHECK(x.is_cpu() || x.is_cuda(), "kernels.layer_norm: no implementation for tensors on ", x.device().str());
  if (residual == nullptr) return layer_norm_blocked(x, weight, bias, eps);
  *sum = x.add(*residual).contiguous();
  return layer_norm_blocked(*sum, weight, bias, eps);
}

// The forward ops' checks: x, the weight and the bias; with a residual, the residual against x (no broadcasting).
void check_forward_inputs(const char* op, const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                          const at::Tensor& bias) {
  check_inputs(op, x, weight);
  check_parameter(op, "bias", bias, x);
  if (residual == nullptr) return;
  check_float_tensor(op, "residual", *residual);
  check_same(op, "residual", *residual, "x", x);
  TORCH_CHECK(residual->sizes() == x.sizes(), "kernels.", op, ": residual has shape ", shape_str(residual->sizes()),
              " but x has shape ", shape_str(x.sizes()), " (no broadcasting)");
}

// The leaving ops compute no gradient: a call that would record one is refused (their callers, kernels.patch's
// blocks, take them only without a gradient to compute).
void check_no_gradient(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  bool records = false, tangent = false;
  for (const at::Tensor* t : tensors) {
    records = records || t->requires_grad();
    tangent = tangent || t->_fw_grad(/*level=*/0).defined();
  }
  TORCH_CHECK(!(records && c10::GradMode::is_enabled()) && !tangent, "kernels.", op,
              " computes no gradient: call it under torch.no_grad() on tensors without forward-mode tangents "
              "(kernels.layer_norm and kernels.add_layer_norm compute both)");
}

at::Tensor layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  check_forward_inputs("layer_norm", x, nullptr, weight, bias);
  return layer_norm_into(x, nullptr, weight, bias, eps, nullptr);
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                  const at::Tensor& weight, const at::Tensor& bias, double eps) {
  check_forward_inputs("add_layer_norm", x, &residual, weight, bias);
  at::Tensor sum;
  at::Tensor y = layer_norm_into(x, &residual, weight, bias, eps, &sum);
  return {sum, y};
}

at::Tensor layer_norm_leaving_row_split(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                        double eps) {
  check_forward_inputs("_layer_norm_leaving_row_split", x, nullptr, weight, bias);
  check_no_gradient("_layer_norm_leaving_row_split", {&x, &weight, &bias});
  return layer_norm_into(x, nullptr, weight, bias, eps, nullptr, /*leave_row_split=*/true);
}

std::tuple<at::Tensor, at::Tensor> add_layer_norm_leaving_row_split(const at::Tensor& x, const at::Tensor& residual,
                                                                    const at::Tensor& weight, const at::Tensor& bias,
                                                                    double eps) {
  check_forward_inputs("_add_layer_norm_leaving_row_split", x, &residual, weight, bias);
  check_no_gradient("_add_layer_norm_leaving_row_split", {&x, &residual, &weight, &bias});
  at::Tensor sum;
  at::Tensor y = layer_norm_into(x, &residual, weight, bias, eps, &sum, /*leave_row_split=*/true);
  return {sum, y};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                                   const at::Tensor& weight, double eps,
                                                                   const std::optional<at::Tensor>& grad_residual) {
  check_inputs("layer_norm_backward", x, weight);
  check_float_tensor("layer_norm_backward", "grad_y", grad_y);
  check_same("layer_norm_backward", "grad_y", grad_y, "x", x);
  TORCH_CHECK(grad_y.sizes() == x.sizes(), "kernels.layer_norm_backward: grad_y has shape ",
              shape_str(grad_y.sizes()), " but x has shape ", shape_str(x.sizes()));
  const bool with_residual = grad_residual.has_value() && grad_residual->defined();
  if (with_residual) {
    check_float_tensor("layer_norm_backward", "grad_residual", *grad_residual);
    check_same("layer_norm_backward", "grad_residual", *grad_residual, "x", x);
    TORCH_CHECK(grad_residual->sizes() == x.sizes(), "kernels.layer_norm_backward: grad_residual has shape ",
                shape_str(grad_residual->sizes()), " but x has shape ", shape_str(x.sizes()));
  }
#ifdef KERNELS_WITH_CUDA
  if (takes_kernel(x)) {
    const at::Tensor g = grad_y.contiguous(), in = x.contiguous(), w = weight.contiguous();
    const at::Tensor other = with_residual ? grad_residual->contiguous() : at::Tensor();
    const int64_t columns = x.size(-1), rows = x.numel() / columns;
    const bool all_aligned = aligned(g) && aligned(in) && aligned(w) && (!with_residual || aligned(other));
    if (layer_norm_fits(element_type(x.scalar_type()), columns, all_aligned)) {
      const c10::cuda::CUDAGuard guard(x.device());
      const int blocks = layer_norm_backward_blocks(x.device().index(), rows);
      at::Tensor grad_x = at::empty(x.sizes(), x.options());
      at::Tensor grad_weight = at::empty({columns}, weight.options());
      at::Tensor grad_bias = at::empty({columns}, weight.options());
      at::Tensor partials = at::empty({blocks, 2, columns}, x.options().dtype(at::kDouble));
      const auto launch = [&](const void* residual) {
        return launch_layer_norm_backward(
            element_type(x.scalar_type()), g.const_data_ptr(), in.const_data_ptr(), w.const_data_ptr(), residual,
            grad_x.mutable_data_ptr(), grad_weight.mutable_data_ptr(), grad_bias.mutable_data_ptr(),
            partials.mutable_data_ptr<double>(), blocks, rows, columns, eps,
            static_cast<std::size_t>(forced_backward_shared_limit.load()), stream_of(x));
      };
      cudaError_t err = launch(with_residual ? other.const_data_ptr() : nullptr);
      // A block whose shared memory holds the staged rows without the residual's third (sm_86 and sm_89 at 1024
      // columns): the kernels without it, then the add (rounded twice, as eager's backward and add are).
      const bool added_apart = with_residual && err == cudaErrorNotSupported;
      if (added_apart) err = launch(nullptr);
      if (err != cudaErrorNotSupported) {  // else a GPU with too little shared memory: the ATen formulas below
        TORCH_CHECK(err == cudaSuccess, "kernels: the layer_norm backward kernels failed to launch: ",
                    cudaGetErrorString(err));
        if (added_apart) grad_x.add_(other);
        return {grad_x, grad_weight, grad_bias};
      }
    }
  }
#endif
  TORCH_CHECK(x.is_cpu() || x.is_cuda(), "kernels.layer_norm_backward: no implementation for tensors on ",
              x.device().str());
  return layer_norm_backward_blocked(grad_y, x, weight, eps, with_residual ? *grad_residual : at::Tensor());
}

}  // namespace
}  // namespace kernels::layer_norm

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("layer_norm(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor");
  m.def("add_layer_norm(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor)");
  m.def("layer_norm_backward(Tensor grad_y, Tensor x, Tensor weight, float eps, Tensor? grad_residual=None) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("_layer_norm_leaving_row_split(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor");
  m.def("_add_layer_norm_leaving_row_split(Tensor x, Tensor residual, Tensor weight, Tensor bias, float eps) -> "
        "(Tensor, Tensor)");
  m.def("_layer_norm_force_backward_shared_limit(int bytes) -> int");
  m.impl("_layer_norm_force_backward_shared_limit",
         torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd,
                         &kernels::layer_norm::force_backward_shared_limit));
}

// The same functions serve both devices: each picks the CUDA kernels or the ATen formulas by the tensors' device,
// dtype and row length.
#define KERNELS_LAYER_NORM_IMPLS(m)                                                                          \
  m.impl("layer_norm", &kernels::layer_norm::layer_norm);                                                    \
  m.impl("add_layer_norm", &kernels::layer_norm::add_layer_norm);                                            \
  m.impl("_layer_norm_leaving_row_split", &kernels::layer_norm::layer_norm_leaving_row_split);              \
  m.impl("_add_layer_norm_leaving_row_split", &kernels::layer_norm::add_layer_norm_leaving_row_split);      \
  m.impl("layer_norm_backward", &kernels::layer_norm::layer_norm_backward)

TORCH_LIBRARY_IMPL(kernels, CPU, m) { KERNELS_LAYER_NORM_IMPLS(m); }
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) { KERNELS_LAYER_NORM_IMPLS(m); }
#endif
#undef KERNELS_LAYER_NORM_IMPLS
