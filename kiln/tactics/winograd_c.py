"""The renderer of kiln/native/csrc/winograd.c, a template: for F(m x m, 3 x 3) it writes M and the four
transforms as C statement lists from the matrices Bᵀ and Aᵀ (kiln.tactics.winograd), zero terms dropped, so each
tile costs only the adds and multiplies the matrices need:

    #define M 4
    #define WINO_INPUT_COLUMNS \\
            r[0][j][k] = 4.0f * d[0][j][k] - 5.0f * d[2][j][k] + d[4][j][k]; \\
            ...
"""
from __future__ import annotations

LIBRARY = "winograd"   # kiln.native's name for the library rendered from winograd.c


def _combo(coefficients: list[float], term: str) -> str:
    """sum_l c_l * term(l), zero coefficients dropped: `term` has one {l} field."""
    parts = []
    for l, c in enumerate(coefficients):
        if c == 0:
            continue
        t = term.format(l=l)
        parts.append(t if c == 1 else f"-{t}" if c == -1 else f"{float(c)!r}f * {t}")
    return " + ".join(parts).replace("+ -", "- ") or "0.0f"


def _statements(macro: str, lines: list[str]) -> str:
    return f"#define {macro} \\\n" + " \\\n".join(f"        {line}" for line in lines) + "\n"


def render(m: int, bt: list[list[float]], at: list[list[float]]) -> str:
    """The definitions winograd.c is compiled after, for output tiles of m x m."""
    a = m + 2
    return "".join([
        f"#define M {m}\n",
        _statements("WINO_INPUT_COLUMNS", [f"r[{i}][j][k] = {_combo(bt[i], 'd[{l}][j][k]')};" for i in range(a)]),
        _statements("WINO_INPUT_ROWS", [f"vi[{j} * plane + k] = {_combo(bt[j], 'r[i][{l}][k]')};" for j in range(a)]),
        _statements("WINO_OUTPUT_COLUMNS", [f"q[{i}][j][k] = {_combo(at[i], 's[{l}][j][k]')};" for i in range(m)]),
        _statements("WINO_OUTPUT_ROWS", [f"o[{j}][k] = {_combo(at[j], 'q[i][{l}][k]')};" for j in range(m)]),
    ])
