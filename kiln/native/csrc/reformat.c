/* Reformat copies between row-major (NCHW) and channel-major (NHWC) float32 layouts (kiln.tactics.reformat): each
   image is a matrix transposed, [c][hw] <-> [hw][c], VW x VW blocks at a time through registers (simd.h's
   transpose_block), the edges element by element. Units are blocks of TB pixels, shared among the threads. */
#include <stdint.h>
#include <string.h>

#include "parallel.h"
#include "simd.h"

#define TB 64   /* pixels per work unit */
/* threads_pay weighs work in multiply-adds: an element moved through a register transpose costs about as much as
   this many, so copies of more than ~4,000 elements are shared among the threads. */
#define MACS_PER_ELEMENT 16

/* dst[j * ld + i] = src[i * ls + j] for i < rows, j < cols. */
static void transpose_tile(const float* restrict src, int64_t ls, float* restrict dst, int64_t ld, int64_t rows,
                           int64_t cols) {
  int64_t i0 = 0;
  for (; i0 + VW <= rows; i0 += VW) {
    int64_t j0 = 0;
    for (; j0 + VW <= cols; j0 += VW) {
      vword t[VW];
      for (int r = 0; r < VW; ++r) t[r] = *(const vword*)(src + (i0 + r) * ls + j0);
      transpose_block(t);
      for (int r = 0; r < VW; ++r) *(vword*)(dst + (j0 + r) * ld + i0) = t[r];
    }
    for (; j0 < cols; ++j0)
      for (int r = 0; r < VW; ++r) dst[j0 * ld + i0 + r] = src[(i0 + r) * ls + j0];
  }
  for (; i0 < rows; ++i0)
    for (int64_t j = 0; j < cols; ++j) dst[j * ld + i0] = src[i0 * ls + j];
}

/* Each image's [rows][cols] matrix transposed into [cols][rows], in units of TB along `pixels_are_rows`' axis. */
static void transpose_images(const float* x, float* y, int64_t n, int64_t rows, int64_t cols, int pixels_are_rows) {
  const int64_t pixels = pixels_are_rows ? rows : cols, blocks = (pixels + TB - 1) / TB;
  MAYBE_PARALLEL(threads_pay(n * blocks, n * rows * cols * MACS_PER_ELEMENT), {
    _Pragma("omp for schedule(static)")
    for (int64_t t = 0; t < n * blocks; ++t) {
      const int64_t b = t / blocks, p0 = (t % blocks) * TB, np = pixels - p0 < TB ? pixels - p0 : TB;
      const float* src = x + b * rows * cols;
      float* dst = y + b * rows * cols;
      if (pixels_are_rows)
        transpose_tile(src + p0 * cols, cols, dst + p0, rows, np, cols);
      else
        transpose_tile(src + p0, cols, dst + p0 * rows, rows, rows, np);
    }
  });
}

/* NCHW -> NHWC: y[b][p][ch] = x[b][ch][p]. */
void kiln_to_nhwc(const float* restrict x, float* restrict y, int64_t n, int64_t c, int64_t hw) {
  transpose_images(x, y, n, c, hw, 0);
}

/* NHWC -> NCHW: y[b][ch][p] = x[b][p][ch]. */
void kiln_to_nchw(const float* restrict x, float* restrict y, int64_t n, int64_t c, int64_t hw) {
  transpose_images(x, y, n, hw, c, 1);
}
