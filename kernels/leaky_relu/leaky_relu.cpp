// The torch side of the LeakyReLU family of `torch.ops.kernels`: schemas, argument checks, dtype dispatch, and the
// CPU and CUDA implementations. CUDA work goes through the plain launchers of leaky_relu.cu (leaky_relu.h), on the
// current stream of the tensor's own device. Fake (meta) implementations are registered in leaky_relu.py; every
// op's Autograd kernel, and the in-place ops' ADInplaceOrView kernels, are in leaky_relu_autograd.cpp, joined after
// this file or built as a library of its own (kernels/loader.py, library_builds).
//
// Ops: leaky_relu, leaky_relu_ (in place), multiply_leaky_relu_ (in place, with the multiply and the branch mask:
// the epilogue of the GEMM family's cuBLAS path), leaky_relu_backward.
//
// Built with KERNELS_WITH_CUDA where torch has CUDA and a GPU is visible; without it, the library is CPU-only.
// Headers are kept to the few ATen pieces used, which keeps the JIT build short.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>

#include "common/torch_checks.h"

#ifdef KERNELS_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "leaky_relu.h"
#endif

namespace kernels::leaky_relu {
namespace {

using common::check_float_tensor;
using common::in_layout_of;
using common::output_like;
using common::shape_str;

// ---- CPU loops -------------------------------------------------------------------------------------------------
// Two builds of each loop, picked at run time (cpu_loops_isa()):
//  - generic: plain C++ for any CPU, branch-free and one instantiation per flag combination, so the compiler
//    vectorizes it with the build's default ISA (SSE2 on x86-64). A branch on the sign of random data mispredicts
//    half the time: 10x slower.
//  - avx2 (x86-64 with GCC): ATen's at::vec::Vectorized loops, compiled with AVX2/FMA/F16C for these functions
//    only, so the library still loads and runs on any CPU. The JIT build has no -mavx2 and no CPU_CAPABILITY
//    macro, so ATen's vector headers would otherwise give their generic element-by-element Vectorized, and
//    float16/bfloat16 would convert in software. Same arithmetic as the generic loops and as eager's own
//    vectorized kernels (in float for float16/bfloat16, one rounding at the end): the same bits.
// The loops take everything by value: captured references could alias the output, which stops vectorization.

constexpr int64_t kCpuGrain = 1 << 14;

template <typename F>
void with_flags(bool a, bool b, F f) {
  using T = std::true_type;
  using N = std::false_type;
  if (a) {
    if (b) f(T{}, T{}); else f(T{}, N{});
  } else {
    if (b) f(N{}, T{}); else f(N{}, N{});
  }
}

template <typename scalar_t, bool kMultiplied, bool kMask>
void multiply_leaky_relu_range(const scalar_t* in, scalar_t* out, bool* positive, int64_t begin, int64_t end,
                               at::opmath_type<scalar_t> multiplier, at::opmath_type<scalar_t> slope) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = begin; i < end; ++i) {
    opmath_t v = static_cast<opmath_t>(in[i]);
    if constexpr (kMultiplied) v = v * multiplier;
    const opmath_t negative = v * slope;  // computed unconditionally: a select, not a branch
    const bool pos = v > opmath_t(0);
    out[i] = static_cast<scalar_t>(pos ? v : negative);
    if constexpr (kMask) positive[i] = pos;
  }
}

template <typename scalar_t, bool kMultiplied, bool kMask>
void leaky_relu_backward_range(const scalar_t* grad_out, const scalar_t* saved, const bool* mask, scalar_t* grad_in,
                               int64_t begin, int64_t end, at::opmath_type<scalar_t> multiplier,
                               at::opmath_type<scalar_t> slope) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = begin; i < end; ++i) {
    bool pos;
    // The mask is read as bytes: read as bool, g++ branches on it (10x slower on a random mask).
    if constexpr (kMask) pos = reinterpret_cast<const std::uint8_t*>(mask)[i] != 0;
    else pos = static_cast<opmath_t>(saved[i]) > opmath_t(0);
    const opmath_t g = static_cast<opmath_t>(grad_out[i]);
    const opmath_t negative = g * slope;
    opmath_t v = pos ? g : negative;
    if constexpr (kMultiplied) v = v * multiplier;
    grad_in[i] = static_cast<scalar_t>(v);
  }
}

}  // namespace
}  // namespace kernels::leaky_relu

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(CPU_CAPABILITY)
#define KERNELS_CPU_AVX2 1
// Everything defined from here to pop_options is compiled for AVX2: ATen's vector headers (their AVX2
// implementation, selected by CPU_CAPABILITY_AVX2, in an inline namespace of our own name so that no symbol is
// shared with torch's builds of the same headers) and the loops below. Only the loops call into it, and only where
// the CPU has those instructions.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // a note on 32-byte vector arguments, about ABIs of GCC before 4.6
#define CPU_CAPABILITY kernels_avx2
#define CPU_CAPABILITY_AVX2
// g++ evaluates #if before it applies the target pragma, so __AVX__ is not yet defined here; Sleef's header (which
// the AVX2 Vectorized<float> includes) declares its AVX functions only where it is. The functions are declared,
// never called by these loops.
#ifndef __AVX__
#define __AVX__ 1
#define KERNELS_DEFINED_AVX
#endif
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#ifdef KERNELS_DEFINED_AVX
#undef __AVX__
#undef KERNELS_DEFINED_AVX
#endif

