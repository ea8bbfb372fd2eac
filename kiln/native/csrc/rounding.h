/* ONNX QuantizeLinear's rounding for kiln's INT8 C kernels (quant.c, softmax.c, layernorm.c, qgemm.c): the
   quotient by the scale (a division, or the correctly rounded reciprocal product), saturated to the type's range
   and rounded half to even, plus the zero point. */
#ifndef KILN_ROUNDING_H
#define KILN_ROUNDING_H

#include <math.h>

#define ROUNDER 12582912.0f   /* 1.5 * 2^23: adding and subtracting it rounds |v| < 2^22 half to even */

/* v saturated to [lo, hi] (the type's range less zp; NaN to lo), rounded half to even, plus zp: the quantized
   integer as a float. Clamping first keeps |v| small for ROUNDER (lo and hi are integers, so clamping before or
   after rounding gives the same integer). */
static inline float saturated_level(float v, float zp, float lo, float hi) {
  v = !(v >= lo) ? lo : v;
  v = v > hi ? hi : v;
  return (v + ROUNDER) - ROUNDER + zp;
}

/* Whether QuantizeLinear's x / scale is a division here or the correctly rounded reciprocal product (qgemm.c's
   quotient16 says how that works, how it was checked, and why AMD targets, whose -march=native names a znver,
   keep the division). -DKILN_QUANTIZE_DIVIDE or -DKILN_QUANTIZE_RECIPROCAL forces either. */
#if defined(KILN_QUANTIZE_DIVIDE) || (!defined(KILN_QUANTIZE_RECIPROCAL) &&                                        \
    (defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) ||                  \
     defined(__znver5__)))
#define QUANTIZE_BY_DIVISION 1
#else
#define QUANTIZE_BY_DIVISION 0
#endif

/* The `inv` quotient() and qgemm.c's quantize16 take for `scale`: 1 / scale where the reciprocal product stands in
   for the division (a normal scale with a normal reciprocal: any quantization scale), else 0 (divide). */
static inline float quotient_reciprocal(float scale) {
  if (QUANTIZE_BY_DIVISION) return 0.0f;
  const float inv = 1.0f / scale;
  return isnormal(scale) && isnormal(inv) && scale > 0.0f ? inv : 0.0f;
}

/* x / scale as IEEE division rounds it: a division where `inv` is 0, else x * inv and one correction step on the
   exact remainder (Markstein), the product first clamped to [lo - 1, hi + 1] (saturated_level's bounds, past which
   all saturates alike) so that infinities and NaN saturate as the division's result does. */
static inline float quotient(float x, float scale, float inv, float lo, float hi) {
  if (inv == 0.0f) return x / scale;
  float q = x * inv;
  q = !(q >= lo - 1.0f) ? lo - 1.0f : q;
  q = q > hi + 1.0f ? hi + 1.0f : q;
  return fmaf(fmaf(-q, scale, x), inv, q);
}

/* The range saturated_level clamps to for an s8 (nonzero `s8`) or u8 type with zero point zp. */
static inline float level_lo(int s8, float zp) { return (s8 ? -128.0f : 0.0f) - zp; }
static inline float level_hi(int s8, float zp) { return (s8 ? 127.0f : 255.0f) - zp; }

#endif
