/* kiln's float32 GEMM micro-kernel, shared by gemm.c and winograd.c: a 6 x 32 register tile (12 vector
   accumulators) over weights packed into panels of 32 columns, [n/32][k][32], with bias, residual and the fused
   activation (Act) applied as the tile is stored. MR and NR are defined here only: kiln.tactics.gemm_c reads them from
   this file to pack weights and size blocks. */
#ifndef KILN_GEMM_H
#define KILN_GEMM_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The micro-kernel below is unrolled for exactly this register tile. */
#define MR 6    /* rows per register tile */
#define NR 32   /* columns per packed weight panel: two 16-float vectors */

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));

/* Which of a layer's tensors are stored in bf16 (kiln.tactics.storage), the `io` bits of the BF16 GEMMs and of
   the Winograd kernel: the input, the output, the residual. */
#define IO_A_BF16 1
#define IO_C_BF16 2
#define IO_RES_BF16 4

#include "activation.h"   /* ACT_RELU, ACT_SWISH, ACT_GELU_*: applied as tiles are stored */
#include "gelu.h"

/* x * sigmoid(x) through Cephes' expf (range reduction by ln 2, a degree-5 polynomial; a few ulp): k_swish one
   float, v_swish 16 at a time in vector registers (the loops the scalar form sits in do not vectorize). */
static inline float k_swish(float x) {
  float t = -x;
  t = t < -87.0f ? -87.0f : (t > 87.0f ? 87.0f : t);
  const float n = (float)(int32_t)(t * 1.44269504088896341f + (t < 0.0f ? -0.5f : 0.5f));
  const float r = t - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
  const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return x / (1.0f + (p * r * r + r + 1.0f) * scale);
}

static inline v16 v_select(v16i mask, v16 a, v16 b) { return (v16)((mask & (v16i)a) | (~mask & (v16i)b)); }

/* 1 + exp(-x), the denominator of x * sigmoid(x) and of sigmoid(x) */
static inline v16 v_one_plus_exp_neg(v16 x) {
  const v16 lo = (v16){0} - 87.0f, hi = (v16){0} + 87.0f, half = (v16){0} + 0.5f;
  v16 t = -x;
  t = v_select((v16i)(t < lo), lo, v_select((v16i)(t > hi), hi, t));
  const v16i ni = __builtin_convertvector(t * 1.44269504088896341f + v_select((v16i)(t < 0.0f), -half, half), v16i);
  const v16 n = __builtin_convertvector(ni, v16);
  const v16 r = t - n * 0.693359375f + n * 2.12194440e-4f;
  v16 p = (v16){0} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
  const v16 scale = (v16)((ni + 127) << 23);
  return 1.0f + (p * r * r + r + 1.0f) * scale;
}

static inline v16 v_swish(v16 x) { return x / v_one_plus_exp_neg(x); }

static inline v16 v_sigmoid(v16 x) { return 1.0f / v_one_plus_exp_neg(x); }

/* gelu.h's odd rational polynomial p(x*x) * x / q(x*x); +-1 from the bound on (gelu.h). */
static inline v16 v_rational(v16 x, float bound, const float* p, int np, const float* q, int nq) {
  const v16 lo = (v16){0} - bound, hi = (v16){0} + bound, one = (v16){0} + 1.0f;
  const v16 c = v_select((v16i)(x < lo), lo, v_select((v16i)(x > hi), hi, x)), x2 = c * c;
  v16 num = (v16){0} + p[0], den = (v16){0} + q[0];
  for (int i = 1; i < np; ++i) num = num * x2 + p[i];
  for (int i = 1; i < nq; ++i) den = den * x2 + q[i];
  return v_select((v16i)(x >= hi), one, v_select((v16i)(x <= lo), -one, c * num / den));
}

/* 0.5 x (1 + erf(x / sqrt 2)), or its tanh form 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) */
static inline v16 v_gelu(v16 x, int tanh_form) {
  const v16 g = tanh_form ? v_rational(0.7978845608028654f * (x * x * x * 0.044715f + x), GELU_TANH_BOUND,
                                       GELU_TANH_P, GELU_COUNT(GELU_TANH_P), GELU_TANH_Q, GELU_COUNT(GELU_TANH_Q))
                          : v_rational(x * 0.7071067811865476f, GELU_ERF_BOUND, GELU_ERF_P, GELU_COUNT(GELU_ERF_P),
                                       GELU_ERF_Q, GELU_COUNT(GELU_ERF_Q));
  return x * 0.5f * (g + 1.0f);
}

/* A layer's fused activation (kiln.tactics.gemm_c.Act), applied after the bias and the residual: where `clamp`,
   the sum clamped to [lo, hi] (a Clip's bounds), then `code` (activation.h; 0 none): ReLU, Swish, GELU, HardSwish,
   HardSigmoid with its alpha and beta, Sigmoid or Tanh. An all-zero Act, or none (NULL), applies nothing. The tile
   functions copy it once (as_act) and pass it by value: read through a pointer, every store to the output (which
   may alias it) would reload its fields. */
typedef struct {
  int32_t code, clamp;
  float lo, hi, alpha, beta;
} Act;

/* min(max(v, lo), hi), as ONNX's Clip: hi everywhere where lo > hi; NaN stays NaN */
static inline v16 v_clamp(v16 v, v16 lo, v16 hi) {
  v = v_select((v16i)(v < lo), lo, v);
  return v_select((v16i)(v > hi), hi, v);
}

static inline Act as_act(const Act* act) {
  const Act none = {0, 0, 0.0f, 0.0f, 0.0f, 0.0f};
  return act ? *act : none;
}

