/* kiln's GEMM and direct convolution on the micro-kernel of gemm.h (kiln.tactics.gemm_c, conv1x1, conv_direct,
   matmul_c), in BF16 on AVX512-BF16 (gemm_bf16) and on AMX tiles (gemm_amx.h). OpenMP shares (batch, column
   panel, row chunk) units out on torch's own thread pool, row chunks outermost where the weights fit in L2
   (ROWS_OUTER_BYTES). */
#include "gemm.h"
#include "window.h"
#include "work_split.h"

/* A GEMM layer's constants (kiln.tactics.gemm_c.GemmCall), built once at load: a call passes only its tensors,
   its batch and its row count, not a dozen integers for ctypes to convert (~1.2 us a call). Row r of item p
   starts at a + p * a_batch + (r / row_width) * line_step + (r % row_width) * col_step elements of A; row r of
   item p of C at p * c_batch + r * ldc (ldc 0: n; wider where C is a slice of a Concat's output, which only a
   layer without a residual writes: a residual is read at C's offsets). */
typedef struct {
  const void* b;       /* packed weights: FP32 panels, or bf16 pairs for the BF16 entry points */
  const float* bias;   /* padded to whole panels (pad_bias), or NULL */
  int64_t a_batch, row_width, col_step, line_step, b_batch, c_batch;
  Act act;
  int64_t k, n, io, ldc;
} GemmCall;

static inline int64_t c_step(const GemmCall* g) { return g->ldc > 0 ? g->ldc : g->n; }

/* A direct convolution's constants (kiln.tactics.gemm_c.ConvCall): input h x w x c, kernel kh x kw, strides, top
   and left padding, output oh x ow x cout. */
typedef struct {
  const void* b;
  const float* bias;
  int64_t h, w, c, kh, kw, sh, sw, pt, pl, oh, ow;
  Act act;
  int64_t cout, io;
} ConvCall;

/* The element offset of row r of item p of A. */
static inline int64_t row_at(const GemmCall* g, int64_t p, int64_t r) {
  return p * g->a_batch + (r / g->row_width) * g->line_step + (r % g->row_width) * g->col_step;
}

void kiln_gemm(const GemmCall* g, const float* restrict a, float* c, const float* res, int64_t batch, int64_t m) {
  const float* restrict b = g->b;
  const float* restrict bias = g->bias;
  const int64_t k = g->k, n = g->n;
  const int64_t panels = (n + NR - 1) / NR, tiles = (m + MR - 1) / MR, chunks = (tiles + CHUNK - 1) / CHUNK;
  const int64_t units = panels * chunks, rows_outer = k * n * (int64_t)sizeof(float) <= ROWS_OUTER_BYTES;
  MAYBE_PARALLEL(threads_pay(batch * units, batch * m * k * n), {
    _Pragma("omp for schedule(static)")
    for (int64_t q = 0; q < batch * units; ++q) {
      const WorkUnit unit = work_unit(q, panels, chunks, tiles, n, NR, rows_outer);
      const int64_t p = unit.p, nb = unit.nb, cols = unit.cols;
      const float* bp = b + p * g->b_batch + nb * k * NR;
      for (int64_t t = unit.first; t < unit.last; ++t) {
        const int64_t r0 = t * MR, mr = m - r0 < MR ? m - r0 : MR;
        const float* rows[MR];
        for (int64_t i = 0; i < MR; ++i) rows[i] = a + row_at(g, p, r0 + (i < mr ? i : 0));
        const int64_t at = p * g->c_batch + r0 * c_step(g) + nb * NR;
        tile(rows, 1, mr, k, bp, c + at, c_step(g), cols, bias ? bias + nb * NR : 0, res ? res + at : 0, &g->act);
      }
    }
  });
}

/* Direct convolution on NHWC input x[n][h][w][c] (dilation 1, one group): output pixel r of an image is a row
   of the GEMM, and kernel row s of its window is one segment of kw * c contiguous input floats. Windows that
   cross the border are copied into a per-thread buffer with zeros where the padding is. Weights are packed as
   for kiln_gemm from [kh][kw][c][cout]; the work split and the epilogue are kiln_gemm's. */
