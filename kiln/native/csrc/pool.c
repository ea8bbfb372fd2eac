/* Pooling on channel-major (NHWC) activations (kiln.tactics.pool_c): 2-D MaxPool (any kernel, stride,
   dilation, padding) and GlobalAveragePool / GlobalMaxPool, vectorized over channels, OpenMP over output rows.
   MaxPool also on u8/s8 and bf16 tensors. NaN propagates as in torch (a window holding NaN gives NaN); averages
   accumulate in double. */
#include <stdint.h>
#include <math.h>

#include "bf16.h"
#define CB 64   /* channels per block of the global pools */

/* The window loop of kiln_maxpool and its INT8 forms: `T` the element type, `LOWEST` its start value, `MAX(v, m)`
   the running maximum (a window with no pixel inside the image keeps LOWEST). */
#define MAXPOOL_BODY(T, LOWEST, MAX)                                                                        \
  _Pragma("omp parallel for schedule(static)")                                                            \
  for (int64_t line = 0; line < n * oh; ++line) {                                                         \
    const int64_t b = line / oh, oy = line % oh;                                                          \
    for (int64_t ox = 0; ox < ow; ++ox) {                                                                 \
      T* restrict out = y + (line * ow + ox) * c;                                                         \
      for (int64_t k = 0; k < c; ++k) out[k] = LOWEST;                                                    \
      for (int64_t i = 0; i < kh; ++i) {                                                                  \
        const int64_t yy = oy * sh - pt + i * dh;                                                         \
        if (yy < 0 || yy >= h) continue;                                                                  \
        for (int64_t j = 0; j < kw; ++j) {                                                                \
          const int64_t xx = ox * sw - pl + j * dw;                                                       \
          if (xx < 0 || xx >= w) continue;                                                                \
          const T* restrict src = x + ((b * h + yy) * w + xx) * c;                                        \
          _Pragma("omp simd")                                                                             \
          for (int64_t k = 0; k < c; ++k) out[k] = MAX(src[k], out[k]);                                   \
        }                                                                                                 \
      }                                                                                                   \
    }                                                                                                     \
  }

#define FLOAT_MAX(v, m) (((v) > (m) || (v) != (v)) ? (v) : (m))
#define INT_MAX_OF(v, m) ((v) > (m) ? (v) : (m))
#define BF16_MAX(v, m) ((bf16_widen(v) > bf16_widen(m) || bf16_widen(v) != bf16_widen(v)) ? (v) : (m))
#define MAXPOOL_ARGS int64_t n, int64_t h, int64_t w, int64_t c, int64_t oh, int64_t ow, int64_t kh, int64_t kw, \
                     int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl

void kiln_maxpool(const float* restrict x, float* restrict y, MAXPOOL_ARGS) { MAXPOOL_BODY(float, -INFINITY, FLOAT_MAX) }

/* INT8 tensors (after Q/DQ fusion a MaxPool between INT8 layers runs on the quantized values: the maximum commutes
   with a positive-scale quantization) */
void kiln_maxpool_u8(const uint8_t* restrict x, uint8_t* restrict y, MAXPOOL_ARGS) { MAXPOOL_BODY(uint8_t, 0, INT_MAX_OF) }

void kiln_maxpool_s8(const int8_t* restrict x, int8_t* restrict y, MAXPOOL_ARGS) { MAXPOOL_BODY(int8_t, -128, INT_MAX_OF) }

/* bf16 tensors (between BF16 layers): the maximum of bf16 values is one of them, so the result is exact */
void kiln_maxpool_bf16(const uint16_t* restrict x, uint16_t* restrict y, MAXPOOL_ARGS) {
  MAXPOOL_BODY(uint16_t, 0xFF80u, BF16_MAX)   /* 0xFF80: -inf */
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
