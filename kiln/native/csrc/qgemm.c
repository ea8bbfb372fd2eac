/* kiln's INT8 GEMM and direct convolution on AVX512-VNNI (kiln.tactics.qgemm_c; on AMX tiles: qgemm_amx.h):
   u8 activations times s8 weights with `vpdpbusd` (four u8 x s8 products summed into each int32 lane, no 16-bit
   saturation), int32 accumulation, then per output channel n: (acc - x_zp * colsum_w[n]) * x_scale * w_scale[n]
   + bias[n], + the residual (INT8 dequantized, or FP32), clamp (ReLU, Clip), Swish or GELU, and FP32 out or
   requantized to u8/s8 (round half to even, saturated). A product the model requantized before adding its bias
   (quantize_static's MatMul -> Q -> DQ -> Add(bias) -> Q) is rounded to INT8 at that mid scale and dequantized
   first, the bias added after, in the graph's float steps. s8 activations are read as u8 with each byte's top bit
   flipped (x_zp + 128: the caller's comp). Weights with zero points (asymmetric, or u8 read as s8) also take
   w_zp[n] * (the row's byte sum) off: sum (x - x_zp)(w - w_zp) = acc - x_zp (colsum[n] - k w_zp[n]) - w_zp[n] sum x,
   the caller folding the middle term into comp. kiln_dqgemm and kiln_dqconv (qgemm_dynamic.h) quantize their FP32
   input first (dynamic quantization) and make the epilogue per call; kiln_qgemm_act (qgemm_act.h) multiplies two
   activations, packing B and its compensation per call and image; kiln_qdepthwise (qdepthwise.h) runs a depthwise
   convolution through the same epilogue.

   Weights are packed once at load as [n/32 panels][k/4 quads][32][4] s8, k zero-padded to whole quads (a
   convolution pads each kernel row's segment of kw * c bytes); activations are read in place and a row's tail
   quad is built from its remaining bytes, never past its end. The register tile is gemm.h's: 6 rows x 32
   columns, 12 zmm accumulators; the work split (batch, panel, row chunk) over OpenMP is work_split.h's, as
   gemm.c's. */
/* No implicit multiply-add contraction: the epilogue's scale, dequantize and bias steps round as the ONNX graph's
   separate Mul / DequantizeLinear / Add do (explicit _mm512_fmadd_ps calls stay fused). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "activation.h"
#include "gelu.h"
#include "lookup.h"
#include "rounding.h"
#include "window.h"
#include "work_split.h"

#define MR 6    /* rows per register tile */
#define NR 32   /* columns per packed weight panel: two vectors of 16 int32 lanes, 4 k-bytes each */

/* Everything after the int32 sums, fixed at load (kiln.tactics.qgemm_c.Epilogue mirrors it field by field). */
typedef struct {
  const int32_t* comp;      /* x_zp (+128 for s8 input) * column sum of the weights, padded to whole panels */
  const float* scale;       /* x_scale * w_scale[n], padded */
  const float* bias;        /* FP32 bias, padded; NULL: none */
  float clamp_lo, clamp_hi; /* ReLU (0, inf), Clip (min, max); (-inf, inf) otherwise */
  float r_scale;            /* an INT8 residual's scale (FP32 ones are added as read) */
  float y_scale;            /* the output's scale (divided by, as QuantizeLinear does) */
  int32_t r_zp, y_zp;
  int32_t act;              /* after the clamp (activation.h): ACT_SWISH, ACT_GELU_ERF, ACT_GELU_TANH; 0 none */
  int32_t out_kind;         /* OUT_F32, OUT_U8, OUT_S8 */
  int32_t signed_input;     /* 1: s8 activations (top bit flipped as read) */
  int32_t pad_byte;         /* the raw input byte of a quantized zero (x_zp), written where a window is padded */
  int32_t r_kind;           /* the residual's type: OUT_F32, OUT_U8, OUT_S8 */
  const int32_t* w_zp;      /* the weights' zero points per column, padded; NULL: all 0 (see above) */
  float mid_scale;          /* the product rounded to INT8 at (mid_scale, mid_zp) before the bias; */
  int32_t mid_zp, mid_kind; /* mid_kind OUT_U8 or OUT_S8; OUT_F32: no such rounding */
  float y_lo, y_hi;         /* the output's integer range less its zero point ([0, 255] - y_zp for u8), and */
  float mid_lo, mid_hi;     /* the mid rounding's: what quantize16 clamps to (computed once at load) */
  const uint8_t* table;     /* 256 output bytes by the requantized raw byte (a pointwise chain on it), padded to
                               TABLE_BYTES for the gather below; NULL: none */
} QEpilogue;

