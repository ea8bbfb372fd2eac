/* LayerNormalization and kiln's SkipLayerNormalization over the trailing axes (kiln.tactics.layernorm_c): one
   pass per row for the sum, two vectorized reductions in double (mean, then the centred variance, as torch and
   onnxruntime compute it), one for the scaled output; OpenMP over rows. The BF16 variant reads its input and skip
   and writes its output in bf16 or FP32, as the plan stores them, and computes in FP32; with LN_RMS it is
   RMSNormalization (T5's, LLaMA's): no mean subtracted, 1 / sqrt(mean of squares + eps), no bias. Instance and
   group normalization run the same statistics over each (n, group) row with one scale and bias per channel, or,
   on channel-major maps, over each group's channels of every pixel; both apply a fused ReLU or SiLU. The INT8
   variant (QLayerNorm) reads u8/s8 rows, the residual sum optionally first, and writes u8/s8. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "activation.h"
#include "parallel.h"
#include "rounding.h"
#include "simd.h"

/* (mean, 1 / sqrt(variance + eps)) of one row. */
static inline void row_stats(const float* restrict src, int64_t n, double eps, float* mean_out, float* inv_out) {
  double sum = 0.0;
  #pragma omp simd reduction(+:sum)
  for (int64_t k = 0; k < n; ++k) sum += src[k];
  const float mean = (float)(sum / (double)n);
  double sq = 0.0;
  #pragma omp simd reduction(+:sq)
  for (int64_t k = 0; k < n; ++k) { const float d = src[k] - mean; sq += (double)d * d; }
  *mean_out = mean;
  *inv_out = (float)(1.0 / sqrt(sq / (double)n + eps));
}

void kiln_layernorm(const float* restrict x, const float* restrict skip, const float* restrict gamma,
                    const float* restrict beta, float* restrict y, int64_t rows, int64_t n, double eps) {
  #pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* restrict a = x + r * n;
    float* restrict out = y + r * n;
    const float* src = a;
    if (skip) {
      const float* restrict b = skip + r * n;
      #pragma omp simd
      for (int64_t k = 0; k < n; ++k) out[k] = a[k] + b[k];
      src = out;
    }
    float mean, inv;
    row_stats(src, n, eps, &mean, &inv);
    if (beta) {
      #pragma omp simd
      for (int64_t k = 0; k < n; ++k) out[k] = (src[k] - mean) * inv * gamma[k] + beta[k];
    } else {
      #pragma omp simd
      for (int64_t k = 0; k < n; ++k) out[k] = (src[k] - mean) * inv * gamma[k];
    }
  }
}

/* `io` bits above bf16.h's IO_X_BF16/IO_Y_BF16: the skip input stored in bf16; RMSNormalization. */
#define LN_SKIP_BF16 4
#define LN_RMS 8

/* (0, 1 / sqrt(mean of squares + eps)) of one row: RMSNormalization's statistics, the sum in double. */
static inline void row_rms(const float* restrict src, int64_t n, double eps, float* mean_out, float* inv_out) {
  double sq = 0.0;
  #pragma omp simd reduction(+:sq)
  for (int64_t k = 0; k < n; ++k) sq += (double)src[k] * src[k];
  *mean_out = 0.0f;
  *inv_out = (float)(1.0 / sqrt(sq / (double)n + eps));
}

static inline void load_row(const void* base, int64_t at, int64_t n, int bf16, float* restrict dst) {
  if (!bf16) {
    memcpy(dst, (const float*)base + at, sizeof(float) * n);
    return;
  }
  const uint16_t* restrict src = (const uint16_t*)base + at;
  #pragma omp simd
  for (int64_t k = 0; k < n; ++k) dst[k] = bf16_widen(src[k]);
}

/* A row of FP32 values into `base` at element `at`, rounded to bf16 where the output is stored so. */
static inline void store_row(const float* restrict src, int64_t n, int bf16, void* base, int64_t at) {
  if (!bf16) {
    memcpy((float*)base + at, src, sizeof(float) * n);
    return;
  }
  uint16_t* restrict dst = (uint16_t*)base + at;
  #pragma omp simd
  for (int64_t k = 0; k < n; ++k) dst[k] = bf16_narrow(src[k]);
}

