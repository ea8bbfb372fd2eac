/* kiln_gemm_bf16 and kiln_conv_bf16 on AMX tiles (amx.h's blocking), part of gemm.c's BF16 section (it uses that
   file's bf16_pairs, at_elem, store_block and the IO_* bits; kiln.tactics.gemm_amx is the Python side).

   A block of 32 rows is packed once as bf16 pairs, [32][kq] with kq a whole number of 16-pair tile steps (zeros
   past k; for a convolution each kernel row's window segment padded so, side by side), then multiplied by every
   panel of its unit's group. B is packed [n/32][kq][32] (kiln.tactics.gemm_amx.pack_amx_*). The 32 x 32 FP32
   block is stored through gemm.c's epilogue (bias, residual, activation; bf16 or FP32). Units are (batch
   item, row block, group of panels), with enough groups for two units per thread. */
#include <omp.h>
#include "amx.h"

_Static_assert(NR == AMX_BLOCK_COLS, "gemm.h's panels are amx.h's blocks");

/* k values (FP32, or bf16 where `src_bf16`) as bf16 pairs into dst[0..kq), zeros past them. */
static void pack_row(uint32_t* dst, const void* src, int64_t k, int src_bf16, int64_t kq) {
  if (src_bf16) {
    memcpy(dst, src, sizeof(uint16_t) * k);
    if (k % 2) ((uint16_t*)dst)[k] = 0;
  } else {
    bf16_pairs((const float*)src, k, dst);
  }
  const int64_t pairs = (k + 1) / 2;
  memset(dst + pairs, 0, sizeof(uint32_t) * (kq - pairs));
}

/* The packed block times the panels [nb0, nb1) of `b`, each 32 x 32 result stored into c (row stride ldc). */
static void amx_panels(const uint32_t* pa, int64_t kq, int64_t mr, const uint32_t* b, int64_t nb0, int64_t nb1,
                       int64_t n, float* out, void* c, int64_t c_at, int64_t ldc, const float* bias, const void* res,
                       const Act* act, int64_t io) {
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    amx_block(pa, kq, mr > AMX_TILE_ROWS, b + nb * kq * NR, out, 0);
    const int64_t at = c_at + nb * NR, cols = n - nb * NR < NR ? n - nb * NR : NR;
    store_block(out, mr, (void*)at_elem(c, at, io & IO_C_BF16), ldc, cols, bias ? bias + nb * NR : 0,
                at_elem(res, at, io & IO_RES_BF16), act, io);
  }
}

void kiln_gemm_bf16_amx(const GemmCall* g, const void* restrict a, void* c, const void* res, int64_t batch,
                        int64_t m) {
  const int64_t k = g->k, n = g->n, io = g->io;
  const int64_t kq = amx_whole_steps((k + 1) / 2), lda = amx_block_stride(kq);
  const AmxSplit split = amx_split(batch, m, n, omp_get_max_threads());
  const int a_bf16 = (io & IO_A_BF16) != 0;
  MAYBE_PARALLEL(threads_pay(split.units, batch * m * k * n), {
    AmxWorker worker = amx_worker_begin(lda, 0);
    uint32_t* pa = worker.rows;
    float* out = (float*)worker.sums;
    _Pragma("omp for schedule(static)")
    for (int64_t u = 0; u < split.units; ++u) {
      const AmxUnit t = amx_unit(&split, u);
      if (t.nb0 >= t.nb1) continue;
      for (int64_t i = 0; i < t.mr; ++i) {
        const void* row = at_elem(a, row_at(g, t.p, t.r0 + i), a_bf16);
        pack_row(pa + i * lda, row, k, a_bf16, kq);
      }
      amx_panels(pa, kq, t.mr, (const uint32_t*)g->b + t.p * g->b_batch, t.nb0, t.nb1, n, out, c,
                 t.p * g->c_batch + t.r0 * c_step(g), c_step(g), g->bias, res, &g->act, io);
    }
    amx_worker_end(&worker);
  });
}

void kiln_conv_bf16_amx(const ConvCall* g, const void* restrict x, void* y, const void* res, int64_t n) {
  const int64_t h = g->h, w = g->w, c = g->c, kh = g->kh, kw = g->kw, sh = g->sh, sw = g->sw, pt = g->pt, pl = g->pl;
  const int64_t oh = g->oh, ow = g->ow, cout = g->cout, io = g->io;
  const int64_t m = oh * ow, seg = kw * c, segq = amx_whole_steps((seg + 1) / 2), kq = kh * segq;
  const int64_t lda = amx_block_stride(kq);
  const AmxSplit split = amx_split(n, m, cout, omp_get_max_threads());
  const int a_bf16 = (io & IO_A_BF16) != 0;
  const size_t elem = a_bf16 ? sizeof(uint16_t) : sizeof(float);
  MAYBE_PARALLEL(threads_pay(split.units, n * m * kh * seg * cout), {
    AmxWorker worker = amx_worker_begin(lda, elem * seg);
    uint32_t* pa = worker.rows;
    float* out = (float*)worker.sums;
    void* pad = worker.pad;
    _Pragma("omp for schedule(static)")
    for (int64_t u = 0; u < split.units; ++u) {
      const AmxUnit t = amx_unit(&split, u);
      if (t.nb0 >= t.nb1) continue;
      const void* image = at_elem(x, t.p * h * w * c, a_bf16);
      for (int64_t i = 0; i < t.mr; ++i) {
        const int64_t r = t.r0 + i, oy = r / ow, x0 = (r % ow) * sw - pl;
        for (int64_t s = 0; s < kh; ++s)
          pack_row(pa + i * lda + s * segq, window_segment(image, h, w, c, kw, oy * sh - pt + s, x0, pad, elem, 0),
                   seg, a_bf16, segq);
      }
      amx_panels(pa, kq, t.mr, g->b, t.nb0, t.nb1, cout, out, y, (t.p * m + t.r0) * cout, cout, g->bias, res, &g->act,
                 io);
    }
    amx_worker_end(&worker);
  });
}

int64_t kiln_amx_ready(void) { return amx_request(); }
