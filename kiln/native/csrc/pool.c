/* Pooling on channel-major (NHWC) activations (kiln.tactics.pool_c): 2-D MaxPool and AveragePool (any kernel,
   stride, dilation, padding) and GlobalAveragePool / GlobalMaxPool, vectorized over channels, OpenMP over output rows.
   MaxPool also on u8/s8 and bf16 tensors; the global pools read and write FP32 or bf16, in either layout; the
   average pools also INT8 in and out (channel-major, integer sums). NaN propagates as in torch (a window holding
   NaN gives NaN); FP32 averages add FP32 sums of 32 pixels in double. */
#include <stdint.h>
#include <math.h>

#include <stdlib.h>

#include "bf16.h"
#include "parallel.h"
#include "rounding.h"
#define CB 64        /* channels per block of the global pools */
#define GP_FLUSH 32  /* pixels a global average sums in FP32 before adding the sum in double */

/* The window loop of kiln_maxpool and its INT8 forms: `T` the element type, `LOWEST` its start value, `MAX(v, m)`
   the running maximum (a window with no pixel inside the image keeps LOWEST), `CW` the channels (c, or a constant
   equal to it: a byte loop of unknown length vectorizes for 64 and leaves 16-48 channels to scalar code). */
#define MAXPOOL_BODY(T, LOWEST, MAX, CW)                                                                    \
  _Pragma("omp parallel for schedule(static)")                                                            \
  for (int64_t line = 0; line < n * oh; ++line) {                                                         \
    const int64_t b = line / oh, oy = line % oh;                                                          \
    for (int64_t ox = 0; ox < ow; ++ox) {                                                                 \
      T* restrict out = y + (line * ow + ox) * c;                                                         \
      for (int64_t k = 0; k < (CW); ++k) out[k] = LOWEST;                                                 \
      for (int64_t i = 0; i < kh; ++i) {                                                                  \
        const int64_t yy = oy * sh - pt + i * dh;                                                         \
        if (yy < 0 || yy >= h) continue;                                                                  \
        for (int64_t j = 0; j < kw; ++j) {                                                                \
          const int64_t xx = ox * sw - pl + j * dw;                                                       \
          if (xx < 0 || xx >= w) continue;                                                                \
          const T* restrict src = x + ((b * h + yy) * w + xx) * c;                                        \
          _Pragma("omp simd")                                                                             \
          for (int64_t k = 0; k < (CW); ++k) out[k] = MAX(src[k], out[k]);                                \
        }                                                                                                 \
      }                                                                                                   \
    }                                                                                                     \
  }

#define FLOAT_MAX(v, m) (((v) > (m) || (v) != (v)) ? (v) : (m))
#define INT_MAX_OF(v, m) ((v) > (m) ? (v) : (m))
#define BF16_MAX(v, m) ((bf16_widen(v) > bf16_widen(m) || bf16_widen(v) != bf16_widen(v)) ? (v) : (m))
#define MAXPOOL_ARGS int64_t n, int64_t h, int64_t w, int64_t c, int64_t oh, int64_t ow, int64_t kh, int64_t kw, \
                     int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl

void kiln_maxpool(const float* restrict x, float* restrict y, MAXPOOL_ARGS) {
  MAXPOOL_BODY(float, -INFINITY, FLOAT_MAX, c)
}

/* INT8 tensors (after Q/DQ fusion a MaxPool between INT8 layers runs on the quantized values: the maximum commutes
   with a positive-scale quantization); common small channel counts compiled with constant widths (c=24, 56x56,
   3x3: 382 -> 42 us on one Zen 4 thread, FP32 133) */