void kiln_layernorm_bf16(const void* x, const void* skip, const float* restrict gamma, const float* restrict beta,
                         void* y, int64_t rows, int64_t n, double eps, int64_t io) {
  #pragma omp parallel
  {
    float* row = (float*)malloc(sizeof(float) * 2 * n);
    float* restrict other = row + n;
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      load_row(x, r * n, n, io & IO_X_BF16, row);
      if (skip) {
        load_row(skip, r * n, n, io & LN_SKIP_BF16, other);
        #pragma omp simd
        for (int64_t k = 0; k < n; ++k) row[k] += other[k];
      }
      float mean, inv;
      (io & LN_RMS ? row_rms : row_stats)(row, n, eps, &mean, &inv);
      #pragma omp simd
      for (int64_t k = 0; k < n; ++k) row[k] = (row[k] - mean) * inv * gamma[k] + (beta ? beta[k] : 0.0f);
      store_row(row, n, io & IO_Y_BF16, y, r * n);
    }
    free(row);
  }
}

/* kiln_layernorm_bf16 as a chain calls it (kiln.runtime.chains, onednn.h's ChainFn): p holds the scale's and the
   bias's addresses (0: none), the rows, the normalized size, epsilon's bits and `io`. */
void kiln_layernorm_bf16_call(const int64_t* p, const void* x, const void* skip, void* y) {
  double eps;
  memcpy(&eps, &p[4], sizeof eps);
  kiln_layernorm_bf16(x, skip, (const float*)(intptr_t)p[0], (const float*)(intptr_t)p[1], y, p[2], p[3], eps, p[5]);
}

/* INT8 LayerNorm (kiln's QLayerNorm): DequantizeLinear -> LayerNormalization -> QuantizeLinear per row, u8 or s8
   in and out. With `b`, the post-LN residual sum comes first, as its QuantizeLinear left it: a and b dequantized and
   added, the sum rounded to INT8 with its own scale, then dequantized with x's. `q` holds the scale and zero point
   of a, b, the sum, x and y (ten floats); bit k of `types` says a, b, the sum, y (k = 0..3) is s8. Rounding is
   ONNX's (half to even, saturated; NaN to the type's lowest value); the statistics come from exact integer sums
   of the row's levels (mean and variance in double, as kiln_layernorm's two passes would find them). */
#define Q8_BLOCK 16384   /* elements summed in int32 before joining the int64 totals: 16384 * 255^2 < 2^31 */

/* A u8 or s8 code as its integer (s8: flip 0x80 and subtract 128, branch-free). */
#define Q8_INT(byte, s8) ((int32_t)((byte) ^ ((s8) ? 0x80 : 0)) - ((s8) ? 128 : 0))

/* v / scale rounded half to even plus zp, saturated to [lo, hi] (the type's range less zp; NaN to lo), as a
   float (rounding.h; `inv`: quotient_reciprocal(scale)). */
static inline float q8_level(float v, float scale, float inv, float zp, float lo, float hi) {
  return saturated_level(quotient(v, scale, inv, lo, hi), zp, lo, hi);
}