namespace kernels::leaky_relu {
namespace {
namespace avx2 {

using at::vec::Vectorized;

// The loops below work on vectors of opmath_t (float16/bfloat16 as two float vectors per vector of scalar_t); the
// last elements of each range, fewer than one vector, take the generic loop.

// positive ? v : v * slope, lane by lane: eager's a * (a > 0 ? 1 : slope) bit for bit.
template <typename opmath_t>
Vectorized<opmath_t> select_positive(const Vectorized<opmath_t>& positive, const Vectorized<opmath_t>& v,
                                     const Vectorized<opmath_t>& slope) {
  return Vectorized<opmath_t>::blendv(v * slope, v, positive);
}

// The lanes of a bool mask as a vector select (all bits set where true).
template <typename opmath_t>
Vectorized<opmath_t> load_mask(const bool* mask) {
  __at_align__ opmath_t lanes[Vectorized<opmath_t>::size()];
  const auto* bytes = reinterpret_cast<const std::uint8_t*>(mask);  // read as bytes: a conversion, not a branch
  for (int k = 0; k < Vectorized<opmath_t>::size(); ++k) lanes[k] = static_cast<opmath_t>(bytes[k]);
  return Vectorized<opmath_t>::loadu(lanes) > Vectorized<opmath_t>(opmath_t(0));
}

template <typename scalar_t, bool kMultiplied, bool kMask>
void multiply_leaky_relu_range(const scalar_t* in, scalar_t* out, bool* positive, int64_t begin, int64_t end,
                               at::opmath_type<scalar_t> multiplier, at::opmath_type<scalar_t> slope) {
  using opmath_t = at::opmath_type<scalar_t>;
  using Vec = Vectorized<scalar_t>;
  using fVec = Vectorized<opmath_t>;
  const fVec zero(opmath_t(0)), multiplier_v(multiplier), slope_v(slope);
  // The values whose sign the mask records, one vector of scalar_t at a time: turned into bools by a plain loop,
  // which the compiler vectorizes (a movemask and eight byte stores per vector took twice as long).
  __at_align__ opmath_t product[Vec::size()];
  const auto apply = [&](fVec v, int at) {
    if constexpr (kMultiplied) v = v * multiplier_v;
    if constexpr (kMask) v.store(product + at);
    return select_positive(v > zero, v, slope_v);
  };
  // One vector of scalar_t at `at`; two per iteration below, as eager's vectorized loops do.
  const auto step = [&](int64_t at) {
    const Vec x = Vec::loadu(in + at);
    if constexpr (std::is_same_v<scalar_t, opmath_t>) {
      apply(x, 0).store(out + at);
    } else {
      auto [x0, x1] = at::vec::convert_to_float<scalar_t>(x);
      const fVec y0 = apply(x0, 0), y1 = apply(x1, fVec::size());
      at::vec::convert_from_float<scalar_t>(y0, y1).store(out + at);
    }
    if constexpr (kMask) {
      for (int k = 0; k < Vec::size(); ++k) positive[at + k] = product[k] > opmath_t(0);
    }
  };
  int64_t i = begin;
  for (; i + 2 * Vec::size() <= end; i += 2 * Vec::size()) {
    step(i);
    step(i + Vec::size());
  }
  for (; i + Vec::size() <= end; i += Vec::size()) step(i);
  leaky_relu::multiply_leaky_relu_range<scalar_t, kMultiplied, kMask>(in, out, positive, i, end, multiplier, slope);
}

template <typename scalar_t, bool kMultiplied, bool kMask>
void leaky_relu_backward_range(const scalar_t* grad_out, const scalar_t* saved, const bool* mask, scalar_t* grad_in,
                               int64_t begin, int64_t end, at::opmath_type<scalar_t> multiplier,
                               at::opmath_type<scalar_t> slope) {
  using opmath_t = at::opmath_type<scalar_t>;
  using Vec = Vectorized<scalar_t>;
  using fVec = Vectorized<opmath_t>;
  const fVec zero(opmath_t(0)), multiplier_v(multiplier), slope_v(slope);
  const auto apply = [&](const fVec& g, const fVec& is_positive) {
    fVec v = select_positive(is_positive, g, slope_v);
    if constexpr (kMultiplied) v = v * multiplier_v;
    return v;
  };
  // One vector of scalar_t at `at`; two per iteration below, as eager's vectorized loops do.
  const auto step = [&](int64_t at) {
    const Vec g = Vec::loadu(grad_out + at);
    if constexpr (std::is_same_v<scalar_t, opmath_t>) {
      fVec is_positive;
      if constexpr (kMask) is_positive = load_mask<opmath_t>(mask + at); else is_positive = Vec::loadu(saved + at) > zero;
      apply(g, is_positive).store(grad_in + at);
    } else {
      auto [g0, g1] = at::vec::convert_to_float<scalar_t>(g);
      fVec p0, p1;
      if constexpr (kMask) {
        p0 = load_mask<opmath_t>(mask + at);
        p1 = load_mask<opmath_t>(mask + at + fVec::size());
      } else {
        auto [s0, s1] = at::vec::convert_to_float<scalar_t>(Vec::loadu(saved + at));
        p0 = s0 > zero;
        p1 = s1 > zero;
      }
      at::vec::convert_from_float<scalar_t>(apply(g0, p0), apply(g1, p1)).store(grad_in + at);
    }
  };
  int64_t i = begin;
  for (; i + 2 * Vec::size() <= end; i += 2 * Vec::size()) {
    step(i);
    step(i + Vec::size());
  }
  for (; i + Vec::size() <= end; i += Vec::size()) step(i);
  leaky_relu::leaky_relu_backward_range<scalar_t, kMultiplied, kMask>(grad_out, saved, mask, grad_in, i, end,
                                                                      multiplier, slope);
}

}  // namespace avx2
}  // namespace
}  // namespace kernels::leaky_relu

