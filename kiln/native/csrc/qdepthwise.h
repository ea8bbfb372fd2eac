/* kiln's INT8 depthwise convolution (kiln.tactics.qdepthwise_c), included by qgemm.c for its epilogue: one group
   per channel (MobileNet's and EfficientNet's 3x3 and 5x5 layers), NHWC u8/s8 in, s8 weights per channel, any
   kernel size, stride, dilation and padding. A GEMM has nothing to reuse here (each channel is its own 1-column
   product), so 16 channels a vector run side by side, each input byte (s8 with its top bit flipped, as the GEMM
   reads it) times its channel's weight. With AVX512-VBMI one byte permute turns four taps of 16 channels into
   vpdpbusd's quads (int32 sums); without it the bytes are converted and summed as floats, exact as well: a product
   is at most 255 * 128, and up to 2^24 / (255 * 128) = 514 taps (the tactic's limit) no partial sum needs more
   than a float's 24 bits.
   Taps outside the image read the zero point's byte, as kiln_qconv's padded windows do, so the epilogue's column
   sums (x_zp * the taps' weight sum per channel) undo the zero point at the borders too; store16 then scales,
   adds the bias, clamps or applies the activation and requantizes, as for every INT8 layer. */

/* The layer's constants (kiln.tactics.qdepthwise_c.DepthwiseCall). */
typedef struct {
  const float* b;     /* weights as floats, [kh * kw][c rounded up to 16] (without AVX512-VBMI) */
  const int8_t* q;    /* weights as s8 quads, [ceil(taps / 4)][c rounded up to 16][4] (with AVX512-VBMI) */
  int64_t n, h, w, c, kh, kw, sh, sw, dh, dw, pt, pl, oh, ow;
  QEpilogue e;
} QDepthwiseCall;

#define DW_BLOCK 64       /* channels per work unit: four vectors of sums */
#define DW_MAX_TAPS 516   /* taps a call's arrays hold; kiln.tactics.qdepthwise_c.MAX_TAPS (514) stays within */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* 16 input bytes (the real channels of `mask`) as the floats the kernel multiplies: s8 read as u8 (`flip`). */
static inline __m512 dw_bytes(const uint8_t* p, __mmask16 mask, __m128i flip) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_xor_si128(_mm_maskz_loadu_epi8(mask, p), flip)));
}

/* The geometry in locals: the kernel's byte stores may alias anything the call structure holds. */
typedef struct {
  int64_t h, w, c, cp, kh, kw, sh, sw, dh, dw, pt, pl, ow, esize;
} DwShape;

#if !defined(__AVX512VBMI__)
/* One output row of `vecs` (a compile-time constant at each call) vectors of channels from c0: every tap's bytes,
   or the zero point's outside the image, times its weights, then the epilogue (QPlain's where it applies). */
static inline __attribute__((always_inline)) void
dw_row(const DwShape* d, const float* b, const QEpilogue* e, const uint8_t* image, int64_t oy, int64_t c0,
       const int vecs, const __mmask16* masks, __m128i flip, __m512 pad, uint8_t* row) {
  const int plain = plain_epilogue(e, 0);
  QPlain halves[2];   /* the second only where the block has its columns: the arrays end at a whole 32 past c */
  if (plain) halves[0] = plain_columns(e, c0);
  if (plain && vecs > 2) halves[1] = plain_columns(e, c0 + 32);
  __m512 a0, a1, a2, a3;
/* acc v += the taps' floats (X(v)) times the weights at wt, for the row's vectors */
#define DW_TAP(X)                                                                                         \
  do {                                                                                                   \
    a0 = _mm512_fmadd_ps(X(0), _mm512_loadu_ps(wt), a0);                                                 \
    if (vecs > 1) a1 = _mm512_fmadd_ps(X(1), _mm512_loadu_ps(wt + 16), a1);                              \
    if (vecs > 2) a2 = _mm512_fmadd_ps(X(2), _mm512_loadu_ps(wt + 32), a2);                              \
    if (vecs > 3) a3 = _mm512_fmadd_ps(X(3), _mm512_loadu_ps(wt + 48), a3);                              \
  } while (0)
#define DW_PAD(V) pad
#define DW_PIXEL(V) dw_bytes(px + 16 * (V), masks[V], flip)
  for (int64_t ox = 0; ox < d->ow; ++ox) {
    a0 = a1 = a2 = a3 = _mm512_setzero_ps();
    const int64_t x0 = ox * d->sw - d->pl;
    const int inside_x = x0 >= 0 && x0 + (d->kw - 1) * d->dw < d->w;
    for (int64_t ky = 0; ky < d->kh; ++ky) {
      const int64_t iy = oy * d->sh - d->pt + ky * d->dh;
      const float* wt = b + ky * d->kw * d->cp + c0;
      if (iy < 0 || iy >= d->h) {   /* a padded kernel row: the zero point's byte at every tap */
        for (int64_t kx = 0; kx < d->kw; ++kx, wt += d->cp) DW_TAP(DW_PAD);
        continue;
      }
      const uint8_t* line = image + iy * d->w * d->c + c0;
      for (int64_t kx = 0; kx < d->kw; ++kx, wt += d->cp) {
        const int64_t ix = x0 + kx * d->dw;
        const uint8_t* px = line + ix * d->c;
        if (inside_x || (ix >= 0 && ix < d->w)) DW_TAP(DW_PIXEL);
        else DW_TAP(DW_PAD);
      }
    }
    uint8_t* out = row + ox * d->c * d->esize;
    const __m512 acc[4] = {a0, a1, a2, a3};
    for (int v = 0; v < vecs; ++v) {
      const __m512i sums = _mm512_cvtps_epi32(acc[v]);
      if (plain) store16_plain(sums, &halves[v / 2], v % 2, 0, out + 16 * v, masks[v]);
      else store16(sums, c0 + 16 * v, e, 0, out + 16 * v * d->esize, masks[v]);
    }
  }
#undef DW_PIXEL
#undef DW_PAD
#undef DW_TAP
}
#endif