enum { OUT_F32 = 0, OUT_U8 = 1, OUT_S8 = 2 };
#define TABLE_BYTES 260   /* 256 entries and 3 bytes a gather of 4 at entry 255 reads past them, rounded up to 4 */

static inline int64_t out_size(const QEpilogue* e) { return e->out_kind == OUT_F32 ? 4 : 1; }
static inline int64_t res_size(const QEpilogue* e) { return e->r_kind == OUT_F32 ? 4 : 1; }

/* A GEMM layer's constant arguments (kiln.tactics.qgemm_c.GemmCall): a call passes only its tensors, so the
   per-call cost is not spent converting a dozen integers. Row r of image p starts at a + p * a_batch +
   (r / row_width) * line_step + (r % row_width) * col_step bytes (strided 1x1 convolutions read in place). */
typedef struct {
  const int8_t* b;   /* weights, [n/32][k/4][32][4] */
  int64_t a_batch, row_width, col_step, line_step, c_batch, batch, k, n;
  QEpilogue e;
} QGemmCall;

/* The byte offset of row r of image p of A. */
static inline int64_t qrow_at(const QGemmCall* g, int64_t p, int64_t r) {
  return p * g->a_batch + (r / g->row_width) * g->line_step + (r % g->row_width) * g->col_step;
}

/* A direct convolution's constant arguments (kiln.tactics.qgemm_c.ConvCall). */
typedef struct {
  const int8_t* b;   /* weights, [cout/32][kh][(kw * c) / 4][32][4] */
  int64_t n, h, w, c, kh, kw, sh, sw, pt, pl, oh, ow, cout;
  QEpilogue e;
} QConvCall;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

static inline __m512 v_swish(__m512 x) {   /* x * sigmoid(x), gemm.h's Cephes expf in intrinsics */
  const __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(-87.0f)),
                                 _mm512_set1_ps(87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f - 2.12194440e-4f), t);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                                              _mm512_set1_epi32(127)), 23));
  return _mm512_div_ps(x, _mm512_fmadd_ps(e, scale, _mm512_set1_ps(1.0f)));
}

/* gelu.h's odd rational polynomials in x*x (pointwise.h's k_erf and k_tanh), +-1 from the bound on. */
static inline __m512 v_rational(__m512 x, float bound, const float* p, int np, const float* q, int nq) {
  const __m512 lo = _mm512_set1_ps(-bound), hi = _mm512_set1_ps(bound);
  const __m512 c = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 x2 = _mm512_mul_ps(c, c);
  __m512 num = _mm512_set1_ps(p[0]), den = _mm512_set1_ps(q[0]);
  for (int i = 1; i < np; ++i) num = _mm512_fmadd_ps(num, x2, _mm512_set1_ps(p[i]));
  for (int i = 1; i < nq; ++i) den = _mm512_fmadd_ps(den, x2, _mm512_set1_ps(q[i]));
  const __m512 r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GE_OQ),
                                        _mm512_div_ps(_mm512_mul_ps(c, num), den), _mm512_set1_ps(1.0f));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LE_OQ), r, _mm512_set1_ps(-1.0f));
}

static inline __m512 v_gelu(__m512 x, int tanh_form) {   /* 0.5 x (1 + erf(x / sqrt 2)), or its tanh form */
  __m512 g;
  if (tanh_form) {   /* tanh(sqrt(2 / pi) (x + 0.044715 x^3)) */
    const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                       _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(x, x), x),
                                                       _mm512_set1_ps(0.044715f), x));
    g = v_rational(inner, GELU_TANH_BOUND, GELU_TANH_P, GELU_COUNT(GELU_TANH_P), GELU_TANH_Q,
                   GELU_COUNT(GELU_TANH_Q));
  } else {
    g = v_rational(_mm512_mul_ps(x, _mm512_set1_ps(0.7071067811865476f)), GELU_ERF_BOUND, GELU_ERF_P,
                   GELU_COUNT(GELU_ERF_P), GELU_ERF_Q, GELU_COUNT(GELU_ERF_Q));
  }
  return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), _mm512_add_ps(g, _mm512_set1_ps(1.0f)));
}

