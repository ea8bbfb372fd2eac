/* bf16 <-> FP32 one value at a time, shared by layernorm.c and simd.h (attention.c): bf16 is FP32's upper half,
   so widening is exact; narrowing rounds to nearest even (a NaN stays a quiet NaN). */
#ifndef KILN_BF16_H
#define KILN_BF16_H

#include <stdint.h>
#include <string.h>

/* The `io` bits kiln's C kernels take for storage types (kiln.tactics.base.bf16_io): the first input, the output
   stored bf16 (else FP32). A kernel's own flags go above them. */
#define IO_X_BF16 1
#define IO_Y_BF16 2

static inline float bf16_widen(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t bf16_narrow(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif /* KILN_BF16_H */