void kiln_conv(const ConvCall* g, const float* restrict x, float* y, const float* res, int64_t n) {
  const float* restrict b = g->b;
  const float* restrict bias = g->bias;
  const int64_t h = g->h, w = g->w, c = g->c, kh = g->kh, kw = g->kw, sh = g->sh, sw = g->sw, pt = g->pt, pl = g->pl;
  const int64_t oh = g->oh, ow = g->ow, cout = g->cout;
  const int64_t m = oh * ow, seg = kw * c, panels = (cout + NR - 1) / NR, tiles = (m + MR - 1) / MR;
  const int64_t chunks = (tiles + CHUNK - 1) / CHUNK, units = panels * chunks;
  const int64_t rows_outer = kh * seg * cout * (int64_t)sizeof(float) <= ROWS_OUTER_BYTES;
  MAYBE_PARALLEL(threads_pay(n * units, n * m * kh * seg * cout), {
    float* pad = (float*)malloc(sizeof(float) * MR * kh * seg);
    const float** rows = (const float**)malloc(sizeof(float*) * MR * kh);
    _Pragma("omp for schedule(static)")
    for (int64_t q = 0; q < n * units; ++q) {
      const WorkUnit unit = work_unit(q, panels, chunks, tiles, cout, NR, rows_outer);
      const int64_t p = unit.p, nb = unit.nb, cols = unit.cols;
      const float* bp = b + nb * kh * seg * NR;
      const float* image = x + p * h * w * c;
      for (int64_t t = unit.first; t < unit.last; ++t) {
        const int64_t r0 = t * MR, mr = m - r0 < MR ? m - r0 : MR;
        for (int64_t i = 0; i < MR; ++i) {
          const int64_t r = r0 + (i < mr ? i : 0), oy = r / ow, x0 = (r % ow) * sw - pl;
          for (int64_t s = 0; s < kh; ++s)
            rows[s * MR + i] = window_segment(image, h, w, c, kw, oy * sh - pt + s, x0, pad + (i * kh + s) * seg,
                                              sizeof(float), 0);
        }
        const int64_t at = (p * m + r0) * cout + nb * NR;
        tile(rows, kh, mr, seg, bp, y + at, cout, cols, bias ? bias + nb * NR : 0, res ? res + at : 0, &g->act);
      }
    }
    free(rows);
    free(pad);
  });
}

/* BF16 products with FP32 accumulation (vdpbf16ps, AVX512-BF16): kiln_gemm's loops and epilogue, with B packed
   as bf16 pairs [n/32][k/2][32] (each 32-bit lane holds rows 2q and 2q+1 of one column). `io` says which tensors
   are stored in bf16 (kiln.tactics.storage): IO_A_BF16 the input, read in place as pairs where its rows are
   even-length (else copied with a zero tail); otherwise each tile's FP32 rows are rounded to bf16 pairs as it
   starts (one vcvtne2ps2bf16 per 32 floats: ~3 % of the tile's instructions). IO_C_BF16 and IO_RES_BF16: the
   output and the residual, widened for the FP32 epilogue and the result rounded to nearest even as it is stored. */
#ifdef __AVX512BF16__
#include <immintrin.h>

static void bf16_pairs(const float* src, int64_t k, uint32_t* dst) {
  int64_t j = 0;
  for (; j + 32 <= k; j += 32)
    _mm512_storeu_si512(dst + j / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + j + 16),
                                                                   _mm512_loadu_ps(src + j)));
  if (j < k) {   /* the tail: masked loads read zeros past k, so an odd k pairs its last value with 0 */
    const int64_t left = k - j, pairs = (left + 1) / 2;
    const __mmask16 lo = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __mmask16 hi = left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : (__mmask16)0;
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, src + j + 16), _mm512_maskz_loadu_ps(lo, src + j));
    _mm512_mask_storeu_epi32(dst + j / 2, (__mmask16)((1u << pairs) - 1), (__m512i)v);
  }
}

/* k values of a row as bf16 pairs: `src` itself where it is bf16 already, even-length and 4-byte aligned, else
   rounded (FP32) or copied (bf16) into `dst`, an odd k paired with a zero. */