/* x / scale rounded as IEEE division rounds it, without a division, from `inv`, 1 / scale rounded to nearest:
   q = x * inv is within an ulp of the quotient, and one correction step (Markstein's theorem) on the exact remainder
   r = x - q * scale gives the correctly rounded quotient, q + r * inv. Checked against division on 10^9 quotients
   next to every rounding boundary of 20,000 scales and on 2 x 10^8 random ones: all equal. q is clamped to
   [lo - 1, hi + 1] first, bounds past which the result clamps alike, so that an infinite x (inf - inf in r) still
   clamps to its side; NaN becomes lo - 1 (max_ps returns its second operand) and r and the result stay NaN.

   Which is faster depends on the divider. Intel's AVX-512 cores divide 16 lanes in 10-16 cycles, more than a K=64
   convolution's products per output vector, where this costs a multiply, two FMAs and a clamp; Zen 4 divides them
   in ~6, and there the division measured faster (an epilogue-shaped loop: 1.78 against 2.28 ns a vector). So AMD
   targets (-march=native names a znver) divide; -DKILN_QUANTIZE_RECIPROCAL or -DKILN_QUANTIZE_DIVIDE forces
   either (rounding.h's QUANTIZE_BY_DIVISION; the tests build both and compare their bytes). */
static inline __m512 quotient16(__m512 x, float scale, float inv, float lo, float hi) {
  const __m512 q = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(inv)), _mm512_set1_ps(lo - 1.0f)),
                                 _mm512_set1_ps(hi + 1.0f));
  const __m512 r = _mm512_fnmadd_ps(q, _mm512_set1_ps(scale), x);
  return _mm512_fmadd_ps(r, _mm512_set1_ps(inv), q);
}

/* ONNX QuantizeLinear of 16 floats as int32 lanes: x / scale clamped to [lo, hi] (the type's range less the zero
   point), rounded half to even (the default MXCSR rounding), plus the zero point. Clamping before rounding gives the
   same integer, as the bounds are integers; NaN takes the low bound (max_ps returns its second operand). The bounds
   and `inv` (rounding.h's quotient_reciprocal) come precomputed: deriving the bounds here from the type and zero
   point cost 10% of a K=32 GEMM. */
static inline __m512i quantize16(__m512 x, float scale, float inv, int32_t zp, float lo, float hi) {
  const __m512 y = inv != 0.0f ? quotient16(x, scale, inv, lo, hi) : _mm512_div_ps(x, _mm512_set1_ps(scale));
  const __m512 t = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
  return _mm512_add_epi32(_mm512_cvtps_epi32(t), _mm512_set1_epi32(zp));
}

/* 16 bytes mapped through a 256-byte table: lookup.h's mapped64 with AVX512-VBMI, else a gather of 4 bytes at each
   byte's offset (the table padded by 3), its low byte kept. */
static inline __m128i mapped16(__m128i bytes, const uint8_t* table) {
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
  return _mm512_castsi512_si128(mapped64(_mm512_castsi128_si512(bytes), table_quarters(table)));
#else
  return _mm512_cvtepi32_epi8(_mm512_i32gather_epi32(_mm512_cvtepu8_epi32(bytes), (const void*)table, 1));
#endif
}

/* 16 output columns from their int32 sums: compensation, scales, [rounded at the mid scale and dequantized,] bias,
   residual, activation, then stored as FP32 or requantized u8/s8 (`mask`: the real columns of a partial panel;
   other lanes are never stored). */
