/* Nearest-neighbour Resize on channel-major (NHWC) activations (kiln.tactics.resize_c): every output pixel is
   one copy of an input pixel's channels, chosen by index tables computed at load. */
#include <stdint.h>
#include <string.h>

void kiln_resize_nearest(const float* restrict x, float* restrict y, int64_t n, int64_t h, int64_t w, int64_t c,
                         int64_t oh, int64_t ow, const int64_t* restrict rows, const int64_t* restrict cols) {
  #pragma omp parallel for schedule(static)
  for (int64_t line = 0; line < n * oh; ++line) {
    const float* restrict src = x + ((line / oh) * h + rows[line % oh]) * w * c;
    float* restrict dst = y + line * ow * c;
    for (int64_t ox = 0; ox < ow; ++ox) memcpy(dst + ox * c, src + cols[ox] * c, sizeof(float) * c);
  }
}
