// GELU with the tanh approximation, y = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), and its derivative,
// per element: the one formula that the CUDA kernels (gelu_tanh.cu) and the CPU loop (gelu_tanh.cpp) both evaluate.
// Plain C math only (no torch, no CUDA headers): compiled by nvcc for the device and by the C++ compiler for the host.
//
// The same function is written as y = x * sigmoid(t), t = 2u, with e = exp(-|t|) in (0, 1]: sigmoid(-|t|) =
// e / (1 + e) never cancels or overflows, where 1 + tanh(u) cancels for negative x. Each result takes its last step
// as one fused multiply-add, so its largest term is rounded once (kernels/gelu_tanh/NOTES.md has the measurements).
#pragma once

#include <math.h>

#ifdef __CUDACC__
#define KERNELS_GELU_TANH_HD __host__ __device__ __forceinline__
#else
#define KERNELS_GELU_TANH_HD inline
#endif

namespace kernels::gelu_tanh {

// t = x * (kT0 + kT1 x^2) = 2u; dt/dx = kT0 + kT3 x^2.
constexpr double kT0 = 1.5957691216057308;    // 2 sqrt(2/pi)
constexpr double kT1 = 0.07135481627260025;   // 2 sqrt(2/pi) * 0.044715
constexpr double kT3 = 0.21406444881780076;   // 3 kT1

KERNELS_GELU_TANH_HD float exp_of(float v) { return expf(v); }
KERNELS_GELU_TANH_HD double exp_of(double v) { return exp(v); }
KERNELS_GELU_TANH_HD float fma_of(float a, float b, float c) { return fmaf(a, b, c); }
KERNELS_GELU_TANH_HD double fma_of(double a, double b, double c) { return fma(a, b, c); }
// a / b: IEEE division, or with kFast (float16 and bfloat16 results, whose rounding hides its error of up to 2 ulps
// of float) the device's approximate division, which is shorter.
template <bool kFast> KERNELS_GELU_TANH_HD float divide(float a, float b) {
#ifdef __CUDA_ARCH__
  if constexpr (kFast) return __fdividef(a, b);
#endif
  return a / b;
}
template <bool kFast> KERNELS_GELU_TANH_HD double divide(double a, double b) { return a / b; }
KERNELS_GELU_TANH_HD float abs_of(float v) { return fabsf(v); }
KERNELS_GELU_TANH_HD double abs_of(double v) { return fabs(v); }

// y = gelu_tanh(x) in Op (float or double); kFastDivide as divide()'s kFast. Non-finite inputs give the formula's
// results: +inf -> +inf, -inf -> NaN (0.5 * -inf * 0), NaN -> NaN; -0.0 -> -0.0.
template <typename Op, bool kFastDivide = false>
KERNELS_GELU_TANH_HD Op gelu_tanh_element(Op x) {
  const Op t = x * fma_of(Op(kT1), x * x, Op(kT0));
  const Op e = exp_of(-abs_of(t));
  const Op small = divide<kFastDivide>(e, Op(1) + e);  // sigmoid(-|t|)
  // x > 0: x * (1 - small) as x - x * small, rounded once; small is 0 past x ~ 11 (float), where y = x (+inf too).
  if (x > Op(0)) return small > Op(0) ? fma_of(-x, small, x) : x;
  return x * small;  // x <= 0 or NaN: sigmoid(t) = small
}

// grad_input = g * gelu_tanh'(x) in Op. With s = sigmoid(t) and q = x dt/dx, f' = s + q s (1 - s), which is
// 1 - small (1 - q big) for x > 0 and small (1 + q big) for x <= 0 (big = sigmoid(|t|) = 1 - small).
template <typename Op, bool kFastDivide = false>
KERNELS_GELU_TANH_HD Op gelu_tanh_backward_element(Op g, Op x) {
  const Op xx = x * x;
  const Op t = x * fma_of(Op(kT1), xx, Op(kT0));
  const Op q = x * fma_of(Op(kT3), xx, Op(kT0));
  const Op e = exp_of(-abs_of(t));
  const Op one_plus_e = Op(1) + e;
  const Op small = divide<kFastDivide>(e, one_plus_e), big = divide<kFastDivide>(Op(1), one_plus_e);
  const bool positive = x > Op(0);
  const Op m = fma_of(positive ? -q : q, big, Op(1));
  Op grad;
  if (!(small > Op(0))) {
    grad = positive ? g : g * small;  // e underflowed (|x| ~ 11 and past, where q may overflow): f' is 1 or 0; NaN x
  } else if (!(abs_of(g) < Op(INFINITY))) {
    grad = g * (positive ? fma_of(-small, m, Op(1)) : small * m);  // g infinite or NaN: g times f'
  } else {
    grad = positive ? fma_of(-(g * small), m, g) : (g * small) * m;  // g folded into the last step
  }
  return abs_of(x) == Op(INFINITY) ? Op(NAN) : grad;  // x = +-inf: NaN, as the formula's autograd gives
}

}  // namespace kernels::gelu_tanh
