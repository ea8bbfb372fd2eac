"""kiln's own float32 GEMM in C: C[m x n] = A[m x k] · B[k x n] (+ bias, + residual, ReLU), for 1x1 convolutions
on channel-major (NHWC) activations and the per-tile-position products of Winograd convolutions.

B (the weights) is packed once at load into panels of 32 columns, [n/32][k][32], so the inner loop reads it
as two straight vectors per step; A is read in place, one row per output pixel (row r at
`(r / row_width) * line_step + (r % row_width) * col_step`, which covers strided 1x1 convolutions without a
copy). A 6 x 32 register tile (12 vector accumulators) is the micro-kernel; a partial tile of rows repeats its
first row and stores only the real ones. The output may be the residual's own buffer (each element is read
before it is written, by the same thread). Bias, residual and ReLU or Swish are applied as the tile is stored. OpenMP
shares (batch, column panel, row chunk) units out on torch's own thread pool, row chunks outermost where the
weights fit in L2 (ROWS_OUTER_BYTES).

Measured on the 2-core AVX-512 CPU of this project: 200-220 GFLOP/s on ResNet-50's Winograd products, where
torch.bmm (MKL) reaches 120-190.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from kiln.ops.nn import apply_activation

# The micro-kernel below is unrolled for exactly this register tile; the C source takes both from here.
PANEL = 32        # columns per packed weight panel (NR): two 16-float vectors
ROW_TILE = 6      # rows per register tile (MR)

SOURCE = f"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#define MR {ROW_TILE}
#define NR {PANEL}
""" + r"""
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
#define CHUNK 8   /* register tiles per work unit: one weight panel stays in L1 across them */
/* Weights up to this size stay in L2 while a row chunk runs across every panel, so the chunk's rows are read
   once and its output (and residual) rows are written in one contiguous sweep; larger weights go panel by
   panel instead, each panel streamed once while all rows pass it. */
#define ROWS_OUTER_BYTES (512 * 1024)

/* Activations applied as tiles are stored: 1 ReLU, 2 Swish (x * sigmoid(x), SiLU). */
#define ACT_RELU 1
#define ACT_SWISH 2

/* x * sigmoid(x) through Cephes' expf (range reduction by ln 2, a degree-5 polynomial; a few ulp): k_swish one
   float, v_swish 16 at a time in vector registers (the loops the scalar form sits in do not vectorize). */
static inline float k_swish(float x) {
  float t = -x;
  t = t < -87.0f ? -87.0f : (t > 87.0f ? 87.0f : t);
  const float n = (float)(int32_t)(t * 1.44269504088896341f + (t < 0.0f ? -0.5f : 0.5f));
  const float r = t - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
  const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  return x / (1.0f + (p * r * r + r + 1.0f) * scale);
}

static inline v16 v_select(v16i mask, v16 a, v16 b) { return (v16)((mask & (v16i)a) | (~mask & (v16i)b)); }

static inline v16 v_swish(v16 x) {
  const v16 lo = (v16){0} - 87.0f, hi = (v16){0} + 87.0f, half = (v16){0} + 0.5f;
  v16 t = -x;
  t = v_select((v16i)(t < lo), lo, v_select((v16i)(t > hi), hi, t));
  const v16i ni = __builtin_convertvector(t * 1.44269504088896341f + v_select((v16i)(t < 0.0f), -half, half), v16i);
  const v16 n = __builtin_convertvector(ni, v16);
  const v16 r = t - n * 0.693359375f + n * 2.12194440e-4f;
  v16 p = (v16){0} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
  const v16 scale = (v16)((ni + 127) << 23);
  return x / (1.0f + (p * r * r + r + 1.0f) * scale);
}

static inline v16 epilogue(v16 v, const float* restrict bias, const float* res, int64_t act) {
  if (bias) v += *(const v16*)bias;
  if (res) v += *(const v16*)res;
  if (act == ACT_RELU) v = (v16)((v16i)v & (v16i)(v > (v16){0}));
  if (act == ACT_SWISH) v = v_swish(v);
  return v;
}

static void store_row(float* c, v16 lo, v16 hi, const float* restrict bias, const float* res,
                      int64_t act, int64_t cols) {
  if (cols == NR) {
    *(v16*)c = epilogue(lo, bias, res, act);
    *(v16*)(c + 16) = epilogue(hi, bias ? bias + 16 : 0, res ? res + 16 : 0, act);
    return;
  }
  /* a partial panel: the same vector epilogue on zero-padded copies, then only `cols` floats stored */
  float b[NR] = {0}, r[NR] = {0}, out[NR];
  if (bias) memcpy(b, bias, sizeof(float) * cols);
  if (res) memcpy(r, res, sizeof(float) * cols);
  *(v16*)out = epilogue(lo, bias ? b : 0, res ? r : 0, act);
  *(v16*)(out + 16) = epilogue(hi, bias ? b + 16 : 0, res ? r + 16 : 0, act);
  memcpy(c, out, sizeof(float) * cols);
}

/* Sums `segs` segments of `k` products into one register tile: segment s reads rows a[s * MR + i] and weights
   b + s * k * NR. A GEMM has one segment; a direct convolution one per kernel row. */
static void tile(const float* const* restrict a, int64_t segs, int64_t mr, int64_t k, const float* restrict b,
                 float* c, int64_t ldc, int64_t cols, const float* restrict bias, const float* res, int64_t act) {
  v16 c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
  v16 c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
  for (int64_t s = 0; s < segs; ++s) {
    const float *a0 = a[s * MR], *a1 = a[s * MR + 1], *a2 = a[s * MR + 2], *a3 = a[s * MR + 3];
    const float *a4 = a[s * MR + 4], *a5 = a[s * MR + 5], *bs = b + s * k * NR;
    for (int64_t l = 0; l < k; ++l) {
      const v16 b0 = *(const v16*)(bs + l * NR), b1 = *(const v16*)(bs + l * NR + 16);
      float x;
      x = a0[l]; c00 += x * b0; c01 += x * b1;
      x = a1[l]; c10 += x * b0; c11 += x * b1;
      x = a2[l]; c20 += x * b0; c21 += x * b1;
      x = a3[l]; c30 += x * b0; c31 += x * b1;
      x = a4[l]; c40 += x * b0; c41 += x * b1;
      x = a5[l]; c50 += x * b0; c51 += x * b1;
    }
  }
  const v16 lo[MR] = {c00, c10, c20, c30, c40, c50}, hi[MR] = {c01, c11, c21, c31, c41, c51};
  for (int64_t i = 0; i < mr; ++i)
    store_row(c + i * ldc, lo[i], hi[i], bias, res ? res + i * ldc : 0, act, cols);
}

void kiln_gemm(const float* restrict a, int64_t a_batch, int64_t row_width, int64_t col_step, int64_t line_step,
               const float* restrict b, int64_t b_batch, float* c, int64_t c_batch,
               const float* restrict bias, const float* res, int64_t act,
               int64_t batch, int64_t m, int64_t k, int64_t n) {
  const int64_t panels = (n + NR - 1) / NR, tiles = (m + MR - 1) / MR, chunks = (tiles + CHUNK - 1) / CHUNK;
  const int64_t units = panels * chunks, rows_outer = k * n * (int64_t)sizeof(float) <= ROWS_OUTER_BYTES;
  #pragma omp parallel for schedule(static)
  for (int64_t q = 0; q < batch * units; ++q) {
    const int64_t p = q / units, u = q % units;
    const int64_t nb = rows_outer ? u % panels : u / chunks, ch = rows_outer ? u / panels : u % chunks;
    const float* bp = b + p * b_batch + nb * k * NR;
    const int64_t cols = n - nb * NR < NR ? n - nb * NR : NR, last = (ch + 1) * CHUNK < tiles ? (ch + 1) * CHUNK : tiles;
    for (int64_t t = ch * CHUNK; t < last; ++t) {
      const int64_t r0 = t * MR, mr = m - r0 < MR ? m - r0 : MR;
      const float* rows[MR];
      for (int64_t i = 0; i < MR; ++i) {
        const int64_t r = r0 + (i < mr ? i : 0);
        rows[i] = a + p * a_batch + (r / row_width) * line_step + (r % row_width) * col_step;
      }
      const int64_t at = p * c_batch + r0 * n + nb * NR;
      tile(rows, 1, mr, k, bp, c + at, n, cols, bias ? bias + nb * NR : 0, res ? res + at : 0, act);
    }
  }
}

/* Direct convolution on NHWC input x[n][h][w][c] (dilation 1, one group): output pixel r of an image is a row
   of the GEMM, and kernel row s of its window is one segment of kw * c contiguous input floats. Windows that
   cross the border are copied into a per-thread buffer with zeros where the padding is. Weights are packed as
   for kiln_gemm from [kh][kw][c][cout]; the work split and the epilogue are kiln_gemm's. */
void kiln_conv(const float* restrict x, int64_t n, int64_t h, int64_t w, int64_t c, int64_t kh, int64_t kw,
               int64_t sh, int64_t sw, int64_t pt, int64_t pl, int64_t oh, int64_t ow,
               const float* restrict b, float* y, const float* restrict bias, const float* res, int64_t act,
               int64_t cout) {
  const int64_t m = oh * ow, seg = kw * c, panels = (cout + NR - 1) / NR, tiles = (m + MR - 1) / MR;
  const int64_t chunks = (tiles + CHUNK - 1) / CHUNK, units = panels * chunks;
  const int64_t rows_outer = kh * seg * cout * (int64_t)sizeof(float) <= ROWS_OUTER_BYTES;
  #pragma omp parallel
  {
    float* pad = (float*)malloc(sizeof(float) * MR * kh * seg);
    const float** rows = (const float**)malloc(sizeof(float*) * MR * kh);
    #pragma omp for schedule(static)
    for (int64_t q = 0; q < n * units; ++q) {
      const int64_t p = q / units, u = q % units;
      const int64_t nb = rows_outer ? u % panels : u / chunks, ch = rows_outer ? u / panels : u % chunks;
      const float* bp = b + nb * kh * seg * NR;
      const float* image = x + p * h * w * c;
      const int64_t cols = cout - nb * NR < NR ? cout - nb * NR : NR;
      const int64_t last = (ch + 1) * CHUNK < tiles ? (ch + 1) * CHUNK : tiles;
      for (int64_t t = ch * CHUNK; t < last; ++t) {
        const int64_t r0 = t * MR, mr = m - r0 < MR ? m - r0 : MR;
        for (int64_t i = 0; i < MR; ++i) {
          const int64_t r = r0 + (i < mr ? i : 0), oy = r / ow, x0 = (r % ow) * sw - pl;
          for (int64_t s = 0; s < kh; ++s) {
            const int64_t yy = oy * sh - pt + s;
            const int inside_y = yy >= 0 && yy < h;
            if (inside_y && x0 >= 0 && x0 + kw <= w) {
              rows[s * MR + i] = image + (yy * w + x0) * c;
              continue;
            }
            float* d = pad + (i * kh + s) * seg;
            for (int64_t j = 0; j < kw; ++j) {
              const int64_t xx = x0 + j;
              if (inside_y && xx >= 0 && xx < w) memcpy(d + j * c, image + (yy * w + xx) * c, sizeof(float) * c);
              else memset(d + j * c, 0, sizeof(float) * c);
            }
            rows[s * MR + i] = d;
          }
        }
        const int64_t at = (p * m + r0) * cout + nb * NR;
        tile(rows, kh, mr, seg, bp, y + at, cout, cols, bias ? bias + nb * NR : 0, res ? res + at : 0, act);
      }
    }
    free(rows);
    free(pad);
  }
}
"""


