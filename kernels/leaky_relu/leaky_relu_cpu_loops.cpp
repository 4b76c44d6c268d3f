// The LeakyReLU family's CPU loops, forward and backward (leaky_relu_cpu_loops.h): plain functions over raw
// pointers, the CPU's counterpart of the CUDA kernels in leaky_relu.cu, called by the torch side (leaky_relu.cpp).
// Only ATen's vector, parallel and scalar-type headers: no tensors, no dispatcher.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "leaky_relu_cpu_loops.h"

namespace kernels::leaky_relu {
namespace {

// ---- CPU loops -------------------------------------------------------------------------------------------------
// Two builds of each loop, picked at run time (loops_isa()):
// - generic: plain C++ for any CPU, branch-free (a branch on random signs mispredicts), one instantiation per flag
//   combination, vectorized by the compiler at the build's default ISA.
// - avx2 (x86-64 with GCC): ATen's Vectorized loops compiled with AVX2/FMA/F16C for these functions only, so the
//   library still runs on any CPU (the JIT build has no -mavx2 or CPU_CAPABILITY, without which ATen's vectors are
//   scalar). Same arithmetic as the generic loops and eager's kernels: the same bits.
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
void multiply_leaky_relu_range(const scalar_t* in, scalar_t* out, std::uint8_t* positive, int64_t begin, int64_t end,
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
void leaky_relu_backward_range(const scalar_t* grad_out, const scalar_t* saved, const std::uint8_t* mask,
                               scalar_t* grad_in,
                               int64_t begin, int64_t end, at::opmath_type<scalar_t> multiplier,
                               at::opmath_type<scalar_t> slope) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = begin; i < end; ++i) {
    bool pos;
    // The mask is read as bytes: read as bool, g++ branches on it, which mispredicts on a random mask.
    if constexpr (kMask) pos = mask[i] != 0;
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
Vectorized<opmath_t> load_mask(const std::uint8_t* mask) {
  __at_align__ opmath_t lanes[Vectorized<opmath_t>::size()];
  // Read as bytes: a conversion, not a branch.
  for (int k = 0; k < Vectorized<opmath_t>::size(); ++k) lanes[k] = static_cast<opmath_t>(mask[k]);
  return Vectorized<opmath_t>::loadu(lanes) > Vectorized<opmath_t>(opmath_t(0));
}

template <typename scalar_t, bool kMultiplied, bool kMask>
void multiply_leaky_relu_range(const scalar_t* in, scalar_t* out, std::uint8_t* positive, int64_t begin, int64_t end,
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
void leaky_relu_backward_range(const scalar_t* grad_out, const scalar_t* saved, const std::uint8_t* mask,
                               scalar_t* grad_in,
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
CpuIsa loops_isa(bool aten_vectorized) {
#ifdef KERNELS_CPU_AVX2
  static const bool has_avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return has_avx2 && aten_vectorized ? CpuIsa::kAvx2 : CpuIsa::kGeneric;
#else
  (void)aten_vectorized;
  return CpuIsa::kGeneric;
#endif
}

// Calls f(scalar_t{}) with the C++ type of `type`.
template <typename F>
void with_element_type(ElementType type, F f) {
  switch (type) {
    case ElementType::kFloat32: f(float{}); break;
    case ElementType::kFloat64: f(double{}); break;
    case ElementType::kFloat16: f(c10::Half{}); break;
    case ElementType::kBFloat16: f(c10::BFloat16{}); break;
  }
}

}  // namespace

void cpu_multiply_leaky_relu(ElementType type, const void* x, void* y, std::uint8_t* positive, std::int64_t n,
                             double multiplier, double negative_slope, bool aten_vectorized) {
  if (n == 0) return;
  const CpuIsa isa = loops_isa(aten_vectorized);
  with_element_type(type, [&](auto element) {
    using scalar_t = decltype(element);
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* in = static_cast<const scalar_t*>(x);
    scalar_t* out = static_cast<scalar_t*>(y);
    const opmath_t s = static_cast<opmath_t>(multiplier), ns = static_cast<opmath_t>(negative_slope);
    with_flags(multiplier != 1.0, positive != nullptr, [&](auto multiplied, auto masked) {
      constexpr bool kMultiplied = decltype(multiplied)::value, kMask = decltype(masked)::value;
      auto range = &multiply_leaky_relu_range<scalar_t, kMultiplied, kMask>;
#ifdef KERNELS_CPU_AVX2
      if (isa == CpuIsa::kAvx2) range = &avx2::multiply_leaky_relu_range<scalar_t, kMultiplied, kMask>;
#endif
      at::parallel_for(0, n, kCpuGrain, [=](int64_t begin, int64_t end) {
        range(in, out, positive, begin, end, s, ns);
      });
    });
  });
}

void cpu_leaky_relu_backward(ElementType type, const void* grad_out, const void* saved, const std::uint8_t* mask,
                             void* grad_in, std::int64_t n, double multiplier, double negative_slope,
                             bool aten_vectorized) {
  if (n == 0) return;
  const CpuIsa isa = loops_isa(aten_vectorized);
  with_element_type(type, [&](auto element) {
    using scalar_t = decltype(element);
    using opmath_t = at::opmath_type<scalar_t>;
    const scalar_t* g = static_cast<const scalar_t*>(grad_out);
    const scalar_t* activation = static_cast<const scalar_t*>(saved);
    scalar_t* out = static_cast<scalar_t*>(grad_in);
    const opmath_t s = static_cast<opmath_t>(multiplier), ns = static_cast<opmath_t>(negative_slope);
    with_flags(multiplier != 1.0, mask != nullptr, [&](auto multiplied, auto masked) {
      constexpr bool kMultiplied = decltype(multiplied)::value, kMask = decltype(masked)::value;
      auto range = &leaky_relu_backward_range<scalar_t, kMultiplied, kMask>;
#ifdef KERNELS_CPU_AVX2
      if (isa == CpuIsa::kAvx2) range = &avx2::leaky_relu_backward_range<scalar_t, kMultiplied, kMask>;
#endif
      at::parallel_for(0, n, kCpuGrain, [=](int64_t begin, int64_t end) {
        range(g, activation, mask, out, begin, end, s, ns);
      });
    });
  });
}

const char* cpu_loops_isa(bool aten_vectorized) {
  return loops_isa(aten_vectorized) == CpuIsa::kAvx2 ? "avx2" : "generic";
}

}  // namespace kernels::leaky_relu
