/* kiln's fused Attention layer (kiln.tactics.attention_c): softmax(Q·Kᵀ·scale + mask)·V per (batch, head), Q, K,
   V, the additive FP32 mask and the output read and written in place through element strides (unit inner stride;
   stride 0 along broadcast axes), each tensor FP32 or bf16 as the plan stores it.

   A work unit is one (batch x head) and a block of query rows; OpenMP shares the units out with a static
   schedule. A unit packs its head's K into key panels [Sk/P][D][P] and V into column panels [Dv/P][Sk][P] (P =
   PANEL, two vectors; zero padded; a thread keeps them while its next units read the same K and V), then per 6-row
   tile: the scores on a 6 x PANEL register tile (gemm.h's, in simd.h's vectors as wide as the CPU's), the softmax in
   FP32 (max-subtracted, in base 2), P·V on the same tile, and the output scaled by 1 / row sum as it is stored.
   The BF16 variant (AVX512-BF16) runs both products on vdpbf16ps (bf16 operand pairs, FP32 accumulation), packing K and V as bf16 pairs and
   rounding Q and P to bf16; the softmax and its row sums stay FP32.

   A row whose every key is masked with -inf gives NaN, as the ONNX graph does (Softmax over -inf), or 0 with
   ATTN_NAN_TO_ZERO (the NaN guard of SDPA's export, which turns every NaN of the output into 0). */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "parallel.h"
#include "simd.h"

#define MR 6           /* query rows per register tile */
#define PANEL (2 * VW) /* keys (Q·Kᵀ) or output columns (P·V) per packed panel: two vectors per tile row */

/* AttnCall.flags: which tensors are bf16, and the NaN guard. */
#define ATTN_Q_BF16 1
#define ATTN_K_BF16 2
#define ATTN_V_BF16 4
#define ATTN_OUT_BF16 8
#define ATTN_NAN_TO_ZERO 16

#define UNITS_PER_THREAD 4   /* split heads into query-row blocks until each thread has this many units... */
#define MIN_BLOCK_TILES 8    /* ...but a block keeps 8 row tiles, so packing its head's K and V stays under ~20 % */

/* A layer's geometry, fixed per input shape (kiln.tactics.attention_c.AttnCall mirrors it field by field):
   element strides of Q [batch][heads][sq][d], K [..][sk][d], V [..][sk][dv], the mask [..][sq][sk] and the
   output [..][sq][dv]. Grouped-query attention: query head h reads K and V head h / kv_group (k_h and v_h step
   from one K/V head to the next), so an exported GQA's K and V, expanded across each group with stride 0, are read
   in place and packed once per group. */
typedef struct {
  int64_t batch, heads, sq, sk, d, dv;
  int64_t q_b, q_h, q_s, k_b, k_h, k_s, v_b, v_h, v_s;
  int64_t m_b, m_h, m_q, m_k, o_b, o_h, o_s;
  int64_t q_at, k_at, v_at, m_at;   /* bytes from each pointer passed to where its operand starts */
  int64_t kv_group;                 /* query heads per K/V head (1: none shared) */
  float scale;
  int32_t flags;
} AttnCall;

static inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

#define LOG2E 1.44269504088896341f

/* A mask value in base 2, m * log2(e), kept at -FLT_MAX where a finite m (the float minimum HF's exports add)
   overflows: a row masked with it throughout then stays uniform, as its softmax in FP32 is; -inf stays -inf. */
static inline vf mask2(vf m) {
  const vf x = m * LOG2E;
  return v_select((vi)(x == -INFINITY) & (vi)(m != -INFINITY), (vf){0} - FLT_MAX, x);
}

/* VW raw scores of keys j.. in base 2: (raw * scale + the mask) * log2(e), `count` of them real (the rest, and all
   where count <= 0, -inf). */
static inline vf scaled(vf raw, const float* restrict m, int64_t j, int64_t count, float scale2, int64_t m_k) {
  if (count >= VW && (!m || m_k == 1)) return raw * scale2 + (m ? mask2(*(const vf*)(m + j)) : (vf){0});
  vf x, mv = {0};
  for (int i = 0; i < VW; ++i) mv[i] = m && i < count ? m[(j + i) * m_k] : 0.0f;
  mv = mask2(mv);
  for (int i = 0; i < VW; ++i) x[i] = i < count ? raw[i] * scale2 + mv[i] : -INFINITY;
  return x;
}

