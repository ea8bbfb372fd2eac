/* Data movement in C.
   - Reformat copies between row-major (NCHW) and channel-major (NHWC) layouts, FP32 or bf16 on either side
     (kiln.tactics.reformat): each image is a matrix transposed, [c][hw] <-> [hw][c], VW x VW blocks at a time
     through registers as 32-bit lanes (simd.h's transpose_block; bf16 widened on load, cut back on store), the
     edges element by element. Units are blocks of TB pixels, shared among the threads.
   - Row-chunk copies (kiln.tactics.copy_c): Concat, Slice and Split along one axis move, for every row of the
     axes before it (in memory order), one contiguous chunk per input; FP32 or bf16 on either side, rounded to
     nearest even when narrowed, or INT8 bytes on both, each input's mapped through a 256-entry table of its own
     where it has one (a requantization to the Concat's scale: kiln.passes.qconcat_table). Units are blocks of up
     to RB rows, each row cut into segments of at most SEG output elements where rows are long, so that a batch-1
     Concat of long rows (a detector's [1, 144, 8400] head, or one row of 700,000 elements) still shares out
     evenly. */
#include <stdint.h>
#include <string.h>

#include "lookup.h"
#include "parallel.h"
#include "simd.h"

#define TB 64   /* pixels per work unit */
/* threads_pay weighs work in multiply-adds: an element moved through a register transpose costs about as much as
   this many, so copies of more than ~4,000 elements are shared among the threads. */
#define MACS_PER_ELEMENT 16
/* ... and an element copied or converted in a row chunk about this many: copies of more than ~16,000 share. */
#define MACS_PER_COPIED 4

/* VW elements from `at` as 32-bit lanes: FP32 bits, or bf16 widened to FP32 (exact). */
static inline vword load_lanes(const void* src, int64_t at, int bf16) {
  if (!bf16) return *(const vword*)((const float*)src + at);
  vh h;
  memcpy(&h, (const uint16_t*)src + at, sizeof h);
  return __builtin_convertvector(h, vu) << 16;
}

/* VW 32-bit lanes to `at`: FP32 as they are, or bf16 (cut exactly where they came from bf16, else rounded). */
static inline void store_lanes(void* dst, int64_t at, vword t, int bf16, int exact) {
  if (!bf16) {
    *(vword*)((float*)dst + at) = t;
    return;
  }
  const vh h = exact ? __builtin_convertvector(t >> 16, vh) : v_bf16((vf)t);
  memcpy((uint16_t*)dst + at, &h, sizeof h);
}

/* dst[j * ld + i] = src[i * ls + j] for i < rows, j < cols, each side FP32 or bf16 (inlined per combination). */
static inline __attribute__((always_inline)) void transpose_tile(const void* restrict src, int64_t ls,
                                                                  void* restrict dst, int64_t ld, int64_t rows,
                                                                  int64_t cols, const int sb, const int db) {
  /* the edges element by element through typed, non-aliasing pointers, so that the compiler vectorizes them (a
     3-channel image is all edge: 0.21 ms for 3 x 640 x 640 into NHWC, 0.37 through untyped loads) */
  const float* restrict sf = (const float*)src;
  const uint16_t* restrict sh = (const uint16_t*)src;
  float* restrict df = (float*)dst;
  uint16_t* restrict dh = (uint16_t*)dst;
#define EDGE_COPY(D, S)                                                                                            \
  do {                                                                                                             \
    if (sb && db) { /* 16 bits to 16 bits: moved as they are (int16, float16, bf16 NaN payloads) */               \
      dh[D] = sh[S];                                                                                               \
      break;                                                                                                       \
    }                                                                                                              \
    const float v_ = sb ? bf16_widen(sh[S]) : sf[S];                                                               \
    if (db) dh[D] = bf16_narrow(v_);                                                                               \
    else df[D] = v_;                                                                                               \
  } while (0)
  int64_t i0 = 0;
  for (; i0 + VW <= rows; i0 += VW) {
    int64_t j0 = 0;
    for (; j0 + VW <= cols; j0 += VW) {
      vword t[VW];
      for (int r = 0; r < VW; ++r) t[r] = load_lanes(src, (i0 + r) * ls + j0, sb);
      transpose_block(t);
      for (int r = 0; r < VW; ++r) store_lanes(dst, (j0 + r) * ld + i0, t[r], db, sb);
    }
    for (; j0 < cols; ++j0)
      for (int r = 0; r < VW; ++r) EDGE_COPY(j0 * ld + i0 + r, (i0 + r) * ls + j0);
  }
  for (; i0 < rows; ++i0)
    for (int64_t j = 0; j < cols; ++j) EDGE_COPY(j * ld + i0, i0 * ls + j);
#undef EDGE_COPY
}

