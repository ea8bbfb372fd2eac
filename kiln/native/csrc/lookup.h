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

static inline void lookup_bytes(const uint8_t* x, uint8_t* y, int64_t begin, int64_t end,
                                const uint8_t* restrict table) {
  int64_t i = begin;
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
  const __m512i t0 = _mm512_loadu_si512(table), t1 = _mm512_loadu_si512(table + 64);
  const __m512i t2 = _mm512_loadu_si512(table + 128), t3 = _mm512_loadu_si512(table + 192);
  for (; i + 64 <= end; i += 64) {
    const __m512i index = _mm512_loadu_si512(x + i);
    const __m512i low = _mm512_permutex2var_epi8(t0, index, t1), high = _mm512_permutex2var_epi8(t2, index, t3);
    _mm512_storeu_si512(y + i, _mm512_mask_blend_epi8(_mm512_movepi8_mask(index), low, high));
  }
#endif
  for (; i < end; ++i) y[i] = table[x[i]];
}

#endif
