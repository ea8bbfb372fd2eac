/* Math helpers for the generated pointwise kernels (kiln.tactics.pointwise_c emits only the loop nest that
   includes this file). With KILN_SIMD_LIBM defined (kiln.native defines it where the C library has libmvec),
   the libm functions are declared `omp declare simd`, so loops calling them vectorize. */
#ifndef KILN_POINTWISE_H
#define KILN_POINTWISE_H

#include <math.h>
#include <stdint.h>

#include "bf16.h"   /* programs reading or writing bf16 tensors widen and round through it */
#include "rounding.h"   /* QuantizeLinear's quotient: a division, or the corrected reciprocal product */

#ifdef KILN_SIMD_LIBM
#define DECL_SIMD _Pragma("omp declare simd notinbranch")
DECL_SIMD float expf(float);
DECL_SIMD float logf(float);
DECL_SIMD float tanhf(float);
DECL_SIMD float erff(float);
DECL_SIMD float powf(float, float);
DECL_SIMD float sinf(float);
DECL_SIMD float cosf(float);
DECL_SIMD float log1pf(float);
DECL_SIMD float expm1f(float);
#endif

static inline float k_max(float a, float b) { return (a != a || a > b) ? a : b; }   /* NaN wins, as in torch */
static inline float k_min(float a, float b) { return (a != a || a < b) ? a : b; }
static inline float k_clip(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }
static inline float k_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
/* ONNX QuantizeLinear as a float: x / scale rounded half to even (the default rounding mode), plus the zero point,
   saturated to [lo, hi] (clamped before rounding: the same integer, as lo and hi are integers). NaN saturates to lo,
   so the INT8 store after it always converts a number in range. The quotient is rounding.h's: with the constant
   scale a program bakes in, its reciprocal folds at compile time. */
static inline float k_quantize(float x, float scale, float zp, float lo, float hi) {
  const float v = quotient(x, scale, quotient_reciprocal(scale), lo - zp, hi - zp);
  return nearbyintf(v > lo - zp ? (v < hi - zp ? v : hi - zp) : lo - zp) + zp;
}
/* tanh and erf as rational polynomials in x*x (the approximations Eigen and MLAS use; gelu.h's coefficients, unrolled
   here): branch-free, so the loop vectorizes without library calls; a few float ulps from the exact value, +-1 from
   the bound on */
static inline float k_tanh(float x) {
  const float c = k_clip(x, -7.90531110763549805f, 7.90531110763549805f), x2 = c * c;
  float p = -2.76076847742355e-16f;
  p = p * x2 + 2.00018790482477e-13f; p = p * x2 - 8.60467152213735e-11f; p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f; p = p * x2 + 6.37261928875436e-04f; p = p * x2 + 4.89352455891786e-03f;
  float q = 1.19825839466702e-06f;
  q = q * x2 + 1.18534705686654e-04f; q = q * x2 + 2.26843463243900e-03f; q = q * x2 + 4.89352518554385e-03f;
  return fabsf(x) < 0.0004f ? x : (x != x ? x : (fabsf(x) >= 7.90531110763549805f ? copysignf(1.0f, x) : c * p / q));
}
static inline float k_erf(float x) {
  const float c = k_clip(x, -4.0f, 4.0f), x2 = c * c;
  float p = -2.72614225801306e-10f;
  p = p * x2 + 2.77068142495902e-08f; p = p * x2 - 2.10102402082508e-06f; p = p * x2 - 5.69250639462346e-05f;
  p = p * x2 - 7.34990630326855e-04f; p = p * x2 - 2.95459980854025e-03f; p = p * x2 - 1.60960333262415e-02f;
  float q = -1.45660718464996e-05f;
  q = q * x2 - 2.13374055278905e-04f; q = q * x2 - 1.68282697438203e-03f; q = q * x2 - 7.37332916720468e-03f;
  q = q * x2 - 1.42647390514189e-02f;
  return x != x ? x : c * p / q;
}

#endif /* KILN_POINTWISE_H */
