/* Resize on channel-major (NHWC) activations (kiln.tactics.resize_c), from tables computed at load: nearest copies
   one input pixel's channels per output pixel; linear and cubic sum taps (input pixels times weights: rows x cols
   of them, FP32 accumulation), reading and writing FP32 or bf16, or INT8 in and out; a one-channel map (a
   row-major tensor's plane) separably, columns then rows. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "parallel.h"
#include "rounding.h"

/* Any element type: each pixel's channels are `pixel_bytes` bytes (FP32 or bf16 maps alike); output pixels are
   `y_step` bytes apart (pixel_bytes, or a wider tensor's pixel where y is a channel slice of it). */
void kiln_resize_nearest(const char* restrict x, char* restrict y, int64_t n, int64_t h, int64_t w,
                         int64_t pixel_bytes, int64_t oh, int64_t ow, const int64_t* restrict rows,
                         const int64_t* restrict cols, int64_t y_step) {
  #pragma omp parallel for schedule(static)
  for (int64_t line = 0; line < n * oh; ++line) {
    const char* restrict src = x + ((line / oh) * h + rows[line % oh]) * w * pixel_bytes;
    char* restrict dst = y + line * ow * y_step;
    for (int64_t ox = 0; ox < ow; ++ox) memcpy(dst + ox * y_step, src + cols[ox] * pixel_bytes, pixel_bytes);
  }
}

#define CHANNEL_BLOCK 64   /* channels accumulated at a time: 4 AVX-512 registers of FP32 */

/* A resampling geometry: per output row and column, `taps` input indices and their weights. */
typedef struct {
  int64_t h, w, c, oh, ow, row_taps, col_taps;
  const int64_t* rows;
  const float* row_weights;
  const int64_t* cols;
  const float* col_weights;
} Taps;

/* One one-channel map (a row-major tensor's plane), separably: every input row resampled along the columns into
   `rows_tmp` [h][ow] (and one row of sums after them), then each output row a weighted sum of its taps' rows
   (both loops vectorize along ox). */
static inline __attribute__((always_inline)) void taps_plane(const void* x, void* y, const Taps* t, int64_t plane,
                                                              float* rows_tmp, int x_bf16, int y_bf16) {
  for (int64_t iy = 0; iy < t->h; ++iy) {
    const int64_t row = (plane * t->h + iy) * t->w;
    for (int64_t ox = 0; ox < t->ow; ++ox) {
      float sum = 0.0f;
      for (int64_t j = 0; j < t->col_taps; ++j) {
        const int64_t at = row + t->cols[ox * t->col_taps + j];
        sum += t->col_weights[ox * t->col_taps + j] *
               (x_bf16 ? bf16_widen(((const uint16_t*)x)[at]) : ((const float*)x)[at]);
      }
      rows_tmp[iy * t->ow + ox] = sum;
    }
  }
  float* acc = rows_tmp + t->h * t->ow;
  for (int64_t oy = 0; oy < t->oh; ++oy) {
    const int64_t out = (plane * t->oh + oy) * t->ow;
    for (int64_t ox = 0; ox < t->ow; ++ox) acc[ox] = 0.0f;
    for (int64_t i = 0; i < t->row_taps; ++i) {
      const float weight = t->row_weights[oy * t->row_taps + i];
      const float* restrict src = rows_tmp + t->rows[oy * t->row_taps + i] * t->ow;
      for (int64_t ox = 0; ox < t->ow; ++ox) acc[ox] += weight * src[ox];
    }
    if (y_bf16) {
      for (int64_t ox = 0; ox < t->ow; ++ox) ((uint16_t*)y)[out + ox] = bf16_narrow(acc[ox]);
    } else {
      memcpy((float*)y + out, acc, t->ow * sizeof(float));
    }
  }
}

