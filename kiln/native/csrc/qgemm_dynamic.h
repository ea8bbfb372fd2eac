/* Dynamic quantization on kiln's INT8 kernels (kiln.tactics.dqgemm_c), part of qgemm.c's VNNI section (it uses
   that file's QGemmCall, QConvCall, QEpilogue, the GEMM and convolution entry points and their AMX variants):
   kiln_dqgemm and kiln_dqconv quantize their FP32 input as DynamicQuantizeLinear does, make the epilogue for that
   scale and zero point, and run the INT8 kernel. */

typedef void (*QGemmFn)(const QGemmCall*, const uint8_t*, void*, const void*, int64_t);
typedef void (*QConvFn)(const QConvCall*, const uint8_t*, void*, const void*);

/* DynamicQuantizeLinear of `total` FP32 values into q (their range
   widened to hold 0, NaN left out; scale and zero point in FP32 as onnxruntime computes them, rint(x / scale) + zp
   saturated to u8), shared among the threads where the tensor is large. Returns the scale; *zp_out the zero point. */
static float dynamic_quantize(const float* x, int64_t total, uint8_t* q, int32_t* zp_out) {
  const int64_t blocks = (total + 15) / 16;
  const int parallel = threads_pay(blocks, total);
  float x_lo = 0.0f, x_hi = 0.0f;
  MAYBE_PARALLEL(parallel, {
    __m512 lo = _mm512_setzero_ps(), hi = lo;   /* masked-off lanes read 0, which the range holds anyway */
    _Pragma("omp for schedule(static)")
    for (int64_t b = 0; b < blocks; ++b) {   /* min/max(v, acc) keep acc where v is NaN */
      const int64_t i = b * 16;
      const __m512 v = _mm512_maskz_loadu_ps(i + 16 <= total ? (__mmask16)0xFFFF : (__mmask16)((1u << (total - i)) - 1),
                                            x + i);
      lo = _mm512_min_ps(v, lo);
      hi = _mm512_max_ps(v, hi);
    }
    const float l = _mm512_reduce_min_ps(lo), h = _mm512_reduce_max_ps(hi);
    _Pragma("omp critical") {
      x_lo = l < x_lo ? l : x_lo;
      x_hi = h > x_hi ? h : x_hi;
    }
  });
  const float scale = x_hi == x_lo ? 1.0f : (x_hi - x_lo) / 255.0f, z = -x_lo / scale;
  const int32_t zp = (int32_t)nearbyintf(z < 0.0f ? 0.0f : z > 255.0f ? 255.0f : z);
  const __m512 vs = _mm512_set1_ps(scale);
  const float inv = quotient_reciprocal(scale), lo_q = (float)-zp, hi_q = 255.0f - (float)zp;   /* quotient16's clamp */
  const __m512i vz = _mm512_set1_epi32(zp), zero = _mm512_setzero_si512();
  MAYBE_PARALLEL(parallel, {
    _Pragma("omp for schedule(static)")
    for (int64_t b = 0; b < blocks; ++b) {   /* default MXCSR rounding: half to even */
      const int64_t i = b * 16;
      const __mmask16 mask = i + 16 <= total ? (__mmask16)0xFFFF : (__mmask16)((1u << (total - i)) - 1);
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i);
      const __m512 v = inv != 0.0f ? quotient16(xv, scale, inv, lo_q, hi_q) : _mm512_div_ps(xv, vs);
      const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(v), vz);
      _mm_mask_storeu_epi8(q + i, mask, _mm512_cvtusepi32_epi8(_mm512_max_epi32(u, zero)));
    }
  });
  *zp_out = zp;
  return scale;
}

/* The per-call epilogue for activations quantized at (scale, zp): comp = zp * colsum and x_scale * w_scale (the
   product the model's Mul takes) for `n` columns padded to whole panels, in `buffer`; FP32 out. */
static void dynamic_epilogue(QEpilogue* e, int64_t n, float scale, int32_t zp, const int32_t* colsum,
                             const float* w_scale, void* buffer) {
  const int64_t padded = (n + NR - 1) / NR * NR;
  int32_t* comp = (int32_t*)buffer;
  float* scales = (float*)(comp + padded);
  for (int64_t j = 0; j < padded; ++j) {
    comp[j] = zp * colsum[j];
    scales[j] = scale * w_scale[j];
  }
  e->comp = comp;
  e->scale = scales;
  e->pad_byte = zp;   /* a padded pixel holds the quantized zero */
}

/* One allocation: `bytes` for the quantized input, then comp and scales for n columns. */
static uint8_t* dynamic_buffers(int64_t bytes, int64_t n, void** epilogue_buffer) {
  const int64_t head = (bytes + 63) / 64 * 64, padded = (n + NR - 1) / NR * NR;
  uint8_t* q = (uint8_t*)malloc((size_t)(head + padded * 8));
  if (!q) abort();
  *epilogue_buffer = q + head;
  return q;
}

/* DynamicQMatMul: the FP32 rows x [m x k] quantized, then `gemm` with their epilogue. */
static void dqgemm(QGemmFn gemm, const QGemmCall* g, const float* x, float* y, int64_t m, const int32_t* colsum,
                   const float* w_scale) {
  void* epilogue_buffer;
  uint8_t* q = dynamic_buffers(m * g->k, g->n, &epilogue_buffer);
  int32_t zp;
  const float scale = dynamic_quantize(x, m * g->k, q, &zp);
  QGemmCall call = *g;
  dynamic_epilogue(&call.e, g->n, scale, zp, colsum, w_scale, epilogue_buffer);
  gemm(&call, q, y, 0, m);
  free(q);
}

/* DynamicQConv: the FP32 NHWC input quantized as one tensor (DynamicQuantizeLinear's one scale), then `conv`, which
   adds the FP32 residual `res` (NULL: none; it may be y itself) before the activation. */
static void dqconv(QConvFn conv, const QConvCall* g, const float* x, float* y, const float* res,
                   const int32_t* colsum, const float* w_scale) {
  const int64_t total = g->n * g->h * g->w * g->c;
  void* epilogue_buffer;
  uint8_t* q = dynamic_buffers(total, g->cout, &epilogue_buffer);
  int32_t zp;
  const float scale = dynamic_quantize(x, total, q, &zp);
  QConvCall call = *g;
  dynamic_epilogue(&call.e, g->cout, scale, zp, colsum, w_scale, epilogue_buffer);
  conv(&call, q, y, res);
  free(q);
}

void kiln_dqgemm(const QGemmCall* g, const float* x, float* y, int64_t m, const int32_t* colsum,
                 const float* w_scale) {
  dqgemm(kiln_qgemm, g, x, y, m, colsum, w_scale);
}

void kiln_dqgemm_amx(const QGemmCall* g, const float* x, float* y, int64_t m, const int32_t* colsum,
                     const float* w_scale) {
  dqgemm(kiln_qgemm_amx, g, x, y, m, colsum, w_scale);
}

void kiln_dqconv(const QConvCall* g, const float* x, float* y, const float* res, const int32_t* colsum,
                 const float* w_scale) {
  dqconv(kiln_qconv, g, x, y, res, colsum, w_scale);
}

void kiln_dqconv_amx(const QConvCall* g, const float* x, float* y, const float* res, const int32_t* colsum,
                     const float* w_scale) {
  dqconv(kiln_qconv_amx, g, x, y, res, colsum, w_scale);
}