/* Each row's max from its lanes' maxima; 0 where every key is -inf, so exp gives 0 throughout. */
static inline void row_tops(const vf* vmax, int64_t mr, float* top) {
  for (int64_t i = 0; i < mr; ++i) {
    top[i] = h_max(vmax[i]);
    top[i] = top[i] == -INFINITY ? 0.0f : top[i];
  }
}

/* 1 / each row's sum; NaN where no key is left (0 with the guard), as ONNX's Softmax over -inf. */
static inline void row_inverses(const vf* sum, int64_t mr, float* inv) {
  for (int64_t i = 0; i < mr; ++i) {
    const float total = h_sum(sum[i]);
    inv[i] = total > 0.0f ? 1.0f / total : NAN;
  }
}

/* A tile's mr raw score rows (row stride ld) in place: scaled and masked (the mask's row i at m + i * m_q, key
   stride m_k), then exp(s - the row's max) over the row rounded up to VW (the padding exactly 0); inv[i] = 1 / row
   i's sum. The rows go through each pass together, so their max and sum chains interleave. */
static void softmax_rows(float* restrict s, int64_t ld, int64_t mr, int64_t n, float scale, const float* restrict m,
                         int64_t m_q, int64_t m_k, float* inv) {
  const int64_t nv = round_up(n, VW);
  vf vmax[MR], sum[MR];
  float top[MR];
  for (int64_t i = 0; i < mr; ++i) vmax[i] = (vf){0} - INFINITY, sum[i] = (vf){0};
  for (int64_t j = 0; j < nv; j += VW)
    for (int64_t i = 0; i < mr; ++i) {
      const vf x = scaled(*(const vf*)(s + i * ld + j), m ? m + i * m_q : 0, j, n - j, scale * LOG2E, m_k);
      *(vf*)(s + i * ld + j) = x;
      vmax[i] = v_max(vmax[i], x);
    }
  row_tops(vmax, mr, top);
  for (int64_t j = 0; j < nv; j += VW)
    for (int64_t i = 0; i < mr; ++i) {
      const vf e = v_exp2(*(const vf*)(s + i * ld + j) - top[i], 0);
      *(vf*)(s + i * ld + j) = e;
      sum[i] += e;
    }
  row_inverses(sum, mr, inv);
}

/* One output row: o[c] * inv for c < dv, NaN as 0 under the guard, FP32 or bf16. */
static void store_out(const float* restrict o, float inv, void* out, int64_t at, int64_t dv, int32_t flags) {
  for (int64_t c = 0; c < dv; c += VW) {   /* o is padded to whole panels: whole vectors read, `n` stored */
    vf x = *(const vf*)(o + c) * inv;
    if (flags & ATTN_NAN_TO_ZERO) x = v_select((vi)(x != x), (vf){0}, x);
    const int64_t n = dv - c < VW ? dv - c : VW;
    if (flags & ATTN_OUT_BF16) {
      const vh h = v_bf16(x);
      if (n == VW) *(vh*)((uint16_t*)out + at + c) = h;
      else memcpy((uint16_t*)out + at + c, &h, sizeof(uint16_t) * n);
    } else if (n == VW) {
      *(vf*)((float*)out + at + c) = x;
    } else {
      memcpy((float*)out + at + c, &x, sizeof(float) * n);
    }
  }
}

/* Per-thread buffers: the packed K and V of one head, a tile's scores and outputs, and its rows as operands. */
typedef struct {
  int64_t skp, dvp, dp, skq;   /* sk and dv rounded up to whole panels; d and sk in bf16 pairs */
  void *k, *v, *rows;
  float *s, *o;
} Scratch;

/* The buffers in one 64-byte aligned block (one allocation per thread and call). */
static Scratch scratch_new(const AttnCall* c) {
  Scratch w;
  w.skp = round_up(c->sk, PANEL);
  w.dvp = round_up(c->dv, PANEL);
  w.dp = (c->d + 1) / 2;
  w.skq = (c->sk + 1) / 2;
  const int64_t tile_rows = MR * (2 * w.dp > w.skp ? 2 * w.dp : w.skp), key_rows = VW * 2 * w.dp;
  const int64_t sizes[5] = {w.skp * 2 * w.dp, w.dvp * 2 * w.skq, tile_rows > key_rows ? tile_rows : key_rows,
                            MR * w.skp, MR * w.dvp};   /* floats: K, V, operand rows, scores, outputs */
  int64_t at[5], total = 0;
  for (int i = 0; i < 5; ++i) at[i] = total, total += round_up(sizes[i], 16);
  float* block = (float*)aligned_alloc(64, sizeof(float) * (size_t)(total > 0 ? total : 16));
  w.k = block + at[0], w.v = block + at[1], w.rows = block + at[2], w.s = block + at[3], w.o = block + at[4];
  return w;
}

