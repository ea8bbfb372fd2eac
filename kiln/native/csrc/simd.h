/* kiln's width-generic vector helpers (GCC vector extensions, no intrinsics): vectors as wide as the CPU's
   registers, VW floats (16 with AVX-512, 8 with AVX2, where 64-byte vectors would be lowered through memory),
   selects, horizontal max/sum, 2^x, bf16 conversions and an in-register VW x VW transpose. Used by attention.c. */
#ifndef KILN_SIMD_H
#define KILN_SIMD_H

#include <stdint.h>
#include <string.h>

#include "bf16.h"

#ifdef __AVX512F__
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(4 * VW), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * VW), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(4 * VW), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(2 * VW), aligned(2)));
typedef uint32_t word __attribute__((may_alias));   /* a float's or a bf16 pair's bits, moved as they are */
typedef uint32_t vword __attribute__((vector_size(4 * VW), aligned(4), may_alias));

/* VW floats rounded to bf16, nearest even (a NaN stays a quiet NaN). */
static inline vh v_bf16(vf x) {
  const vu u = (vu)x;
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
  const vu is_nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
  return __builtin_convertvector((is_nan & quiet) | (~is_nan & rounded), vh);
}

static inline vf v_select(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

static inline vf v_max(vf a, vf b) { return v_select((vi)(a > b), a, b); }

/* The largest and the sum of a vector's lanes, by halving (log2(VW) shuffles, not VW - 1 lane extractions). */
#if VW == 16
#define HALVINGS {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},        \
                 {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},        \
                 {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},        \
                 {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}
#else
#define HALVINGS {4, 5, 6, 7, 0, 1, 2, 3}, {2, 3, 0, 1, 6, 7, 4, 5}, {1, 0, 3, 2, 5, 4, 7, 6}
#endif
static const vi halvings[] = {HALVINGS};
#define STEPS ((int)(sizeof halvings / sizeof halvings[0]))

static inline float h_max(vf x) {
  for (int k = 0; k < STEPS; ++k) x = v_max(x, __builtin_shuffle(x, halvings[k]));
  return x[0];
}

static inline float h_sum(vf x) {
  for (int k = 0; k < STEPS; ++k) x += __builtin_shuffle(x, halvings[k]);
  return x[0];
}

/* 2^x for x <= 0 (the scores are kept in base 2: scale and mask times log2(e)): n = round(x), 2^(x - n) by a
   polynomial on [-1/2, 1/2] fitted for relative error (degree 5: within 3.2e-7; degree 3, `cheap`: within 1.4e-4,
   below the bf16 rounding the BF16 kernel applies to P next), times 2^n through the exponent bits; exactly 0
   below -126 (masked keys). */
static inline vf v_exp2(vf x, int cheap) {
  const vf lo = (vf){0} - 126.0f;
  const vi below = (vi)(x < lo);
  const vf t = v_select(below, lo, x);
  const vi n = __builtin_convertvector(t - 0.5f, vi);   /* t <= 0: truncation rounds */
  const vf f = t - __builtin_convertvector(n, vf);
  vf p;
  if (cheap) {
    p = ((0.055029309031f * f + 0.24225680198f) * f + 0.69325303606f) * f + 0.99995134716f;
  } else {
    p = (0.0013260921426f * f + 0.0096701760021f) * f + 0.055507121807f;
    p = ((p * f + 0.2402222428f) * f + 0.6931470027f) * f + 1.0000000492f;
  }
  return (vf)(~below & ((vi)p + (n << 23)));
}

/* x * sigmoid(x) (SiLU: ONNX's Swish with alpha 1), VW at a time: e = 2^(-|x| log2(e)) <= 1 from v_exp2 (within
   3.2e-7 relative), sigmoid = 1 / (1 + e) where x >= 0 and e / (1 + e) below, so nothing overflows. */
static inline vf v_silu(vf x) {
  const vi negative = (vi)(x < 0.0f);
  const vf e = v_exp2(v_select(negative, x, -x) * 1.44269504088896341f, 0);
  return x * v_select(negative, e, (vf){0} + 1.0f) / (1.0f + e);
}

/* t, a VW x VW block of 32-bit lanes, transposed in place: log2(VW) stages, stage s swapping the off-diagonal b x b
   blocks (b = VW / 2^(s+1)) of every 2b x 2b block: rows r and r + b take lanes from both (SWAPS: the pair of
   two-vector shuffle indices per stage). */
#if VW == 16
#define SWAPS {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},                                        \
              {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},                                  \
              {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},                                      \
              {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},                                    \
              {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},                                      \
              {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},                                    \
              {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},                                      \
              {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}
#else
#define SWAPS {0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}, {0, 1, 8, 9, 4, 5, 12, 13},             \
              {2, 3, 10, 11, 6, 7, 14, 15}, {0, 8, 2, 10, 4, 12, 6, 14}, {1, 9, 3, 11, 5, 13, 7, 15}
#endif
static const vu swaps[] = {SWAPS};

static inline void transpose_block(vword* t) {
  #pragma GCC unroll 4
  for (int s = 0; s < STEPS; ++s) {
    const int b = VW >> (s + 1);
    #pragma GCC unroll 16
    for (int r = 0; r < VW; ++r)
      if (!(r & b)) {
        const vword lo = t[r], hi = t[r + b];
        t[r] = __builtin_shuffle(lo, hi, swaps[2 * s]);
        t[r + b] = __builtin_shuffle(lo, hi, swaps[2 * s + 1]);
      }
  }
}

#endif /* KILN_SIMD_H */
