/* kiln_qgemm and kiln_qconv on AMX-INT8 tiles (amx.h's blocking, `tdpbusd`), part of qgemm.c's VNNI section (it
   uses that file's QGemmCall, QConvCall, store16, QPlain and store32_plain, out_size and res_size;
   kiln.tactics.qgemm_amx is the Python side).

   A block of 32 rows is packed once as u8 quads, [32][kq] with kq a whole number of 16-quad tile steps (zero
   bytes past k; for a convolution each kernel row's window segment padded so, side by side; s8 input with each
   byte's top bit flipped, as the VNNI kernel reads it), then multiplied by every panel of its unit's group. The
   weights are packed [n/32][kq][32][4] (kiln.tactics.qgemm_amx.pack_amx_*). Each 32 x 32 block of int32 sums goes
   through qgemm.c's epilogue (zero-point compensation, scales, bias, residual, activation, FP32 or u8/s8). */
#include <omp.h>
#include "amx.h"

_Static_assert(NR == AMX_BLOCK_COLS, "qgemm.c's panels are amx.h's blocks");

/* k bytes of a row into dst as quads, zero bytes to kq quads; `flip` 0x80808080 reads s8 as u8. */
static void pack_qrow(uint32_t* dst, const uint8_t* src, int64_t k, uint32_t flip, int64_t kq) {
  memcpy(dst, src, (size_t)k);
  memset((uint8_t*)dst + k, 0, (size_t)(kq * 4 - k));
  if (flip)
    for (int64_t q = 0; q < (k + 3) / 4; ++q) dst[q] ^= flip;   /* the pad bytes' products meet zero weights */
}

/* Each packed row's byte sum over `segs` segments of `seg` bytes, `segq` quads apart (read as packed: flipped),
   into sums: what weights with zero points take off (qgemm.c's weight_zero_points). */
static void packed_row_sums(const uint32_t* pa, int64_t lda, int64_t mr, int64_t segs, int64_t seg, int64_t segq,
                            int32_t* sums) {
  for (int64_t i = 0; i < mr; ++i) {
    sums[i] = 0;
    for (int64_t s = 0; s < segs; ++s) sums[i] += byte_sum((const uint8_t*)(pa + i * lda + s * segq), seg, 0);
  }
}

/* The packed block times the panels [nb0, nb1) of `b`, each 32 x 32 block of sums stored through the epilogue
   (`sums`: the rows' byte sums where the weights have zero points, else NULL). */
static void qamx_panels(const uint32_t* pa, int64_t kq, int64_t mr, const int8_t* b, int64_t nb0, int64_t nb1,
                        int64_t n, int32_t* out, uint8_t* c, const uint8_t* res, int64_t ldc, const QEpilogue* e,
                        const int32_t* sums) {
  const int64_t esize = out_size(e);
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    amx_block(pa, kq, mr > AMX_TILE_ROWS, b + nb * kq * NR * 4, out, 1);
    if (sums)
      for (int64_t i = 0; i < mr; ++i) {
        __m512i row[1][2] = {{_mm512_loadu_si512(out + i * NR), _mm512_loadu_si512(out + i * NR + 16)}};
        weight_zero_points(row, sums + i, 1, e->w_zp + nb * NR);
        _mm512_storeu_si512(out + i * NR, row[0][0]);
        _mm512_storeu_si512(out + i * NR + 16, row[0][1]);
      }
    const int64_t cols = n - nb * NR < NR ? n - nb * NR : NR;
    const __mmask16 lo = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 hi = cols >= NR ? (__mmask16)0xFFFF : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
    if (plain_epilogue(e, res)) {   /* INT8 out, 1-byte residual: no element sizes to scale by */
      const QPlain p = plain_columns(e, nb * NR);
      for (int64_t i = 0; i < mr; ++i)
        store32_plain(_mm512_loadu_si512(out + i * NR), _mm512_loadu_si512(out + i * NR + 16), &p,
                      res ? res + i * ldc + nb * NR : 0, c + i * ldc + nb * NR, lo, hi);
      continue;
    }
    for (int64_t i = 0; i < mr; ++i) {
      uint8_t* row = c + (i * ldc + nb * NR) * esize;
      const uint8_t* r = res ? res + (i * ldc + nb * NR) * res_size(e) : 0;
      store16(_mm512_loadu_si512(out + i * NR), nb * NR, e, r, row, lo);
      if (hi) store16(_mm512_loadu_si512(out + i * NR + 16), nb * NR + 16, e, r ? r + 16 * res_size(e) : 0,
                      row + 16 * esize, hi);
    }
  }
}