static void transpose_tile_io(const void* src, int64_t ls, void* dst, int64_t ld, int64_t rows, int64_t cols,
                              int io) {
  switch (io & 3) {
    case 0: transpose_tile(src, ls, dst, ld, rows, cols, 0, 0); break;
    case IO_X_BF16: transpose_tile(src, ls, dst, ld, rows, cols, 1, 0); break;
    case IO_Y_BF16: transpose_tile(src, ls, dst, ld, rows, cols, 0, 1); break;
    default: transpose_tile(src, ls, dst, ld, rows, cols, 1, 1);
  }
}

/* Each image's [rows][cols] matrix transposed into [cols][rows], in units of TB along `pixels_are_rows`' axis. */
static void transpose_images(const void* x, void* y, int64_t n, int64_t rows, int64_t cols, int pixels_are_rows,
                             int io) {
  const int64_t pixels = pixels_are_rows ? rows : cols, blocks = (pixels + TB - 1) / TB;
  const int64_t in_size = io & IO_X_BF16 ? 2 : 4, out_size = io & IO_Y_BF16 ? 2 : 4;
  MAYBE_PARALLEL(threads_pay(n * blocks, n * rows * cols * MACS_PER_ELEMENT), {
    _Pragma("omp for schedule(static)")
    for (int64_t t = 0; t < n * blocks; ++t) {
      const int64_t b = t / blocks, p0 = (t % blocks) * TB, np = pixels - p0 < TB ? pixels - p0 : TB;
      const char* src = (const char*)x + b * rows * cols * in_size;
      char* dst = (char*)y + b * rows * cols * out_size;
      if (pixels_are_rows)
        transpose_tile_io(src + p0 * cols * in_size, cols, dst + p0 * out_size, rows, np, cols, io);
      else
        transpose_tile_io(src + p0 * in_size, cols, dst + p0 * rows * out_size, rows, rows, np, io);
    }
  });
}

/* NCHW -> NHWC: y[b][p][ch] = x[b][ch][p]; `io`: which side is bf16. */
void kiln_to_nhwc(const void* restrict x, void* restrict y, int64_t n, int64_t c, int64_t hw, int64_t io) {
  transpose_images(x, y, n, c, hw, 0, (int)io);
}

/* NHWC -> NCHW: y[b][ch][p] = x[b][p][ch]. */
void kiln_to_nchw(const void* restrict x, void* restrict y, int64_t n, int64_t c, int64_t hw, int64_t io) {
  transpose_images(x, y, n, hw, c, 1, (int)io);
}


/* ------------------------------------------------------------------------------------------- row-chunk copies */
#define RB 64       /* rows per work unit, at most */
#define SEG 16384   /* output elements per work unit, at most (rows of more are cut into segments) */

/* One input's chunk: in each row, `count` elements of `src_size` bytes (4: FP32, 2: bf16, 1: INT8) from element
   `src_at` (rows `src_step` apart) go to element `dst_at` of the output's row; INT8 bytes through `table` (256
   bytes) where it is not NULL. */
typedef struct {
  int64_t src_step, src_at, count, dst_at, src_size;
  const uint8_t* table;
} CopyPart;