static inline const uint32_t* as_bf16_pairs(const void* src, int64_t k, int src_bf16, uint32_t* dst) {
  if (!src_bf16) {
    bf16_pairs((const float*)src, k, dst);
    return dst;
  }
  if (k % 2 == 0 && ((uintptr_t)src & 3) == 0) return (const uint32_t*)src;
  if (src != (const void*)dst) memmove(dst, src, sizeof(uint16_t) * k);
  if (k % 2) ((uint16_t*)dst)[k] = 0;
  return dst;
}

/* Lanes [0, cols) of a row of NR columns. */
static inline __mmask32 cols_mask(int64_t cols) { return cols >= NR ? 0xFFFFFFFFu : (__mmask32)((1u << cols) - 1); }

/* The 32 elements at p (bf16 where `bf16`, else FP32) as FP32 halves lo (0-15) and hi (16-31), zero outside `mask`:
   masked loads, no copies (widening bf16 is exact: it is FP32's upper half). */
static inline void load_row32(const void* p, int bf16, __mmask32 mask, v16* lo, v16* hi) {
  if (bf16) {
    const __m512i h = _mm512_maskz_loadu_epi16(mask, p);
    *lo = (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16);
    *hi = (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16);
  } else {
    *lo = (v16)_mm512_maskz_loadu_ps((__mmask16)mask, p);
    *hi = (v16)_mm512_maskz_loadu_ps((__mmask16)(mask >> 16), (const float*)p + 16);
  }
}

/* lo and hi stored to the lanes of `mask` at p, rounded to bf16 (nearest even) where `bf16`. */
static inline void store_row32(void* p, int bf16, __mmask32 mask, v16 lo, v16 hi) {
  if (bf16) {
    _mm512_mask_storeu_epi16(p, mask, (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo));
  } else {
    _mm512_mask_storeu_ps(p, (__mmask16)mask, (__m512)lo);
    _mm512_mask_storeu_ps((float*)p + 16, (__mmask16)(mask >> 16), (__m512)hi);
  }
}

/* store_row with masked loads and stores, for outputs and residuals of either type: the epilogue in FP32, bias
   padded to whole panels (pad_bias). */
static inline void store_row_io(void* c, v16 lo, v16 hi, const float* restrict bias, const void* res, const Act act,
                                int64_t cols, int64_t io) {
  const __mmask32 mask = cols_mask(cols);
  v16 r[2];
  if (res) load_row32(res, (io & IO_RES_BF16) != 0, mask, &r[0], &r[1]);
  lo = epilogue(lo, bias, res ? (const float*)&r[0] : 0, act);
  hi = epilogue(hi, bias ? bias + 16 : 0, res ? (const float*)&r[1] : 0, act);
  store_row32(c, (io & IO_C_BF16) != 0, mask, lo, hi);
}

/* Row i of a tile, its FP32 sums lo (columns 0-15) and hi (16-31), stored with the epilogue: output and residual
   elements of `io`'s types, row stride ldc elements, `cols` columns. */
static inline void store_row_at(void* c, int64_t i, int64_t ldc, v16 lo, v16 hi, const float* restrict bias,
                                const void* res, const Act act, int64_t cols, int64_t io) {
  const size_t c_size = io & IO_C_BF16 ? sizeof(uint16_t) : sizeof(float);
  const size_t r_size = io & IO_RES_BF16 ? sizeof(uint16_t) : sizeof(float);
  store_row_io((char*)c + i * ldc * c_size, lo, hi, bias, res ? (const char*)res + i * ldc * r_size : 0, act, cols, io);
}

/* `mr` rows of FP32 sums out[i][0..NR) stored as store_row_at stores one (the AMX kernels' epilogue). */
static void store_block(const float* out, int64_t mr, void* c, int64_t ldc, int64_t cols, const float* restrict bias,
                        const void* res, const Act* act, int64_t io) {
  const Act fused = as_act(act);
  for (int64_t i = 0; i < mr; ++i)
    store_row_at(c, i, ldc, *(const v16*)(out + i * NR), *(const v16*)(out + i * NR + 16), bias, res, fused, cols, io);
}

