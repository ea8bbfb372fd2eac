/* AMX tile operations for kiln's BF16 GEMM (gemm_amx.h): the hardware's (AMX-TILE, AMX-BF16: eight tile
   registers of up to 16 rows x 64 bytes, `tdpbf16ps` C[m][n] += sum over pairs A[m][2q..2q+1] . B[q][2n..2n+1]
   in FP32) or, compiled with -DKILN_AMX_EMULATE, the same operations in plain C on thread-local tiles, so the
   kernels' packing, addressing and epilogue are tested on CPUs without AMX (under the sanitizers too).

   Linux hands out AMX state per process on request: amx_request() asks once (arch_prctl ARCH_REQ_XCOMP_PERM for
   XTILEDATA); a thread configures its tiles (TILE_CONFIG) before it uses them and releases them after. */
#ifndef KILN_AMX_H
#define KILN_AMX_H

#include <stdint.h>
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

#define TILE_CONFIG(cfg) memcpy(&amx_cfg, (cfg), sizeof amx_cfg)
#define TILE_RELEASE() memset(&amx_cfg, 0, sizeof amx_cfg)
#define TILE_ZERO(t) memset(amx_tiles[t], 0, sizeof amx_tiles[t])
#define TILE_LOAD(t, base, stride) amx_emu_load(t, base, stride)
#define TILE_STORE(t, base, stride) amx_emu_store(t, base, stride)
#define TILE_DPBF16PS(c, a, b) amx_emu_dpbf16ps(c, a, b)

static inline int amx_request(void) { return 1; }

#else
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
#define TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define TILE_RELEASE() _tile_release()
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 where the kernel lets this process use AMX tile data (asked once; harmless to ask again), else 0. */
static inline int amx_request(void) {
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
#endif

/* Every tile 16 rows x 64 bytes: what the BF16 kernels use throughout (their operands are padded to whole tiles). */
AMX_TARGET static inline void amx_configure_full_tiles(void) {
  TileConfig cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = AMX_TILE_ROWS;
    cfg.colsb[t] = AMX_TILE_BYTES;
  }
  TILE_CONFIG(&cfg);
}

#endif /* KILN_AMX_H */