static void scratch_free(Scratch* w) { free(w->k); }

/* VW keys into a key panel: word e of key r (rows[r]; NULL: a missing key, zeros) to dst[e * PANEL + r] for e < n,
   VW x VW blocks at a time through registers, the tail word by word. */
static void transpose_keys(const word* const* rows, int64_t n, word* dst) {
  int64_t e0 = 0;
  for (; e0 + VW <= n; e0 += VW) {
    vword t[VW];
    for (int r = 0; r < VW; ++r) t[r] = rows[r] ? *(const vword*)(rows[r] + e0) : (vword){0};
    transpose_block(t);
    for (int r = 0; r < VW; ++r) *(vword*)(dst + (e0 + r) * PANEL) = t[r];
  }
  for (; e0 < n; ++e0)
    for (int r = 0; r < VW; ++r) dst[e0 * PANEL + r] = rows[r] ? rows[r][e0] : 0;
}

/* FP32 operands: K as key panels [skp/PANEL][d][PANEL], V as column panels [dvp/PANEL][sk][PANEL], zero padded. */
static void pack_f32(const AttnCall* c, const void* k, const void* v, Scratch* w) {
  const int64_t sk = c->sk, d = c->d, dv = c->dv;
  float* restrict kp = (float*)w->k;
  float* restrict vp = (float*)w->v;
  float* restrict tmp = (float*)w->rows;   /* bf16 keys widened */
  for (int64_t j0 = 0; j0 < w->skp; j0 += VW) {
    const word* rows[VW];
    for (int r = 0; r < VW; ++r) {
      const int64_t j = j0 + r;
      if (j >= sk) {
        rows[r] = 0;
      } else if (c->flags & ATTN_K_BF16) {
        const uint16_t* row = (const uint16_t*)k + j * c->k_s;
        for (int64_t e = 0; e < d; ++e) tmp[r * d + e] = bf16_widen(row[e]);
        rows[r] = (const word*)(tmp + r * d);
      } else {
        rows[r] = (const word*)((const float*)k + j * c->k_s);
      }
    }
    transpose_keys(rows, d, (word*)kp + (j0 / PANEL) * d * PANEL + j0 % PANEL);
  }
  for (int64_t j = 0; j < sk; ++j)
    for (int64_t nb = 0; nb < w->dvp / PANEL; ++nb) {
      float* restrict dst = vp + (nb * sk + j) * PANEL;
      const int64_t cols = dv - nb * PANEL < PANEL ? dv - nb * PANEL : PANEL;
      if (c->flags & ATTN_V_BF16) {
        const uint16_t* row = (const uint16_t*)v + j * c->v_s + nb * PANEL;
        for (int64_t e = 0; e < PANEL; ++e) dst[e] = e < cols ? bf16_widen(row[e]) : 0.0f;
      } else if (cols == PANEL) {
        const float* row = (const float*)v + j * c->v_s + nb * PANEL;
        *(vf*)dst = *(const vf*)row;
        *(vf*)(dst + VW) = *(const vf*)(row + VW);
      } else {
        const float* row = (const float*)v + j * c->v_s + nb * PANEL;
        for (int64_t e = 0; e < PANEL; ++e) dst[e] = e < cols ? row[e] : 0.0f;
      }
    }
}

/* gemm.h's register tile at this vector width: rows a[i] (k floats each, read in place) times the panel b [k][PANEL],
   all PANEL columns stored into c (row stride ldc). 2 x MR accumulators: 12 of AVX2's 16 registers. */