#undef CPU_CAPABILITY_AVX2
#undef CPU_CAPABILITY
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

namespace kernels::leaky_relu {
namespace {

enum class CpuIsa { kGeneric, kAvx2 };

// The AVX2 loops where the CPU has AVX2, FMA and F16C and ATen itself runs vectorized kernels (so
// ATEN_CPU_CAPABILITY=default, which makes eager use its generic kernels, does the same here).
CpuIsa cpu_loops_isa() {
#ifdef KERNELS_CPU_AVX2
  static const CpuIsa isa = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                                    __builtin_cpu_supports("f16c") && at::get_cpu_capability() != "DEFAULT"
                                ? CpuIsa::kAvx2
                                : CpuIsa::kGeneric;
  return isa;
#else
  return CpuIsa::kGeneric;
#endif
}

#ifdef KERNELS_WITH_CUDA
ElementType element_type(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return ElementType::kFloat64;
    case at::kHalf: return ElementType::kFloat16;
    case at::kBFloat16: return ElementType::kBFloat16;
    default: return ElementType::kFloat32;  // the checks admit no other type
  }
}
#endif

// ---- element-wise runners: one function per kernel, CPU loop or CUDA launch --------------------------------------

// y = leaky_relu(x * multiplier, slope), mask = x * multiplier > 0 (if defined). x, y and mask share one dense
// layout.
void run_multiply_leaky_relu(const at::Tensor& x, const at::Tensor& y, const at::Tensor& mask, double multiplier,
                             double slope) {
  const int64_t n = x.numel();
  if (n == 0) return;
#ifdef KERNELS_WITH_CUDA
  if (x.is_cuda()) {
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaError_t err = launch_multiply_leaky_relu(
        element_type(x.scalar_type()), x.const_data_ptr(), y.mutable_data_ptr(),
        mask.defined() ? static_cast<std::uint8_t*>(mask.mutable_data_ptr()) : nullptr, n, multiplier, slope,
        c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
    TORCH_CHECK(err == cudaSuccess, "kernels: the leaky_relu kernel failed to launch: ", cudaGetErrorString(err));
    return;
  }
#endif
  TORCH_CHECK(x.is_cpu(), "kernels: no implementation for tensors on ", x.device().str());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "multiply_leaky_relu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    bool* positive = mask.defined() ? mask.mutable_data_ptr<bool>() : nullptr;
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    scalar_t* out = y.mutable_data_ptr<scalar_t>();
    const opmath_t s = static_cast<opmath_t>(multiplier), ns = static_cast<opmath_t>(slope);
    with_flags(multiplier != 1.0, positive != nullptr, [&](auto multiplied, auto masked) {
      constexpr bool kMultiplied = decltype(multiplied)::value, kMask = decltype(masked)::value;
      auto range = &multiply_leaky_relu_range<scalar_t, kMultiplied, kMask>;
#ifdef KERNELS_CPU_AVX2
      if (cpu_loops_isa() == CpuIsa::kAvx2) range = &avx2::multiply_leaky_relu_range<scalar_t, kMultiplied, kMask>;
#endif
      at::parallel_for(0, n, kCpuGrain, [=](int64_t begin, int64_t end) {
        range(in, out, positive, begin, end, s, ns);
      });
    });
  });
}

