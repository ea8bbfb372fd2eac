/* Reformat copies between row-major (NCHW) and channel-major (NHWC) float32 layouts (kiln.tactics.reformat). */
#include <stdint.h>
#define TB 64   /* pixels (and channels) per block */

/* NCHW -> NHWC: y[b][p][ch] = x[b][ch][p]. Each source row (one channel) is read straight; the writes are
   strided by the (few) channels, whose lines stay in L1 across the block of pixels. */
void kiln_to_nhwc(const float* restrict x, float* restrict y, int64_t n, int64_t c, int64_t hw) {
  const int64_t blocks = (hw + TB - 1) / TB;
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n * blocks; ++t) {
    const int64_t b = t / blocks, p0 = (t % blocks) * TB, p1 = p0 + TB < hw ? p0 + TB : hw;
    for (int64_t ch = 0; ch < c; ++ch) {
      const float* restrict src = x + (b * c + ch) * hw;
      float* restrict dst = y + b * hw * c + ch;
      for (int64_t p = p0; p < p1; ++p) dst[p * c] = src[p];
    }
  }
}

/* NHWC -> NCHW: y[b][ch][p] = x[b][p][ch], TB x TB blocks, each output row written straight. */
void kiln_to_nchw(const float* restrict x, float* restrict y, int64_t n, int64_t c, int64_t hw) {
  const int64_t blocks = (c + TB - 1) / TB;
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n * blocks; ++t) {
    const int64_t b = t / blocks, c0 = (t % blocks) * TB, c1 = c0 + TB < c ? c0 + TB : c;
    const float* restrict src = x + b * hw * c;
    float* restrict dst = y + b * c * hw;
    for (int64_t p0 = 0; p0 < hw; p0 += TB) {
      const int64_t p1 = p0 + TB < hw ? p0 + TB : hw;
      for (int64_t ch = c0; ch < c1; ++ch) {
        #pragma omp simd
        for (int64_t p = p0; p < p1; ++p) dst[ch * hw + p] = src[p * c + ch];
      }
    }
  }
}