#define INT8_MAXPOOL(NAME, T, LOWEST)                                                                       \
  void NAME(const T* restrict x, T* restrict y, MAXPOOL_ARGS) {                                             \
    switch (c) {                                                                                            \
      case 8: { MAXPOOL_BODY(T, LOWEST, INT_MAX_OF, 8) } break;                                             \
      case 16: { MAXPOOL_BODY(T, LOWEST, INT_MAX_OF, 16) } break;                                           \
      case 24: { MAXPOOL_BODY(T, LOWEST, INT_MAX_OF, 24) } break;                                           \
      case 32: { MAXPOOL_BODY(T, LOWEST, INT_MAX_OF, 32) } break;                                           \
      case 48: { MAXPOOL_BODY(T, LOWEST, INT_MAX_OF, 48) } break;                                           \
      default: { MAXPOOL_BODY(T, LOWEST, INT_MAX_OF, c) } break;                                            \
    }                                                                                                       \
  }

INT8_MAXPOOL(kiln_maxpool_u8, uint8_t, 0)
INT8_MAXPOOL(kiln_maxpool_s8, int8_t, -128)

/* bf16 tensors (between BF16 layers): the maximum of bf16 values is one of them, so the result is exact */
void kiln_maxpool_bf16(const uint16_t* restrict x, uint16_t* restrict y, MAXPOOL_ARGS) {
  MAXPOOL_BODY(uint16_t, 0xFF80u, BF16_MAX, c)   /* 0xFF80: -inf */
}

/* Runs the statements after AT for each tap of output pixel (b, oy, ox)'s window under kiln_avgpool's geometry g
   that lies inside the image, AT naming its pixel's element offset; adds to `count` the taps that count (inside
   the padded image with g[13], count_include_pad; inside the image without). */
#define FOR_EACH_TAP(g, b, oy, ox, count, AT, ...)                                                          \
  for (int64_t i_ = 0; i_ < (g)[3]; ++i_) {                                                                 \
    const int64_t yy_ = (oy) * (g)[5] - (g)[9] + i_ * (g)[7];                                               \
    if (yy_ >= (g)[0] + (g)[11]) break;   /* the ceil-mode overhang past the padding never counts */        \
    for (int64_t j_ = 0; j_ < (g)[4]; ++j_) {                                                               \
      const int64_t xx_ = (ox) * (g)[6] - (g)[10] + j_ * (g)[8];                                            \
      if (xx_ >= (g)[1] + (g)[12]) break;                                                                   \
      const int inside_ = yy_ >= 0 && yy_ < (g)[0] && xx_ >= 0 && xx_ < (g)[1];                             \
      (count) += inside_ || (g)[13];                                                                        \
      if (!inside_) continue;                                                                               \
      const int64_t AT = (((b) * (g)[0] + yy_) * (g)[1] + xx_) * (g)[2];                                    \
      __VA_ARGS__                                                                                           \
    }                                                                                                       \
  }

/* INT8 average pools (kiln.passes.qpool's QAveragePool: DequantizeLinear -> AveragePool / GlobalAveragePool /
   spatial ReduceMean -> QuantizeLinear, per-tensor): the taps' bytes summed in integers (exact); the mean of the
   dequantized taps divided by the output scale, in double, then taken as a float (QuantizeLinear's input type),
   saturated and rounded half to even as QuantizeLinear rounds (rounding.h). `q`: x_scale / y_scale, x_zero_point,
   y_zero_point, x signed, y signed. */
static inline __attribute__((always_inline)) void store_levels(const double* restrict centred, int64_t cb,
                                                              double scale, const double* q, void* y, int64_t at) {
  const int y_signed = q[4] != 0.0;
  const float zy = (float)q[2], lo = level_lo(y_signed, zy), hi = level_hi(y_signed, zy);
  if (y_signed) {
    int8_t* restrict out = (int8_t*)y + at;
    _Pragma("omp simd")
    for (int64_t k = 0; k < cb; ++k)
      out[k] = (int8_t)(int32_t)saturated_level((float)(centred[k] * scale), zy, lo, hi);
  } else {
    uint8_t* restrict out = (uint8_t*)y + at;
    _Pragma("omp simd")
    for (int64_t k = 0; k < cb; ++k)
      out[k] = (uint8_t)(int32_t)saturated_level((float)(centred[k] * scale), zy, lo, hi);
  }
}