#if defined(__AVX512VBMI__)
/* Taps 4g..4g+3 (at p[0..3], each + at, `mask`'s channels) of 16 channels as vpdpbusd's u8 quads: the four 16-byte
   loads side by side, s8 flipped, then byte 4i + j <- byte 16j + i: channel i's four taps in its int32 lane. */
static inline __m512i dw_quads(const uint8_t* const* p, int64_t at, __mmask16 mask, __m512i transpose, __m512i flip) {
  __m512i z = _mm512_castsi128_si512(_mm_maskz_loadu_epi8(mask, p[0] + at));
  z = _mm512_inserti32x4(z, _mm_maskz_loadu_epi8(mask, p[1] + at), 1);
  z = _mm512_inserti32x4(z, _mm_maskz_loadu_epi8(mask, p[2] + at), 2);
  z = _mm512_inserti32x4(z, _mm_maskz_loadu_epi8(mask, p[3] + at), 3);
  return _mm512_permutexvar_epi8(transpose, _mm512_xor_si512(z, flip));
}

/* dw_row with VNNI sums: four taps of 16 channels per vpdpbusd. `offsets`: each tap's byte offset from its window's
   first pixel; taps outside the image (and the last quad's spare ones, whose weights are 0) read `pad`. */
static inline __attribute__((always_inline)) void
dw_row_vnni(const DwShape* d, const int8_t* q, const QEpilogue* e, const uint8_t* image, int64_t oy, int64_t c0,
            const int vecs, const __mmask16* masks, const int64_t* offsets, const uint8_t* pad, uint8_t* row) {
  const int64_t taps = d->kh * d->kw, groups = (taps + 3) / 4;
  const int plain = plain_epilogue(e, 0);
  QPlain halves[2];   /* the second only where the block has its columns: the arrays end at a whole 32 past c */
  if (plain) halves[0] = plain_columns(e, c0);
  if (plain && vecs > 2) halves[1] = plain_columns(e, c0 + 32);
  const __m512i flip = _mm512_set1_epi8(e->signed_input ? (char)0x80 : 0);
  const __m512i transpose = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43,
                                            27, 11, 58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54,
                                            38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4, 51, 35, 19, 3, 50, 34, 18, 2, 49,
                                            33, 17, 1, 48, 32, 16, 0);
  const uint8_t* src[DW_MAX_TAPS];
  for (int64_t t = taps; t < groups * 4; ++t) src[t] = pad;
  const int64_t iy0 = oy * d->sh - d->pt, inside_y = iy0 >= 0 && iy0 + (d->kh - 1) * d->dh < d->h;
  for (int64_t ox = 0; ox < d->ow; ++ox) {
    const int64_t x0 = ox * d->sw - d->pl;
    if (inside_y && x0 >= 0 && x0 + (d->kw - 1) * d->dw < d->w) {
      const uint8_t* first = image + (iy0 * d->w + x0) * d->c + c0;
      for (int64_t t = 0; t < taps; ++t) src[t] = first + offsets[t];
    } else {
      for (int64_t t = 0; t < taps; ++t) {
        const int64_t iy = iy0 + (t / d->kw) * d->dh, ix = x0 + (t % d->kw) * d->dw;
        src[t] = iy >= 0 && iy < d->h && ix >= 0 && ix < d->w ? image + (iy * d->w + ix) * d->c + c0 : pad;
      }
    }
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    const int8_t* wq = q + c0 * 4;
    for (int64_t g = 0; g < groups; ++g, wq += d->cp * 4) {
      const uint8_t* const* p = src + 4 * g;
      a0 = _mm512_dpbusd_epi32(a0, dw_quads(p, 0, masks[0], transpose, flip), _mm512_loadu_si512(wq));
#define DW_QUADS(V, ACC) ACC = _mm512_dpbusd_epi32(ACC, dw_quads(p, 16 * (V), masks[V], transpose, flip), \
                                                 _mm512_loadu_si512(wq + 64 * (V)))
      if (vecs > 1) DW_QUADS(1, a1);
      if (vecs > 2) DW_QUADS(2, a2);
      if (vecs > 3) DW_QUADS(3, a3);
#undef DW_QUADS
    }
    uint8_t* out = row + ox * d->c * d->esize;
    const __m512i acc[4] = {a0, a1, a2, a3};
    for (int v = 0; v < vecs; ++v) {
      if (plain) store16_plain(acc[v], &halves[v / 2], v % 2, 0, out + 16 * v, masks[v]);
      else store16(acc[v], c0 + 16 * v, e, 0, out + 16 * v * d->esize, masks[v]);
    }
  }
}
#endif