static void product_tile(const float* const* restrict a, int64_t mr, int64_t k, const float* restrict b, float* c,
                         int64_t ldc) {
  vf acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = (vf){0};
  for (int64_t l = 0; l < k; ++l) {
    const vf b0 = *(const vf*)(b + l * PANEL), b1 = *(const vf*)(b + l * PANEL + VW);
    for (int i = 0; i < MR; ++i) {
      const float x = a[i][l];
      acc[i][0] += x * b0;
      acc[i][1] += x * b1;
    }
  }
  for (int64_t i = 0; i < mr; ++i) {
    *(vf*)(c + i * ldc) = acc[i][0];
    *(vf*)(c + i * ldc + VW) = acc[i][1];
  }
}

#define DEAD_KEY -1e30f   /* a mask value at or below it (-inf, or the float minimum HF's exports add) kills its key */

/* 1 + the last key that some row of a tile (mr mask rows from m, row stride m_q) keeps alive (mask > DEAD_KEY).
   Past it every row's scores are at most ~-1e30 below a live key's, so exp gives exactly 0: they add nothing to the
   softmax sums or P·V, and the products stop there. A causal mask's upper triangle, half of a decoder's prefill, is
   skipped tile by tile. A row with no live key keeps every key (its softmax over -inf is NaN, over the float minimum
   uniform), as do keys broadcast by stride. A non-finite V value at a skipped key (NaN through 0 x Inf in the ONNX
   graph) is not read, so it no longer spreads, except at the key after an odd count in the BF16 path (pairs). */
static int64_t live_keys(const float* m, int64_t mr, int64_t m_q, int64_t m_k, int64_t sk) {
  if (!m || m_k != 1) return sk;
  int64_t live = 0;
  for (int64_t i = 0; i < (m_q ? mr : 1); ++i) {
    const float* row = m + i * m_q;
    int64_t j = sk;
    while (j > 0 && row[j - 1] <= DEAD_KEY) --j;
    if (j == 0) return sk;
    live = j > live ? j : live;
  }
  return live;
}

/* FP32 math on one tile of mr query rows from row r0: scores, softmax, P·V over the live keys, stored. `q`,
   `mask` and `out` point at this (batch, head). */
static void tile_f32(const AttnCall* c, Scratch* w, const void* q, const float* mask, void* out, int64_t r0,
                     int64_t mr) {
  const float* rows[MR];
  float* qw = (float*)w->rows;
  for (int64_t i = 0; i < MR; ++i) {
    const int64_t r = r0 + (i < mr ? i : 0);
    if (c->flags & ATTN_Q_BF16) {
      for (int64_t e = 0; e < c->d; ++e) qw[i * c->d + e] = bf16_widen(((const uint16_t*)q)[r * c->q_s + e]);
      rows[i] = qw + i * c->d;
    } else {
      rows[i] = (const float*)q + r * c->q_s;
    }
  }
  const float* m = mask ? mask + r0 * c->m_q : 0;
  const int64_t n = live_keys(m, mr, c->m_q, c->m_k, c->sk);
  for (int64_t nb = 0; nb < round_up(n, PANEL) / PANEL; ++nb)
    product_tile(rows, mr, c->d, (const float*)w->k + nb * c->d * PANEL, w->s + nb * PANEL, w->skp);
  float inv[MR];
  softmax_rows(w->s, w->skp, mr, n, c->scale, m, c->m_q, c->m_k, inv);
  for (int64_t i = 0; i < MR; ++i) rows[i] = w->s + (i < mr ? i : 0) * w->skp;
  for (int64_t nb = 0; nb < w->dvp / PANEL; ++nb)
    product_tile(rows, mr, n, (const float*)w->v + nb * c->sk * PANEL, w->o + nb * PANEL, w->dvp);
  for (int64_t i = 0; i < mr; ++i) store_out(w->o + i * w->dvp, inv[i], out, (r0 + i) * c->o_s, c->dv, c->flags);
}

typedef void (*PackFn)(const AttnCall*, const void*, const void*, Scratch*);
typedef void (*TileFn)(const AttnCall*, Scratch*, const void*, const float*, void*, int64_t, int64_t);

/* The work split: units of (batch x head, query-row block), static schedule; a thread packs K and V once for its
   consecutive units that read the same ones (a head's row blocks, a group's heads, heads broadcast one K). */