static inline __attribute__((always_inline)) void
store16(__m512i acc, int64_t col, const QEpilogue* e, const void* res, void* out, __mmask16 mask) {
  __m512 y = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_loadu_si512(e->comp + col)));
  y = _mm512_mul_ps(y, _mm512_loadu_ps(e->scale + col));
  if (e->mid_kind != OUT_F32) {   /* DequantizeLinear(QuantizeLinear(y)) at the mid scale, as the model had it */
    const __m512i m = quantize16(y, e->mid_scale, quotient_reciprocal(e->mid_scale), e->mid_zp, e->mid_lo, e->mid_hi);
    y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(m, _mm512_set1_epi32(e->mid_zp))),
                      _mm512_set1_ps(e->mid_scale));
  }
  if (e->bias) y = _mm512_add_ps(y, _mm512_loadu_ps(e->bias + col));
  if (res && e->r_kind == OUT_F32) {   /* an FP32 residual (a sum left unquantized) */
    y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, res));
  } else if (res) {
    const __m128i bytes = _mm_maskz_loadu_epi8(mask, res);
    const __m512i r = e->r_kind == OUT_S8 ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(r, _mm512_set1_epi32(e->r_zp))),
                        _mm512_set1_ps(e->r_scale), y);
  }
  y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(e->clamp_lo)), _mm512_set1_ps(e->clamp_hi));
  if (e->act == ACT_SWISH) y = v_swish(y);
  else if (e->act == ACT_GELU_ERF || e->act == ACT_GELU_TANH) y = v_gelu(y, e->act == ACT_GELU_TANH);
  if (e->out_kind == OUT_F32) {
    _mm512_mask_storeu_ps(out, mask, y);
    return;
  }
  const float inv = quotient_reciprocal(e->y_scale);
  const __m128i q = _mm512_cvtepi32_epi8(quantize16(y, e->y_scale, inv, e->y_zp, e->y_lo, e->y_hi));
  _mm_mask_storeu_epi8(out, mask, e->table ? mapped16(q, e->table) : q);
}

/* The common epilogue (INT8 output, no mid rounding, table or activation function; bias, clamp and an INT8
   residual), with its per-column vectors and constants loaded once per tile or panel: store16 reloads every field
   for every row, as its byte stores may alias them (15% of a K=64 1x1 convolution on Zen 4). The same steps in the
   same order as store16, so the bytes are the same; a missing bias adds zeros, which no rounding can tell apart. */
typedef struct {
  __m512i comp[2], r_zp;
  __m512 scale[2], bias[2], clamp_lo, clamp_hi, r_scale;
  float y_scale, y_inv, y_lo, y_hi;
  int32_t y_zp, r_signed;
} QPlain;

/* Whether store16_plain stores store16's bytes for `e` and a residual `res` (NULL: none). */
static inline int plain_epilogue(const QEpilogue* e, const void* res) {
  return e->out_kind != OUT_F32 && e->mid_kind == OUT_F32 && !e->table && e->act == 0 &&
         (!res || e->r_kind != OUT_F32);
}

/* A panel's column vectors from its first column `col` (the arrays are padded to whole panels) and the
   epilogue's constants, broadcast once. */
static inline QPlain plain_columns(const QEpilogue* e, int64_t col) {
  QPlain p;
  for (int h = 0; h < 2; ++h) {
    p.comp[h] = _mm512_loadu_si512(e->comp + col + 16 * h);
    p.scale[h] = _mm512_loadu_ps(e->scale + col + 16 * h);
    p.bias[h] = e->bias ? _mm512_loadu_ps(e->bias + col + 16 * h) : _mm512_setzero_ps();
  }
  p.clamp_lo = _mm512_set1_ps(e->clamp_lo);
  p.clamp_hi = _mm512_set1_ps(e->clamp_hi);
  p.r_scale = _mm512_set1_ps(e->r_scale);
  p.r_zp = _mm512_set1_epi32(e->r_zp);
  p.y_scale = e->y_scale, p.y_inv = quotient_reciprocal(e->y_scale), p.y_lo = e->y_lo, p.y_hi = e->y_hi;
  p.y_zp = e->y_zp;
  p.r_signed = e->r_kind == OUT_S8;
  return p;
}

/* store16 for half h (columns 16h..16h+15 of the panel) under QPlain. */
static inline __attribute__((always_inline)) void
store16_plain(__m512i acc, const QPlain* p, int h, const uint8_t* res, uint8_t* out, __mmask16 mask) {
  __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, p->comp[h])), p->scale[h]);
  y = _mm512_add_ps(y, p->bias[h]);
  if (res) {
    const __m128i bytes = _mm_maskz_loadu_epi8(mask, res);
    const __m512i r = p->r_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(r, p->r_zp)), p->r_scale, y);
  }
  y = _mm512_min_ps(_mm512_max_ps(y, p->clamp_lo), p->clamp_hi);
  _mm_mask_storeu_epi8(out, mask,
                       _mm512_cvtepi32_epi8(quantize16(y, p->y_scale, p->y_inv, p->y_zp, p->y_lo, p->y_hi)));
}