/* row[k] = the k-th level of x less x's zero point (a small integer, exact in float); returns the row's sum and
   sum of squares of those integers, exactly. No multiply-add contraction here: the residual sum rounds as the
   graph's two DequantizeLinear and its Add do, so its INT8 level is the model's. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
static void level_row(const uint8_t* restrict a, const uint8_t* restrict b, const float* restrict q, int types,
                      int64_t n, float* restrict row, int64_t* sum_out, int64_t* squares_out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const int a8 = types & 1, b8 = types & 2;
  const float a_scale = q[0], a_zp = q[1], b_scale = q[2], b_zp = q[3], t_scale = q[4], t_zp = q[5];
  const float t_lo = level_lo(types & 4, t_zp), t_hi = level_hi(types & 4, t_zp), t_inv = quotient_reciprocal(t_scale);
  const int32_t x_zp = (int32_t)q[7];
  int64_t sum = 0, squares = 0;
  for (int64_t k0 = 0; k0 < n; k0 += Q8_BLOCK) {
    const int64_t k1 = k0 + Q8_BLOCK < n ? k0 + Q8_BLOCK : n;
    int32_t s = 0, s2 = 0;
    if (!b) {
      #pragma omp simd reduction(+:s, s2)
      for (int64_t k = k0; k < k1; ++k) {
        const int32_t d = Q8_INT(a[k], a8) - x_zp;
        row[k] = (float)d;
        s += d;
        s2 += d * d;
      }
    } else {
      #pragma omp simd reduction(+:s, s2)
      for (int64_t k = k0; k < k1; ++k) {
        const float total = ((float)Q8_INT(a[k], a8) - a_zp) * a_scale + ((float)Q8_INT(b[k], b8) - b_zp) * b_scale;
        const int32_t d = (int32_t)q8_level(total, t_scale, t_inv, t_zp, t_lo, t_hi) - x_zp;
        row[k] = (float)d;
        s += d;
        s2 += d * d;
      }
    }
    sum += s;
    squares += s2;
  }
  *sum_out = sum;
  *squares_out = squares;
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

/* out[k] = the quantized (row[k] * x_scale - mean) * inv * gamma[k] + beta[k] (no beta: 0). */
static void quantized_row(const float* restrict row, const float* restrict gamma, const float* restrict beta,
                          int64_t n, float x_scale, float mean, float inv, const float* restrict q, int s8,
                          uint8_t* restrict out) {
  const float y_scale = q[8], y_zp = q[9], lo = level_lo(s8, y_zp), hi = level_hi(s8, y_zp);
  const float y_inv = quotient_reciprocal(y_scale);
  if (beta) {
    #pragma omp simd
    for (int64_t k = 0; k < n; ++k)   /* s8 stored as its two's-complement byte */
      out[k] = (uint8_t)(int32_t)q8_level((row[k] * x_scale - mean) * inv * gamma[k] + beta[k], y_scale, y_inv,
                                          y_zp, lo, hi);
  } else {
    #pragma omp simd
    for (int64_t k = 0; k < n; ++k)
      out[k] = (uint8_t)(int32_t)q8_level((row[k] * x_scale - mean) * inv * gamma[k], y_scale, y_inv, y_zp, lo,
                                          hi);
  }
}

void kiln_layernorm_q8(const uint8_t* a, const uint8_t* b, const float* restrict gamma, const float* restrict beta,
                       uint8_t* y, int64_t rows, int64_t n, double eps, const float* q, int64_t types) {
  const float x_scale = q[6];
  if (rows <= 0 || n <= 0) return;
  #pragma omp parallel if (rows * n >= 32768)
  {
    float* row = (float*)malloc(sizeof(float) * n);
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      int64_t sum, squares;
      level_row(a + r * n, b ? b + r * n : NULL, q, (int)types, n, row, &sum, &squares);
      /* the dequantized row's statistics from exact integer sums: n^2 variance = n S2 - S^2 (int64) */
      const __int128 spread_n2 = (__int128)squares * n - (__int128)sum * sum;   /* n S2 passes int64 past n ~ 1e7 */
      const double scale = (double)x_scale, spread = (double)spread_n2 / ((double)n * (double)n);
      const float mean = (float)(scale * (double)sum / (double)n);
      const float inv = (float)(1.0 / sqrt(scale * scale * spread + eps));
      quantized_row(row, gamma, beta, n, x_scale, mean, inv, q, (int)(types & 8), y + r * n);
    }
    free(row);
  }
}

static inline vf activate(vf v, int64_t act) {
  if (act == ACT_RELU) return v_max(v, (vf){0});
  return act == ACT_SWISH ? v_silu(v) : v;
}

/* dst[k] = act((src[k] - m[k]) * a[k] + b[k]) for k < n (dst may be src); m, a and b NULL: dst[k] = act(src[k]).
   VW at a time, the tail through zero-filled vectors. (Centring first keeps x * a and m * a, both large where the
   mean is large against the spread, from cancelling.) */