static void run_units(const AttnCall* c, const void* q, const void* k, const void* v, const float* mask, void* out,
                      PackFn pack, TileFn compute) {
  const int64_t heads = c->batch * c->heads, tiles = (c->sq + MR - 1) / MR;
  const int64_t threads = omp_get_max_threads();
  const int64_t most = tiles / MIN_BLOCK_TILES > 1 ? tiles / MIN_BLOCK_TILES : 1;
  int64_t blocks = 1;   /* the fewest that share the units evenly among the threads, or give each several */
  while (blocks < most && (heads * blocks) % threads != 0 && heads * blocks < UNITS_PER_THREAD * threads) ++blocks;
  const size_t q_size = c->flags & ATTN_Q_BF16 ? 2 : 4, k_size = c->flags & ATTN_K_BF16 ? 2 : 4;
  const size_t v_size = c->flags & ATTN_V_BF16 ? 2 : 4, o_size = c->flags & ATTN_OUT_BF16 ? 2 : 4;
  const int64_t macs = heads * c->sq * c->sk * (c->d + c->dv);
  q = (const char*)q + c->q_at, k = (const char*)k + c->k_at, v = (const char*)v + c->v_at;
  mask = mask ? (const float*)((const char*)mask + c->m_at) : 0;
  MAYBE_PARALLEL(threads_pay(heads * blocks, macs), {
    Scratch w = scratch_new(c);
    const char *packed_k = 0, *packed_v = 0;
    _Pragma("omp for schedule(static)")
    for (int64_t u = 0; u < heads * blocks; ++u) {
      const int64_t bh = u / blocks, blk = u % blocks, b = bh / c->heads, h = bh % c->heads, kvh = h / c->kv_group;
      const char* kh = (const char*)k + (b * c->k_b + kvh * c->k_h) * k_size;
      const char* vh = (const char*)v + (b * c->v_b + kvh * c->v_h) * v_size;
      if (kh != packed_k || vh != packed_v) {
        pack(c, kh, vh, &w);
        packed_k = kh, packed_v = vh;
      }
      const int64_t base = tiles / blocks, extra = tiles % blocks;
      const int64_t first = blk * base + (blk < extra ? blk : extra), last = first + base + (blk < extra);
      const void* qh = (const char*)q + (b * c->q_b + h * c->q_h) * q_size;
      const float* mh = mask ? mask + b * c->m_b + h * c->m_h : 0;
      void* oh = (char*)out + (b * c->o_b + h * c->o_h) * o_size;
      for (int64_t t = first; t < last; ++t) {
        const int64_t r0 = t * MR;
        compute(c, &w, qh, mh, oh, r0, c->sq - r0 < MR ? c->sq - r0 : MR);
      }
    }
    scratch_free(&w);
  });
}

void kiln_attention(const AttnCall* call, const void* q, const void* k, const void* v, const float* mask,
                    void* out) {
  run_units(call, q, k, v, mask, out, pack_f32, tile_f32);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

/* n values of a row as bf16 pairs (an odd n paired with 0): `src` itself where it is bf16 already, n even and
   4-byte aligned, else rounded (FP32, 32 at a time, the tail through masked loads) or copied (bf16) into `dst`. */
static const uint32_t* row_pairs(const void* src, int64_t n, int src_bf16, uint32_t* dst) {
  if (src_bf16) {
    if (n % 2 == 0 && ((uintptr_t)src & 3) == 0) return (const uint32_t*)src;
    memcpy(dst, src, sizeof(uint16_t) * n);
    if (n % 2) ((uint16_t*)dst)[n] = 0;
    return dst;
  }
  const float* f = (const float*)src;
  int64_t j = 0;
  for (; j + 32 <= n; j += 32)
    _mm512_storeu_si512(dst + j / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(f + j + 16), _mm512_loadu_ps(f + j)));
  if (j < n) {
    const int64_t left = n - j, pairs = (left + 1) / 2;
    const __mmask16 lo = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __mmask16 hi = left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : (__mmask16)0;
    const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, f + j + 16), _mm512_maskz_loadu_ps(lo, f + j));
    _mm512_mask_storeu_epi32(dst + j / 2, (__mmask16)((1u << pairs) - 1), (__m512i)x);
  }
  return dst;
}

/* Up to 16 values of a row (`cols`, the rest 0) as bf16 in the low halves of 32-bit lanes. */
static inline __m512i bf16_lanes(const void* src, int64_t cols, int src_bf16) {
  const __mmask16 keep = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
  const __m256i h = src_bf16 ? _mm256_maskz_loadu_epi16(keep, src)
                             : (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, src));
  return _mm512_cvtepu16_epi32(h);
}