/* One row of a panel under QPlain: its two halves of sums (the second stored only where `hi` has columns). */
static inline __attribute__((always_inline)) void
store32_plain(__m512i acc0, __m512i acc1, const QPlain* p, const uint8_t* res, uint8_t* out, __mmask16 lo,
              __mmask16 hi) {
  store16_plain(acc0, p, 0, res, out, lo);
  if (hi) store16_plain(acc1, p, 1, res ? res + 16 : 0, out + 16, hi);
}

static inline uint32_t quad(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* 1-3 bytes, the rest zero: a masked load, which touches no byte past the row's end */
static inline uint32_t tail_quad(const uint8_t* p, int64_t bytes) {
  return (uint32_t)_mm_cvtsi128_si32(_mm_maskz_loadu_epi8((__mmask16)((1u << bytes) - 1), p));
}

/* The sum of `bytes` bytes at p, each with its top bit flipped where `flip` (0x80808080: s8 read as u8). */
static inline int32_t byte_sum(const uint8_t* p, int64_t bytes, uint32_t flip) {
  const __m512i f = _mm512_set1_epi32((int)flip), zero = _mm512_setzero_si512();
  __m512i acc = zero;
  int64_t i = 0;
  for (; i + 64 <= bytes; i += 64)
    acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_xor_si512(_mm512_loadu_si512(p + i), f), zero));
  if (i < bytes) {
    const __mmask64 mask = ((__mmask64)1 << (bytes - i)) - 1;   /* bytes - i < 64 */
    const __m512i v = _mm512_maskz_mov_epi8(mask, _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, p + i), f));
    acc = _mm512_add_epi64(acc, _mm512_sad_epu8(v, zero));
  }
  return (int32_t)_mm512_reduce_add_epi64(acc);
}

/* Takes w_zp[col0 + j] * sums[i] off column j of row i's 32 int32 sums (the weights' zero points, padded to whole
   panels), for `rows` rows. */
static inline void weight_zero_points(__m512i (*acc)[2], const int32_t* sums, int rows, const int32_t* w_zp) {
  const __m512i z0 = _mm512_loadu_si512(w_zp), z1 = _mm512_loadu_si512(w_zp + 16);
  for (int i = 0; i < rows; ++i) {
    const __m512i s = _mm512_set1_epi32(sums[i]);
    acc[i][0] = _mm512_sub_epi32(acc[i][0], _mm512_mullo_epi32(s, z0));
    acc[i][1] = _mm512_sub_epi32(acc[i][1], _mm512_mullo_epi32(s, z1));
  }
}

/* Sums `segs` segments of `k` bytes into `rows` (1-6) rows of a 32-column tile (segment s: rows a[s * MR + i],
   weights b + s * quads * NR * 4), then stores them through the epilogue. `rows` and `flip` (0, or 0x80808080 for
   s8 input) are compile-time constants at each call site (tile_rows), so a short tile (a batch-1 linear layer, the
   last rows) computes only its rows and the u8 path broadcasts straight from memory. Weights with zero points
   read the rows' byte sums from `sums` (a GEMM's, summed once per call) or sum the segments here (NULL). */
