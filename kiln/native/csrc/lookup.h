/* Table lookup over bytes: y[i] = table[x[i]] for i in [begin, end), for a chain of elementwise ops whose only
   input per call is an INT8 tensor, evaluated once on all 256 byte values (kiln.tactics.lookup_c; the tables on a
   Concat's inputs, kiln.tactics.copy_c). With AVX512-VBMI one vpermi2b picks 64 bytes from 128 table entries; two
   of them cover the table's halves and the index's top bit chooses. y may be x (a kernel's fresh output mapped in
   place): each byte is read before its own position is written. */
#ifndef KILN_LOOKUP_H
#define KILN_LOOKUP_H

#include <stdint.h>
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
/* The table's four 64-byte quarters, loaded once per loop (or call) that maps bytes through it. */
typedef struct {
  __m512i q0, q1, q2, q3;
} TableQuarters;

static inline TableQuarters table_quarters(const uint8_t* table) {
  return (TableQuarters){_mm512_loadu_si512(table), _mm512_loadu_si512(table + 64), _mm512_loadu_si512(table + 128),
                         _mm512_loadu_si512(table + 192)};
}

/* 64 bytes mapped through the table: a vpermi2b per half of it, the index's top bit choosing between them (also
   qgemm.c's epilogue, on 16 requantized bytes in the low lanes). */
static inline __m512i mapped64(__m512i index, TableQuarters t) {
  const __m512i low = _mm512_permutex2var_epi8(t.q0, index, t.q1), high = _mm512_permutex2var_epi8(t.q2, index, t.q3);
  return _mm512_mask_blend_epi8(_mm512_movepi8_mask(index), low, high);
}
#endif

static inline void lookup_bytes(const uint8_t* x, uint8_t* y, int64_t begin, int64_t end,
                                const uint8_t* restrict table) {
  int64_t i = begin;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
  const TableQuarters t = table_quarters(table);
  for (; i + 64 <= end; i += 64) _mm512_storeu_si512(y + i, mapped64(_mm512_loadu_si512(x + i), t));
#endif
  for (; i < end; ++i) y[i] = table[x[i]];
}

#define LOOKUP_BLOCK 16384   /* bytes per OpenMP work unit */
#define LOOKUP_PARALLEL_MIN 262144   /* a lookup moves ~64 bytes a cycle: smaller tensors stay on one thread */

/* `SPEC void NAME(x, y, count, table)`: y = table[x] over `count` bytes by BLOCK_FN (one block of
   y[i] = table[x[i]] per call), OpenMP over blocks of LOOKUP_BLOCK; on the calling thread below MIN elements (a
   team of one costs 1-2 us). */
#define LOOKUP(SPEC, NAME, OUT, BLOCK_FN, MIN)                                                               \
  SPEC void NAME(const uint8_t* x, OUT* y, int64_t count, const OUT* restrict table) {                     \
    if (count < (MIN)) {                                                                                     \
      BLOCK_FN(x, y, 0, count, table);                                                                       \
      return;                                                                                                \
    }                                                                                                        \
    _Pragma("omp parallel for schedule(static)")                                                             \
    for (int64_t b = 0; b < (count + LOOKUP_BLOCK - 1) / LOOKUP_BLOCK; ++b)                                  \
      BLOCK_FN(x, y, b * LOOKUP_BLOCK, (b + 1) * LOOKUP_BLOCK < count ? (b + 1) * LOOKUP_BLOCK : count, table); \
  }

LOOKUP(static inline, lookup_bytes_shared, uint8_t, lookup_bytes, LOOKUP_PARALLEL_MIN)

#endif
