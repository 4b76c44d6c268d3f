// Argument checks and layout helpers shared by the families' torch-side files (kernels/*/*.cpp). Torch headers
// only; never included by a .cu file.
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#ifdef KERNELS_WITH_CUDA
#include <ATen/cuda/EmptyTensor.h>
#endif

#include <cctype>
#include <cstdio>
#include <string>

#include "element_type.h"

namespace kernels::common {

// The launchers' element type of a dtype the checks admitted (float32, float64, float16, bfloat16).
inline ElementType element_type(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return ElementType::kFloat64;
    case at::kHalf: return ElementType::kFloat16;
    case at::kBFloat16: return ElementType::kBFloat16;
    default: return ElementType::kFloat32;
  }
}

// Messages format numbers, shapes and devices as std::string here: on the GPU machine (library built by another
// g++ than torch's) streaming an int64_t, a double, an IntArrayRef or a Device into TORCH_CHECK's message crashed
// the process (a null num_put facet: SIGSEGV at address 0); strings and ScalarType names stream safely.
inline std::string number_str(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  return text;
}

inline std::string shape_str(at::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// A dtype as Python names it (torch.float32), so that the ops' messages and their fakes' (kernels/checks.py) read
// alike; ATen's own names (Float) stream where no Python name is listed, lowercased (Float8_e4m3fn: float8_e4m3fn).
inline std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: {
      std::string name = c10::toString(t);
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return "torch." + name;
    }
  }
}

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

inline void check_float_tensor(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), "kernels.", op, ": ", name, " is an undefined tensor");
  TORCH_CHECK(is_supported_float(t.scalar_type()), "kernels.", op, ": ", name,
              " must be a float32, float64, float16 or bfloat16 tensor, got ", dtype_str(t.scalar_type()));
}

inline void check_same(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), "kernels.", op, ": expected ", name, " and ", ref_name,
              " on the same device, got ", name, " on ", t.device().str(), " and ", ref_name, " on ",
              ref.device().str());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "kernels.", op, ": expected ", name, " and ", ref_name,
              " to have the same dtype, got ", name, " ", dtype_str(t.scalar_type()), " and ", ref_name, " ",
              dtype_str(ref.scalar_type()));
}

// An output for an element-wise op on x: at::empty_like(x)'s tensor (x's dtype, device, and strides where x is dense,
// else contiguous in x's suggested memory format), allocated directly as TensorIterator does, skipping
// at::empty_like's dispatcher trips, which weigh on a small call's host time. Other devices take at::empty_like.
inline at::Tensor output_like(const at::Tensor& x) {
  const bool dense = x.is_non_overlapping_and_dense();
#ifdef KERNELS_WITH_CUDA
  if (x.is_cuda())
    return at::Tensor(dense ? at::detail::empty_strided_cuda(x.sizes(), x.strides(), x.scalar_type(), x.device())
                            : at::detail::empty_cuda(x.sizes(), x.scalar_type(), x.device(), x.suggest_memory_format()));
#endif
  if (!x.is_cpu()) return at::empty_like(x);
  return at::Tensor(dense ? at::detail::empty_strided_cpu(x.sizes(), x.strides(), x.scalar_type())
                          : at::detail::empty_cpu(x.sizes(), x.scalar_type(), false, x.suggest_memory_format()));
}

// The element-wise kernels walk memory linearly, so their operands must cover one dense block of memory in one
// shared layout. Returns t itself where it already has layout's strides, else a copy of t in that layout.
// `layout` must be dense (as output_like makes it: same strides as a dense input, contiguous for any other).
inline at::Tensor in_layout_of(const at::Tensor& t, const at::Tensor& layout) {
  if (t.strides() == layout.strides()) return t;
  return at::empty_like(layout, t.options()).copy_(t);
}

}  // namespace kernels::common