/* kiln's tile() in BF16: `segs` segments of `kp` bf16 pairs, segment s reading rows a[s * MR + i] and weights
   b + s * kp * NR; output and residual elements of `io`'s types, row stride ldc elements. */
static void tile_bf16(const uint32_t* const* a, int64_t segs, int64_t mr, int64_t kp, const uint32_t* restrict b,
                      void* c, int64_t ldc, int64_t cols, const float* restrict bias, const void* res, const Act* act,
                      int64_t io) {
  __m512 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t s = 0; s < segs; ++s) {
    const uint32_t* const* as = a + s * MR;
    const uint32_t* bs = b + s * kp * NR;
    for (int64_t q = 0; q < kp; ++q) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bs + q * NR);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bs + q * NR + 16);
      for (int i = 0; i < MR; ++i) {
        const __m512bh ai = (__m512bh)_mm512_set1_epi32((int)as[i][q]);
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
      }
    }
  }
  const Act fused = as_act(act);
  for (int64_t i = 0; i < mr; ++i) store_row_at(c, i, ldc, (v16)acc[i][0], (v16)acc[i][1], bias, res, fused, cols, io);
}

/* Byte address of element `at` of a tensor whose elements are bf16 where `bf16`, else FP32. */
static inline const void* at_elem(const void* base, int64_t at, int bf16) {
  return base ? (const char*)base + at * (bf16 ? sizeof(uint16_t) : sizeof(float)) : 0;
}

void kiln_gemm_bf16(const GemmCall* g, const void* restrict a, void* c, const void* res, int64_t batch, int64_t m) {
  const uint32_t* restrict b = g->b;
  const float* restrict bias = g->bias;
  const int64_t k = g->k, n = g->n, io = g->io;
  const int64_t kp = (k + 1) / 2, panels = (n + NR - 1) / NR, tiles = (m + MR - 1) / MR;
  const int64_t chunks = (tiles + CHUNK - 1) / CHUNK, units = panels * chunks;
  const int64_t rows_outer = kp * n * (int64_t)sizeof(uint32_t) <= ROWS_OUTER_BYTES;
  const int a_bf16 = (io & IO_A_BF16) != 0;
  MAYBE_PARALLEL(threads_pay(batch * units, batch * m * k * n), {
    uint32_t* converted = (uint32_t*)malloc(sizeof(uint32_t) * MR * kp);
    _Pragma("omp for schedule(static)")
    for (int64_t q = 0; q < batch * units; ++q) {
      const WorkUnit unit = work_unit(q, panels, chunks, tiles, n, NR, rows_outer);
      const int64_t p = unit.p, nb = unit.nb, cols = unit.cols;
      const uint32_t* bp = b + p * g->b_batch + nb * kp * NR;
      for (int64_t t = unit.first; t < unit.last; ++t) {
        const int64_t r0 = t * MR, mr = m - r0 < MR ? m - r0 : MR;
        const uint32_t* rows[MR];
        rows[0] = as_bf16_pairs(at_elem(a, row_at(g, p, r0), a_bf16), k, a_bf16, converted);
        for (int64_t i = 1; i < MR; ++i)   /* a partial tile repeats its first row */
          rows[i] = i < mr ? as_bf16_pairs(at_elem(a, row_at(g, p, r0 + i), a_bf16), k, a_bf16, converted + i * kp)
                           : rows[0];
        const int64_t at = p * g->c_batch + r0 * c_step(g) + nb * NR;
        tile_bf16(rows, 1, mr, kp, bp, (void*)at_elem(c, at, io & IO_C_BF16), c_step(g), cols,
                  bias ? bias + nb * NR : 0,
                  at_elem(res, at, io & IO_RES_BF16), &g->act, io);
      }
    }
    free(converted);
  });
}
/* kiln_conv in BF16: B packed as bf16 pairs per kernel row, [cout/32][kh][(kw * c + 1) / 2][32]; each window
   segment (read in place, or copied with zero padding at the border) is rounded to bf16 pairs as its tile
   starts, or used as it is where the input is bf16 already (IO_A_BF16, an even segment). */
