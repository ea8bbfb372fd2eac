/* Winograd convolution F(M x M, 3 x 3), vectorized over channels, one block of tiles at a time
   (kiln.tactics.winograd):

     input  (NHWC, padding read as zeros) --in_tile-->  V[A^2][block][C]    (Bᵀ d B per tile)
     V x U (one GEMM per tile position, gemm.h's micro-kernel)  ->  P[A^2][block][Cout group]
     P --out_tile--> Aᵀ P A per tile, + bias, + residual, ReLU or Swish, cropped into the NHWC output

   The arithmetic is FP32 throughout; the input, the residual and the output may be stored in bf16 (`io`, gemm.h's
   IO_* bits): widened as tiles are read, the result rounded to nearest even as it is written.

   A template: kiln.tactics.winograd_c renders, ahead of this file, M and the four transforms as statement
   lists with the matrices' zero terms dropped, so each tile costs only the adds and multiplies they need:
     WINO_INPUT_COLUMNS   r[i][j][k] = sum_l Bᵀ[i][l] d[l][j][k]       for every i < A
     WINO_INPUT_ROWS      vi[j * plane + k] = sum_l Bᵀ[j][l] r[i][l][k] for every j < A
     WINO_OUTPUT_COLUMNS  q[i][j][k] = sum_l Aᵀ[i][l] s[l][j][k]       for every i < M
     WINO_OUTPUT_ROWS     o[j][k] = sum_l Aᵀ[j][l] q[i][l][k]          for every j < M */
#ifndef M
#error "winograd.c is a template: kiln.tactics.winograd_c renders M and the WINO_* transforms ahead of it"
#endif
#include <omp.h>
#include "bf16.h"
#include "gemm.h"

#define A (M + 2)   /* input tile size */
#define CB 64       /* channels per inner vector loop: a tile's A^2 x 64 floats stay in L1 */

/* One tile's Bᵀ d B, every channel, into v[(i * A + j) * plane + row * c + channel]. */
static inline void in_tile(const void* restrict x, float* restrict v, const int64_t plane, const int64_t row,
                           const int64_t b, const int64_t y0, const int64_t x0, const int64_t h, const int64_t w,
                           const int64_t c, const int x_bf16) {
  for (int64_t c0 = 0; c0 < c; c0 += CB) {
    const int64_t cb = c - c0 < CB ? c - c0 : CB;
    float d[A][A][CB], r[A][A][CB];
    for (int i = 0; i < A; ++i)
      for (int j = 0; j < A; ++j) {
        const int64_t yy = y0 + i, xx = x0 + j;
        const int64_t at = ((b * h + yy) * w + xx) * c + c0;
        if (yy >= 0 && yy < h && xx >= 0 && xx < w && x_bf16) {
          const uint16_t* restrict src = (const uint16_t*)x + at;
          #pragma omp simd
          for (int64_t k = 0; k < cb; ++k) d[i][j][k] = bf16_widen(src[k]);
        } else if (yy >= 0 && yy < h && xx >= 0 && xx < w) {
          const float* restrict src = (const float*)x + at;
          #pragma omp simd
          for (int64_t k = 0; k < cb; ++k) d[i][j][k] = src[k];
        } else {
          #pragma omp simd
          for (int64_t k = 0; k < cb; ++k) d[i][j][k] = 0.0f;
        }
      }
    for (int j = 0; j < A; ++j) {
      #pragma omp simd
      for (int64_t k = 0; k < cb; ++k) {
        WINO_INPUT_COLUMNS
      }
    }
    for (int i = 0; i < A; ++i) {
      float* restrict vi = v + (int64_t)i * A * plane + row * c + c0;
      #pragma omp simd
      for (int64_t k = 0; k < cb; ++k) {
        WINO_INPUT_ROWS
      }
    }
  }
}

/* One tile's Aᵀ M A for output channels [c_begin, c_end), read from mm[p * plane + row * ldm + channel - m_c0],
   with bias, residual and ReLU or Swish, cropped into the NHWC output, whose pixels are `y_step` elements apart
   (co, or a wider tensor's channels where y is a channel slice of it: a Concat's output). */