/* Adds the cb bytes at x + at (s8 where `s8`) to acc. */
static inline __attribute__((always_inline)) void add_bytes(int32_t* restrict acc, const void* x, int64_t at,
                                                           int64_t cb, const int s8) {
  if (s8) {
    const int8_t* restrict src = (const int8_t*)x + at;
    _Pragma("omp simd")
    for (int64_t k = 0; k < cb; ++k) acc[k] += src[k];
  } else {
    const uint8_t* restrict src = (const uint8_t*)x + at;
    _Pragma("omp simd")
    for (int64_t k = 0; k < cb; ++k) acc[k] += src[k];
  }
}

/* kiln_avgpool's window (same geometry) on INT8 bytes: padded taps that count add the zero point's value, 0. */
static inline __attribute__((always_inline)) void avg_window_q8(const void* restrict x, void* restrict y,
    int64_t at_out, int64_t b, int64_t oy, int64_t ox, int64_t c0, int64_t cb, const int64_t* g, const double* q,
    const int s8) {
  int32_t acc[CB];
  double centred[CB];
  int64_t count = 0, inside_count = 0;
  for (int64_t k = 0; k < cb; ++k) acc[k] = 0;
  FOR_EACH_TAP(g, b, oy, ox, count, at, {
    ++inside_count;
    add_bytes(acc, x, at + c0, cb, s8);
  })
  const double centre = (double)inside_count * q[1];
  _Pragma("omp simd")
  for (int64_t k = 0; k < cb; ++k) centred[k] = (double)acc[k] - centre;
  store_levels(centred, cb, count ? q[0] / (double)count : NAN, q, y, at_out);
}

/* avg_window_q8 on `CHANNELS` channels, compiled for the input's signedness. */
#define Q8_WINDOW(CHANNELS) (s8 ? avg_window_q8(x, y, at, b, oy, ox, c0, CHANNELS, geometry, q, 1) \
                              : avg_window_q8(x, y, at, b, oy, ox, c0, CHANNELS, geometry, q, 0))

/* 2-D AveragePool on channel-major INT8 tensors (kiln_avgpool's geometry), OpenMP over output rows. */
void kiln_avgpool_q8(const void* restrict x, void* restrict y, int64_t n, int64_t oh, int64_t ow,
                     const int64_t* restrict geometry, const double* restrict q) {
  const int64_t c = geometry[2];
  const int s8 = q[3] != 0.0;
  MAYBE_PARALLEL(threads_pay(n * oh, n * oh * ow * c * geometry[3] * geometry[4]), {
    _Pragma("omp for schedule(static)")
    for (int64_t line = 0; line < n * oh; ++line) {
      const int64_t b = line / oh, oy = line % oh;
      for (int64_t ox = 0; ox < ow; ++ox)
        for (int64_t c0 = 0; c0 < c; c0 += CB) {
          const int64_t cb = c - c0 < CB ? c - c0 : CB, at = (line * ow + ox) * c + c0;
          if (cb == CB) Q8_WINDOW(CB);   /* blocks of common widths with fixed trip counts: sums in registers */
          else if (cb == 32) Q8_WINDOW(32);
          else if (cb == 24) Q8_WINDOW(24);
          else if (cb == 16) Q8_WINDOW(16);
          else Q8_WINDOW(cb);
        }
    }
  });
}

#undef Q8_WINDOW

#define Q8_FLUSH 65536   /* pixels summed in int32 before adding to int64: 65536 x 255 stays below 2^31 */

/* Pixels [p0, p1) of one image's channels [c0, c0 + cb) (at x + c0, c bytes a pixel) summed into sums[cb]: int32
   runs of Q8_FLUSH pixels added into int64. Inlined per width so that common widths keep their sums in registers. */
