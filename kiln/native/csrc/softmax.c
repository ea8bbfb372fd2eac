/* Softmax and LogSoftmax along one run of axes (kiln.tactics.softmax_c). The input, in memory order, is
   [outer][n][inner]: the reduced axes are the n-run, `inner` elements apart. inner == 1 (the last axis, or the
   channels of a channel-major tensor) reduces contiguous rows, VW elements at a time; inner > 1 (ONNX Softmax on
   axis 1 of an NCHW tensor, YOLOv8's DFL) reduces VW independent lanes at once, each lane one column of `inner`.
   Three passes over the input: the largest value, the sum of exp(x - max), then exp(x - max) / sum (Softmax) or
   x - max - log(sum) (LogSoftmax), in FP32 whatever the storage; inputs and outputs FP32 or bf16 (`io` bits).

   exp is Cephes' expf, as gemm.h's Swish: range reduction by ln 2 in two parts and a degree-5 polynomial, within
   ~2 ulp. It keeps NaN, so a row holding NaN or +inf (inf - inf) or only -inf (-inf + inf) sums to NaN and comes
   out NaN, as torch's does; v_max may pass a NaN over, but x - max then finds it. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "parallel.h"
#include "rounding.h"
#include "simd.h"

#define SM_LOG 4   /* `io` bit above bf16.h's IO_X_BF16/IO_Y_BF16: LogSoftmax */

/* Work per element, in threads_pay's multiply-adds: three passes, one or two exponentials. */
#define MACS_PER_ELEMENT 24
#define LANE_BLOCKS 32   /* VW-lane columns per work unit where inner > 1 */

/* e^x, VW at a time, for x <= 0 (x - max): 0 below -87.3 (e^x under FLT_MIN), NaN kept. */
static inline vf v_exp_neg(vf x) {
  const vf lo = (vf){0} - 87.33f;
  const vi below = (vi)(x < lo), nan = (vi)(x != x);
  const vf t = v_select(below | nan, (vf){0}, x);
  const vi ni = __builtin_convertvector(t * 1.44269504088896341f - 0.5f, vi);   /* t <= 0: rounds to nearest */
  const vf n = __builtin_convertvector(ni, vf);
  const vf r = t - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = (vf){0} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
  const vf e = (p * r * r + r + 1.0f) * (vf)((ni + 127) << 23);
  return v_select(nan, x, (vf)(~below & (vi)e));
}

