/* Pooling on channel-major (NHWC) activations (kiln.tactics.pool_c): 2-D MaxPool (any kernel, stride,
   dilation, padding) and GlobalAveragePool / GlobalMaxPool, vectorized over channels, OpenMP over output rows.
   NaN propagates as in torch (a window holding NaN gives NaN); averages accumulate in double. */
#include <stdint.h>
#include <math.h>
#define CB 64   /* channels per block of the global pools */

void kiln_maxpool(const float* restrict x, float* restrict y, int64_t n, int64_t h, int64_t w, int64_t c,
                  int64_t oh, int64_t ow, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh, int64_t dw,
                  int64_t pt, int64_t pl) {
  #pragma omp parallel for schedule(static)
  for (int64_t line = 0; line < n * oh; ++line) {
    const int64_t b = line / oh, oy = line % oh;
    for (int64_t ox = 0; ox < ow; ++ox) {
      float* restrict out = y + (line * ow + ox) * c;
      for (int64_t k = 0; k < c; ++k) out[k] = -INFINITY;
      for (int64_t i = 0; i < kh; ++i) {
        const int64_t yy = oy * sh - pt + i * dh;
        if (yy < 0 || yy >= h) continue;
        for (int64_t j = 0; j < kw; ++j) {
          const int64_t xx = ox * sw - pl + j * dw;
          if (xx < 0 || xx >= w) continue;
          const float* restrict src = x + ((b * h + yy) * w + xx) * c;
          #pragma omp simd
          for (int64_t k = 0; k < c; ++k) {
            const float v = src[k];
            out[k] = (v > out[k] || v != v) ? v : out[k];
          }
        }
      }
    }
  }
}

void kiln_global_pool(const float* restrict x, float* restrict y, int64_t n, int64_t hw, int64_t c, int64_t mean) {
  const int64_t blocks = (c + CB - 1) / CB;
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n * blocks; ++t) {
    const int64_t b = t / blocks, c0 = (t % blocks) * CB, cb = c - c0 < CB ? c - c0 : CB;
    double sum[CB];
    float top[CB];
    for (int64_t k = 0; k < cb; ++k) { sum[k] = 0.0; top[k] = -INFINITY; }
    for (int64_t p = 0; p < hw; ++p) {
      const float* restrict src = x + (b * hw + p) * c + c0;
      if (mean) {
        #pragma omp simd
        for (int64_t k = 0; k < cb; ++k) sum[k] += src[k];
      } else {
        #pragma omp simd
        for (int64_t k = 0; k < cb; ++k) top[k] = (src[k] > top[k] || src[k] != src[k]) ? src[k] : top[k];
      }
    }
    for (int64_t k = 0; k < cb; ++k) y[b * c + c0 + k] = mean ? (float)(sum[k] / (double)hw) : top[k];
  }
}