static inline __attribute__((always_inline)) void sum_pixels(int64_t* restrict sums, const void* x, int64_t p0,
                                                            int64_t p1, int64_t c, int64_t cb, const int s8) {
  int32_t run[CB];
  for (int64_t k = 0; k < cb; ++k) sums[k] = 0;
  for (int64_t q0 = p0; q0 < p1; q0 += Q8_FLUSH) {
    const int64_t q1 = q0 + Q8_FLUSH < p1 ? q0 + Q8_FLUSH : p1;
    for (int64_t k = 0; k < cb; ++k) run[k] = 0;
    for (int64_t p = q0; p < q1; ++p) add_bytes(run, x, p * c, cb, s8);
    for (int64_t k = 0; k < cb; ++k) sums[k] += run[k];
  }
}

#define SUM_PIXELS(WIDTH) \
  (s8 ? sum_pixels(sums, image, p0, p1, c, WIDTH, 1) : sum_pixels(sums, image, p0, p1, c, WIDTH, 0))

/* The mean over the hw pixels of n channel-major INT8 images of c channels, y[b][ch] (GlobalAveragePool). Units of
   (image, block of CB channels, segment of pixels), enough for two a thread; each leaves its block's sums in `part`,
   added per channel after. */
void kiln_global_avgpool_q8(const void* restrict x, void* restrict y, int64_t n, int64_t hw, int64_t c,
                            const double* restrict q) {
  if (n * c == 0) return;
  const int64_t blocks = (c + CB - 1) / CB, want = 2 * (int64_t)omp_get_max_threads();
  const int parallel = threads_pay(2, n * hw * c);   /* one thread: one segment, no partial sums to add */
  int64_t segs = !parallel || n * blocks >= want ? 1 : (want + n * blocks - 1) / (n * blocks);
  segs = segs < hw ? segs : (hw > 0 ? hw : 1);
  const int64_t per_seg = (hw + segs - 1) / segs;
  const int s8 = q[3] != 0.0;
  int64_t* part = malloc((size_t)(n * segs * c) * sizeof *part);
  if (!part) abort();
  MAYBE_PARALLEL(parallel && n * blocks * segs > 1, {
    _Pragma("omp for schedule(static)")
    for (int64_t t = 0; t < n * blocks * segs; ++t) {
      const int64_t s = t % segs, b = t / segs / blocks, c0 = t / segs % blocks * CB;
      const int64_t cb = c - c0 < CB ? c - c0 : CB, p0 = s * per_seg, p1 = p0 + per_seg < hw ? p0 + per_seg : hw;
      const uint8_t* image = (const uint8_t*)x + b * hw * c + c0;
      int64_t* sums = part + (b * segs + s) * c + c0;
      if (cb == CB) SUM_PIXELS(CB);
      else if (cb == 32) SUM_PIXELS(32);
      else if (cb == 24) SUM_PIXELS(24);
      else if (cb == 16) SUM_PIXELS(16);
      else SUM_PIXELS(cb);
    }
  });
  for (int64_t b = 0; b < n; ++b)
    for (int64_t c0 = 0; c0 < c; c0 += CB) {
      const int64_t cb = c - c0 < CB ? c - c0 : CB;
      double centred[CB];
      for (int64_t k = 0; k < cb; ++k) {
        int64_t sum = 0;
        for (int64_t s = 0; s < segs; ++s) sum += part[(b * segs + s) * c + c0 + k];
        centred[k] = (double)sum - (double)hw * q[1];
      }
      store_levels(centred, cb, hw ? q[0] / (double)hw : NAN, q, y, b * c + c0);
    }
  free(part);
}
#undef SUM_PIXELS

/* One output pixel's channels [c0, c0 + cb): the window's sum over the taps inside the image, times 1 / the count
   of taps that count (inside the padded image with `include_pad`, inside the image without). Inlined per storage
   combination so the conversions vectorize. */