@lru_cache(maxsize=None)
def library():
    """The compiled GEMM, or None without a C compiler (callers then keep their torch paths)."""
    from kiln.tactics import codegen

    if not codegen.available():
        return None
    lib = codegen.load_library(SOURCE, "gemm")
    lib.kiln_gemm.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int64,
                              ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5
    lib.kiln_gemm.restype = None
    lib.kiln_conv.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 12 + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
    lib.kiln_conv.restype = None
    return lib


def epilogue_inputs_fit(layer, out_shape: tuple[int, ...]) -> bool:
    """A convolution's bias (input 2) is a constant where given, and its fused residual (input 3) has exactly the
    output's shape and dtype: a residual that broadcasts is added by the Add layer's own kernel."""
    shapes = layer.input_shapes
    if len(shapes) > 2 and shapes[2] is not None and 2 not in layer.const_inputs:
        return False
    return len(shapes) < 4 or shapes[3] is None or (tuple(shapes[3]) == tuple(out_shape)
                                                    and layer.input_dtypes[3] == "float32")


def nhwc_kernel(launch, out_shape: tuple[int, ...], spec: dict | None, has_residual: bool):
    """The kernel around a C launch `launch(x, out, residual)` that writes an NHWC output with bias, residual and
    ReLU or Swish applied as it stores (other activations run after it). With a residual it carries
    `into_input` (kiln.tactics.donation): the variant writing over the residual's dead buffer, each element
    read before it is overwritten."""
    post = spec if spec and not activation_code(spec) else None
    last = torch.channels_last

    def finish(out):
        return [apply_activation(post, out) if post else out]

    def run(xs):
        out = torch.empty(out_shape, memory_format=last)
        launch(xs[0].contiguous(memory_format=last), out,
               xs[3].contiguous(memory_format=last) if has_residual else None)
        return finish(out)

    def run_into_residual(xs):
        r = xs[3]
        if not r.is_contiguous(memory_format=last):
            return run(xs)
        launch(xs[0].contiguous(memory_format=last), r, r)
        return finish(r)
    if has_residual:
        run.into_input = (3, run_into_residual)
    return run


def activation_code(spec: dict | None) -> int:
    """The C kernels' fused activation: 1 ReLU, 2 Swish (alpha 1); 0 for none or one applied after the kernel."""
    if not spec:
        return 0
    if spec["op"] == "Relu":
        return 1
    return 2 if spec["op"] == "Swish" and spec.get("attrs", {}).get("alpha", 1.0) == 1.0 else 0


def pack_weights(b: torch.Tensor) -> torch.Tensor:
    """[..., k, n] -> [..., panels, k, 32] float32, the columns zero-padded to whole panels."""
    k, n = b.shape[-2:]
    panels = -(-n // PANEL)
    padded = torch.zeros((*b.shape[:-1], panels * PANEL), dtype=torch.float32)
    padded[..., :n] = b
    return padded.view(*b.shape[:-1], panels, PANEL).transpose(-3, -2).contiguous()


def pad_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """The bias zero-padded to whole panels (the micro-kernel reads it 32 at a time)."""
    if bias is None:
        return None
    padded = torch.zeros(-(-n // PANEL) * PANEL, dtype=torch.float32)
    padded[:n] = bias.reshape(-1).float()
    return padded