static inline void copy_bytes(char* restrict d, const char* restrict s, int64_t n) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) memcpy(d + i, s + i, 64);   /* fixed sizes: inlined as vector moves */
  if (i + 32 <= n) { memcpy(d + i, s + i, 32); i += 32; }
  if (i + 16 <= n) { memcpy(d + i, s + i, 16); i += 16; }
  if (i + 8 <= n) { memcpy(d + i, s + i, 8); i += 8; }
  if (i + 4 <= n) { memcpy(d + i, s + i, 4); i += 4; }
  if (i + 2 <= n) { memcpy(d + i, s + i, 2); i += 2; }
  if (i < n) d[i] = s[i];
}

/* The vector part ends at a multiple of VW computed up front: with `i + VW <= n` GCC (12, AVX2 targets) warned of
   undefined behaviour in the tail loop of a constant-count row, an iteration that never runs. */
static inline void narrow_row(uint16_t* restrict d, const float* restrict s, int64_t n) {
  const int64_t whole = n - n % VW;
  for (int64_t i = 0; i < whole; i += VW) {
    vf x;
    memcpy(&x, s + i, sizeof x);
    const vh h = v_bf16(x);
    memcpy(d + i, &h, sizeof h);
  }
  for (int64_t i = whole; i < n; ++i) d[i] = bf16_narrow(s[i]);
}

static inline void widen_row(float* restrict d, const uint16_t* restrict s, int64_t n) {
  const int64_t whole = n - n % VW;
  for (int64_t i = 0; i < whole; i += VW) {
    vh h;
    memcpy(&h, s + i, sizeof h);
    const vu u = __builtin_convertvector(h, vu) << 16;
    memcpy(d + i, &u, sizeof u);
  }
  for (int64_t i = whole; i < n; ++i) d[i] = bf16_widen(s[i]);
}

/* Rows of a fixed size: the compiler unrolls the copy or conversion into vector moves (a channel chunk of NHWC
   tensors is 16-256 bytes; a loop over a run-time count spent ~10 cycles a row on 32-byte rows, 3x torch.cat). */
#define COPY_ROWS_OF(BYTES)                                                                                        \
  case BYTES:                                                                                                      \
    for (int64_t r = r0; r < r1; ++r, s += s_step, d += d_step) memcpy(d, s, BYTES);                             \
    return;

static inline void convert_row(char* restrict d, const char* restrict s, int64_t count, int dst_bf16) {
  if (dst_bf16)
    narrow_row((uint16_t*)d, (const float*)s, count);
  else
    widen_row((float*)d, (const uint16_t*)s, count);
}

#define CONVERT_ROWS_OF(COUNT)                                                                                     \
  case COUNT:                                                                                                      \
    for (int64_t r = r0; r < r1; ++r, s += s_step, d += d_step) convert_row(d, s, COUNT, dst_bf16);              \
    return;

