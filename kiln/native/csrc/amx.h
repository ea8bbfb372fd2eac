/* AMX tile operations for kiln's BF16 and INT8 GEMMs (gemm_amx.h, qgemm_amx.h): the hardware's (AMX-TILE,
   AMX-BF16, AMX-INT8: eight tile registers of up to 16 rows x 64 bytes; `tdpbf16ps` C[m][n] += sum over pairs
   A[m][2q..2q+1] . B[q][2n..2n+1] in FP32, `tdpbusd` the same over u8 x s8 quads in int32) or, compiled with
   -DKILN_AMX_EMULATE, the same operations in plain C on thread-local tiles, so the kernels' packing, addressing
   and epilogue are tested on CPUs without AMX (under the sanitizers too).

   Linux hands out AMX state per process on request: amx_request() asks once (arch_prctl ARCH_REQ_XCOMP_PERM for
   XTILEDATA); a thread configures its tiles (TILE_CONFIG) before it uses them and releases them after. */
#ifndef KILN_AMX_H
#define KILN_AMX_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define AMX_TILE_ROWS 16    /* rows of a tile */
#define AMX_TILE_BYTES 64   /* bytes of a tile row: 16 FP32, or 16 bf16 pairs */

typedef struct {    /* palette 1's 64-byte tile configuration (ldtilecfg's memory operand) */
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} TileConfig;

#ifdef KILN_AMX_EMULATE
#include "bf16.h"

#define AMX_TARGET
static __thread TileConfig amx_cfg;
static __thread uint8_t amx_tiles[8][AMX_TILE_ROWS][AMX_TILE_BYTES];

static inline void amx_emu_load(int t, const void* base, int64_t stride) {
  for (int r = 0; r < amx_cfg.rows[t]; ++r) memcpy(amx_tiles[t][r], (const char*)base + r * stride, amx_cfg.colsb[t]);
}

static inline void amx_emu_store(int t, void* base, int64_t stride) {
  for (int r = 0; r < amx_cfg.rows[t]; ++r) memcpy((char*)base + r * stride, amx_tiles[t][r], amx_cfg.colsb[t]);
}

static inline void amx_emu_dpbf16ps(int c, int a, int b) {
  for (int m = 0; m < amx_cfg.rows[c]; ++m)
    for (int n = 0; n < amx_cfg.colsb[c] / 4; ++n) {
      float acc;
      memcpy(&acc, &amx_tiles[c][m][4 * n], sizeof acc);
      for (int q = 0; q < amx_cfg.colsb[a] / 4; ++q) {
        uint16_t a2[2], b2[2];
        memcpy(a2, &amx_tiles[a][m][4 * q], sizeof a2);
        memcpy(b2, &amx_tiles[b][q][4 * n], sizeof b2);
        acc += bf16_widen(a2[0]) * bf16_widen(b2[0]) + bf16_widen(a2[1]) * bf16_widen(b2[1]);
      }
      memcpy(&amx_tiles[c][m][4 * n], &acc, sizeof acc);
    }
}

static inline void amx_emu_dpbusd(int c, int a, int b) {
  for (int m = 0; m < amx_cfg.rows[c]; ++m)
    for (int n = 0; n < amx_cfg.colsb[c] / 4; ++n) {
      int32_t acc;
      memcpy(&acc, &amx_tiles[c][m][4 * n], sizeof acc);
      for (int q = 0; q < amx_cfg.colsb[a] / 4; ++q)
        for (int j = 0; j < 4; ++j)
          acc += (int32_t)amx_tiles[a][m][4 * q + j] * (int32_t)(int8_t)amx_tiles[b][q][4 * n + j];
      memcpy(&amx_tiles[c][m][4 * n], &acc, sizeof acc);
    }
}

#define TILE_CONFIG(cfg) memcpy(&amx_cfg, (cfg), sizeof amx_cfg)
#define TILE_RELEASE() memset(&amx_cfg, 0, sizeof amx_cfg)
#define TILE_ZERO(t) memset(amx_tiles[t], 0, sizeof amx_tiles[t])
#define TILE_LOAD(t, base, stride) amx_emu_load(t, base, stride)
#define TILE_STORE(t, base, stride) amx_emu_store(t, base, stride)
#define TILE_DPBF16PS(c, a, b) amx_emu_dpbf16ps(c, a, b)
#define TILE_DPBUSD(c, a, b) amx_emu_dpbusd(c, a, b)

static inline int amx_request(void) { return 1; }

#else
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8")))
#define TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define TILE_RELEASE() _tile_release()
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_DPBUSD(c, a, b) _tile_dpbusd(c, a, b)

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 where the kernel lets this process use AMX tile data (asked once; harmless to ask again), else 0. */
static inline int amx_request(void) {
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#endif

/* Every tile 16 rows x 64 bytes: what kiln's kernels use throughout (their operands are padded to whole tiles). */
AMX_TARGET __attribute__((noinline)) static void amx_begin(void) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = AMX_TILE_ROWS;
    cfg.colsb[t] = AMX_TILE_BYTES;
  }
  TILE_CONFIG(&cfg);
}

AMX_TARGET __attribute__((noinline)) static void amx_end(void) { TILE_RELEASE(); }

/* The blocking shared by the BF16 (gemm_amx.h) and INT8 (qgemm_amx.h) kernels: a block of 32 rows packed once, k
   in steps of 16 four-byte groups (bf16 pairs or u8 quads: one tile row), times panels of 32 columns packed
   [k steps x 16][32][4 bytes]. */