static inline __attribute__((always_inline)) void avg_window(
    const void* restrict x, void* restrict y, int64_t at_out, int64_t b, int64_t oy, int64_t ox, int64_t c0,
    int64_t cb, const int64_t* g, const int src_bf16, const int dst_bf16) {
  float acc[CB];
  int64_t count = 0;
  for (int64_t k = 0; k < cb; ++k) acc[k] = 0.0f;
  FOR_EACH_TAP(g, b, oy, ox, count, at, {
    if (src_bf16) {
      const uint16_t* restrict src = (const uint16_t*)x + at + c0;
      _Pragma("omp simd")
      for (int64_t k = 0; k < cb; ++k) acc[k] += bf16_widen(src[k]);
    } else {
      const float* restrict src = (const float*)x + at + c0;
      _Pragma("omp simd")
      for (int64_t k = 0; k < cb; ++k) acc[k] += src[k];
    }
  })
  const float scale = count ? 1.0f / (float)count : NAN;   /* no tap counts: 0/0, as the reference gives */
  if (dst_bf16) {
    uint16_t* restrict out = (uint16_t*)y + at_out;
    _Pragma("omp simd")
    for (int64_t k = 0; k < cb; ++k) out[k] = bf16_narrow(acc[k] * scale);
  } else {
    float* restrict out = (float*)y + at_out;
    _Pragma("omp simd")
    for (int64_t k = 0; k < cb; ++k) out[k] = acc[k] * scale;
  }
}

#define AVGPOOL_LOOP(SRC_BF16, DST_BF16)                                                                     \
  MAYBE_PARALLEL(threads_pay(n * oh, n * oh * ow * c * geometry[3] * geometry[4]), {                        \
    _Pragma("omp for schedule(static)")                                                                     \
    for (int64_t line = 0; line < n * oh; ++line) {                                                         \
      const int64_t b = line / oh, oy = line % oh;                                                          \
      for (int64_t ox = 0; ox < ow; ++ox)                                                                   \
        for (int64_t c0 = 0; c0 < c; c0 += CB)                                                              \
          avg_window(x, y, (line * ow + ox) * c + c0, b, oy, ox, c0, c - c0 < CB ? c - c0 : CB, geometry,   \
                     SRC_BF16, DST_BF16);                                                                   \
    }                                                                                                       \
  })

/* 2-D AveragePool on channel-major tensors, FP32 or bf16 either side (`io`: bf16.h's bits);
   `geometry`: h, w, c, kh, kw, sh, sw, dh, dw, pt, pl, pb, pr, count_include_pad. OpenMP over output rows. */
void kiln_avgpool(const void* restrict x, void* restrict y, int64_t n, int64_t oh, int64_t ow,
                  const int64_t* restrict geometry, int64_t io) {
  const int64_t c = geometry[2];
  switch (io & (IO_X_BF16 | IO_Y_BF16)) {
    case 0: AVGPOOL_LOOP(0, 0); break;
    case IO_X_BF16: AVGPOOL_LOOP(1, 0); break;
    case IO_Y_BF16: AVGPOOL_LOOP(0, 1); break;
    default: AVGPOOL_LOOP(1, 1); break;
  }
}


static inline float gp_load_f32(const float* p, int64_t k) { return p[k]; }
static inline float gp_load_bf16(const uint16_t* p, int64_t k) { return bf16_widen(p[k]); }
static inline void gp_store_f32(float* p, int64_t k, float v) { p[k] = v; }
static inline void gp_store_bf16(uint16_t* p, int64_t k, float v) { p[k] = bf16_narrow(v); }

/* Channel-major: units of (image, block of CB channels, segment of pixels), each pixel's block read as a vector;
   a unit leaves its block's partial sums (or maxima) in `part`, which a second pass combines per channel. */