// grad_in = (positive ? grad_out : grad_out * slope) * multiplier, positive = mask if `saved` is bool, else
// saved > 0.
void run_leaky_relu_backward(const at::Tensor& grad_out, const at::Tensor& saved, const at::Tensor& grad_in,
                             double multiplier, double slope) {
  const int64_t n = grad_out.numel();
  if (n == 0) return;
  const bool is_mask = saved.scalar_type() == at::kBool;
#ifdef KERNELS_WITH_CUDA
  if (grad_out.is_cuda()) {
    const c10::cuda::CUDAGuard guard(grad_out.device());
    const cudaError_t err = launch_leaky_relu_backward(
        element_type(grad_out.scalar_type()), grad_out.const_data_ptr(), is_mask ? nullptr : saved.const_data_ptr(),
        is_mask ? static_cast<const std::uint8_t*>(saved.const_data_ptr()) : nullptr, grad_in.mutable_data_ptr(),
        n, multiplier, slope, c10::cuda::getCurrentCUDAStream(grad_out.device().index()).stream());
    TORCH_CHECK(err == cudaSuccess, "kernels: the leaky_relu backward kernel failed to launch: ",
                cudaGetErrorString(err));
    return;
  }
#endif
  TORCH_CHECK(grad_out.is_cpu(), "kernels: no implementation for tensors on ", grad_out.device().str());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_out.scalar_type(), "leaky_relu_backward", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* g = grad_out.const_data_ptr<scalar_t>();
    const scalar_t* activation = is_mask ? nullptr : saved.const_data_ptr<scalar_t>();
    const bool* positive = is_mask ? saved.const_data_ptr<bool>() : nullptr;
    scalar_t* out = grad_in.mutable_data_ptr<scalar_t>();
    const opmath_t s = static_cast<opmath_t>(multiplier), ns = static_cast<opmath_t>(slope);
    with_flags(multiplier != 1.0, is_mask, [&](auto multiplied, auto masked) {
      constexpr bool kMultiplied = decltype(multiplied)::value, kMask = decltype(masked)::value;
      auto range = &leaky_relu_backward_range<scalar_t, kMultiplied, kMask>;
#ifdef KERNELS_CPU_AVX2
      if (cpu_loops_isa() == CpuIsa::kAvx2) range = &avx2::leaky_relu_backward_range<scalar_t, kMultiplied, kMask>;
#endif
      at::parallel_for(0, n, kCpuGrain, [=](int64_t begin, int64_t end) {
        range(g, activation, positive, out, begin, end, s, ns);
      });
    });
  });
}

// ---- ops --------------------------------------------------------------------------------------------------------

at::Tensor leaky_relu(const at::Tensor& x, double negative_slope) {
  check_float_tensor("leaky_relu", "x", x);
  // Same layout as F.leaky_relu's output: x's strides if x is dense (a transpose too), contiguous otherwise.
  at::Tensor y = output_like(x);
  run_multiply_leaky_relu(in_layout_of(x, y), y, at::Tensor(), 1.0, negative_slope);
  return y;
}