void kiln_conv_bf16(const ConvCall* g, const void* restrict x, void* y, const void* res, int64_t n) {
  const uint32_t* restrict b = g->b;
  const float* restrict bias = g->bias;
  const int64_t h = g->h, w = g->w, c = g->c, kh = g->kh, kw = g->kw, sh = g->sh, sw = g->sw, pt = g->pt, pl = g->pl;
  const int64_t oh = g->oh, ow = g->ow, cout = g->cout, io = g->io;
  const int64_t m = oh * ow, seg = kw * c, segp = (seg + 1) / 2, panels = (cout + NR - 1) / NR;
  const int64_t tiles = (m + MR - 1) / MR, chunks = (tiles + CHUNK - 1) / CHUNK, units = panels * chunks;
  const int64_t rows_outer = kh * segp * cout * (int64_t)sizeof(uint32_t) <= ROWS_OUTER_BYTES;
  const int a_bf16 = (io & IO_A_BF16) != 0;
  const size_t elem = a_bf16 ? sizeof(uint16_t) : sizeof(float);
  MAYBE_PARALLEL(threads_pay(n * units, n * m * kh * seg * cout), {
    float* pad = (float*)malloc(sizeof(float) * seg);
    uint32_t* converted = (uint32_t*)malloc(sizeof(uint32_t) * MR * kh * segp);
    const uint32_t* rows[MR * 16];   /* kernel heights up to 16 (supports() checks) */
    _Pragma("omp for schedule(static)")
    for (int64_t q = 0; q < n * units; ++q) {
      const WorkUnit unit = work_unit(q, panels, chunks, tiles, cout, NR, rows_outer);
      const int64_t p = unit.p, nb = unit.nb, cols = unit.cols;
      const uint32_t* bp = b + nb * kh * segp * NR;
      const void* image = at_elem(x, p * h * w * c, a_bf16);
      for (int64_t t = unit.first; t < unit.last; ++t) {
        const int64_t r0 = t * MR, mr = m - r0 < MR ? m - r0 : MR;
        for (int64_t i = 0; i < MR; ++i) {
          const int64_t r = r0 + (i < mr ? i : 0), oy = r / ow, x0 = (r % ow) * sw - pl;
          for (int64_t s = 0; s < kh; ++s) {
            uint32_t* d = converted + (s * MR + i) * segp;   /* bf16 input: also the border's padded copy */
            const void* src = window_segment(image, h, w, c, kw, oy * sh - pt + s, x0, a_bf16 ? (void*)d : pad, elem,
                                             0);
            rows[s * MR + i] = as_bf16_pairs(src, seg, a_bf16, d);
          }
        }
        const int64_t at = (p * m + r0) * cout + nb * NR;
        tile_bf16(rows, kh, mr, segp, bp, (void*)at_elem(y, at, io & IO_C_BF16), cout, cols,
                  bias ? bias + nb * NR : 0, at_elem(res, at, io & IO_RES_BF16), &g->act, io);
      }
    }
    free(converted);
    free(pad);
  });
}
#include "gemm_amx.h"
#else
/* Compiled on every CPU so the library stays one unit; kiln offers its BF16 tactics only where AVX512-BF16 is. */
void kiln_gemm_bf16(const GemmCall* g, const void* a, void* c, const void* res, int64_t batch, int64_t m) {
  (void)g; (void)a; (void)c; (void)res; (void)batch; (void)m;
  abort();   /* unreachable: no tactic calls it without AVX512-BF16 */
}

void kiln_conv_bf16(const ConvCall* g, const void* x, void* y, const void* res, int64_t n) {
  (void)g; (void)x; (void)y; (void)res; (void)n;
  abort();   /* unreachable, as above */
}

void kiln_gemm_bf16_amx(const GemmCall* g, const void* a, void* c, const void* res, int64_t batch, int64_t m) {
  kiln_gemm_bf16(g, a, c, res, batch, m);   /* aborts, as above: AMX CPUs all have AVX512-BF16 */
}

void kiln_conv_bf16_amx(const ConvCall* g, const void* x, void* y, const void* res, int64_t n) {
  kiln_conv_bf16(g, x, y, res, n);   /* aborts */
}

int64_t kiln_amx_ready(void) { return 0; }
#endif
