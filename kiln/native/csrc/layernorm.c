/* LayerNormalization and kiln's SkipLayerNormalization over the trailing axes (kiln.tactics.layernorm_c): one
   pass per row for the sum, two vectorized reductions in double (mean, then the centred variance, as torch and
   onnxruntime compute it), one for the scaled output; OpenMP over rows. The BF16 variant reads its input and skip
   and writes its output in bf16 or FP32, as the plan stores them, and computes in FP32; with LN_RMS it is
   RMSNormalization (T5's, LLaMA's): no mean subtracted, 1 / sqrt(mean of squares + eps), no bias. Instance and
   group normalization run the same statistics over each (n, group) row with one scale and bias per channel. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "bf16.h"

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

/* InstanceNormalization and GroupNormalization on row-major [N, C, spatial...] maps: each row (one (n, group):
   channels_per_group x hw values, contiguous) normalized by its own mean and variance (double sums, as
   row_stats), then each channel's scale and bias (gamma/beta: `groups` x channels_per_group of them, FP32);
   InstanceNormalization is groups = C, one channel a row. `io` holds IO_X_BF16 / IO_Y_BF16. */
void kiln_groupnorm(const void* x, const float* restrict gamma, const float* restrict beta, void* y, int64_t rows,
                    int64_t n, int64_t groups, int64_t hw, double eps, int64_t io) {
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
      store_row(row, n, io & IO_Y_BF16, y, r * n);
    }
    free(row);
  }
}