#define GLOBAL_POOL_NHWC(NAME, TIN, TOUT, LOAD, STORE)                                                       \
  static void NAME(const TIN* restrict x, TOUT* restrict y, int64_t n, int64_t hw, int64_t c, int mean,     \
                   int64_t segs, double* restrict part) {                                                   \
    const int64_t blocks = (c + CB - 1) / CB, units = n * blocks * segs, per_seg = (hw + segs - 1) / segs;  \
    MAYBE_PARALLEL(threads_pay(units, n * hw * c), {                                                        \
      _Pragma("omp for schedule(static)")                                                                   \
      for (int64_t t = 0; t < units; ++t) {                                                                 \
        const int64_t s = t % segs, b = t / segs / blocks, c0 = (t / segs % blocks) * CB;                   \
        const int64_t cb = c - c0 < CB ? c - c0 : CB;                                                       \
        const int64_t p0 = s * per_seg, p1 = p0 + per_seg < hw ? p0 + per_seg : hw;                         \
        double acc[CB];                                                                                     \
        float run[CB];                                                                                      \
        for (int64_t k = 0; k < cb; ++k) acc[k] = mean ? 0.0 : -INFINITY;                                   \
        for (int64_t q = p0; q < p1; q += GP_FLUSH) { /* FP32 sums of GP_FLUSH pixels, added up in double */\
          const int64_t q1 = q + GP_FLUSH < p1 ? q + GP_FLUSH : p1;                                         \
          for (int64_t k = 0; k < cb; ++k) run[k] = mean ? 0.0f : -INFINITY;                                \
          for (int64_t p = q; p < q1; ++p) {                                                                \
            const TIN* restrict src = x + (b * hw + p) * c + c0;                                            \
            if (mean) {                                                                                     \
              _Pragma("omp simd")                                                                           \
              for (int64_t k = 0; k < cb; ++k) run[k] += LOAD(src, k);                                      \
            } else {                                                                                        \
              _Pragma("omp simd")                                                                           \
              for (int64_t k = 0; k < cb; ++k) {                                                            \
                const float v = LOAD(src, k);                                                               \
                run[k] = (v > run[k] || v != v) ? v : run[k];                                               \
              }                                                                                             \
            }                                                                                               \
          }                                                                                                 \
          for (int64_t k = 0; k < cb; ++k)                                                                  \
            acc[k] = mean ? acc[k] + run[k] : ((run[k] > acc[k] || run[k] != run[k]) ? run[k] : acc[k]);    \
        }                                                                                                   \
        for (int64_t k = 0; k < cb; ++k) {                                                                  \
          if (segs == 1) STORE(y, b * c + c0 + k, (float)(mean ? acc[k] / (double)hw : acc[k]));            \
          else part[(b * segs + s) * c + c0 + k] = acc[k];                                                  \
        }                                                                                                   \
      }                                                                                                     \
    });                                                                                                     \
    for (int64_t b = 0; b < n && segs > 1; ++b)                                                             \
      for (int64_t ch = 0; ch < c; ++ch) {                                                                  \
        double r = part[b * segs * c + ch];                                                                 \
        for (int64_t s = 1; s < segs; ++s) {                                                                \
          const double v = part[(b * segs + s) * c + ch];                                                   \
          r = mean ? r + v : ((v > r || v != v) ? v : r);   /* a NaN, once in r, stays */                   \
        }                                                                                                   \
        STORE(y, b * c + ch, (float)(mean ? r / (double)hw : r));                                           \
      }                                                                                                     \
  }