void kiln_qgemm_amx(const QGemmCall* g, const uint8_t* a, void* c, const void* res, int64_t m) {
  const int64_t k = g->k, n = g->n, kq = amx_whole_steps((k + 3) / 4), lda = amx_block_stride(kq);
  const AmxSplit split = amx_split(g->batch, m, n, omp_get_max_threads());
  const int64_t esize = out_size(&g->e);
  const uint32_t flip = g->e.signed_input ? 0x80808080u : 0;
  MAYBE_PARALLEL(threads_pay(split.units, g->batch * m * k * n), {
    AmxWorker worker = amx_worker_begin(lda, 0);
    uint32_t* pa = worker.rows;
    int32_t* out = (int32_t*)worker.sums;
    _Pragma("omp for schedule(static)")
    for (int64_t u = 0; u < split.units; ++u) {
      const AmxUnit t = amx_unit(&split, u);
      if (t.nb0 >= t.nb1) continue;
      for (int64_t i = 0; i < t.mr; ++i) pack_qrow(pa + i * lda, a + qrow_at(g, t.p, t.r0 + i), k, flip, kq);
      int32_t sums[AMX_BLOCK_ROWS];
      if (g->e.w_zp) packed_row_sums(pa, lda, t.mr, 1, k, kq, sums);
      const int64_t at = t.p * g->c_batch + t.r0 * n;
      qamx_panels(pa, kq, t.mr, g->b, t.nb0, t.nb1, n, out, (uint8_t*)c + at * esize,
                  res ? (const uint8_t*)res + at * res_size(&g->e) : 0, n, &g->e, g->e.w_zp ? sums : 0);
    }
    amx_worker_end(&worker);
  });
}

void kiln_qconv_amx(const QConvCall* g, const uint8_t* x, void* y, const void* res) {
  const int64_t h = g->h, w = g->w, c = g->c, kh = g->kh, kw = g->kw, ow = g->ow, cout = g->cout;
  const int64_t m = g->oh * ow, seg = kw * c, segq = amx_whole_steps((seg + 3) / 4), kq = kh * segq;
  const int64_t lda = amx_block_stride(kq), esize = out_size(&g->e);
  const AmxSplit split = amx_split(g->n, m, cout, omp_get_max_threads());
  const uint32_t flip = g->e.signed_input ? 0x80808080u : 0;
  MAYBE_PARALLEL(threads_pay(split.units, g->n * m * kh * seg * cout), {
    AmxWorker worker = amx_worker_begin(lda, (size_t)seg);
    uint32_t* pa = worker.rows;
    int32_t* out = (int32_t*)worker.sums;
    uint8_t* pad = (uint8_t*)worker.pad;
    _Pragma("omp for schedule(static)")
    for (int64_t u = 0; u < split.units; ++u) {
      const AmxUnit t = amx_unit(&split, u);
      if (t.nb0 >= t.nb1) continue;
      const uint8_t* image = x + t.p * h * w * c;
      for (int64_t i = 0; i < t.mr; ++i) {
        const int64_t r = t.r0 + i, oy = r / ow, x0 = (r % ow) * g->sw - g->pl;
        for (int64_t s = 0; s < kh; ++s)
          pack_qrow(pa + i * lda + s * segq,
                    window_segment(image, h, w, c, kw, oy * g->sh - g->pt + s, x0, pad, 1, g->e.pad_byte), seg, flip,
                    segq);
      }
      int32_t sums[AMX_BLOCK_ROWS];
      if (g->e.w_zp) packed_row_sums(pa, lda, t.mr, kh, seg, segq, sums);
      const int64_t at = (t.p * m + t.r0) * cout;
      qamx_panels(pa, kq, t.mr, g->b, t.nb0, t.nb1, cout, out, (uint8_t*)y + at * esize,
                  res ? (const uint8_t*)res + at * res_size(&g->e) : 0, cout, &g->e, g->e.w_zp ? sums : 0);
    }
    amx_worker_end(&worker);
  });
}

int64_t kiln_amx_int8_ready(void) { return amx_request(); }
