/* Convolution windows on NHWC images, shared by the direct convolutions of gemm.c (FP32, BF16) and qgemm.c (INT8):
   one kernel row of a window is kw * c contiguous elements, read in place where it lies inside the image. */
#ifndef KILN_WINDOW_H
#define KILN_WINDOW_H

#include <stdint.h>
#include <string.h>

/* Kernel row yy of the window starting at column x0: the kw * c elements (`elem` bytes each) in place where the
   window lies inside the image, else copied into `pad` with every byte of the padding set to `pad_byte` (0 for
   floats; an INT8 input's zero point, so the column-sum compensation is the same for every pixel). */
static inline const void* window_segment(const void* image, int64_t h, int64_t w, int64_t c, int64_t kw,
                                         int64_t yy, int64_t x0, void* pad, size_t elem, int pad_byte) {
  const int inside_y = yy >= 0 && yy < h;
  const char* img = (const char*)image;
  char* out = (char*)pad;
  if (inside_y && x0 >= 0 && x0 + kw <= w) return img + (yy * w + x0) * c * elem;
  for (int64_t j = 0; j < kw; ++j) {
    const int64_t xx = x0 + j;
    if (inside_y && xx >= 0 && xx < w) memcpy(out + j * c * elem, img + (yy * w + xx) * c * elem, elem * c);
    else memset(out + j * c * elem, pad_byte, elem * c);
  }
  return pad;
}

#endif /* KILN_WINDOW_H */