// x = leaky_relu(x * multiplier, negative_slope) in place; returns the bool mask of x * multiplier > 0 where
// return_mask (the backward needs it when the slope is negative, as the output's sign then no longer tells), else
// an empty tensor. `op` names the calling op in error messages.
at::Tensor multiply_leaky_relu_in_place(const char* op, const at::Tensor& x, double multiplier, double negative_slope,
                                        bool return_mask) {
  check_float_tensor(op, "x", x);
  const auto mask_like = [&](const at::Tensor& t) {
    const auto options = t.options().dtype(at::kBool);
    return return_mask ? at::empty_like(t, options) : at::empty({0}, options);
  };
  if (x.is_non_overlapping_and_dense()) {
    at::Tensor mask = mask_like(x);
    run_multiply_leaky_relu(x, x, return_mask ? mask : at::Tensor(), multiplier, negative_slope);
    return mask;
  }
  TORCH_CHECK(at::has_internal_overlap(x) != at::MemOverlap::Yes, "kernels.", op,
              ": x has elements that share memory (an expanded view), which an in-place operation cannot write; "
              "call it on x.clone()");
  const at::Tensor tmp = x.contiguous();
  at::Tensor mask = mask_like(tmp);
  run_multiply_leaky_relu(tmp, tmp, return_mask ? mask : at::Tensor(), multiplier, negative_slope);
  x.copy_(tmp);
  return mask;
}

at::Tensor multiply_leaky_relu_(const at::Tensor& x, double multiplier, double negative_slope, bool return_mask) {
  return multiply_leaky_relu_in_place("multiply_leaky_relu_", x, multiplier, negative_slope, return_mask);
}

void leaky_relu_(const at::Tensor& x, double negative_slope) {
  multiply_leaky_relu_in_place("leaky_relu_", x, 1.0, negative_slope, false);
}

at::Tensor leaky_relu_backward(const at::Tensor& grad_output, const at::Tensor& saved, double negative_slope,
                               double multiplier) {
  check_float_tensor("leaky_relu_backward", "grad_output", grad_output);
  TORCH_CHECK(saved.defined() && (saved.scalar_type() == at::kBool || saved.scalar_type() == grad_output.scalar_type()),
              "kernels.leaky_relu_backward: saved must be a bool mask or have grad_output's dtype (",
              grad_output.scalar_type(), "), got ", saved.defined() ? c10::toString(saved.scalar_type()) : "undefined");
  TORCH_CHECK(saved.device() == grad_output.device(), "kernels.leaky_relu_backward: expected grad_output and saved on "
              "the same device, got ", grad_output.device().str(), " and ", saved.device().str());
  TORCH_CHECK(saved.sizes() == grad_output.sizes(), "kernels.leaky_relu_backward: grad_output has shape ",
              shape_str(grad_output.sizes()), " but saved has shape ", shape_str(saved.sizes()));
  at::Tensor grad_in = output_like(grad_output);
  run_leaky_relu_backward(in_layout_of(grad_output, grad_in), in_layout_of(saved, grad_in), grad_in,
                          multiplier, negative_slope);
  return grad_in;
}

}  // namespace
}  // namespace kernels::leaky_relu

TORCH_LIBRARY_FRAGMENT(kernels, m) {
  m.def("leaky_relu(Tensor x, float negative_slope) -> Tensor");
  m.def("leaky_relu_(Tensor(a!) x, float negative_slope) -> ()");
  m.def("multiply_leaky_relu_(Tensor(a!) x, float multiplier, float negative_slope, bool return_mask) -> Tensor");
  m.def("leaky_relu_backward(Tensor grad_output, Tensor saved, float negative_slope, float multiplier) -> Tensor");
}

// The same functions serve both devices: each picks the CPU loop or the CUDA launch by the tensors' device.
#define KERNELS_LEAKY_RELU_IMPLS(m)                                                  \
  m.impl("leaky_relu", &kernels::leaky_relu::leaky_relu);                            \
  m.impl("leaky_relu_", &kernels::leaky_relu::leaky_relu_);                          \
  m.impl("multiply_leaky_relu_", &kernels::leaky_relu::multiply_leaky_relu_);        \
  m.impl("leaky_relu_backward", &kernels::leaky_relu::leaky_relu_backward)

TORCH_LIBRARY_IMPL(kernels, CPU, m) { KERNELS_LEAKY_RELU_IMPLS(m); }
#ifdef KERNELS_WITH_CUDA
TORCH_LIBRARY_IMPL(kernels, CUDA, m) { KERNELS_LEAKY_RELU_IMPLS(m); }
#endif
#undef KERNELS_LEAKY_RELU_IMPLS