/* Channel-planar: one row of hw pixels per image and channel. */
#define GLOBAL_POOL_NCHW(NAME, TIN, TOUT, LOAD, STORE)                                                       \
  static void NAME(const TIN* restrict x, TOUT* restrict y, int64_t rows, int64_t hw, int mean) {           \
    MAYBE_PARALLEL(threads_pay(rows, rows * hw), {                                                          \
      _Pragma("omp for schedule(static)")                                                                   \
      for (int64_t r = 0; r < rows; ++r) {                                                                  \
        const TIN* restrict src = x + r * hw;                                                               \
        double sum = 0.0;                                                                                   \
        float top = -INFINITY;                                                                              \
        if (mean) {                                                                                         \
          _Pragma("omp simd reduction(+:sum)")                                                              \
          for (int64_t p = 0; p < hw; ++p) sum += LOAD(src, p);                                             \
        } else {                                                                                            \
          for (int64_t p = 0; p < hw; ++p) {                                                                \
            const float v = LOAD(src, p);                                                                   \
            top = (v > top || v != v) ? v : top;                                                            \
          }                                                                                                 \
        }                                                                                                   \
        STORE(y, r, mean ? (float)(sum / (double)hw) : top);                                                \
      }                                                                                                     \
    });                                                                                                     \
  }

GLOBAL_POOL_NHWC(gp_nhwc_ff, float, float, gp_load_f32, gp_store_f32)
GLOBAL_POOL_NHWC(gp_nhwc_bf, uint16_t, float, gp_load_bf16, gp_store_f32)
GLOBAL_POOL_NHWC(gp_nhwc_fb, float, uint16_t, gp_load_f32, gp_store_bf16)
GLOBAL_POOL_NHWC(gp_nhwc_bb, uint16_t, uint16_t, gp_load_bf16, gp_store_bf16)
GLOBAL_POOL_NCHW(gp_nchw_ff, float, float, gp_load_f32, gp_store_f32)
GLOBAL_POOL_NCHW(gp_nchw_bf, uint16_t, float, gp_load_bf16, gp_store_f32)
GLOBAL_POOL_NCHW(gp_nchw_fb, float, uint16_t, gp_load_f32, gp_store_bf16)
GLOBAL_POOL_NCHW(gp_nchw_bb, uint16_t, uint16_t, gp_load_bf16, gp_store_bf16)

/* GlobalAveragePool (`mean`) or GlobalMaxPool over the hw pixels of n images of c channels, channel-major or
   (`planar`) channel-planar input; y[b][ch]. A window holding NaN gives NaN; means accumulate in double. */
void kiln_global_pool(const void* restrict x, void* restrict y, int64_t n, int64_t hw, int64_t c, int64_t mean,
                      int64_t io, int64_t planar) {
  const int m = (int)mean;
  if (n * c == 0) return;
  if (planar) {
    switch (io & (IO_X_BF16 | IO_Y_BF16)) {
      case 0: gp_nchw_ff(x, y, n * c, hw, m); break;
      case IO_X_BF16: gp_nchw_bf(x, y, n * c, hw, m); break;
      case IO_Y_BF16: gp_nchw_fb(x, y, n * c, hw, m); break;
      default: gp_nchw_bb(x, y, n * c, hw, m); break;
    }
    return;
  }
  /* pixel segments: enough units for every thread to get two where images x channel blocks give fewer */
  const int64_t blocks = (c + CB - 1) / CB, want = 2 * (int64_t)omp_get_max_threads();
  int64_t segs = n * blocks >= want ? 1 : (want + n * blocks - 1) / (n * blocks);
  segs = segs < hw ? segs : (hw > 0 ? hw : 1);
  double* part = segs > 1 ? malloc((size_t)(n * segs * c) * sizeof *part) : NULL;
  if (!part) segs = 1;   /* one segment writes y directly */
  switch (io & (IO_X_BF16 | IO_Y_BF16)) {
    case 0: gp_nhwc_ff(x, y, n, hw, c, m, segs, part); break;
    case IO_X_BF16: gp_nhwc_bf(x, y, n, hw, c, m, segs, part); break;
    case IO_Y_BF16: gp_nhwc_fb(x, y, n, hw, c, m, segs, part); break;
    default: gp_nhwc_bb(x, y, n, hw, c, m, segs, part); break;
  }
  free(part);
}
