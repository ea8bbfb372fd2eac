/* ONNX QuantizeLinear's rounding for kiln's INT8 C kernels (quant.c, softmax.c, layernorm.c): a value already
   divided by its scale, saturated to the type's range and rounded half to even, plus the zero point. */
#ifndef KILN_ROUNDING_H
#define KILN_ROUNDING_H

#define ROUNDER 12582912.0f   /* 1.5 * 2^23: adding and subtracting it rounds |v| < 2^22 half to even */

/* v saturated to [lo, hi] (the type's range less zp; NaN to lo), rounded half to even, plus zp: the quantized
   integer as a float. Clamping first keeps |v| small for ROUNDER (lo and hi are integers, so clamping before or
   after rounding gives the same integer). */
static inline float saturated_level(float v, float zp, float lo, float hi) {
  v = !(v >= lo) ? lo : v;
  v = v > hi ? hi : v;
  return (v + ROUNDER) - ROUNDER + zp;
}

/* The range saturated_level clamps to for an s8 (nonzero `s8`) or u8 type with zero point zp. */
static inline float level_lo(int s8, float zp) { return (s8 ? -128.0f : 0.0f) - zp; }
static inline float level_hi(int s8, float zp) { return (s8 ? 127.0f : 255.0f) - zp; }

#endif
