"""C source for the Winograd transforms F(m x m, 3 x 3), one pass each, vectorized over channels.

    input  (NHWC, padding read as zeros) --wino_input-->  V[(m+2)^2][tiles][C]   (Bᵀ d B per tile)
    V x U (one GEMM per tile position, kiln.tactics.gemm_c)           ->  M[(m+2)^2][tiles][Cout]
    M --wino_output--> Aᵀ M A per tile, + bias, + residual, ReLU, cropped into the NHWC output

The transform matrices are compiled in as literals (zero terms dropped), so each tile costs only the adds and
multiplies the matrices need. OpenMP shares tiles out on torch's own thread pool.
"""
from __future__ import annotations

CHANNEL_BLOCK = 64   # channels per inner vector loop: a tile's (m+2)^2 x 64 floats stay in L1


def _combo(coefficients: list[float], term: str) -> str:
    """sum_l c_l * term(l), zero coefficients dropped: `term` has one {l} field."""
    parts = []
    for l, c in enumerate(coefficients):
        if c == 0:
            continue
        t = term.format(l=l)
        parts.append(t if c == 1 else f"-{t}" if c == -1 else f"{float(c)!r}f * {t}")
    return " + ".join(parts).replace("+ -", "- ") or "0.0f"


def source(m: int, bt: list[list[float]], at: list[list[float]]) -> str:
    a = m + 2
    cols = "\n".join(f"        r[{i}][j][k] = {_combo(bt[i], 'd[{l}][j][k]')};" for i in range(a))
    rows = "\n".join(f"        vi[{j} * plane + k] = {_combo(bt[j], 'r[i][{l}][k]')};" for j in range(a))
    out_cols = "\n".join(f"        q[{i}][j][k] = {_combo(at[i], 's[{l}][j][k]')};" for i in range(m))
    out_rows = "\n".join(f"        o[{j}][k] = {_combo(at[j], 'q[i][{l}][k]')};" for j in range(m))
    return f"""#include <stdint.h>
#define A {a}
#define M {m}
#define CB {CHANNEL_BLOCK}

void wino_input(const float* restrict x, float* restrict v, const int64_t n, const int64_t h, const int64_t w,
                const int64_t c, const int64_t pt, const int64_t pl, const int64_t tiles_h, const int64_t tiles_w) {{
  const int64_t tiles = n * tiles_h * tiles_w;
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {{
    const int64_t b = t / (tiles_h * tiles_w), th = (t / tiles_w) % tiles_h, tw = t % tiles_w;
    const int64_t y0 = th * M - pt, x0 = tw * M - pl;
    for (int64_t c0 = 0; c0 < c; c0 += CB) {{
      const int64_t cb = c - c0 < CB ? c - c0 : CB;
      float d[A][A][CB], r[A][A][CB];
      for (int i = 0; i < A; ++i)
        for (int j = 0; j < A; ++j) {{
          const int64_t yy = y0 + i, xx = x0 + j;
          if (yy >= 0 && yy < h && xx >= 0 && xx < w) {{
            const float* restrict src = x + ((b * h + yy) * w + xx) * c + c0;
            #pragma omp simd
            for (int64_t k = 0; k < cb; ++k) d[i][j][k] = src[k];
          }} else {{
            #pragma omp simd
            for (int64_t k = 0; k < cb; ++k) d[i][j][k] = 0.0f;
          }}
        }}
      for (int j = 0; j < A; ++j) {{
        #pragma omp simd
        for (int64_t k = 0; k < cb; ++k) {{
{cols}
        }}
      }}
      const int64_t plane = tiles * c;
      for (int i = 0; i < A; ++i) {{
        float* restrict vi = v + (int64_t)i * A * plane + t * c + c0;
        #pragma omp simd
        for (int64_t k = 0; k < cb; ++k) {{
{rows}
        }}
      }}
    }}
  }}
}}

void wino_output(const float* restrict mm, float* y, const float* restrict bias,
                 const float* res, const int64_t relu, const int64_t n, const int64_t oh, const int64_t ow,
                 const int64_t co, const int64_t tiles_h, const int64_t tiles_w) {{
  const int64_t tiles = n * tiles_h * tiles_w, plane = tiles * co;
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {{
    const int64_t b = t / (tiles_h * tiles_w), th = (t / tiles_w) % tiles_h, tw = t % tiles_w;
    for (int64_t c0 = 0; c0 < co; c0 += CB) {{
      const int64_t cb = co - c0 < CB ? co - c0 : CB;
      float s[A][A][CB], q[M][A][CB], o[M][CB];
      for (int p = 0; p < A * A; ++p) {{
        const float* restrict src = mm + p * plane + t * co + c0;
        #pragma omp simd
        for (int64_t k = 0; k < cb; ++k) s[p / A][p % A][k] = src[k];
      }}
      for (int j = 0; j < A; ++j) {{
        #pragma omp simd
        for (int64_t k = 0; k < cb; ++k) {{
{out_cols}
        }}
      }}
      for (int i = 0; i < M; ++i) {{
        const int64_t yy = th * M + i;
        if (yy >= oh) break;
        #pragma omp simd
        for (int64_t k = 0; k < cb; ++k) {{
{out_rows}
        }}
        for (int j = 0; j < M; ++j) {{
          const int64_t xx = tw * M + j;
          if (xx >= ow) break;
          const int64_t at = ((b * oh + yy) * ow + xx) * co + c0;
          #pragma omp simd
          for (int64_t k = 0; k < cb; ++k) {{
            float val = o[j][k] + (bias ? bias[c0 + k] : 0.0f);
            if (res) val += res[at + k];
            y[at + k] = (relu && val < 0.0f) ? 0.0f : val;
          }}
        }}
      }}
    }}
  }}
}}
"""
