/* The toolchain probe (kiln.native.toolchain()): builds where the C compiler makes OpenMP shared libraries that
   link the libm functions the generated kernels call (vectorized with KILN_SIMD_LIBM). */
#include "pointwise.h"

float kiln_probe(float x);

float kiln_probe(float x) { return expf(x) + tanhf(x) + erff(x) + logf(x) + log1pf(x) + expm1f(x); }