/* Part p's elements that land in output columns [c0, c1) of rows [r0, r1). */
static void copy_part(const CopyPart* p, const void* src, void* dst, int64_t dst_step, int64_t out_size, int64_t r0,
                      int64_t r1, int64_t c0, int64_t c1) {
  const int64_t lo = p->dst_at > c0 ? p->dst_at : c0;
  const int64_t hi = p->dst_at + p->count < c1 ? p->dst_at + p->count : c1;
  const int64_t in_size = p->src_size, count = hi - lo, dst_bf16 = out_size == 2;
  if (lo >= hi || (in_size != out_size && (in_size == 1 || out_size == 1))) return;   /* bytes are not converted */
  const int64_t s_step = p->src_step * in_size, d_step = dst_step * out_size;
  const char* s = (const char*)src + r0 * s_step + (p->src_at + lo - p->dst_at) * in_size;
  char* d = (char*)dst + r0 * d_step + lo * out_size;
  if (p->table && in_size == 1) {
    for (int64_t r = r0; r < r1; ++r, s += s_step, d += d_step)
      lookup_bytes((const uint8_t*)s, (uint8_t*)d, 0, count, p->table);
    return;
  }
  if (in_size == out_size) {
    switch (count * in_size) {
      COPY_ROWS_OF(16) COPY_ROWS_OF(32) COPY_ROWS_OF(64) COPY_ROWS_OF(96) COPY_ROWS_OF(128) COPY_ROWS_OF(192)
      COPY_ROWS_OF(256)
      default:
        for (int64_t r = r0; r < r1; ++r, s += s_step, d += d_step) copy_bytes(d, s, count * in_size);
    }
    return;
  }
  switch (count) {
    CONVERT_ROWS_OF(16) CONVERT_ROWS_OF(32) CONVERT_ROWS_OF(48) CONVERT_ROWS_OF(64) CONVERT_ROWS_OF(128)
    default:
      for (int64_t r = r0; r < r1; ++r, s += s_step, d += d_step) convert_row(d, s, count, dst_bf16);
  }
}

/* For each of `rows` rows and each part: dst[row * dst_step + dst_at + j] = srcs[part][row * src_step + src_at + j],
   j < count, elements of `dst_size` bytes, converted between FP32 and bf16 where the two sides differ, INT8 bytes
   mapped through the part's table where it has one. The parts fill columns [0, dst_cols) of each row: dst_cols is
   dst_step for a whole output, less for a slice of a wider one (a Concat's input written in place). */
void kiln_copy_rows(const CopyPart* parts, int64_t n_parts, const void* const* srcs, void* dst, int64_t dst_step,
                    int64_t dst_size, int64_t rows, int64_t dst_cols) {
  if (rows <= 0 || dst_cols <= 0) return;   /* an empty output */
  const int64_t segments = (dst_cols + SEG - 1) / SEG, width = (dst_cols + segments - 1) / segments;
  const int64_t fit = SEG / dst_cols, block = fit < 1 ? 1 : (fit > RB ? RB : fit);
  const int64_t blocks = (rows + block - 1) / block, units = blocks * segments;
  MAYBE_PARALLEL(threads_pay(units, rows * dst_cols * MACS_PER_COPIED), {
    _Pragma("omp for schedule(static)")
    for (int64_t u = 0; u < units; ++u) {
      const int64_t b = u / segments, c0 = u % segments * width, c1 = c0 + width < dst_cols ? c0 + width : dst_cols;
      const int64_t r0 = b * block, r1 = r0 + block < rows ? r0 + block : rows;
      for (int64_t k = 0; k < n_parts; ++k)
        copy_part(&parts[k], srcs[k], dst, dst_step, dst_size, r0, r1, c0, c1);
    }
  });
}


/* ------------------------------------------------------------------------------------------------ permutations */
#define PERMUTE_MAX_RANK 8
#define ST 32   /* a scalar tile's block side */

/* 1- and 8-byte tiles element by element (4- and 2-byte ones go through transpose_tile's register blocks, whose
   lanes are moved bit for bit: a bf16 side is widened and cut back exactly, any 16-bit payload unchanged). */
#define SCALAR_TILE(T)                                                                                             \
  do {                                                                                                             \
    const T* restrict s_ = (const T*)src;                                                                          \
    T* restrict d_ = (T*)dst;                                                                                      \
    for (int64_t j0 = 0; j0 < cols; j0 += ST)                                                                      \
      for (int64_t i0 = 0; i0 < rows; i0 += ST) {   /* ST x ST blocks: both sides' lines stay in L1 */            \
        const int64_t j1 = j0 + ST < cols ? j0 + ST : cols, i1 = i0 + ST < rows ? i0 + ST : rows;                  \
        for (int64_t j = j0; j < j1; ++j)                                                                          \
          for (int64_t i = i0; i < i1; ++i) d_[j * ld + i] = s_[i * ls + j];                                       \
      }                                                                                                            \
  } while (0)

