// The split method's numerics, shared by every kernel of the GEMM family, so that the Hopper kernel (gemm_sm90.cu)
// and the sm_80 kernel (gemm_sm80.cu) compute one function: the power-of-two scales (per row of x, per row and chunk
// of W), the fp16 hi/lo split, the promotion of a chunk's products into fp32, the output's unscaling and the fused
// epilogue; and the order along K in which the Hopper kernel hands its fp16 halves to the tensor cores. Non-finite
// values are split as 0 and their rows flagged (gemm.h, kNonFiniteRow); launch_nonfinite_outputs (gemm_split.cu)
// writes the outputs they reach. Device code, portable; the output's unscaling (exact_power_of_two, row_unscale,
// unscale) is host code too, so that a host program checks it against ldexpf (tests/test_gemm_split.py).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <cuda_fp16.h>

#include "gelu_tanh/gelu_tanh_math.h"
#include "gemm.h"

namespace kernels::gemm {

// A scaled row (or chunk of a row) has its largest |value| in [2^(kTargetExponent - 1), 2^kTargetExponent): far
// from fp16's overflow (65504) and, for lo = 2^-11 below hi, from its subnormal range.
constexpr int kTargetExponent = 14;

// 2^p as a float, for -126 <= p <= 127.
KERNELS_GEMM_HOST_DEVICE __forceinline__ float exact_power_of_two(int p) {
#ifdef __CUDA_ARCH__
  return __int_as_float((127 + p) << 23);
#else
  const std::uint32_t bits = static_cast<std::uint32_t>(127 + p) << 23;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

// The exponent e with max_abs * 2^e in [2^13, 2^14), computed from the bits (exact for subnormals); 0 if max_abs is
// 0. e lies in [-114, 162].
__device__ __forceinline__ int scale_exponent(float max_abs) {
  if (max_abs == 0.0f) return 0;
  unsigned bits = __float_as_uint(max_abs);
  int biased = static_cast<int>((bits >> 23) & 0xff);
  int offset = 0;
  if (biased == 0) {  // subnormal: scale by 2^64 (exact) to read its exponent
    bits = __float_as_uint(max_abs * exact_power_of_two(64));
    biased = static_cast<int>((bits >> 23) & 0xff);
    offset = 64;
  }
  // max_abs = 1.f * 2^(biased - 127 - offset), with 1 <= f < 2; f * 2^(biased - 127 - offset + e) in [2^13, 2^14).
  return (kTargetExponent - 1) - (biased - 127 - offset);
}

// 2^e as two float factors (2^e alone is not a float for e > 127, which subnormal rows reach): v * a * b is exact.
struct PowerOfTwo {
  float a, b;
};

__device__ __forceinline__ PowerOfTwo power_of_two(int e) {
  return {exact_power_of_two(e / 2), exact_power_of_two(e - e / 2)};
}

__device__ __forceinline__ bool is_finite(float v) { return fabsf(v) <= 3.402823466e38f; }  // false for NaN

// The splits of two finite values v0, v1 scaled by 2^e: hi = fp16(v 2^e), lo = fp16(v 2^e - hi), packed as fp16
// pairs (v0 in the low half, as the tensor cores read a pair of consecutive k).
struct SplitPair {
  __half2 hi, lo;
};

__device__ __forceinline__ SplitPair split_pair(float s0, float s1) {  // already scaled
  const __half2 hi = __floats2half2_rn(s0, s1);
  const float2 back = __half22float2(hi);
  return {hi, __floats2half2_rn(s0 - back.x, s1 - back.y)};
}

__device__ __forceinline__ SplitPair split_pair(float v0, float v1, PowerOfTwo scale) {
  return split_pair((v0 * scale.a) * scale.b, (v1 * scale.a) * scale.b);
}

// An fp16 pair's 32 bits, as stores of packed pairs take them.
__device__ __forceinline__ std::uint32_t bits(__half2 pair) {
  std::uint32_t word;
  std::memcpy(&word, &pair, sizeof word);
  return word;
}

// The promotion of one chunk's products: total += accumulator * 2^-e, with the chunk's inverse power of two
// (power_of_two(-e)); exact but for the one rounding of the add. kSingle: inverse.b is 1 (e <= 126), one multiply.
template <bool kSingle = false>
__device__ __forceinline__ float promote(float accumulator, PowerOfTwo inverse, float total) {
  return kSingle ? fmaf(accumulator, inverse.a, total) : fmaf(accumulator * inverse.a, inverse.b, total);
}

// An output's product before the epilogue: the promoted total times 2^-e, e the exponent of its row of x, as two
// multiplies by the row's factors (row_unscale), without a branch: for e <= 126 (every row but those below ~2^-113 in
// magnitude; e >= -114 always), total 2^-e and 1, one multiply, exact but for the result's own rounding; for e up
// to 252, total 2^(126 - e), exact while that product is a normal float (|total| >= 2^(e - 252)), then 2^-126,
// rounding once, as ldexpf(total, -e) does (a smaller |total| gives a result under 2^-252: 0 either way); beyond (a
// row flagged non-finite, whose outputs the fix-up rewrites), 0.
struct RowUnscale {
  float a, b;
};

KERNELS_GEMM_HOST_DEVICE __forceinline__ RowUnscale row_unscale(int e) {
  if (e <= 126) return {exact_power_of_two(-e), 1.0f};
  return {e <= 252 ? exact_power_of_two(126 - e) : 0.0f, exact_power_of_two(-126)};
}

KERNELS_GEMM_HOST_DEVICE __forceinline__ float unscale(float total, RowUnscale row) { return (total * row.a) * row.b; }

KERNELS_GEMM_HOST_DEVICE __forceinline__ float unscale(float total, int e) { return unscale(total, row_unscale(e)); }

// The fused epilogue (gemm.h, Epilogue), eager's order of operations: v = (product + bias) * multiplier, then the
// activation. `positive` (the mask the backward reads where LeakyReLU's slope is negative) is v > 0.
struct Activated {
  float value;
  bool positive;
};

// nn.GELU()'s v * Phi(v) in eager's CUDA kernel's operations and order, v * 0.5 * (1 + erf(v / sqrt(2))) in float:
// the bits F.gelu gives for the same v (erfc would avoid the cancellation where v < 0, at about twice the instructions
// in an epilogue that the tensor cores wait on).
__device__ __forceinline__ float gelu_erf(float v) { return v * 0.5f * (1.0f + erff(v * 0.70710678118654752f)); }

// The activation of v = (product + bias) * multiplier, chosen at compile time: a loop over outputs carries only its
// own activation's instructions (with_activation picks the instantiation once per loop).
template <Activation kActivation>
__device__ __forceinline__ float activate(float v, float negative_slope) {
  if constexpr (kActivation == Activation::kGeluErf) {
    return gelu_erf(v);
  } else if constexpr (kActivation == Activation::kGeluTanh) {
    return gelu_tanh::gelu_tanh_element<float>(v);
  } else {
    return v > 0.0f ? v : v * negative_slope;
  }
}

// The GELU's input gradient grad * gelu'(v), as the backward a GELU's own op records computes it: for the erf form
// eager's CUDA kernel's operations and order, grad * (Phi(v) + v phi(v)) in float; for the tanh form gelu_tanh's
// (gelu_tanh_math.h, the op kernels::gelu_tanh_backward).
template <Activation kGelu>
__device__ __forceinline__ float gelu_backward(float grad, float v) {
  static_assert(kGelu != Activation::kLeakyReLU, "a GELU's backward");
  if constexpr (kGelu == Activation::kGeluErf) {
    constexpr float kAlpha = 0.70710678118654752f;          // 1 / sqrt(2)
    constexpr float kBeta = 0.39894228040143268f;           // 1 / sqrt(2 pi)
    const float cdf = 0.5f * (1.0f + erff(v * kAlpha));
    const float pdf = expf(-0.5f * v * v) * kBeta;
    return grad * (cdf + v * pdf);
  } else {
    return gelu_tanh::gelu_tanh_backward_element<float>(grad, v);
  }
}

// v = (product + bias) * multiplier: the value the activation is applied to (Epilogue::pre's).
__device__ __forceinline__ float pre_activation(float product, float bias, const Epilogue& epilogue) {
  return (product + bias) * epilogue.multiplier;
}

template <Activation kActivation>
__device__ __forceinline__ Activated apply_epilogue(float product, float bias, const Epilogue& epilogue) {
  const float v = pre_activation(product, bias, epilogue);
  return {activate<kActivation>(v, epilogue.negative_slope), v > 0.0f};
}

// body(std::integral_constant<Activation, a>{}) for a = `activation`: the loop in body compiled once per activation.
// kGelus false: LeakyReLU's alone (a kernel whose launcher takes no GELU).
template <bool kGelus = true, typename Body>
__device__ __forceinline__ void with_activation(Activation activation, Body&& body) {
  if constexpr (!kGelus) {
    body(std::integral_constant<Activation, Activation::kLeakyReLU>{});
    return;
  }
  switch (activation) {
    case Activation::kGeluErf:
      body(std::integral_constant<Activation, Activation::kGeluErf>{});
      return;
    case Activation::kGeluTanh:
      body(std::integral_constant<Activation, Activation::kGeluTanh>{});
      return;
    default:
      body(std::integral_constant<Activation, Activation::kLeakyReLU>{});
      return;
  }
}

// apply_epilogue's result for a product that is +-inf or NaN (the non-finite fix-up's outputs), without the GELUs'
// arithmetic: both give +inf for +inf and NaN for -inf (-inf * 0) and NaN, as their formulas do.
__device__ __forceinline__ Activated apply_epilogue_non_finite(float product, float bias, const Epilogue& epilogue) {
  if (epilogue.activation == Activation::kLeakyReLU)
    return apply_epilogue<Activation::kLeakyReLU>(product, bias, epilogue);
  const float v = pre_activation(product, bias, epilogue);
  return {v > 0.0f ? v : __int_as_float(0x7fffffff), v > 0.0f};
}

// apply_epilogue()'s value for a plain product (bias 0, multiplier and slope 1: the backward's products), in one add:
// (product + 0) * 1 either way, so -0 becomes +0 here too.
__device__ __forceinline__ float plain_product_output(float product) { return product + 0.0f; }

// The order along K in which the GEMM feeds the tensor cores, per chunk of kSplitChunk consecutive k (gemm.h). The GEMM's
// threads read W (fp32, from TMA's 128-byte-swizzled tiles) as packs of 4 consecutive k; wgmma's register operand
// wants each thread's pairs at k = 2t, 2t + 1, 2t + 8, 2t + 9 of a 16-wide step (t = lane % 4). So pack q of a
// chunk (k = 4q .. 4q + 3) is taken as the pairs at positions split_position(q) and split_position(q) + 8, and x,
// which the GEMM reads as fp16 from shared memory, is split into that order (its fp16 pair of k = 4q, 4q + 1 at
// position split_position(q), of 4q + 2, 4q + 3 at + 8). Thread t reads packs 2t, 2t + 1 of each 32-wide half of
// the chunk: conflict-free 16-byte shared-memory reads under the 128-byte swizzle.
__host__ __device__ constexpr int split_position(int q) {
  // q = 8 b + 2 t + h (b: 32-wide half, t: thread in the quad, h: which of its two packs) -> step 2 b + h, pair t.
  return 32 * (q / 8) + 16 * (q % 2) + 2 * ((q % 8) / 2);
}

// ---- a row's split, pack by pack (the row passes; other families' kernels that leave a split of what they write) ----

// Folds a pack of four into a thread's running row maximum of finite |v| and non-finite flag.
__device__ __forceinline__ void fold(float v, float& max_abs, bool& non_finite) {
  max_abs = fmaxf(max_abs, is_finite(v) ? fabsf(v) : 0.0f);
  non_finite |= !is_finite(v);
}

__device__ __forceinline__ void fold(float4 v, float& max_abs, bool& non_finite) {
  fold(v.x, max_abs, non_finite);
  fold(v.y, max_abs, non_finite);
  fold(v.z, max_abs, non_finite);
  fold(v.w, max_abs, non_finite);
}

__device__ __forceinline__ float clean(float v) { return is_finite(v) ? v : 0.0f; }

// Splits pack i of a row (k = 4i .. 4i + 3) and stores its halves at their places in the GEMM's order. A
// non-finite v becomes 0 + 0: its row is flagged, and the outputs it reaches are computed by
// nonfinite_outputs_kernel (the tensor cores would mix an infinity with the random signs of the other operand's lo
// into NaN where eager gives an infinity).
// kNatural: in k's own order (for the GEMM that reads w transposed); else in split_position's.
template <bool kNatural>
__device__ __forceinline__ void split_pack(float4 v, PowerOfTwo scale, std::int64_t i, __half* hi_row,
                                           __half* lo_row) {
  const SplitPair first = split_pair(clean(v.x), clean(v.y), scale);
  const SplitPair second = split_pair(clean(v.z), clean(v.w), scale);
  const std::int64_t chunk_start = i / (kSplitChunk / 4) * kSplitChunk;
  const int q = static_cast<int>(i % (kSplitChunk / 4));
  const std::int64_t place = chunk_start + (kNatural ? 4 * q : split_position(q));
  const int second_offset = kNatural ? 2 : 8;
  *reinterpret_cast<__half2*>(hi_row + place) = first.hi;
  *reinterpret_cast<__half2*>(lo_row + place) = first.lo;
  *reinterpret_cast<__half2*>(hi_row + place + second_offset) = second.hi;
  *reinterpret_cast<__half2*>(lo_row + place + second_offset) = second.lo;
}

}  // namespace kernels::gemm