static inline void out_tile(const float* restrict mm, const int64_t plane, const int64_t ldm, const int64_t row,
                            const int64_t m_c0, void* y, const float* restrict bias, const void* res,
                            const int64_t act, const int64_t b, const int64_t th, const int64_t tw,
                            const int64_t oh, const int64_t ow, const int64_t co, const int64_t c_begin,
                            const int64_t c_end, const int64_t io, const int64_t y_step) {
  for (int64_t c0 = c_begin; c0 < c_end; c0 += CB) {
    const int64_t cb = c_end - c0 < CB ? c_end - c0 : CB;
    float s[A][A][CB], q[M][A][CB], o[M][CB], row_out[CB];
    for (int p = 0; p < A * A; ++p) {
      const float* restrict src = mm + p * plane + row * ldm + c0 - m_c0;
      #pragma omp simd
      for (int64_t k = 0; k < cb; ++k) s[p / A][p % A][k] = src[k];
    }
    for (int j = 0; j < A; ++j) {
      #pragma omp simd
      for (int64_t k = 0; k < cb; ++k) {
        WINO_OUTPUT_COLUMNS
      }
    }
    for (int i = 0; i < M; ++i) {
      const int64_t yy = th * M + i;
      if (yy >= oh) break;
      #pragma omp simd
      for (int64_t k = 0; k < cb; ++k) {
        WINO_OUTPUT_ROWS
      }
      for (int j = 0; j < M; ++j) {
        const int64_t xx = tw * M + j;
        if (xx >= ow) break;
        const int64_t pixel = (b * oh + yy) * ow + xx, at = pixel * co + c0, y_at = pixel * y_step + c0;
        float* out = row_out;   /* then stored: the residual may be the output's own buffer (read first) */
        #pragma omp simd
        for (int64_t k = 0; k < cb; ++k) out[k] = o[j][k] + (bias ? bias[c0 + k] : 0.0f);
        if (res && io & IO_RES_BF16) {
          #pragma omp simd
          for (int64_t k = 0; k < cb; ++k) out[k] += bf16_widen(((const uint16_t*)res)[at + k]);
        } else if (res) {
          #pragma omp simd
          for (int64_t k = 0; k < cb; ++k) out[k] += ((const float*)res)[at + k];
        }
        if (act == ACT_RELU) {
          #pragma omp simd
          for (int64_t k = 0; k < cb; ++k) out[k] = out[k] < 0.0f ? 0.0f : out[k];
        }
        if (act == ACT_SWISH) {   /* on the row just written, still in L1: 16 at a time, then one by one */
          int64_t k = 0;
          for (; k + 16 <= cb; k += 16) *(v16*)(out + k) = v_swish(*(v16*)(out + k));
          for (; k < cb; ++k) out[k] = k_swish(out[k]);
        }
        if (io & IO_C_BF16) {
          uint16_t* restrict dst = (uint16_t*)y + y_at;
          #pragma omp simd
          for (int64_t k = 0; k < cb; ++k) dst[k] = bf16_narrow(out[k]);
        } else {
          memcpy((float*)y + y_at, out, sizeof(float) * cb);
        }
      }
    }
  }
}

/* All three steps per unit of (block of `block` tiles, group of column panels), in this thread's slice of
   `scratch`: the block's transformed input and products stay in L2 instead of passing through memory. */
void wino_fused(const void* restrict x, const float* restrict u, const int64_t panel_stride, void* y,
                const float* restrict bias, const void* res, const int64_t act, const int64_t n, const int64_t h,
                const int64_t w, const int64_t c, const int64_t co, const int64_t pt, const int64_t pl,
                const int64_t oh, const int64_t ow, const int64_t tiles_h, const int64_t tiles_w,
                const int64_t block, const int64_t groups, float* scratch, const int64_t threads, const int64_t io,
                const int64_t y_step) {
  const int64_t tiles = n * tiles_h * tiles_w, blocks = (tiles + block - 1) / block;
  const int64_t panels = (co + NR - 1) / NR, group_panels = (panels + groups - 1) / groups;
  const int64_t v_size = (int64_t)A * A * block * c, p_size = (int64_t)A * A * block * group_panels * NR;
  #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t unit = 0; unit < blocks * groups; ++unit) {
    const int64_t blk = unit / groups, g = unit % groups;
    const int64_t t0 = blk * block, bt = tiles - t0 < block ? tiles - t0 : block;
    const int64_t pg0 = g * group_panels, pg1 = pg0 + group_panels < panels ? pg0 + group_panels : panels;
    if (pg0 >= pg1) continue;
    const int64_t ldp = (pg1 - pg0) * NR, c_begin = pg0 * NR, c_end = pg1 * NR < co ? pg1 * NR : co;
    float* v = scratch + omp_get_thread_num() * (v_size + p_size);
    float* prod = v + v_size;
    for (int64_t r = 0; r < bt; ++r) {
      const int64_t t = t0 + r, b = t / (tiles_h * tiles_w), th = (t / tiles_w) % tiles_h, tw = t % tiles_w;
      in_tile(x, v, bt * c, r, b, th * M - pt, tw * M - pl, h, w, c, (io & IO_A_BF16) != 0);
    }
    for (int64_t p = 0; p < A * A; ++p)
      for (int64_t nb = pg0; nb < pg1; ++nb) {
        const int64_t cols = co - nb * NR < NR ? co - nb * NR : NR;
        for (int64_t r0 = 0; r0 < bt; r0 += MR) {
          const int64_t mr = bt - r0 < MR ? bt - r0 : MR;
          const float* rows[MR];
          for (int64_t i = 0; i < MR; ++i) rows[i] = v + p * bt * c + (r0 + (i < mr ? i : 0)) * c;
          tile(rows, 1, mr, c, u + p * panel_stride + nb * c * NR, prod + p * bt * ldp + r0 * ldp + (nb - pg0) * NR,
               ldp, cols, 0, 0, 0);
        }
      }
    for (int64_t r = 0; r < bt; ++r) {
      const int64_t t = t0 + r, b = t / (tiles_h * tiles_w), th = (t / tiles_w) % tiles_h, tw = t % tiles_w;
      out_tile(prod, bt * ldp, ldp, r, c_begin, y, bias, res, act, b, th, tw, oh, ow, co, c_begin, c_end, io,
               y_step);
    }
  }
}