/* bf16 operands: K as key panels of d-pairs [skp/32][dp][32], V as column panels of key pairs [dvp/32][skq][32]
   (each 32-bit lane two bf16 values of one column), odd tails paired with 0. `w->rows` is free here. */
static void pack_bf16(const AttnCall* c, const void* k, const void* v, Scratch* w) {
  const int k_half = (c->flags & ATTN_K_BF16) != 0, v_half = (c->flags & ATTN_V_BF16) != 0;
  const size_t k_size = k_half ? 2 : 4, v_size = v_half ? 2 : 4;
  const int64_t sk = c->sk, dp = w->dp;
  uint32_t* restrict kp = (uint32_t*)w->k;
  uint32_t* restrict vp = (uint32_t*)w->v;
  for (int64_t j0 = 0; j0 < w->skp; j0 += VW) {
    const word* rows[VW];
    for (int r = 0; r < VW; ++r)
      rows[r] = j0 + r >= sk ? 0 : row_pairs((const char*)k + (j0 + r) * c->k_s * k_size, c->d, k_half,
                                             (uint32_t*)w->rows + r * dp);
    transpose_keys(rows, dp, kp + (j0 / PANEL) * dp * PANEL + j0 % PANEL);
  }
  for (int64_t p = 0; p < w->skq; ++p) {
    const char* row0 = (const char*)v + 2 * p * c->v_s * v_size;
    const char* row1 = 2 * p + 1 < sk ? row0 + c->v_s * v_size : 0;
    for (int64_t e = 0; e < w->dvp; e += 16) {
      const int64_t cols = c->dv - e;
      __m512i lanes = _mm512_setzero_si512();
      if (cols > 0) {
        lanes = bf16_lanes(row0 + e * v_size, cols, v_half);
        if (row1) lanes = _mm512_or_si512(lanes, _mm512_slli_epi32(bf16_lanes(row1 + e * v_size, cols, v_half), 16));
      }
      _mm512_storeu_si512(vp + ((e / PANEL) * w->skq + p) * PANEL + e % PANEL, lanes);
    }
  }
}

/* The accumulators of a 6 x 32 tile of bf16-pair products: rows a[i] (kp pairs each) times the panel b [kp][32]. */
#define DP_TILE(acc, a, kp, b)                                                     \
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();      \
  for (int64_t p = 0; p < kp; ++p) {                                             \
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * PANEL);             \
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * PANEL + 16);        \
    for (int i = 0; i < MR; ++i) {                                               \
      const __m512bh ai = (__m512bh)_mm512_set1_epi32((int)a[i][p]);             \
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);                          \
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);                          \
    }                                                                            \
  }

/* P·V with P rounded to bf16 (its row sums stay FP32). Until 2026-11-24 P was split into two bf16 parts, hi + lo,
   at 1.5x the cost of this product; over 8 random inputs of BERT-base (random weights) the mean 1 - cosine to FP32 was the
   same either way (last_hidden_state 0.00165 split, 0.00175 rounded; pooler 0.00346 and 0.00337): the model's other
   roundings dominate. The tile is stored whole into c (row stride ldc floats). */
static void values_dp(const uint32_t* const* a, int64_t mr, int64_t kp, const uint32_t* restrict b, float* c,
                      int64_t ldc) {
  __m512 acc[MR][2];
  DP_TILE(acc, a, kp, b)
  for (int64_t i = 0; i < mr; ++i) {
    _mm512_storeu_ps(c + i * ldc, acc[i][0]);
    _mm512_storeu_ps(c + i * ldc + 16, acc[i][1]);
  }
}

/* Q·Kᵀ for keys col0.. (one panel): the scores stored scaled and masked in base 2 into the rows of s (stride ld;
   keys past n -inf), each row's running max in vmax: the softmax's first pass, done while the tile is in registers. */
static void scores_dp(const uint32_t* const* a, int64_t mr, int64_t kp, const uint32_t* restrict b, float* s,
                      int64_t ld, int64_t col0, int64_t n, float scale2, const float* m, int64_t m_q, int64_t m_k,
                      vf* vmax) {
  __m512 acc[MR][2];
  DP_TILE(acc, a, kp, b)
  for (int64_t i = 0; i < mr; ++i)
    for (int h = 0; h < 2; ++h) {
      const int64_t j = col0 + VW * h;
      const vf x = scaled((vf)acc[i][h], m ? m + i * m_q : 0, j, n - j, scale2, m_k);
      *(vf*)(s + i * ld + j) = x;
      vmax[i] = v_max(vmax[i], x);
    }
}

