/* Depthwise convolution on NHWC activations (kiln.tactics.depthwise_c): one group per channel and one output
   channel each, as MobileNet's and EfficientNet's 3x3 and 5x5 layers have them; any kernel size, stride, dilation
   and padding. Each output row is one unit of work. Pixels whose windows lie inside the image's columns go PX at a
   time, PX sums of one channel vector in registers and each tap's weights loaded once for all of them; the others
   (borders, a row's last few) one at a time over only their taps inside the image, CB channel vectors in flight.
   Zero padding adds nothing, so skipped taps are exact. A channel tail is a masked load. FP32 arithmetic; the input
   and the output FP32 or bf16 (`io` bits); bias, clamp (ReLU, Clip), then Swish or HardSwish as sums are stored. */
#include <stdint.h>
#include <string.h>

#include <immintrin.h>

#include "activation.h"
#include "parallel.h"
#include "simd.h"

#define PX 8   /* output pixels per register block inside the image */
#define CB 4   /* channel vectors per pixel at the borders */

typedef struct {
  const float* weights;   /* [taps][lanes]: channels padded to whole vectors with zeros */
  const float* bias;      /* [lanes], zeros where the layer has none */
  int64_t h, w, c, lanes, kh, kw, sh, sw, dh, dw, pt, pl, oh, ow, act, io;
  float lo, hi;           /* the clamp after the bias: ReLU (0, inf), Clip (min, max), none (-inf, inf) */
} DepthwiseCall;

/* x * clamp(x / 6 + 1/2, 0, 1): ONNX's HardSwish (alpha 1/6, beta 1/2). */
static inline vf v_hardswish(vf x) {
  const vf zero = {0}, one = zero + 1.0f;
  vf gate = x * (1.0f / 6.0f) + 0.5f;
  gate = v_select((vi)(gate < zero), zero, v_select((vi)(gate > one), one, gate));
  return x * gate;
}

static inline vf finish(vf v, const DepthwiseCall* g) {
  const vf lo = (vf){0} + g->lo, hi = (vf){0} + g->hi;
  v = v_select((vi)(v < lo), lo, v);   /* min(max(v, lo), hi), as ONNX's Clip: hi where lo > hi */
  v = v_select((vi)(v > hi), hi, v);
  if (g->act == ACT_SWISH) return v_silu(v);
  if (g->act == ACT_HARDSWISH) return v_hardswish(v);
  return v;
}

/* A vector of channels c0 .. c0 + n - 1 (n <= VW) from x[at] as FP32 (bf16 widened), lanes past n zero and never
   read: the last pixel's last channels end the tensor. */
static inline vf load_tail(const void* x, int64_t at, int64_t n, int bf16) {
  if (bf16) {
#if VW == 16 && defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), (const uint16_t*)x + at);
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
    vh h = {0};
    memcpy(&h, (const uint16_t*)x + at, sizeof(uint16_t) * (size_t)n);
    return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
  }
#if VW == 16
  return (vf)_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), (const float*)x + at);
#else
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return (vf)_mm256_maskload_ps((const float*)x + at, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lanes));
#endif
}

static inline vf load_full(const void* x, int64_t at, int bf16) {
  return bf16 ? (vf)(__builtin_convertvector(*(const vh*)((const uint16_t*)x + at), vu) << 16)
              : *(const vf*)((const float*)x + at);
}

/* `n` lanes of v (n < VW: a row's last channels) stored at y[at], FP32 or bf16. */
static inline void store_tail(void* y, int64_t at, vf v, int64_t n, int bf16) {
  for (int64_t k = 0; k < n; ++k) {
    if (bf16) ((uint16_t*)y)[at + k] = bf16_narrow(v[k]);
    else ((float*)y)[at + k] = v[k];
  }
}

static inline void store_lanes(void* y, int64_t at, vf v, int64_t n, int bf16) {
  if (n < VW) store_tail(y, at, v, n, bf16);
  else if (bf16) *(vh*)((uint16_t*)y + at) = v_bf16(v);
  else *(vf*)((float*)y + at) = v;
}

/* PX output pixels ox0 .. ox0 + PX - 1 of row `oy` (of image x), whose windows lie inside the image's columns, one
   vector of channels from c0 (`n` of them, VW where `full`): PX sums in registers, each tap's weights loaded once for
   all of them. */
static inline __attribute__((always_inline)) void
inside_block(const DepthwiseCall* g, const void* x, void* y, int64_t oy, int64_t ox0, int64_t c0, int64_t ky0,
             int64_t ky1, int64_t n, int full) {
  const int xb = g->io & IO_X_BF16;
  vf acc[PX];
  const vf bias = *(const vf*)(g->bias + c0);
#pragma GCC unroll 16
  for (int j = 0; j < PX; ++j) acc[j] = bias;
  const int64_t step = g->sw * g->c;
  for (int64_t ky = ky0; ky < ky1; ++ky) {
    const int64_t iy = oy * g->sh - g->pt + ky * g->dh;
    int64_t at = (iy * g->w + ox0 * g->sw - g->pl) * g->c + c0;
    const float* wk = g->weights + ky * g->kw * g->lanes + c0;
    for (int64_t kx = 0; kx < g->kw; ++kx, at += g->dw * g->c, wk += g->lanes) {
      const vf wv = *(const vf*)wk;
#pragma GCC unroll 16
      for (int j = 0; j < PX; ++j)
        acc[j] += (full ? load_full(x, at + j * step, xb) : load_tail(x, at + j * step, n, xb)) * wv;
    }
  }
  const int64_t out = (oy * g->ow + ox0) * g->c + c0;
#pragma GCC unroll 16
  for (int j = 0; j < PX; ++j) store_lanes(y, out + j * g->c, finish(acc[j], g), full ? VW : n, g->io & IO_Y_BF16);
}

