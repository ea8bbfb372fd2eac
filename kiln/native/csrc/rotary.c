/* kiln's RotaryEmbedding layer (kiln.tactics.rotary_c): y = x·cos + rotate_half(x)·sin along the last axis, d wide,
   rotate_half(x) = [-x[d/2:], x[:d/2]] (the half-split form of HF's LLaMA, Mistral, Qwen2, GPT-NeoX; the pass
   kiln.passes.rotary). x and y are row-major rows of d; cos and sin rows are found through the element strides of
   x's leading axes (0 where a table broadcasts: one row for every head). x, y, cos and sin each FP32 or bf16 as
   the plan stores them; the arithmetic is FP32, rounded once where y is bf16. OpenMP over the outer axes. */
#include <omp.h>
#include <stdint.h>

#include "bf16.h"
#include "parallel.h"

#define ROT_COS_BF16 4   /* RotaryCall.io, above bf16.h's IO_X_BF16 and IO_Y_BF16 */
#define ROT_SIN_BF16 8
#define ROT_LEAD 4       /* leading axes, outer first; 1 where x has fewer */
#define ROT_MAX_D 1024   /* widest row: staged on the stack */

/* kiln.tactics.rotary_c.RotaryCall mirrors it field by field. */
typedef struct {
  int64_t lead[ROT_LEAD];
  int64_t cos_st[ROT_LEAD], sin_st[ROT_LEAD];
  int64_t d, io;
} RotaryCall;

/* n values from p (FP32 or bf16) into FP32 f. */
static inline void widen(const void* p, int bf16, int64_t n, float* restrict f) {
  if (bf16) {
    for (int64_t j = 0; j < n; ++j) f[j] = bf16_widen(((const uint16_t*)p)[j]);
  } else {
    for (int64_t j = 0; j < n; ++j) f[j] = ((const float*)p)[j];
  }
}

/* One row: x, cos, sin widened where bf16, the arithmetic in FP32, y stored in its type. */
static void rotate_row(const RotaryCall* c, const void* x, const void* cs, const void* sn, void* y) {
  const int64_t d = c->d, h = d / 2;
  float xs[ROT_MAX_D], cf[ROT_MAX_D], sf[ROT_MAX_D], out[ROT_MAX_D];
  const float* restrict xr = (c->io & IO_X_BF16) ? (widen(x, 1, d, xs), xs) : (const float*)x;
  const float* restrict co = (c->io & ROT_COS_BF16) ? (widen(cs, 1, d, cf), cf) : (const float*)cs;
  const float* restrict si = (c->io & ROT_SIN_BF16) ? (widen(sn, 1, d, sf), sf) : (const float*)sn;
  float* restrict o = (c->io & IO_Y_BF16) ? out : (float*)y;
  for (int64_t j = 0; j < h; ++j) o[j] = xr[j] * co[j] - xr[j + h] * si[j];
  for (int64_t j = h; j < d; ++j) o[j] = xr[j] * co[j] + xr[j - h] * si[j];
  if (c->io & IO_Y_BF16)
    for (int64_t j = 0; j < d; ++j) ((uint16_t*)y)[j] = bf16_narrow(out[j]);
}

void kiln_rotary(const RotaryCall* c, const void* x, const void* cos, const void* sin, void* y) {
  const int64_t d = c->d, outer = c->lead[0] * c->lead[1] * c->lead[2], rows = c->lead[3];
  const size_t xsize = (c->io & IO_X_BF16) ? 2 : 4, ysize = (c->io & IO_Y_BF16) ? 2 : 4;
  const size_t csize = (c->io & ROT_COS_BF16) ? 2 : 4, ssize = (c->io & ROT_SIN_BF16) ? 2 : 4;
  MAYBE_PARALLEL(threads_pay(outer, outer * rows * d), {
    _Pragma("omp for schedule(static)")
    for (int64_t u = 0; u < outer; ++u) {
      const int64_t i2 = u % c->lead[2], i1 = u / c->lead[2] % c->lead[1], i0 = u / c->lead[2] / c->lead[1];
      const int64_t cos_at = i0 * c->cos_st[0] + i1 * c->cos_st[1] + i2 * c->cos_st[2];
      const int64_t sin_at = i0 * c->sin_st[0] + i1 * c->sin_st[1] + i2 * c->sin_st[2];
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = u * rows + r;
        rotate_row(c, (const char*)x + row * d * xsize, (const char*)cos + (cos_at + r * c->cos_st[3]) * csize,
                   (const char*)sin + (sin_at + r * c->sin_st[3]) * ssize, (char*)y + row * d * ysize);
      }
    }
  });
}