static inline void affine_row(const float* src, float* dst, const float* restrict m, const float* restrict a,
                              const float* restrict b, int64_t n, int64_t act) {
  int64_t k = 0;
  for (; k + VW <= n; k += VW) {
    vf v = *(const vf*)(src + k);
    if (a) v = (v - *(const vf*)(m + k)) * *(const vf*)(a + k) + *(const vf*)(b + k);
    *(vf*)(dst + k) = activate(v, act);
  }
  if (k == n) return;
  float v[VW] = {0}, vm[VW] = {0}, va[VW] = {0}, vb[VW] = {0};
  memcpy(v, src + k, sizeof(float) * (n - k));
  if (a) {
    memcpy(vm, m + k, sizeof(float) * (n - k));
    memcpy(va, a + k, sizeof(float) * (n - k));
    memcpy(vb, b + k, sizeof(float) * (n - k));
  }
  vf r = *(vf*)v;
  if (a) r = (r - *(vf*)vm) * *(vf*)va + *(vf*)vb;
  r = activate(r, act);
  memcpy(dst + k, &r, sizeof(float) * (n - k));
}

/* InstanceNormalization and GroupNormalization on row-major [N, C, spatial...] maps: each row (one (n, group):
   channels_per_group x hw values, contiguous) normalized by its own mean and variance (double sums, as
   row_stats), then each channel's scale and bias (gamma/beta: `groups` x channels_per_group of them, FP32);
   InstanceNormalization is groups = C, one channel a row. `io` holds IO_X_BF16 / IO_Y_BF16. */
void kiln_groupnorm(const void* x, const float* restrict gamma, const float* restrict beta, void* y, int64_t rows,
                    int64_t n, int64_t groups, int64_t hw, double eps, int64_t act, int64_t io) {
  const int64_t per_group = n / hw;
  #pragma omp parallel if (rows * n >= 65536)
  {
    float* row = (float*)malloc(sizeof(float) * n);
    #pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      load_row(x, r * n, n, io & IO_X_BF16, row);
      float mean, inv;
      row_stats(row, n, eps, &mean, &inv);
      for (int64_t s = 0; s < per_group; ++s) {
        const int64_t channel = (r % groups) * per_group + s;
        const float scale = inv * gamma[channel], bias = beta[channel];
        float* restrict seg = row + s * hw;
        #pragma omp simd
        for (int64_t k = 0; k < hw; ++k) seg[k] = (seg[k] - mean) * scale + bias;
      }
      if (act) affine_row(row, row, NULL, NULL, NULL, n, act);
      store_row(row, n, io & IO_Y_BF16, y, r * n);
    }
    free(row);
  }
}

/* Each group's statistics from its channels' sums (S1 = sum of x - shift, S2 = sum of (x - shift)^2 per channel,
   per thread, in double), per channel as y = (x - m) * a + beta: m the group's mean, sum(S1 + hw shift) / count,
   and a = gamma / sqrt(var + eps), where sum((x - m)^2) = S2 + 2 (shift - m) S1 + hw (shift - m)^2. */
static void group_affine(const double* sums, int64_t threads, const float* shift, const float* gamma, float* m,
                         float* a, int64_t c, int64_t groups, int64_t hw, double eps) {
  const int64_t per_group = c / groups;
  const double count = (double)per_group * (double)hw;
  for (int64_t g = 0; g < groups; ++g) {
    double s1[per_group], s2[per_group], total = 0.0, spread = 0.0;
    for (int64_t j = 0; j < per_group; ++j) {
      const int64_t k = g * per_group + j;
      s1[j] = s2[j] = 0.0;
      for (int64_t t = 0; t < threads; ++t) {
        s1[j] += sums[2 * c * t + k];
        s2[j] += sums[2 * c * t + c + k];
      }
      total += s1[j] + (double)hw * shift[k];
    }
    const double mean = total / count;
    for (int64_t j = 0; j < per_group; ++j) {
      const double off = shift[g * per_group + j] - mean;
      spread += s2[j] + 2.0 * off * s1[j] + (double)hw * off * off;
    }
    const double var = spread > 0.0 ? spread / count : 0.0;
    const float inv = (float)(1.0 / sqrt(var + eps));
    for (int64_t k = g * per_group; k < (g + 1) * per_group; ++k) {
      m[k] = (float)mean;
      a[k] = inv * gamma[k];
    }
  }
}