/* One output pixel, every channel: only the taps inside the image (rows ky0 .. ky1 - 1, columns kx0 .. kx1 - 1),
   CB channel vectors at a time so that CB sums are in flight; the last vector may be partial. */
static void pixel(const DepthwiseCall* g, const void* x, void* y, int64_t oy, int64_t ox, int64_t ky0, int64_t ky1) {
  const int xb = g->io & IO_X_BF16, yb = g->io & IO_Y_BF16;
  int64_t kx0 = 0, kx1 = g->kw;
  while (kx0 < kx1 && ox * g->sw - g->pl + kx0 * g->dw < 0) ++kx0;
  while (kx1 > kx0 && ox * g->sw - g->pl + (kx1 - 1) * g->dw >= g->w) --kx1;
  const int64_t whole = g->c / VW * VW, out = (oy * g->ow + ox) * g->c;
  int64_t c0 = 0;
  for (; c0 + CB * VW <= whole; c0 += CB * VW) {
    vf acc[CB];
#pragma GCC unroll 8
    for (int b = 0; b < CB; ++b) acc[b] = *(const vf*)(g->bias + c0 + b * VW);
    for (int64_t ky = ky0; ky < ky1; ++ky)
      for (int64_t kx = kx0; kx < kx1; ++kx) {
        const int64_t at = ((oy * g->sh - g->pt + ky * g->dh) * g->w + ox * g->sw - g->pl + kx * g->dw) * g->c + c0;
        const float* wk = g->weights + (ky * g->kw + kx) * g->lanes + c0;
#pragma GCC unroll 8
        for (int b = 0; b < CB; ++b) acc[b] += load_full(x, at + b * VW, xb) * *(const vf*)(wk + b * VW);
      }
#pragma GCC unroll 8
    for (int b = 0; b < CB; ++b) store_lanes(y, out + c0 + b * VW, finish(acc[b], g), VW, yb);
  }
  for (; c0 < g->c; c0 += VW) {   /* the vectors left over, the partial one last */
    const int64_t n = g->c - c0 < VW ? g->c - c0 : VW;
    vf acc = *(const vf*)(g->bias + c0);
    for (int64_t ky = ky0; ky < ky1; ++ky)
      for (int64_t kx = kx0; kx < kx1; ++kx) {
        const int64_t at = ((oy * g->sh - g->pt + ky * g->dh) * g->w + ox * g->sw - g->pl + kx * g->dw) * g->c + c0;
        const vf v = n == VW ? load_full(x, at, xb) : load_tail(x, at, n, xb);
        acc += v * *(const vf*)(g->weights + (ky * g->kw + kx) * g->lanes + c0);
      }
    store_lanes(y, out + c0, finish(acc, g), n, yb);
  }
}

/* Output row `oy` of one image: the columns whose windows lie inside the image's columns PX at a time, the others
   (at the borders, and short of PX at the end) pixel by pixel. */
static void output_row(const DepthwiseCall* g, const void* x, void* y, int64_t oy) {
  int64_t ky0 = 0, ky1 = g->kh;   /* the kernel rows inside the image */
  while (ky0 < ky1 && oy * g->sh - g->pt + ky0 * g->dh < 0) ++ky0;
  while (ky1 > ky0 && oy * g->sh - g->pt + (ky1 - 1) * g->dh >= g->h) --ky1;
  const int64_t first = (g->pl + g->sw - 1) / g->sw;   /* the first column whose window starts inside */
  const int64_t reach = (g->kw - 1) * g->dw - g->pl;   /* the last tap's offset from ox * sw */
  const int64_t last = g->w - 1 - reach < 0 ? -1 : (g->w - 1 - reach) / g->sw;
  const int64_t whole = g->c / VW * VW;
  int64_t ox = 0;
  while (ox < g->ow) {
    if (ox >= first && ox + PX - 1 <= last) {
      for (int64_t c0 = 0; c0 < whole; c0 += VW) inside_block(g, x, y, oy, ox, c0, ky0, ky1, VW, 1);
      if (whole < g->c) inside_block(g, x, y, oy, ox, whole, ky0, ky1, g->c - whole, 0);
      ox += PX;
    } else {
      pixel(g, x, y, oy, ox, ky0, ky1);
      ox += 1;
    }
  }
}

void kiln_depthwise(const DepthwiseCall* g, const void* x, void* y, int64_t batch) {
  if (batch <= 0 || g->oh <= 0 || g->ow <= 0) return;
  const size_t in_size = g->io & IO_X_BF16 ? 2 : 4, out_size = g->io & IO_Y_BF16 ? 2 : 4;
  const int64_t units = batch * g->oh, image = g->h * g->w * g->c, out_image = g->oh * g->ow * g->c;
  MAYBE_PARALLEL(threads_pay(units, units * g->ow * g->c * g->kh * g->kw), {
    _Pragma("omp for schedule(static)")
    for (int64_t u = 0; u < units; ++u) {
      const int64_t b = u / g->oh;
      output_row(g, (const char*)x + b * image * (int64_t)in_size, (char*)y + b * out_image * (int64_t)out_size,
                 u % g->oh);
    }
  });
}
