/* LayerNormalization and kiln's SkipLayerNormalization over the trailing axes (kiln.tactics.layernorm_c): one
   pass per row for the sum, two vectorized reductions in double (mean, then the centred variance, as torch and
   onnxruntime compute it), one for the scaled output; OpenMP over rows. */
#include <stdint.h>
#include <math.h>

void kiln_layernorm(const float* restrict x, const float* restrict skip, const float* restrict gamma,
                    const float* restrict beta, float* restrict y, int64_t rows, int64_t n, double eps) {
  #pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* restrict a = x + r * n;
    float* restrict out = y + r * n;
    const float* src = a;
    if (skip) {
      const float* restrict b = skip + r * n;
      #pragma omp simd
      for (int64_t k = 0; k < n; ++k) out[k] = a[k] + b[k];
      src = out;
    }
    double sum = 0.0;
    #pragma omp simd reduction(+:sum)
    for (int64_t k = 0; k < n; ++k) sum += src[k];
    const float mean = (float)(sum / (double)n);
    double sq = 0.0;
    #pragma omp simd reduction(+:sq)
    for (int64_t k = 0; k < n; ++k) { const float d = src[k] - mean; sq += (double)d * d; }
    const float inv = (float)(1.0 / sqrt(sq / (double)n + eps));
    if (beta) {
      #pragma omp simd
      for (int64_t k = 0; k < n; ++k) out[k] = (src[k] - mean) * inv * gamma[k] + beta[k];
    } else {
      #pragma omp simd
      for (int64_t k = 0; k < n; ++k) out[k] = (src[k] - mean) * inv * gamma[k];
    }
  }
}
