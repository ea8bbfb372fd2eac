/* Nearest-neighbour Resize on channel-major (NHWC) activations (kiln.tactics.resize_c): every output pixel is
   one copy of an input pixel's channels, chosen by index tables computed at load; FP32 or bf16 alike. */
#include <stdint.h>
#include <string.h>

/* Any element type: each pixel's channels are `pixel_bytes` bytes (FP32 or bf16 maps alike). */
void kiln_resize_nearest(const char* restrict x, char* restrict y, int64_t n, int64_t h, int64_t w,
                         int64_t pixel_bytes, int64_t oh, int64_t ow, const int64_t* restrict rows,
                         const int64_t* restrict cols) {
  #pragma omp parallel for schedule(static)
  for (int64_t line = 0; line < n * oh; ++line) {
    const char* restrict src = x + ((line / oh) * h + rows[line % oh]) * w * pixel_bytes;
    char* restrict dst = y + line * ow * pixel_bytes;
    for (int64_t ox = 0; ox < ow; ++ox) memcpy(dst + ox * pixel_bytes, src + cols[ox] * pixel_bytes, pixel_bytes);
  }
}