static inline __attribute__((always_inline)) void
qtile(const uint8_t* const* a, int64_t segs, int64_t k, const int8_t* restrict b, uint8_t* c, int64_t ldc_bytes,
      int64_t esize, int64_t cols, int64_t col0, const uint8_t* res, int64_t ldr_bytes, const QEpilogue* e,
      const int32_t* sums, const int rows, const uint32_t flip) {
  const int64_t full = k / 4, tail = k % 4, quads = full + (tail != 0);
  __m512i c00 = _mm512_setzero_si512(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m512i c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
/* one quad step of row I (if the tile has it): its broadcast quad times the panel's two weight vectors */
#define QROW(I, X, LO, HI)                                                                                 \
  if (rows > (I)) {                                                                                       \
    const __m512i x = _mm512_set1_epi32((int)((X) ^ flip));                                               \
    LO = _mm512_dpbusd_epi32(LO, x, b0);                                                                  \
    HI = _mm512_dpbusd_epi32(HI, x, b1);                                                                  \
  }
#define QSTEP(QUAD, AT, B)                                                                                 \
  do {                                                                                                    \
    const __m512i b0 = _mm512_loadu_si512(B), b1 = _mm512_loadu_si512((B) + 64);                          \
    QROW(0, QUAD(a0 + (AT)), c00, c01) QROW(1, QUAD(a1 + (AT)), c10, c11)                                 \
    QROW(2, QUAD(a2 + (AT)), c20, c21) QROW(3, QUAD(a3 + (AT)), c30, c31)                                 \
    QROW(4, QUAD(a4 + (AT)), c40, c41) QROW(5, QUAD(a5 + (AT)), c50, c51)                                 \
  } while (0)
#define TAIL(P) tail_quad(P, tail)
  for (int64_t s = 0; s < segs; ++s) {
    const uint8_t *a0 = a[s * MR], *a1 = a[s * MR + 1], *a2 = a[s * MR + 2], *a3 = a[s * MR + 3];
    const uint8_t *a4 = a[s * MR + 4], *a5 = a[s * MR + 5];
    const int8_t* bs = b + s * quads * NR * 4;
    for (int64_t q = 0; q < full; ++q) QSTEP(quad, 4 * q, bs + q * NR * 4);
    if (tail) QSTEP(TAIL, 4 * full, bs + full * NR * 4);   /* the last 1-3 bytes; their padded weights are 0 */
  }
#undef TAIL
#undef QSTEP
#undef QROW
  __m512i acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  if (e->w_zp) {
    int32_t own[MR] = {0};
    if (!sums) {   /* each row's byte sum over its segments */
      for (int i = 0; i < rows; ++i)
        for (int64_t s = 0; s < segs; ++s) own[i] += byte_sum(a[s * MR + i], k, flip);
      sums = own;
    }
    weight_zero_points(acc, sums, rows, e->w_zp + col0);
  }
  const __mmask16 lo = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
  const __mmask16 hi = cols >= NR ? (__mmask16)0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
  if (plain_epilogue(e, res)) {
    const QPlain p = plain_columns(e, col0);
    for (int i = 0; i < rows; ++i)
      store32_plain(acc[i][0], acc[i][1], &p, res ? res + i * ldr_bytes : 0, c + i * ldc_bytes, lo, hi);
    return;
  }
  for (int i = 0; i < rows; ++i) {
    uint8_t* row = c + i * ldc_bytes;
    const uint8_t* r = res ? res + i * ldr_bytes : 0;
    store16(acc[i][0], col0, e, r, row, lo);
    if (hi) store16(acc[i][1], col0 + 16, e, r ? r + 16 * res_size(e) : 0, row + 16 * esize, hi);
  }
}

/* qtile for `mr` rows and the input's signedness, each combination compiled on its own. */
static void tile_rows(const uint8_t* const* a, int64_t segs, int64_t mr, int64_t k, const int8_t* restrict b,
                      uint8_t* c, int64_t ldc_bytes, int64_t esize, int64_t cols, int64_t col0, const uint8_t* res,
                      int64_t ldr_bytes, const QEpilogue* e, const int32_t* sums) {
#define QTILE(R)                                                                                                   \
  (e->signed_input ? qtile(a, segs, k, b, c, ldc_bytes, esize, cols, col0, res, ldr_bytes, e, sums, R, 0x80808080u) \
                   : qtile(a, segs, k, b, c, ldc_bytes, esize, cols, col0, res, ldr_bytes, e, sums, R, 0))
  switch (mr) {
    case 1: QTILE(1); break;
    case 2: QTILE(2); break;
    case 3: QTILE(3); break;
    case 4: QTILE(4); break;
    case 5: QTILE(5); break;
    default: QTILE(6);
  }
#undef QTILE
}

/* Each row's byte sum, image after image (read as the kernel reads them, s8 flipped): what weights with zero points
   take off every panel's sums, summed once rather than per panel. The caller frees it. */
static int32_t* row_sums(const QGemmCall* g, const uint8_t* a, int64_t m) {
  const int64_t rows = g->batch * m;
  const uint32_t flip = g->e.signed_input ? 0x80808080u : 0;
  int32_t* sums = (int32_t*)malloc(sizeof(int32_t) * (size_t)(rows > 0 ? rows : 1));
  if (!sums) abort();
  MAYBE_PARALLEL(threads_pay(rows, rows * g->k), {
    _Pragma("omp for schedule(static)")
    for (int64_t r = 0; r < rows; ++r) sums[r] = byte_sum(a + qrow_at(g, r / m, r % m), g->k, flip);
  });
  return sums;
}

/* kiln_qgemm's loop over B (packed) and the compensation `comps` (NULL: the epilogue's own) of each image: image p
   reads b + p * b_image bytes and comps + p * comp_image (an activation B, packed per call: kiln_qgemm_act). */
static void qgemm_images(const QGemmCall* g, const uint8_t* a, void* c, const void* res, int64_t m, const int8_t* b,
                         int64_t b_image, const int32_t* comps, int64_t comp_image) {
  const int64_t c_batch = g->c_batch, batch = g->batch, k = g->k, n = g->n;
  const QEpilogue* e = &g->e;
  const int64_t quads = (k + 3) / 4, panels = (n + NR - 1) / NR, tiles = (m + MR - 1) / MR;
  const int64_t chunks = (tiles + CHUNK - 1) / CHUNK, units = panels * chunks, esize = out_size(e);
  const int64_t rows_outer = quads * 4 * n <= ROWS_OUTER_BYTES;
  int32_t* sums = e->w_zp ? row_sums(g, a, m) : 0;
  MAYBE_PARALLEL(threads_pay(batch * units, batch * m * k * n), {
    QEpilogue own = *e;   /* the image's compensation, where each image has its own */
    _Pragma("omp for schedule(static)")
    for (int64_t q = 0; q < batch * units; ++q) {
      const WorkUnit unit = work_unit(q, panels, chunks, tiles, n, NR, rows_outer);
      const int8_t* bp = b + unit.p * b_image + unit.nb * quads * NR * 4;
      if (comps) own.comp = comps + unit.p * comp_image;
      const QEpilogue* ue = comps ? &own : e;
      for (int64_t t = unit.first; t < unit.last; ++t) {
        const int64_t r0 = t * MR, mr = m - r0 < MR ? m - r0 : MR;
        const uint8_t* rows[MR];
        for (int64_t i = 0; i < MR; ++i)   /* a partial tile repeats its first row */
          rows[i] = a + qrow_at(g, unit.p, r0 + (i < mr ? i : 0));
        const int64_t at = unit.p * c_batch + r0 * n + unit.nb * NR;
        uint8_t* out = (uint8_t*)c + at * esize;
        const uint8_t* r = res ? (const uint8_t*)res + at * res_size(e) : 0;
        tile_rows(rows, 1, mr, k, bp, out, n * esize, esize, unit.cols, unit.nb * NR, r, n * res_size(e), ue,
                  sums ? sums + unit.p * m + r0 : 0);
      }
    }
  });
  free(sums);
}

/* C[m x n] = A[m x k] . B per image (`g`), C rows n wide and c_batch elements per image; `res` (the residual, of
   e.r_kind) laid out as C, and may be C itself where they have one type. */
void kiln_qgemm(const QGemmCall* g, const uint8_t* a, void* c, const void* res, int64_t m) {
  qgemm_images(g, a, c, res, m, g->b, 0, 0, 0);
}

/* Direct convolution on NHWC x[n][h][w][c] (dilation 1, one group): output pixel r is a GEMM row, kernel row s of
   its window one segment of kw * c bytes; B packed from [kh][kw * c padded to quads][cout]. Windows crossing the
   border are copied into a per-thread buffer, padded with the zero point's byte. */
void kiln_qconv(const QConvCall* g, const uint8_t* x, void* y, const void* res) {
  const int64_t n = g->n, h = g->h, w = g->w, c = g->c, kh = g->kh, kw = g->kw, sh = g->sh, sw = g->sw;
  const int64_t pt = g->pt, pl = g->pl, oh = g->oh, ow = g->ow, cout = g->cout;
  const int8_t* b = g->b;
  const QEpilogue* e = &g->e;
  const int64_t m = oh * ow, seg = kw * c, quads = (seg + 3) / 4, panels = (cout + NR - 1) / NR;
  const int64_t tiles = (m + MR - 1) / MR, chunks = (tiles + CHUNK - 1) / CHUNK, units = panels * chunks;
  const int64_t rows_outer = kh * quads * 4 * cout <= ROWS_OUTER_BYTES, esize = out_size(e);
  MAYBE_PARALLEL(threads_pay(n * units, n * m * kh * seg * cout), {
    uint8_t* pad = (uint8_t*)malloc((size_t)(MR * kh * seg));
    const uint8_t** rows = (const uint8_t**)malloc(sizeof(uint8_t*) * MR * kh);
    _Pragma("omp for schedule(static)")
    for (int64_t q = 0; q < n * units; ++q) {
      const WorkUnit unit = work_unit(q, panels, chunks, tiles, cout, NR, rows_outer);
      const int8_t* bp = b + unit.nb * kh * quads * NR * 4;
      const uint8_t* image = x + unit.p * h * w * c;
      for (int64_t t = unit.first; t < unit.last; ++t) {
        const int64_t r0 = t * MR, mr = m - r0 < MR ? m - r0 : MR;
        for (int64_t i = 0; i < MR; ++i) {
          const int64_t r = r0 + (i < mr ? i : 0), oy = r / ow, x0 = (r % ow) * sw - pl;
          for (int64_t s = 0; s < kh; ++s)
            rows[s * MR + i] = window_segment(image, h, w, c, kw, oy * sh - pt + s, x0, pad + (i * kh + s) * seg, 1,
                                              e->pad_byte);
        }
        const int64_t at = (unit.p * m + r0) * cout + unit.nb * NR;
        uint8_t* out = (uint8_t*)y + at * esize;
        const uint8_t* r = res ? (const uint8_t*)res + at * res_size(e) : 0;
        tile_rows(rows, kh, mr, seg, bp, out, cout * esize, esize, unit.cols, unit.nb * NR, r, cout * res_size(e), e,
                  0);   /* windows: their byte sums are summed per tile */
      }
    }
    free(rows);
    free(pad);
  });
}
#include "qgemm_amx.h"
#include "qgemm_dynamic.h"
#include "qgemm_act.h"
#else
/* Compiled on every CPU so the library stays one unit; kiln offers these tactics only where AVX512-VNNI is. */
void kiln_qgemm(const QGemmCall* g, const uint8_t* a, void* c, const void* res, int64_t m) {
  (void)g; (void)a; (void)c; (void)res; (void)m;
  abort();   /* unreachable: no tactic calls it without AVX512-VNNI */
}

void kiln_qconv(const QConvCall* g, const uint8_t* x, void* y, const void* res) {
  (void)g; (void)x; (void)y; (void)res;
  abort();   /* unreachable, as above */
}

void kiln_qgemm_amx(const QGemmCall* g, const uint8_t* a, void* c, const void* res, int64_t m) {
  kiln_qgemm(g, a, c, res, m);   /* aborts, as above: AMX CPUs all have AVX512-VNNI */
}

void kiln_qconv_amx(const QConvCall* g, const uint8_t* x, void* y, const void* res) {
  kiln_qconv(g, x, y, res);   /* aborts, as above */
}

void kiln_dqgemm(const QGemmCall* g, const float* x, float* y, int64_t m, const int32_t* colsum,
                 const float* w_scale) {
  (void)g; (void)x; (void)y; (void)m; (void)colsum; (void)w_scale;
  abort();   /* unreachable, as above */
}

void kiln_dqgemm_amx(const QGemmCall* g, const float* x, float* y, int64_t m, const int32_t* colsum,
                     const float* w_scale) {
  kiln_dqgemm(g, x, y, m, colsum, w_scale);   /* aborts, as above */
}

void kiln_dqconv(const QConvCall* g, const float* x, float* y, const float* res, const int32_t* colsum,
                 const float* w_scale) {
  (void)g; (void)x; (void)y; (void)res; (void)colsum; (void)w_scale;
  abort();   /* unreachable, as above */
}

void kiln_dqconv_amx(const QConvCall* g, const float* x, float* y, const float* res, const int32_t* colsum,
                     const float* w_scale) {
  kiln_dqconv(g, x, y, res, colsum, w_scale);   /* aborts, as above */
}

void kiln_qgemm_act(const QGemmCall* g, const uint8_t* a, const uint8_t* b, void* c, int64_t m, int64_t x_zp,
                    int64_t b_unsigned) {
  (void)g; (void)a; (void)b; (void)c; (void)m; (void)x_zp; (void)b_unsigned;
  abort();   /* unreachable, as above */
}

int64_t kiln_amx_int8_ready(void) { return 0; }
#endif
#include "qdepthwise.h"
