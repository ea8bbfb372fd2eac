/* INT8 products of two activations (kiln.tactics.qgemm_act_c), part of qgemm.c's VNNI section: attention's
   Q.K^T and P.V in a Q/DQ model, B an INT8 tensor computed per call. Each image's B is packed into kiln_qgemm's
   panels on every call (u8 shifted to s8 by flipping the top bit; its zero point, less 128, is the epilogue's
   weight zero point) with its column sums, then the images run as kiln_qgemm runs them. */

/* Rows r..r+3 of 16 columns (bytes `flip`ped) as 16 quads, column after column: 64 bytes of a panel. */
static inline __m512i quads16(const uint8_t* b, int64_t n, __m128i flip) {
  const __m128i r0 = _mm_xor_si128(_mm_loadu_si128((const __m128i*)b), flip);
  const __m128i r1 = _mm_xor_si128(_mm_loadu_si128((const __m128i*)(b + n)), flip);
  const __m128i r2 = _mm_xor_si128(_mm_loadu_si128((const __m128i*)(b + 2 * n)), flip);
  const __m128i r3 = _mm_xor_si128(_mm_loadu_si128((const __m128i*)(b + 3 * n)), flip);
  const __m128i lo01 = _mm_unpacklo_epi8(r0, r1), hi01 = _mm_unpackhi_epi8(r0, r1);
  const __m128i lo23 = _mm_unpacklo_epi8(r2, r3), hi23 = _mm_unpackhi_epi8(r2, r3);
  const __m512i q = _mm512_castsi128_si512(_mm_unpacklo_epi16(lo01, lo23));
  return _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(q, _mm_unpackhi_epi16(lo01, lo23), 1),
                                               _mm_unpacklo_epi16(hi01, hi23), 2), _mm_unpackhi_epi16(hi01, hi23), 3);
}

/* Image p's B [k][n] (u8 read as s8 where `flip`) into panels [n/32][k/4][32][4], zero-padded, and its
   compensation: comp[j] = x_zp * (sum_k B[k][j] - k * w_zp[j]), w_zp as the epilogue has them (NULL: 0). Whole
   quads of 16 columns are interleaved in registers and summed by vpdpbusd with ones; the edges byte by byte. */
static void pack_image(const uint8_t* b, int64_t k, int64_t n, uint8_t flip, int8_t* packed, int32_t* comp,
                       int64_t x_zp, const int32_t* w_zp) {
  const int64_t quads = (k + 3) / 4, panels = (n + NR - 1) / NR, full = k / 4, blocks = n / 16;
  memset(packed, 0, (size_t)(panels * quads * NR * 4));
  const __m128i flips = _mm_set1_epi8((char)flip);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t j16 = 0; j16 < blocks; ++j16) {
    const int64_t j = j16 * 16;
    int8_t* dst = packed + (j / NR) * quads * NR * 4 + (j % NR) * 4;
    __m512i sums = _mm512_setzero_si512();
    for (int64_t q = 0; q < full; ++q) {
      const __m512i v = quads16(b + 4 * q * n + j, n, flips);
      _mm512_storeu_si512(dst + q * NR * 4, v);
      sums = _mm512_dpbusd_epi32(sums, ones, v);
    }
    _mm512_storeu_si512(comp + j, sums);
  }
  for (int64_t j = blocks * 16; j < panels * NR; ++j) comp[j] = 0;
  for (int64_t r = 0; r < k; ++r) {   /* the edges: the last 1-3 rows, the last columns short of 16 */
    const int64_t from = r < full * 4 ? blocks * 16 : 0;
    int8_t* dst = packed + (r / 4) * NR * 4 + (r % 4);
    for (int64_t j = from; j < n; ++j) {
      const int8_t v = (int8_t)(b[r * n + j] ^ flip);
      dst[(j / NR) * quads * NR * 4 + (j % NR) * 4] = v;
      comp[j] += v;
    }
  }
  for (int64_t j = 0; j < panels * NR; ++j) comp[j] = (int32_t)x_zp * (comp[j] - (w_zp ? (int32_t)k * w_zp[j] : 0));
}

/* C[p] = A[p] . B[p] for g->batch images: A rows as kiln_qgemm reads them, B [k][n] contiguous per image (u8 where
   `b_unsigned`), `x_zp` the activation's zero point as the kernel reads it (+128 for s8 input); g->b and g->e.comp
   are unused (per call here). */
void kiln_qgemm_act(const QGemmCall* g, const uint8_t* a, const uint8_t* b, void* c, int64_t m, int64_t x_zp,
                    int64_t b_unsigned) {
  const int64_t k = g->k, n = g->n, batch = g->batch;
  const int64_t image = ((k + 3) / 4) * 4 * ((n + NR - 1) / NR) * NR, cols = (n + NR - 1) / NR * NR;
  int8_t* packed = (int8_t*)aligned_alloc(64, (size_t)((batch * image + 63) / 64 * 64));
  int32_t* comps = (int32_t*)malloc(sizeof(int32_t) * (size_t)(batch * cols));
  if (!packed || !comps) abort();
  MAYBE_PARALLEL(threads_pay(batch, batch * k * n), {
    _Pragma("omp for schedule(static)")
    for (int64_t p = 0; p < batch; ++p)
      pack_image(b + p * k * n, k, n, b_unsigned ? 0x80 : 0, packed + p * image, comps + p * cols, x_zp, g->e.w_zp);
  });
  qgemm_images(g, a, c, 0, m, packed, image, comps, cols);
  free(comps);
  free(packed);
}