/* y[n][oh][ow][c] from x[n][h][w][c]: work units of one output row and one block of 64 channels; VNNI sums with
   AVX512-VBMI's byte permute, else float ones. */
void kiln_qdepthwise(const QDepthwiseCall* g, const uint8_t* x, void* y) {
  const DwShape d = {g->h, g->w, g->c, (g->c + 15) / 16 * 16, g->kh, g->kw, g->sh, g->sw, g->dh, g->dw, g->pt,
                     g->pl, g->ow, out_size(&g->e)};
  const int64_t blocks = (d.c + DW_BLOCK - 1) / DW_BLOCK, oh = g->oh, rows = g->n * oh;
  const QEpilogue e = g->e;
#if defined(__AVX512VBMI__)
  const int8_t* q = g->q;
  int64_t offsets[DW_MAX_TAPS];
  for (int64_t t = 0; t < d.kh * d.kw; ++t) offsets[t] = ((t / d.kw) * d.dh * d.w + (t % d.kw) * d.dw) * d.c;
  uint8_t pad[DW_BLOCK];
  memset(pad, e.pad_byte, sizeof pad);
#define DW_ROW(V) dw_row_vnni(&d, q, &e, image, oy, c0, V, masks, offsets, pad, row)
#else
  const uint32_t flip_byte = g->e.signed_input ? 0x80u : 0u;
  const __m128i flip = _mm_set1_epi8((char)flip_byte);
  const __m512 pad = _mm512_set1_ps((float)(((uint32_t)g->e.pad_byte ^ flip_byte) & 0xFFu));
  const float* b = g->b;
#define DW_ROW(V) dw_row(&d, b, &e, image, oy, c0, V, masks, flip, pad, row)
#endif
  MAYBE_PARALLEL(threads_pay(rows * blocks, rows * d.ow * d.c * d.kh * d.kw), {
    _Pragma("omp for schedule(static)")
    for (int64_t u = 0; u < rows * blocks; ++u) {
      const int64_t r = u / blocks, c0 = (u % blocks) * DW_BLOCK, p = r / oh, oy = r % oh;
      const int64_t cn = d.c - c0 < DW_BLOCK ? d.c - c0 : DW_BLOCK;
      __mmask16 masks[DW_BLOCK / 16];
      for (int v = 0; v < DW_BLOCK / 16; ++v) {
        const int64_t left = cn - 16 * v;
        masks[v] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
      }
      const uint8_t* image = x + p * d.h * d.w * d.c;
      uint8_t* row = (uint8_t*)y + (r * d.ow * d.c + c0) * d.esize;
      switch ((cn + 15) / 16) {
        case 1: DW_ROW(1); break;
        case 2: DW_ROW(2); break;
        case 3: DW_ROW(3); break;
        default: DW_ROW(4);
      }
    }
  });
#undef DW_ROW
}
#else
void kiln_qdepthwise(const QDepthwiseCall* g, const uint8_t* x, void* y) {
  (void)g; (void)x; (void)y;
  abort();   /* unreachable: no tactic calls it without AVX512-VNNI */
}
#endif
