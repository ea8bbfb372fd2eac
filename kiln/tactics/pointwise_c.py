"""The C generator for PointWise programs: one loop nest reading every input once and writing the output once,
after `#include "pointwise.h"` (kiln/native/csrc, the static math helpers the expressions call).

    PWN(Sigmoid, Mul, Add)  ==>  for i: t0 = sig(x0[i]); t1 = t0 * x0[i]; t2 = t1 + x1[j(i)]; out[i] = t2

Only numbers from the program reach the source (op names map through a fixed table, attribute values are
formatted as floats), so an engine file cannot inject code. Broadcast inputs are addressed per row: the output
is viewed as rows x inner, with each input's offset computed once per row and a stride 0 or 1 inside it.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

HEADER_FILE = "pointwise.h"   # kiln/native/csrc: the math helpers (k_tanh, k_erf, ...) every program includes

PARALLEL_MIN_ELEMENTS = 16384   # below this one thread does the whole loop (OpenMP start-up costs more)
BLOCK_ELEMENTS = 8192           # elements per unit of work shared among threads


def _f(value: Any) -> str:
    """A float literal (raises for anything that is not a number)."""
    v = float(value)
    if math.isnan(v):
        return "NAN"
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    return f"{v!r}f"


def _gelu(a, x):
    if a.get("approximate", "none") == "tanh":
        return f"0.5f * {x} * (1.0f + k_tanh(0.7978845608028654f * ({x} + 0.044715f * {x} * {x} * {x})))"
    if a.get("approximate", "none") != "none":
        raise ValueError(f"Gelu approximate={a.get('approximate')!r}")
    return f"0.5f * {x} * (1.0f + k_erf({x} * 0.7071067811865476f))"


def _selu(a, x):
    alpha, gamma = _f(a.get("alpha", 1.6732632423543772)), _f(a.get("gamma", 1.0507009873554805))
    return f"{gamma} * ({x} > 0.0f ? {x} : {alpha} * expm1f({x}))"


UNARY = {
    "Relu": lambda a, x: f"({x} < 0.0f ? 0.0f : {x})",
    "Sigmoid": lambda a, x: f"(1.0f / (1.0f + expf(-{x})))",
    "Tanh": lambda a, x: f"k_tanh({x})",
    "LeakyRelu": lambda a, x: f"({x} > 0.0f ? {x} : {x} * {_f(a.get('alpha', 0.01))})",
    "Elu": lambda a, x: f"({x} > 0.0f ? {x} : {_f(a.get('alpha', 1.0))} * expm1f({x}))",
    "Selu": _selu,
    "Softplus": lambda a, x: f"k_softplus({x})",
    "Softsign": lambda a, x: f"({x} / (1.0f + fabsf({x})))",
    "HardSigmoid": lambda a, x: f"k_clip({_f(a.get('alpha', 0.2))} * {x} + {_f(a.get('beta', 0.5))}, 0.0f, 1.0f)",
    "HardSwish": lambda a, x: f"({x} * k_clip({x} + 3.0f, 0.0f, 6.0f) / 6.0f)",
    "Mish": lambda a, x: f"({x} * k_tanh(k_softplus({x})))",
    "Swish": lambda a, x: f"({x} / (1.0f + expf(-{_f(a.get('alpha', 1.0))} * {x})))",
    "ThresholdedRelu": lambda a, x: f"({x} > {_f(a.get('alpha', 1.0))} ? {x} : 0.0f)",
    "Gelu": _gelu,
    "Sqrt": lambda a, x: f"sqrtf({x})",
    "Exp": lambda a, x: f"expf({x})",
    "Log": lambda a, x: f"logf({x})",
    "Neg": lambda a, x: f"(-{x})",
    "Abs": lambda a, x: f"fabsf({x})",
    "Reciprocal": lambda a, x: f"(1.0f / {x})",
    "Erf": lambda a, x: f"k_erf({x})",
    "Floor": lambda a, x: f"floorf({x})",
    "Ceil": lambda a, x: f"ceilf({x})",
    "Round": lambda a, x: f"nearbyintf({x})",   # ONNX rounds half to even, the default rounding mode
    "Sin": lambda a, x: f"sinf({x})",
    "Cos": lambda a, x: f"cosf({x})",
    "Identity": lambda a, x: x,
}
BINARY = {
    "Add": "({a} + {b})", "Sub": "({a} - {b})", "Mul": "({a} * {b})", "Div": "({a} / {b})",
    "PRelu": "({a} < 0.0f ? {a} * {b} : {a})",
}
VARIADIC = {"Max": "k_max({a}, {b})", "Min": "k_min({a}, {b})", "Sum": "({a} + {b})"}
FLOAT = 1   # ONNX TensorProto.FLOAT, the only Cast target kept in a float program


def _pow(b_const: float | None, a: str, b: str) -> str:
    if b_const == 2.0:
        return f"({a} * {a})"
    if b_const == 3.0:
        return f"({a} * {a} * {a})"
    if b_const == 0.5:
        return f"sqrtf({a})"
    if b_const == 1.0:
        return a
    return f"powf({a}, {b})"


def _scalar(value: Any) -> float | None:
    """A host scalar argument ({"const": 0.5} or {"const": [0.5]}), None when absent."""
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError("a host argument with more than one value")
        value = value[0]
    return None if value is None else float(value)


def step_expression(step: dict, args: list[str], consts: list[float | None]) -> str:
    """C expression for one program step; `args` are the argument expressions, `consts` their constant values."""
    op, attrs = step["op"], step.get("attrs", {})
    if op in UNARY:
        return UNARY[op](attrs, args[0])
    if op == "Clip":
        lo = consts[1] if len(consts) > 1 and consts[1] is not None else attrs.get("min")
        hi = consts[2] if len(consts) > 2 and consts[2] is not None else attrs.get("max")
        lo_s = _f(lo) if lo is not None else "(-INFINITY)"
        hi_s = _f(hi) if hi is not None else "INFINITY"
        return f"k_clip({args[0]}, {lo_s}, {hi_s})"
    if op == "Cast" and attrs.get("to") == FLOAT:
        return args[0]
    if op in BINARY and len(args) == 2:
        return BINARY[op].format(a=args[0], b=args[1])
    if op == "Pow" and len(args) == 2:
        return _pow(consts[1], args[0], args[1])
    if op in VARIADIC and args:
        expr = args[0]
        for b in args[1:]:
            expr = VARIADIC[op].format(a=expr, b=b)
        return expr
    if op == "Mean" and args:
        return "((" + " + ".join(args) + f") / {_f(len(args))})"
    if op == "ScaleShift" and len(args) == 3:   # kiln's folded BatchNormalization (kiln.tactics.codegen)
        return f"({args[0]} * {args[1]} + {args[2]})"
    if op == "Quantize" and len(args) == 3:   # kiln's QuantizeLinear of one scale (kiln.tactics.codegen)
        return f"k_quantize({args[0]}, {args[1]}, {args[2]}, {_f(attrs['lo'])}, {_f(attrs['hi'])})"
    if op == "Dequantize" and len(args) == 3:
        return f"(({args[0]} - {args[2]}) * {args[1]})"
    raise ValueError(f"op {op} has no C expression")


def supported_step(step: dict) -> bool:
    op, attrs = step.get("op"), step.get("attrs", {})
    if op == "Cast":
        return attrs.get("to") == FLOAT
    if op == "Gelu":
        return attrs.get("approximate", "none") in ("none", "tanh")
    return op in UNARY or op in BINARY or op in VARIADIC or \
        op in ("Clip", "Pow", "Mean", "ScaleShift", "Quantize", "Dequantize")


@dataclass(frozen=True)
class LoopNest:
    """The output viewed as [rows, inner] after merging axes; per input and axis, the element stride (0: broadcast)."""

    dims: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)


def loop_nest(out_shape: tuple[int, ...], in_shapes: list[tuple[int, ...]]) -> LoopNest:
    """Contiguous strides of each input broadcast to `out_shape`, with adjacent axes merged where every input
    agrees (both broadcast or both dense), so most programs become one flat loop."""
    rank = len(out_shape)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in in_shapes]
    strides = []
    for shape in padded:
        st, acc = [0] * rank, 1
        for k in range(rank - 1, -1, -1):
            st[k] = 0 if shape[k] == 1 and out_shape[k] != 1 else acc
            acc *= shape[k]
        strides.append(st)
    dims: list[int] = []
    merged: list[list[int]] = [[] for _ in in_shapes]
    for k in range(rank):
        if out_shape[k] == 1:
            continue
        if dims and all((s[k] == 0) == (m[-1] == 0) and (s[k] == 0 or m[-1] == s[k] * out_shape[k])
                        for s, m in zip(strides, merged)):
            dims[-1] *= out_shape[k]
            for s, m in zip(strides, merged):
                m[-1] = s[k]
            continue
        dims.append(out_shape[k])
        for s, m in zip(strides, merged):
            m.append(s[k])
    if not dims:
        dims, merged = [1], [[1] for _ in in_shapes]
    return LoopNest(tuple(dims), tuple(tuple(m) for m in merged))


INT8_C_TYPES = {"int8": "int8_t", "uint8": "uint8_t"}
# A program with Q/DQ steps rounds each operation as onnxruntime's separate ops do: GCC would otherwise contract a
# dequantize's multiply and the add after it into one FMA, and a value at a rounding tie would quantize a step away.
EXACT_ROUNDING = ("#if defined(__GNUC__) && !defined(__clang__)", '#pragma GCC optimize("fp-contract=off")', "#endif")


@dataclass(frozen=True)
class ShapedNest:
    """A loop nest whose dims and strides arrive per call (`nest_array`): for layers whose shapes vary with the
    input shapes. Only whether each input is read densely along the inner axis (stride 1, not 0) is compiled in."""

    dense_inner: tuple[bool, ...]


def nest_array(nest: LoopNest, read: list[int]) -> list[int]:
    """What a ShapedNest program takes per call: [rank, dims..., then each read input's strides, rank each]."""
    return [len(nest.dims), *nest.dims, *(s for i in read for s in nest.strides[i])]


def generate(steps: list[dict], n_inputs: int, nest: LoopNest | ShapedNest, scalars: dict[int, float] | None = None,
             bf16_inputs: frozenset[int] = frozenset(), bf16_output: bool = False,
             int8_inputs: dict[int, str] | None = None, int8_output: str | None = None) -> str:
    """The C translation unit: `void kiln_pointwise(const void* const* in, void* out, const int64_t* nest)`.
    Inputs in `scalars` (one-element constants) become literals and are not read, nor are inputs no step uses. The
    work is split in blocks of at most BLOCK_ELEMENTS of one row, shared out among the OpenMP threads; each block is
    one vectorized loop. A LoopNest is compiled in (`nest` unused, pass NULL); a ShapedNest reads it per call
    (`nest_array` of the call's loop nest, the inputs `read_inputs` names). Inputs in `bf16_inputs` are read as bf16
    and widened, and a `bf16_output` is rounded to nearest even as it is stored: the arithmetic is FP32 either way.
    `int8_inputs` (index -> "int8"/"uint8") are read as those integers, and an `int8_output` stored so (the
    caller's last step writes an integer in range)."""
    scalars, int8_inputs = scalars or {}, int8_inputs or {}
    in_type = {i: INT8_C_TYPES[int8_inputs[i]] if i in int8_inputs else "uint16_t" if i in bf16_inputs else "float"
               for i in range(n_inputs)}
    out_type = INT8_C_TYPES[int8_output] if int8_output else "uint16_t" if bf16_output else "float"
    expressions = _expressions(steps, n_inputs, scalars)
    used = _used(expressions, n_inputs)
    read = [i for i in used if i not in scalars]
    dense = {i: nest.dense_inner[i] if isinstance(nest, ShapedNest) else bool(nest.strides[i][-1]) for i in read}
    params = "".join(f"const {in_type[i]}* restrict p{i}, " for i in read)
    lines = [*(EXACT_ROUNDING if any(step["op"] in ("Quantize", "Dequantize") for step in steps) else ()),
             f'#include "{HEADER_FILE}"', "",
             f"static inline void k_block({params}{out_type}* restrict out, const int64_t j0, const int64_t j1) {{",
             "  #pragma omp simd",
             "  for (int64_t j = j0; j < j1; ++j) {"]
    for i in used:
        index = "j" if dense.get(i) else "0"
        load = f"bf16_widen(p{i}[{index}])" if i in bf16_inputs else f"p{i}[{index}]"
        lines.append(f"    const float v{i} = {_f(scalars[i])};" if i in scalars else f"    const float v{i} = {load};")
    lines += [f"    const float t{k} = {expr};" for k, expr in enumerate(expressions)]
    result = f"t{len(steps) - 1}"
    stored = f"({out_type}){result}" if int8_output else f"bf16_narrow({result})" if bf16_output else result
    lines += [f"    out[j] = {stored};", "  }", "}", ""]
    driver = _shaped_driver if isinstance(nest, ShapedNest) else _static_driver
    return "\n".join(lines + driver(nest, read, in_type, out_type))


def read_inputs(steps: list[dict], n_inputs: int, scalars: dict[int, float]) -> list[int]:
    """The inputs a generated program reads through pointers, in the order `nest_array` lists their strides."""
    return [i for i in _used(_expressions(steps, n_inputs, scalars), n_inputs) if i not in scalars]


def _used(expressions: list[str], n_inputs: int) -> list[int]:
    return [i for i in range(n_inputs) if any(re.search(rf"\bv{i}\b", e) for e in expressions)]


def _static_driver(nest: LoopNest, read: list[int], in_type: dict[int, str], out_type: str) -> list[str]:
    rows, inner = math.prod(nest.dims[:-1]), nest.dims[-1]
    chunk = min(inner, BLOCK_ELEMENTS)
    per_row = -(-inner // chunk) if inner else 1
    pointers = []
    for i in read:
        terms, div = [], 1
        for k in range(len(nest.dims) - 2, -1, -1):
            if nest.strides[i][k]:
                terms.append(f"((r / {div}) % {nest.dims[k]}) * {nest.strides[i][k]}")
            div *= nest.dims[k]
        pointers.append(f"(const {in_type[i]}*)in[{i}] + {' + '.join(terms) or '0'}, ")
    return ["void kiln_pointwise(const void* const* in, void* out, const int64_t* nest) {",
            "  (void)nest;   /* the loop nest is compiled in */",
            f"  #pragma omp parallel for schedule(static) if({int(nest.elements >= PARALLEL_MIN_ELEMENTS)})",
            f"  for (int64_t b = 0; b < {rows * per_row}; ++b) {{",
            f"    const int64_t r = b / {per_row}, j0 = (b % {per_row}) * {chunk};",
            f"    const int64_t j1 = j0 + {chunk} < {inner} ? j0 + {chunk} : {inner};",
            f"    k_block({''.join(pointers)}({out_type}*)out + r * {inner}, j0, j1);",
            "  }", "}", ""]


def _shaped_driver(nest: ShapedNest, read: list[int], in_type: dict[int, str], out_type: str) -> list[str]:
    n_read = max(len(read), 1)
    pointers = "".join(f"(const {in_type[i]}*)in[{i}] + offset[{m}], " for m, i in enumerate(read))
    return ["void kiln_pointwise(const void* const* in, void* out, const int64_t* nest) {",
            "  const int64_t rank = nest[0];",
            "  const int64_t* dims = nest + 1;",
            "  const int64_t* strides = nest + 1 + rank;   /* read input m's strides at m * rank */",
            "  int64_t rows = 1;",
            "  for (int64_t k = 0; k + 1 < rank; ++k) rows *= dims[k];",
            "  const int64_t inner = dims[rank - 1];",
            f"  const int64_t chunk = inner < {BLOCK_ELEMENTS} ? inner : {BLOCK_ELEMENTS};",
            "  const int64_t per_row = chunk > 0 ? (inner + chunk - 1) / chunk : 1;",
            f"  #pragma omp parallel for schedule(static) if(rows * inner >= {PARALLEL_MIN_ELEMENTS})",
            "  for (int64_t b = 0; b < rows * per_row; ++b) {",
            "    const int64_t r = b / per_row, j0 = (b % per_row) * chunk;",
            "    const int64_t j1 = j0 + chunk < inner ? j0 + chunk : inner;",
            f"    int64_t offset[{n_read}] = {{0}};",
            "    int64_t div = 1;",
            "    for (int64_t k = rank - 2; k >= 0; --k) {",
            "      const int64_t at = (r / div) % dims[k];",
            f"      for (int64_t m = 0; m < {len(read)}; ++m) offset[m] += at * strides[m * rank + k];",
            "      div *= dims[k];",
            "    }",
            f"    k_block({pointers}({out_type}*)out + r * inner, j0, j1);",
            "  }", "}", ""]


def expressible(steps: list[dict], n_inputs: int) -> bool:
    """Whether every step of the program has a C expression (ops, attributes and arguments all valid)."""
    try:
        _expressions(steps, n_inputs, {})
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return False
    return all(supported_step(s) for s in steps)


def _expressions(steps: list[dict], n_inputs: int, scalars: dict[int, float]) -> list[str]:
    if not steps:
        raise ValueError("an empty program")
    out: list[str] = []
    for step in steps:
        args, consts = [], []
        for a in step["args"]:
            if a is None:
                args.append("0.0f")
                consts.append(None)
            elif isinstance(a, dict):
                value = _scalar(a["const"])
                args.append("0.0f" if value is None else _f(value))
                consts.append(value)
            elif isinstance(a, str) and a[:1] in ("x", "t") and a[1:].isdigit() and \
                    int(a[1:]) < (n_inputs if a[0] == "x" else len(out)):
                args.append(("v" if a[0] == "x" else "t") + str(int(a[1:])))
                consts.append(scalars.get(int(a[1:])) if a[0] == "x" else None)
            else:
                raise ValueError(f"argument {a!r}")
        out.append(step_expression(step, args, consts))
    return out
