/* 1x1 convolution on row-major (NCHW) activations with few output channels (kiln.tactics.conv_planes): each output
   plane is a weighted sum of the input planes, y[o][p] = bias[o] + sum_c w[o][c] * x[c][p], computed VW pixels at a
   time for up to OB output channels in registers, the input planes read along their rows. A detector's DFL
   expectation (16 -> 1 channel over [4, 8400]) or a segmentation head's last layer then needs no reformat into
   channel-major order and no GEMM packing. FP32 arithmetic; input and output FP32 or bf16 (`io` bits). */
#include <stdint.h>
#include <string.h>

#include "parallel.h"
#include "simd.h"

#define OB 8             /* output channels per register block */
#define PB (2 * VW)      /* pixels per register block */
#define UNIT_PIXELS 512  /* pixels per work unit */

typedef struct {
  int64_t cin, cout, hw, relu, io;
} PlaneCall;

static inline vf load_pixels(const void* x, int64_t at, int bf16) {
  if (!bf16) {
    vf v;
    memcpy(&v, (const float*)x + at, sizeof v);
    return v;
  }
  vh h;
  memcpy(&h, (const uint16_t*)x + at, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}

static inline void store_pixels(void* y, int64_t at, vf v, int bf16) {
  if (!bf16) {
    memcpy((float*)y + at, &v, sizeof v);
    return;
  }
  const vh h = v_bf16(v);
  memcpy((uint16_t*)y + at, &h, sizeof h);
}

static inline float load_one(const void* x, int64_t at, int bf16) {
  return bf16 ? bf16_widen(((const uint16_t*)x)[at]) : ((const float*)x)[at];
}

static inline void store_one(void* y, int64_t at, float v, int bf16) {
  if (bf16) ((uint16_t*)y)[at] = bf16_narrow(v);
  else ((float*)y)[at] = v;
}

/* Pixels [p0, p1) of one image: whole PB blocks in registers, the rest one pixel at a time. */
static void planes(const PlaneCall* c, const void* x, const float* w, const float* bias, void* y, int64_t p0,
                   int64_t p1) {
  const int xb = c->io & IO_X_BF16, yb = c->io & IO_Y_BF16;
  int64_t p = p0;
  for (; p + PB <= p1; p += PB)
    for (int64_t o0 = 0; o0 < c->cout; o0 += OB) {
      const int64_t ob = c->cout - o0 < OB ? c->cout - o0 : OB;
      vf acc[OB][2];
      for (int64_t o = 0; o < ob; ++o) acc[o][0] = acc[o][1] = (vf){0} + (bias ? bias[o0 + o] : 0.0f);
      for (int64_t ci = 0; ci < c->cin; ++ci) {
        const vf a = load_pixels(x, ci * c->hw + p, xb), b = load_pixels(x, ci * c->hw + p + VW, xb);
        const float* wc = w + o0 * c->cin + ci;
        for (int64_t o = 0; o < ob; ++o) {
          acc[o][0] += wc[o * c->cin] * a;
          acc[o][1] += wc[o * c->cin] * b;
        }
      }
      for (int64_t o = 0; o < ob; ++o)
        for (int k = 0; k < 2; ++k) {
          vf v = acc[o][k];
          if (c->relu) v = v_max(v, (vf){0});
          store_pixels(y, (o0 + o) * c->hw + p + k * VW, v, yb);
        }
    }
  for (; p < p1; ++p)
    for (int64_t o = 0; o < c->cout; ++o) {
      float s = bias ? bias[o] : 0.0f;
      for (int64_t ci = 0; ci < c->cin; ++ci) s += w[o * c->cin + ci] * load_one(x, ci * c->hw + p, xb);
      store_one(y, o * c->hw + p, c->relu && s < 0.0f ? 0.0f : s, yb);
    }
}

void kiln_conv_planes(const PlaneCall* c, const void* x, const float* w, const float* bias, void* y, int64_t batch) {
  if (batch <= 0 || c->hw <= 0) return;
  const int64_t per_image = (c->hw + UNIT_PIXELS - 1) / UNIT_PIXELS, units = batch * per_image;
  const size_t in_size = c->io & IO_X_BF16 ? 2 : 4, out_size = c->io & IO_Y_BF16 ? 2 : 4;
  MAYBE_PARALLEL(threads_pay(units, batch * c->hw * c->cin * c->cout), {
    _Pragma("omp for schedule(static)")
    for (int64_t u = 0; u < units; ++u) {
      const int64_t n = u / per_image, p0 = u % per_image * UNIT_PIXELS;
      const int64_t p1 = p0 + UNIT_PIXELS < c->hw ? p0 + UNIT_PIXELS : c->hw;
      planes(c, (const char*)x + n * c->cin * c->hw * in_size, w, bias,
             (char*)y + n * c->cout * c->hw * out_size, p0, p1);
    }
  });
}