static void taps_planes(const void* x, void* y, const Taps* t, int64_t planes, int x_bf16, int y_bf16) {
  const int parallel = threads_pay(planes, planes * t->oh * t->ow * (t->row_taps + t->col_taps));
  MAYBE_PARALLEL(parallel, {
    float* rows_tmp = malloc((t->h + 1) * t->ow * sizeof(float));   /* + one output row's sums */
    _Pragma("omp for schedule(static)")
    for (int64_t plane = 0; plane < planes; ++plane) {
      if (x_bf16 && y_bf16) taps_plane(x, y, t, plane, rows_tmp, 1, 1);
      else if (x_bf16) taps_plane(x, y, t, plane, rows_tmp, 1, 0);
      else if (y_bf16) taps_plane(x, y, t, plane, rows_tmp, 0, 1);
      else taps_plane(x, y, t, plane, rows_tmp, 0, 0);
    }
    free(rows_tmp);
  });
}

/* Element kinds taps_line reads and writes: FP32, bf16, or INT8 bytes (u8, s8) centred on and quantized at
   `q`'s zero points. */
enum { KIND_F32, KIND_BF16, KIND_U8, KIND_S8 };

/* One output row's pixels: per block of channels, the weighted taps summed in FP32, then stored as `out_kind`
   (INT8: times x_scale / y_scale, saturated and rounded half to even as QuantizeLinear rounds; rounding.h).
   `q` (INT8 only): x_scale / y_scale, x_zero_point, y_zero_point. */
static inline __attribute__((always_inline)) void taps_line(const void* x, void* y, const Taps* t, int64_t line,
                                                             const int in_kind, const int out_kind, const double* q) {
  const int64_t b = line / t->oh, oy = line % t->oh;
  const int64_t* rows = t->rows + oy * t->row_taps;
  const float* row_w = t->row_weights + oy * t->row_taps;
  const float ratio = q ? (float)q[0] : 1.0f, zx = q ? (float)q[1] : 0.0f, zy = q ? (float)q[2] : 0.0f;
  const float lo = level_lo(out_kind == KIND_S8, zy), hi = level_hi(out_kind == KIND_S8, zy);
  for (int64_t ox = 0; ox < t->ow; ++ox) {
    const int64_t* cols = t->cols + ox * t->col_taps;
    const float* col_w = t->col_weights + ox * t->col_taps;
    const int64_t out = (line * t->ow + ox) * t->c;
    for (int64_t c0 = 0; c0 < t->c; c0 += CHANNEL_BLOCK) {
      const int64_t cn = t->c - c0 < CHANNEL_BLOCK ? t->c - c0 : CHANNEL_BLOCK;
      float acc[CHANNEL_BLOCK] = {0};
      for (int64_t i = 0; i < t->row_taps; ++i) {
        const int64_t row = (b * t->h + rows[i]) * t->w;
        for (int64_t j = 0; j < t->col_taps; ++j) {
          const float weight = row_w[i] * col_w[j];
          const int64_t at = (row + cols[j]) * t->c + c0;
          if (in_kind == KIND_BF16) {
            const uint16_t* src = (const uint16_t*)x + at;
            for (int64_t k = 0; k < cn; ++k) acc[k] += weight * bf16_widen(src[k]);
          } else if (in_kind == KIND_U8) {
            const uint8_t* src = (const uint8_t*)x + at;
            for (int64_t k = 0; k < cn; ++k) acc[k] += weight * ((float)src[k] - zx);
          } else if (in_kind == KIND_S8) {
            const int8_t* src = (const int8_t*)x + at;
            for (int64_t k = 0; k < cn; ++k) acc[k] += weight * ((float)src[k] - zx);
          } else {
            const float* src = (const float*)x + at;
            for (int64_t k = 0; k < cn; ++k) acc[k] += weight * src[k];
          }
        }
      }
      if (out_kind == KIND_BF16)
        for (int64_t k = 0; k < cn; ++k) ((uint16_t*)y)[out + c0 + k] = bf16_narrow(acc[k]);
      else if (out_kind == KIND_U8)
        for (int64_t k = 0; k < cn; ++k)
          ((uint8_t*)y)[out + c0 + k] = (uint8_t)(int32_t)saturated_level(acc[k] * ratio, zy, lo, hi);
      else if (out_kind == KIND_S8)
        for (int64_t k = 0; k < cn; ++k)
          ((int8_t*)y)[out + c0 + k] = (int8_t)(int32_t)saturated_level(acc[k] * ratio, zy, lo, hi);
      else
        memcpy((float*)y + out + c0, acc, cn * sizeof(float));
    }
  }
}