static inline v16 epilogue(v16 v, const float* restrict bias, const float* res, const Act act) {
  if (bias) v += *(const v16*)bias;
  if (res) v += *(const v16*)res;
  const v16 zero = {0}, one = zero + 1.0f;
  if (act.clamp) v = v_clamp(v, zero + act.lo, zero + act.hi);
  switch (act.code) {
    case ACT_RELU: return v_select((v16i)(v < zero), zero, v);   /* NaN stays NaN, as ONNX's and torch's Relu */
    case ACT_SWISH: return v_swish(v);
    case ACT_GELU_ERF: return v_gelu(v, 0);
    case ACT_GELU_TANH: return v_gelu(v, 1);
    case ACT_HARDSWISH: return v * v_clamp(v * (1.0f / 6.0f) + 0.5f, zero, one);
    case ACT_HARDSIGMOID: return v_clamp(v * act.alpha + act.beta, zero, one);
    case ACT_SIGMOID: return v_sigmoid(v);
    case ACT_TANH: return v_rational(v, GELU_TANH_BOUND, GELU_TANH_P, GELU_COUNT(GELU_TANH_P), GELU_TANH_Q,
                                     GELU_COUNT(GELU_TANH_Q));
    default: return v;
  }
}

static inline __attribute__((always_inline)) void store_row(float* c, v16 lo, v16 hi, const float* restrict bias,
                                                             const float* res, const Act act, int64_t cols) {
  if (cols == NR) {
    *(v16*)c = epilogue(lo, bias, res, act);
    *(v16*)(c + 16) = epilogue(hi, bias ? bias + 16 : 0, res ? res + 16 : 0, act);
    return;
  }
  /* a partial panel: the same vector epilogue on zero-padded copies, then only `cols` floats stored */
  float b[NR] = {0}, r[NR] = {0}, out[NR];
  if (bias) memcpy(b, bias, sizeof(float) * cols);
  if (res) memcpy(r, res, sizeof(float) * cols);
  *(v16*)out = epilogue(lo, bias ? b : 0, res ? r : 0, act);
  *(v16*)(out + 16) = epilogue(hi, bias ? b + 16 : 0, res ? r + 16 : 0, act);
  memcpy(c, out, sizeof(float) * cols);
}

/* The k loop of a 6-row register tile into accumulators c00..c51: segment s's rows a[s * MR + i] times two
   vectors of type V, at `at` and `at + W` floats into each NR-float weight row of b + s * k * NR. */
#define TILE_SUMS(V, at, W)                                                                                 \
  for (int64_t s = 0; s < segs; ++s) {                                                                      \
    const float *a0 = a[s * MR], *a1 = a[s * MR + 1], *a2 = a[s * MR + 2], *a3 = a[s * MR + 3];             \
    const float *a4 = a[s * MR + 4], *a5 = a[s * MR + 5], *bs = b + s * k * NR + (at);                      \
    for (int64_t l = 0; l < k; ++l) {                                                                       \
      const V b0 = *(const V*)(bs + l * NR), b1 = *(const V*)(bs + l * NR + (W));                           \
      float x;                                                                                              \
      x = a0[l]; c00 += x * b0; c01 += x * b1;                                                              \
      x = a1[l]; c10 += x * b0; c11 += x * b1;                                                              \
      x = a2[l]; c20 += x * b0; c21 += x * b1;                                                              \
      x = a3[l]; c30 += x * b0; c31 += x * b1;                                                              \
      x = a4[l]; c40 += x * b0; c41 += x * b1;                                                              \
      x = a5[l]; c50 += x * b0; c51 += x * b1;                                                              \
    }                                                                                                       \
  }

#if defined(__AVX512F__)
/* Sums `segs` segments of `k` products into one register tile: segment s reads rows a[s * MR + i] and weights
   b + s * k * NR. A GEMM has one segment; a direct convolution one per kernel row. */
static void tile(const float* const* restrict a, int64_t segs, int64_t mr, int64_t k, const float* restrict b,
                 float* c, int64_t ldc, int64_t cols, const float* restrict bias, const float* res, const Act* act) {
  v16 c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
  v16 c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
  TILE_SUMS(v16, 0, 16)
  const v16 lo[MR] = {c00, c10, c20, c30, c40, c50}, hi[MR] = {c01, c11, c21, c31, c41, c51};
  const Act fused = as_act(act);
  for (int64_t i = 0; i < mr; ++i)
    store_row(c + i * ldc, lo[i], hi[i], bias, res ? res + i * ldc : 0, fused, cols);
}

#else
/* AVX2 has 16 vector registers of 8 floats. The 6 x 32 tile above would need 48 of them, and GCC lowers the
   64-byte vectors to stack traffic (65x slower, measured with -march=x86-64-v3): here each 16-column half of the
   panel is its own 6 x 16 tile of 8-float vectors, 12 accumulators, A's rows read once per half. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static void tile(const float* const* restrict a, int64_t segs, int64_t mr, int64_t k, const float* restrict b,
                 float* c, int64_t ldc, int64_t cols, const float* restrict bias, const float* res, const Act* act) {
  float acc[MR][NR] = {{0}};
  for (int64_t half = 0; half < (cols > 16 ? 2 : 1); ++half) {
    v8 c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
    v8 c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
    TILE_SUMS(v8, half * 16, 8)
    const v8 sums[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int i = 0; i < MR; ++i) memcpy(&acc[i][half * 16], sums[i], sizeof sums[i]);
  }
  const Act fused = as_act(act);
  for (int64_t i = 0; i < mr; ++i) {
    v16 lo, hi;
    memcpy(&lo, acc[i], sizeof lo);
    memcpy(&hi, acc[i] + 16, sizeof hi);
    store_row(c + i * ldc, lo, hi, bias, res ? res + i * ldc : 0, fused, cols);
  }
}
#endif

#endif /* KILN_GEMM_H */