/* `count` (<= VW) elements from element `at` of `base`, FP32 or bf16, widened; the other lanes `pad`. */
static inline vf load(const void* base, int64_t at, int64_t count, int bf16, float pad) {
  if (count == VW) {   /* fixed-size copies: inlined as vector loads */
    vf v;
    if (!bf16) {
      memcpy(&v, (const float*)base + at, sizeof v);
      return v;
    }
    vh h;
    memcpy(&h, (const uint16_t*)base + at, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
  }
  vf v = (vf){0} + pad;
  if (bf16) {
    vh h = {0};
    memcpy(&h, (const uint16_t*)base + at, sizeof(uint16_t) * count);
    const vf w = (vf)(__builtin_convertvector(h, vu) << 16);
    if (count == VW) return w;
    for (int64_t i = 0; i < count; ++i) v[i] = w[i];
    return v;
  }
  memcpy(&v, (const float*)base + at, sizeof(float) * count);
  return v;
}

static inline void store(void* base, int64_t at, int64_t count, int bf16, vf v) {
  if (count == VW) {
    if (bf16) {
      const vh h = v_bf16(v);
      memcpy((uint16_t*)base + at, &h, sizeof h);
    } else {
      memcpy((float*)base + at, &v, sizeof v);
    }
    return;
  }
  if (bf16) {
    const vh h = v_bf16(v);
    memcpy((uint16_t*)base + at, &h, sizeof(uint16_t) * count);
  } else {
    memcpy((float*)base + at, &v, sizeof(float) * count);
  }
}

/* Up to this many exponentials are kept (in y where it is FP32, else on the stack) for the last pass; more are
   computed again. */
#define KEPT 4096

/* One contiguous row of n elements at element `at`. */
static void softmax_row(const void* x, void* y, int64_t at, int64_t n, int io) {
  const int xb = io & IO_X_BF16, yb = io & IO_Y_BF16, log = io & SM_LOG;
  vf m = (vf){0} - INFINITY;
  for (int64_t j = 0; j < n; j += VW) m = v_max(m, load(x, at + j, n - j < VW ? n - j : VW, xb, -INFINITY));
  const vf max = (vf){0} + h_max(m);
  float kept[yb && n <= KEPT ? n + VW : 1];
  float* e = log ? 0 : (!yb ? (float*)y + at : (n <= KEPT ? kept : 0));
  vf s = (vf){0};
  for (int64_t j = 0; j < n; j += VW) {
    const int64_t count = n - j < VW ? n - j : VW;
    const vf v = v_exp_neg(load(x, at + j, count, xb, -INFINITY) - max);
    s += v;
    if (e) store(e, j, count, 0, v);
  }
  const float total = h_sum(s);
  const vf scale = (vf){0} + 1.0f / total, shift = max + (log ? logf(total) : 0.0f);
  for (int64_t j = 0; j < n; j += VW) {
    const int64_t count = n - j < VW ? n - j : VW;
    vf v;
    if (log) v = load(x, at + j, count, xb, 0.0f) - shift;
    else v = (e ? load(e, j, count, 0, 0.0f) : v_exp_neg(load(x, at + j, count, xb, 0.0f) - max)) * scale;
    store(y, at + j, count, yb, v);
  }
}

/* Columns [at, at + width) (width <= LANE_BLOCKS * VW) of n rows `inner` apart, one column a lane: each pass runs
   along the rows' contiguous stretches (prefetched), the columns' running max and sum on the stack. The
   exponentials are kept for the last pass: in y where it is FP32, else on the stack where n * width <= KEPT (the
   caller narrows bf16 outputs' units to fit), else computed again. */
static void softmax_columns(const void* x, void* y, int64_t at, int64_t n, int64_t inner, int64_t width, int io) {
  const int xb = io & IO_X_BF16, yb = io & IO_Y_BF16, log = io & SM_LOG;
  const int64_t vectors = (width + VW - 1) / VW;
  vf max[LANE_BLOCKS], sum[LANE_BLOCKS], kept[yb && !log && n * vectors * VW <= KEPT ? KEPT / VW : 1];
  const int keep = yb && !log && n * vectors * VW <= KEPT;
  for (int64_t c = 0; c < vectors; ++c) max[c] = (vf){0} - INFINITY, sum[c] = (vf){0};
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < vectors; ++c) {
      const int64_t count = width - c * VW < VW ? width - c * VW : VW;
      max[c] = v_max(max[c], load(x, at + j * inner + c * VW, count, xb, 0.0f));
    }
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < vectors; ++c) {
      const int64_t count = width - c * VW < VW ? width - c * VW : VW, e = at + j * inner + c * VW;
      const vf v = v_exp_neg(load(x, e, count, xb, 0.0f) - max[c]);
      sum[c] += v;
      if (keep) kept[j * vectors + c] = v;
      else if (!log && !yb) store(y, e, count, 0, v);
    }
  for (int64_t c = 0; c < vectors; ++c) {
    if (log)
      for (int i = 0; i < VW; ++i) max[c][i] += logf(sum[c][i]);   /* the shift: max + log(sum) */
    else
      sum[c] = 1.0f / sum[c];   /* the scale */
  }
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < vectors; ++c) {
      const int64_t count = width - c * VW < VW ? width - c * VW : VW, e = at + j * inner + c * VW;
      vf v;
      if (log) v = load(x, e, count, xb, 0.0f) - max[c];
      else if (keep) v = kept[j * vectors + c] * sum[c];
      else if (!yb) v = load(y, e, count, 0, 0.0f) * sum[c];
      else v = v_exp_neg(load(x, e, count, xb, 0.0f) - max[c]) * sum[c];
      store(y, e, count, yb, v);
    }
}