static void transpose_tile_bytes(const void* src, int64_t ls, void* dst, int64_t ld, int64_t rows, int64_t cols,
                                 int64_t size) {
  switch (size) {
    case 4: transpose_tile(src, ls, dst, ld, rows, cols, 0, 0); break;
    case 2: transpose_tile(src, ls, dst, ld, rows, cols, 1, 1); break;
    case 1: SCALAR_TILE(uint8_t); break;
    default: SCALAR_TILE(uint64_t);
  }
}

/* dst = src with its axes permuted: src viewed as `rank` axes of `dims` (row-major), output axis i is input axis
   perm[i]; elements of `size` bytes (1, 2, 4 or 8). The caller merges what moves together first (no size-1 axes,
   no two input axes that stay neighbours). Where the innermost axis stays innermost each unit copies whole runs;
   otherwise the input's innermost axis (a) and the output's (b) make a matrix per index of the other axes,
   transposed TB rows of b at a time. */
void kiln_permute(const void* restrict src, void* restrict dst, int64_t rank, const int64_t* dims,
                  const int64_t* perm, int64_t size) {
  if (rank < 1 || rank > PERMUTE_MAX_RANK) return;
  int64_t in_stride[PERMUTE_MAX_RANK], out_stride[PERMUTE_MAX_RANK], others[PERMUTE_MAX_RANK], total = 1;
  for (int64_t k = rank - 1; k >= 0; --k) { in_stride[k] = total; total *= dims[k]; }
  for (int64_t i = rank - 1, s = 1; i >= 0; --i) { out_stride[perm[i]] = s; s *= dims[perm[i]]; }
  const int64_t a = rank - 1, b = perm[rank - 1];
  int64_t n_others = 0, outer = 1;
  for (int64_t k = 0; k < rank; ++k)
    if (k != a && k != b) { others[n_others++] = k; outer *= dims[k]; }
  /* a unit: TB rows of b for one index of the other axes, or (runs) RB consecutive indices, stepped like an
     odometer: decomposing each index into strides costs more than copying a short run */
  const int64_t blocks = b == a ? 1 : (dims[b] + TB - 1) / TB, per_unit = b == a ? RB : 1;
  const int64_t units = (outer + per_unit - 1) / per_unit * blocks;
  MAYBE_PARALLEL(threads_pay(units, total * (b == a ? MACS_PER_COPIED : MACS_PER_ELEMENT)), {
    _Pragma("omp for schedule(static)")
    for (int64_t u = 0; u < units; ++u) {
      const int64_t first = u / blocks * per_unit, last = first + per_unit < outer ? first + per_unit : outer;
      int64_t index[PERMUTE_MAX_RANK], rest = first, s_at = 0, d_at = 0;
      for (int64_t m = n_others - 1; m >= 0; --m) {
        const int64_t k = others[m];
        index[m] = rest % dims[k];
        rest /= dims[k];
        s_at += index[m] * in_stride[k];
        d_at += index[m] * out_stride[k];
      }
      for (int64_t o = first; o < last; ++o) {
        if (b == a) {
          copy_bytes((char*)dst + d_at * size, (const char*)src + s_at * size, dims[a] * size);
        } else {
          const int64_t b0 = u % blocks * TB, nb = dims[b] - b0 < TB ? dims[b] - b0 : TB;
          transpose_tile_bytes((const char*)src + (s_at + b0 * in_stride[b]) * size, in_stride[b],
                               (char*)dst + (d_at + b0) * size, out_stride[a], nb, dims[a], size);
        }
        for (int64_t m = n_others - 1; m >= 0; --m) {   /* the next index of the other axes */
          const int64_t k = others[m];
          s_at += in_stride[k];
          d_at += out_stride[k];
          if (++index[m] < dims[k]) break;
          s_at -= dims[k] * in_stride[k];
          d_at -= dims[k] * out_stride[k];
          index[m] = 0;
        }
      }
    }
  });
}