/* Linear or cubic Resize of the two spatial axes: y[b, oy, ox, :] = sum over i, j of row_weights[oy][i] *
   col_weights[ox][j] * x[b, rows[oy][i], cols[ox][j], :]. `io` holds IO_X_BF16 / IO_Y_BF16. */
void kiln_resize_taps(const void* x, void* y, int64_t n, int64_t h, int64_t w, int64_t c, int64_t oh, int64_t ow,
                      int64_t row_taps, const int64_t* rows, const float* row_weights, int64_t col_taps,
                      const int64_t* cols, const float* col_weights, int64_t io) {
  const Taps t = {h, w, c, oh, ow, row_taps, col_taps, rows, row_weights, cols, col_weights};
  const int x_bf16 = (io & IO_X_BF16) != 0, y_bf16 = (io & IO_Y_BF16) != 0;
  if (c == 1) {
    taps_planes(x, y, &t, n, x_bf16, y_bf16);
    return;
  }
  const int parallel = threads_pay(n * oh, n * oh * ow * c * row_taps * col_taps);
  MAYBE_PARALLEL(parallel, {
    _Pragma("omp for schedule(static)")
    for (int64_t line = 0; line < n * oh; ++line) {
      if (x_bf16 && y_bf16) taps_line(x, y, &t, line, KIND_BF16, KIND_BF16, 0);
      else if (x_bf16) taps_line(x, y, &t, line, KIND_BF16, KIND_F32, 0);
      else if (y_bf16) taps_line(x, y, &t, line, KIND_F32, KIND_BF16, 0);
      else taps_line(x, y, &t, line, KIND_F32, KIND_F32, 0);
    }
  });
}

/* kiln_resize_taps on channel-major INT8 maps (kiln.passes.qpool's QResize: DequantizeLinear -> linear or cubic
   Resize -> QuantizeLinear, per-tensor): each tap's byte less the input zero point, weighted and summed in FP32,
   then quantized as taps_line says. `q`: x_scale / y_scale, x_zero_point, y_zero_point, x signed, y signed. */
void kiln_resize_taps_q8(const void* x, void* y, int64_t n, int64_t h, int64_t w, int64_t c, int64_t oh, int64_t ow,
                         int64_t row_taps, const int64_t* rows, const float* row_weights, int64_t col_taps,
                         const int64_t* cols, const float* col_weights, const double* q) {
  const Taps t = {h, w, c, oh, ow, row_taps, col_taps, rows, row_weights, cols, col_weights};
  const int x_s8 = q[3] != 0.0, y_s8 = q[4] != 0.0;
  MAYBE_PARALLEL(threads_pay(n * oh, n * oh * ow * c * row_taps * col_taps), {
    _Pragma("omp for schedule(static)")
    for (int64_t line = 0; line < n * oh; ++line) {
      if (x_s8 && y_s8) taps_line(x, y, &t, line, KIND_S8, KIND_S8, q);
      else if (x_s8) taps_line(x, y, &t, line, KIND_S8, KIND_U8, q);
      else if (y_s8) taps_line(x, y, &t, line, KIND_U8, KIND_S8, q);
      else taps_line(x, y, &t, line, KIND_U8, KIND_U8, q);
    }
  });
}