/* FP32 sums of up to this many pixels, then added into the thread's double ones. */
#define GN_BLOCK 128

static inline void flush_sums(float* restrict s1, float* restrict s2, double* restrict mine, int64_t c) {
  for (int64_t k = 0; k < c; ++k) {
    mine[k] += s1[k];
    mine[c + k] += s2[k];
    s1[k] = s2[k] = 0.0f;
  }
}

/* The c values at element `at` of x as FP32: in place, or widened from bf16 into buf. */
static inline const float* pixel(const void* x, int64_t at, int64_t c, int bf16, float* buf) {
  if (!bf16) return (const float*)x + at;
  load_row(x, at, c, 1, buf);
  return buf;
}

/* GroupNormalization and InstanceNormalization on channel-major (NHWC) maps, where group g of an image is channels
   [g * C/G, (g + 1) * C/G) of every pixel. One pass sums each channel, shifted by its value at the first pixel
   (so the sums of squares do not cancel); group_affine turns them into a per-channel mean and scale; a second pass
   writes act((x - m) * a + beta). Threads split each image's pixels. `io` holds IO_X_BF16 / IO_Y_BF16. */
void kiln_groupnorm_nhwc(const void* x, const float* restrict gamma, const float* restrict beta, void* y,
                         int64_t batch, int64_t hw, int64_t c, int64_t groups, double eps, int64_t act, int64_t io) {
  const int parallel = threads_pay(hw, hw * c);
  const int64_t threads = parallel ? omp_get_max_threads() : 1;
  double* sums = (double*)calloc(2 * c * threads, sizeof(double));
  float* shift = (float*)malloc(sizeof(float) * 3 * c);
  float* m = shift + c;
  float* a = m + c;
  MAYBE_PARALLEL(parallel, {
    float* buf = (float*)malloc(sizeof(float) * 3 * c);
    float* s1 = buf + c;
    float* s2 = s1 + c;
    double* mine = sums + 2 * c * omp_get_thread_num();
    for (int64_t n = 0; n < batch; ++n) {
      const int64_t base = n * hw * c;
      _Pragma("omp single")
      load_row(x, base, c, io & IO_X_BF16, shift);
      memset(mine, 0, sizeof(double) * 2 * c);
      memset(s1, 0, sizeof(float) * 2 * c);
      int64_t pending = 0;
      _Pragma("omp for schedule(static) nowait")
      for (int64_t p = 0; p < hw; ++p) {
        const float* restrict v = pixel(x, base + p * c, c, io & IO_X_BF16, buf);
        _Pragma("omp simd")
        for (int64_t k = 0; k < c; ++k) {
          const float d = v[k] - shift[k];
          s1[k] += d;
          s2[k] += d * d;
        }
        if (++pending == GN_BLOCK) {
          flush_sums(s1, s2, mine, c);
          pending = 0;
        }
      }
      flush_sums(s1, s2, mine, c);
      _Pragma("omp barrier")
      _Pragma("omp single")
      group_affine(sums, threads, shift, gamma, m, a, c, groups, hw, eps);
      _Pragma("omp for schedule(static)")
      for (int64_t p = 0; p < hw; ++p) {
        const int64_t at = base + p * c;
        const float* v = pixel(x, at, c, io & IO_X_BF16, buf);
        if (io & IO_Y_BF16) {
          affine_row(v, buf, m, a, beta, c, act);
          store_row(buf, c, 1, y, at);
        } else {
          affine_row(v, (float*)y + at, m, a, beta, c, act);
        }
      }
    }
    free(buf);
  });
  free(sums);
  free(shift);
}