/* The softmax's exp pass over a tile's base-2 scores (rows of n32, a multiple of 32), written straight as bf16
   pairs of keys for P·V (row stride pld): P is never stored in FP32; inv[i] = 1 / row i's FP32 sum. */
static void softmax_pairs(const float* restrict s, int64_t ld, int64_t mr, int64_t n32, const vf* vmax,
                          uint32_t* p, int64_t pld, float* inv) {
  vf sum[MR];
  float top[MR];
  row_tops(vmax, mr, top);
  for (int64_t i = 0; i < mr; ++i) sum[i] = (vf){0};
  for (int64_t j = 0; j < n32; j += 32)
    for (int64_t i = 0; i < mr; ++i) {
      const vf e0 = v_exp2(*(const vf*)(s + i * ld + j) - top[i], 1);
      const vf e1 = v_exp2(*(const vf*)(s + i * ld + j + 16) - top[i], 1);
      sum[i] += e0 + e1;
      _mm512_storeu_si512(p + i * pld + j / 2, (__m512i)_mm512_cvtne2ps_pbh((__m512)e1, (__m512)e0));
    }
  row_inverses(sum, mr, inv);
}

/* BF16 math on one tile: Q rounded to bf16 pairs, scores and P·V on vdpbf16ps, softmax in FP32. */
static void tile_bf16(const AttnCall* c, Scratch* w, const void* q, const float* mask, void* out, int64_t r0,
                      int64_t mr) {
  const uint32_t* rows[MR];
  uint32_t* pairs = (uint32_t*)w->rows;
  const size_t q_size = c->flags & ATTN_Q_BF16 ? 2 : 4;
  const int64_t pld = w->skp / 2;
  for (int64_t i = 0; i < MR; ++i) {
    const int64_t r = r0 + (i < mr ? i : 0);
    rows[i] = row_pairs((const char*)q + r * c->q_s * q_size, c->d, c->flags & ATTN_Q_BF16, pairs + i * w->dp);
  }
  vf vmax[MR];
  for (int64_t i = 0; i < MR; ++i) vmax[i] = (vf){0} - INFINITY;
  const float* m = mask ? mask + r0 * c->m_q : 0;
  const int64_t n = live_keys(m, mr, c->m_q, c->m_k, c->sk), n32 = round_up(n, PANEL);
  for (int64_t nb = 0; nb < n32 / PANEL; ++nb)
    scores_dp(rows, mr, w->dp, (const uint32_t*)w->k + nb * w->dp * PANEL, w->s, w->skp, nb * PANEL, n,
              c->scale * LOG2E, m, c->m_q, c->m_k, vmax);
  float inv[MR];
  softmax_pairs(w->s, w->skp, mr, n32, vmax, pairs, pld, inv);   /* Q's pairs are spent: P's overwrite them */
  for (int64_t i = 0; i < MR; ++i) rows[i] = pairs + (i < mr ? i : 0) * pld;
  for (int64_t nb = 0; nb < w->dvp / PANEL; ++nb)
    values_dp(rows, mr, (n + 1) / 2, (const uint32_t*)w->v + nb * w->skq * PANEL, w->o + nb * PANEL, w->dvp);
  for (int64_t i = 0; i < mr; ++i) store_out(w->o + i * w->dvp, inv[i], out, (r0 + i) * c->o_s, c->dv, c->flags);
}

void kiln_attention_bf16(const AttnCall* call, const void* q, const void* k, const void* v, const float* mask,
                         void* out) {
  run_units(call, q, k, v, mask, out, pack_bf16, tile_bf16);
}
#else
/* Compiled on every CPU so the library stays one unit; kiln offers its BF16 tactic only where AVX512-BF16 is. */
void kiln_attention_bf16(const AttnCall* call, const void* q, const void* k, const void* v, const float* mask,
                         void* out) {
  (void)call; (void)q; (void)k; (void)v; (void)mask; (void)out;
  abort();   /* unreachable: no tactic calls it without AVX512-BF16 */
}
#endif