#define AMX_BLOCK_ROWS 32
#define AMX_BLOCK_COLS 32
#define AMX_STEP (AMX_TILE_BYTES / 4)   /* four-byte groups per tile row */

static inline int64_t amx_whole_steps(int64_t groups) { return (groups + AMX_STEP - 1) / AMX_STEP * AMX_STEP; }

/* A packed block's row stride in groups: one step more than kq, so 16 rows never sit 4 KiB apart (one L1 set). */
static inline int64_t amx_block_stride(int64_t kq) { return kq + AMX_STEP; }

/* The work split: units of (batch item, group of panels, block of 32 rows), with enough groups for two units per
   thread; `units` in all. Blocks are innermost, so where there are few (a 7x7 map: 49 rows, 2 blocks) OpenMP's
   static schedule hands each thread whole groups: it streams its share of the weights once and every block
   reuses it from L2, where blocks outermost had each thread stream all of them (2.3 MB for a 3x3 convolution of
   512 channels) and one thread finish 32 rows, the other 17. */
typedef struct { int64_t blocks, groups, per_group, panels, m, units; } AmxSplit;

static inline AmxSplit amx_split(int64_t batch, int64_t m, int64_t n, int64_t threads) {
  AmxSplit s = {(m + AMX_BLOCK_ROWS - 1) / AMX_BLOCK_ROWS, 1, 0, (n + AMX_BLOCK_COLS - 1) / AMX_BLOCK_COLS, m, 0};
  const int64_t row_units = batch * s.blocks, want = 2 * threads;
  s.groups = row_units >= want ? 1 : (want + row_units - 1) / row_units;
  s.groups = s.groups < s.panels ? s.groups : s.panels;
  s.per_group = (s.panels + s.groups - 1) / s.groups;
  s.units = row_units * s.groups;
  return s;
}

/* One thread's share of an AMX kernel's parallel region: its packed block (AMX_BLOCK_ROWS rows of `lda` four-byte
   groups), the block's 32-bit sums (32 x 32, FP32 or int32), `pad_bytes` for a border window's zero-padded copy,
   and its tiles configured (amx_worker_begin) until amx_worker_end releases all of it. */
typedef struct { uint32_t* rows; void* sums; void* pad; } AmxWorker;

static inline AmxWorker amx_worker_begin(int64_t lda, size_t pad_bytes) {
  const AmxWorker w = {(uint32_t*)aligned_alloc(64, sizeof(uint32_t) * AMX_BLOCK_ROWS * lda),
                       aligned_alloc(64, sizeof(uint32_t) * AMX_BLOCK_ROWS * AMX_BLOCK_COLS),
                       pad_bytes ? malloc(pad_bytes) : 0};
  amx_begin();
  return w;
}

static inline void amx_worker_end(AmxWorker* w) {
  amx_end();
  free(w->pad);
  free(w->sums);
  free(w->rows);
}

/* Unit u: batch item p, rows [r0, r0 + mr), panels [nb0, nb1) (empty where the groups outnumber the panels). */
typedef struct { int64_t p, r0, mr, nb0, nb1; } AmxUnit;

static inline AmxUnit amx_unit(const AmxSplit* s, int64_t u) {
  AmxUnit t = {u / (s->groups * s->blocks), u % s->blocks * AMX_BLOCK_ROWS, 0,
               (u / s->blocks) % s->groups * s->per_group, 0};
  t.mr = s->m - t.r0 < AMX_BLOCK_ROWS ? s->m - t.r0 : AMX_BLOCK_ROWS;
  t.nb1 = t.nb0 + s->per_group < s->panels ? t.nb0 + s->per_group : s->panels;
  return t;
}

/* out[32][32] (FP32 for BF16, int32 for INT8) = a[rows][kq] . b[kq][32] over the packed block's rows (the second
   16 only where `two`): tiles C 0-3 (2 x 2 of 16 x 16), A 4-5, B 6-7 (a panel's columns 0-15 and 16-31). */
AMX_TARGET __attribute__((noinline)) static void amx_block(const uint32_t* a, int64_t kq, int two, const void* b,
                                                           void* out, int int8) {
  const int64_t lda = amx_block_stride(kq) * 4, ldb = AMX_BLOCK_COLS * 4;
  const char* bb = (const char*)b;
  char* o = (char*)out;
  const uint32_t* a1 = a + AMX_TILE_ROWS * amx_block_stride(kq);
#define AMX_DP(C, A, B) do { if (int8) TILE_DPBUSD(C, A, B); else TILE_DPBF16PS(C, A, B); } while (0)
  TILE_ZERO(0);
  TILE_ZERO(1);
  TILE_ZERO(2);
  TILE_ZERO(3);
  for (int64_t q = 0; q < kq; q += AMX_STEP) {
    TILE_LOAD(4, a + q, lda);
    TILE_LOAD(6, bb + q * ldb, ldb);
    TILE_LOAD(7, bb + q * ldb + AMX_TILE_BYTES, ldb);
    AMX_DP(0, 4, 6);
    AMX_DP(1, 4, 7);
    if (two) {
      TILE_LOAD(5, a1 + q, lda);
      AMX_DP(2, 5, 6);
      AMX_DP(3, 5, 7);
    }
  }
#undef AMX_DP
  TILE_STORE(0, o, ldb);
  TILE_STORE(1, o + AMX_TILE_BYTES, ldb);
  if (two) {
    TILE_STORE(2, o + AMX_TILE_ROWS * ldb, ldb);
    TILE_STORE(3, o + AMX_TILE_ROWS * ldb + AMX_TILE_BYTES, ldb);
  }
}

#endif /* KILN_AMX_H */
