/* QuantizeLinear and DequantizeLinear with one scale and zero point (kiln.tactics.quant_c), on u8 or s8: one
   pass over the elements, OpenMP over blocks. Quantizing also converts a channel-planar (NCHW) input to the
   channel-major (NHWC) layout kiln's INT8 convolutions read, so the network's input needs no Reformat after it.
   Rounding is ONNX's: x / scale rounded half to even, plus the zero point, saturated. Also here: the byte table
   lookups that run an elementwise chain on an INT8 input. */
#include <stdint.h>
#include <stdlib.h>

#include "lookup.h"
#include "rounding.h"

#define BLOCK 4096   /* elements per OpenMP work unit */
#define PARALLEL_MIN 32768   /* fewer elements run on the calling thread: waking the team costs more than they do */

/* x / scale + zp, saturated to [lo, hi] and rounded half to even (rounding.h; `inv`: quotient_reciprocal). */
static inline float quantized(float x, float scale, float inv, float zp, float lo, float hi) {
  return saturated_level(quotient(x, scale, inv, lo - zp, hi - zp), zp, lo - zp, hi - zp);
}

/* One elementwise function over `count` elements, `y[i] = EXPR` (of x[i]), OpenMP over blocks of BLOCK. */
#define ELEMENTWISE(NAME, IN, OUT, EXPR)                                                                     \
  void NAME(const IN* restrict x, OUT* restrict y, int64_t count, float scale, int64_t zero_point) {        \
    const float zp = (float)zero_point, inv = quotient_reciprocal(scale);                                    \
    (void)inv;                                                                                               \
    _Pragma("omp parallel for schedule(static) if(count >= PARALLEL_MIN)")                                   \
    for (int64_t b = 0; b < (count + BLOCK - 1) / BLOCK; ++b) {                                              \
      const int64_t end = (b + 1) * BLOCK < count ? (b + 1) * BLOCK : count;                                 \
      _Pragma("omp simd")                                                                                    \
      for (int64_t i = b * BLOCK; i < end; ++i) y[i] = EXPR;                                                 \
    }                                                                                                        \
  }
#define QUANTIZE(NAME, T, LO, HI) ELEMENTWISE(NAME, float, T, (T)(int32_t)quantized(x[i], scale, inv, zp, LO, HI))
#define DEQUANTIZE(NAME, T) ELEMENTWISE(NAME, T, float, ((float)x[i] - zp) * scale)

/* NCHW float in, NHWC out: a run of PIXELS pixels is quantized plane by plane into a small buffer (vectorized),
   then interleaved into channel-major order. */
#define PIXELS 256
#define QUANTIZE_TO_NHWC(NAME, T, LO, HI)                                                                    \
  void NAME(const float* restrict x, T* restrict y, int64_t n, int64_t c, int64_t hw, float scale,          \
            int64_t zero_point) {                                                                            \
    const float zp = (float)zero_point, inv = quotient_reciprocal(scale);                                    \
    const int64_t runs = (hw + PIXELS - 1) / PIXELS;                                                         \
    _Pragma("omp parallel if(n * hw * c >= PARALLEL_MIN)")                                                   \
    {                                                                                                        \
      T* buf = (T*)malloc(sizeof(T) * PIXELS * c);                                                           \
      _Pragma("omp for schedule(static)")                                                                    \
      for (int64_t u = 0; u < n * runs; ++u) {                                                               \
        const int64_t b = u / runs, p0 = (u % runs) * PIXELS, len = hw - p0 < PIXELS ? hw - p0 : PIXELS;     \
        for (int64_t k = 0; k < c; ++k) {                                                                    \
          const float* restrict src = x + (b * c + k) * hw + p0;                                             \
          T* restrict row = buf + k * PIXELS;                                                                \
          _Pragma("omp simd")                                                                                \
          for (int64_t p = 0; p < len; ++p) row[p] = (T)(int32_t)quantized(src[p], scale, inv, zp, LO, HI); \
        }                                                                                                    \
        T* restrict dst = y + (b * hw + p0) * c;                                                             \
        if (c == 3) { /* images: the channel count known, the interleave unrolls */                         \
          for (int64_t p = 0; p < len; ++p) {                                                                \
            dst[3 * p] = buf[p]; dst[3 * p + 1] = buf[PIXELS + p]; dst[3 * p + 2] = buf[2 * PIXELS + p];     \
          }                                                                                                  \
        } else {                                                                                             \
          for (int64_t p = 0; p < len; ++p)                                                                  \
            for (int64_t k = 0; k < c; ++k) dst[p * c + k] = buf[k * PIXELS + p];                            \
        }                                                                                                    \
      }                                                                                                      \
      free(buf);                                                                                             \
    }                                                                                                        \
  }

QUANTIZE(kiln_quantize_u8, uint8_t, 0.0f, 255.0f)
QUANTIZE(kiln_quantize_s8, int8_t, -128.0f, 127.0f)
QUANTIZE_TO_NHWC(kiln_quantize_nhwc_u8, uint8_t, 0.0f, 255.0f)
QUANTIZE_TO_NHWC(kiln_quantize_nhwc_s8, int8_t, -128.0f, 127.0f)
DEQUANTIZE(kiln_dequantize_u8, uint8_t)
DEQUANTIZE(kiln_dequantize_s8, int8_t)

/* Table lookups (lookup.h's LOOKUP over its lookup_bytes, and over floats here). */
static void lookup_floats(const uint8_t* restrict x, float* restrict y, int64_t begin, int64_t end,
                          const float* restrict table) {
  for (int64_t i = begin; i < end; ++i) y[i] = table[x[i]];
}

LOOKUP(, kiln_lookup_u8, uint8_t, lookup_bytes, LOOKUP_PARALLEL_MIN)
LOOKUP(, kiln_lookup_f32, float, lookup_floats, LOOKUP_PARALLEL_MIN / 4)   /* four bytes written per byte read */