void kiln_softmax(const void* x, void* y, int64_t outer, int64_t n, int64_t inner, int64_t io) {
  if (outer <= 0 || n <= 0 || inner <= 0) return;
  /* VW-lane columns per unit: LANE_BLOCKS, fewer where a bf16 output's exponentials are kept on the stack */
  const int64_t fit = (io & IO_Y_BF16) && !(io & SM_LOG) ? KEPT / VW / n : LANE_BLOCKS;
  const int64_t blocks = fit < 1 ? LANE_BLOCKS : (fit < LANE_BLOCKS ? fit : LANE_BLOCKS);
  const int64_t lane_units = inner == 1 ? 1 : ((inner + VW - 1) / VW + blocks - 1) / blocks;
  const int64_t units = outer * lane_units;
  MAYBE_PARALLEL(threads_pay(units, outer * n * inner * MACS_PER_ELEMENT), {
    _Pragma("omp for schedule(static)")
    for (int64_t u = 0; u < units; ++u) {
      const int64_t o = u / lane_units, base = o * n * inner;
      if (inner == 1) {
        softmax_row(x, y, base, n, (int)io);
        continue;
      }
      const int64_t c0 = u % lane_units * blocks * VW, c1 = c0 + blocks * VW < inner ? c0 + blocks * VW : inner;
      softmax_columns(x, y, base + c0, n, inner, c1 - c0, (int)io);
    }
  });
}

/* INT8 Softmax on the last axis (kiln.tactics.softmax_c.QuantizedSoftmaxTactic): DequantizeLinear, Softmax and
   QuantizeLinear of one scale each, as a quantized model writes them around attention's probabilities. A row of
   u8/s8 is widened to FP32 on the stack, softmax_row runs on it in place, and each probability quantized as ONNX
   does (p / scale rounded half to even, plus the zero point, saturated). `types`: bit 0 the input is s8, bit 1
   the output is. Rows longer than KEPT are the caller's to compute (kiln.tactics.softmax_c), as are empty ones. */

static void softmax_row_q8(const uint8_t* x, uint8_t* y, int64_t n, float x_scale, float x_zp, float y_scale,
                           float y_zp, int types) {
  float row[n + VW];
  const float lo = level_lo(types & 2, y_zp), hi = level_hi(types & 2, y_zp), y_inv = quotient_reciprocal(y_scale);
  if (types & 1)
    for (int64_t j = 0; j < n; ++j) row[j] = ((float)(int8_t)x[j] - x_zp) * x_scale;
  else
    for (int64_t j = 0; j < n; ++j) row[j] = ((float)x[j] - x_zp) * x_scale;
  softmax_row(row, row, 0, n, 0);   /* in place, FP32: each chunk is read before it is written */
  for (int64_t j = 0; j < n; ++j) {
    const int32_t q = (int32_t)saturated_level(quotient(row[j], y_scale, y_inv, lo, hi), y_zp, lo, hi);
    y[j] = (uint8_t)q;   /* s8 stored as its two's-complement byte */
  }
}

void kiln_softmax_q8(const uint8_t* x, uint8_t* y, int64_t rows, int64_t n, float x_scale, int64_t x_zp,
                     float y_scale, int64_t y_zp, int64_t types) {
  if (rows <= 0 || n <= 0 || n > KEPT) return;
  MAYBE_PARALLEL(threads_pay(rows, rows * n * MACS_PER_ELEMENT), {
    _Pragma("omp for schedule(static)")
    for (int64_t r = 0; r < rows; ++r)
      softmax_row_q8(x + r * n, y + r * n, n, x_scale, (float)x_zp, y_scale, (float)y_zp, (int)types);
  });
}
