/* The work split kiln's GEMM loops share (gemm.c FP32/BF16, qgemm.c INT8): OpenMP's static schedule over units
   of (batch x column panels x row chunks), row chunks outermost where the weights fit in L2. */
#ifndef KILN_WORK_SPLIT_H
#define KILN_WORK_SPLIT_H

#include <stdint.h>

#include "parallel.h"

#define CHUNK 8   /* register tiles per work unit: one weight panel stays in L1 across them */
/* Weights up to this size stay in L2 while a row chunk runs across every panel, so the chunk's rows are read
   once and its output (and residual) rows are written in one contiguous sweep; larger weights go panel by
   panel instead, each panel streamed once while all rows pass it. */
#define ROWS_OUTER_BYTES (512 * 1024)

typedef struct { int64_t p, nb, cols, first, last; } WorkUnit;

/* Unit q names an image p, a weight panel nb of `panel` columns with its `cols` real ones (of n), and row tiles
   [first, last). The tiles are shared evenly among the chunks (33 tiles: 7,7,7,6,6 rather than 8,8,8,8,1), so
   the static schedule hands each thread the same work whichever way the units are ordered. */
static inline WorkUnit work_unit(int64_t q, int64_t panels, int64_t chunks, int64_t tiles, int64_t n,
                                 int64_t panel, int64_t rows_outer) {
  const int64_t units = panels * chunks, u = q % units;
  const int64_t nb = rows_outer ? u % panels : u / chunks, ch = rows_outer ? u / panels : u % chunks;
  const int64_t base = tiles / chunks, extra = tiles % chunks;
  const int64_t first = ch * base + (ch < extra ? ch : extra), last = first + base + (ch < extra);
  const WorkUnit unit = {q / units, nb, n - nb * panel < panel ? n - nb * panel : panel, first, last};
  return unit;
}

#endif /* KILN_WORK_SPLIT_H */
