"""kiln's RotaryEmbedding layer (kiln.passes.rotary) in C (kiln/native/csrc/rotary.c): y = x·cos + rotate_half(x)·sin
in one pass over x, where the graph took seven layers (two Slices, Neg, Concat, and a PointWise for the products and
the sum). cos and sin are read through their broadcast strides, never expanded.

`kiln.rotary` is FP32; `kiln.rotary_bf16` reads x, cos and sin and writes y as a BF16 plan stores them (each FP32
or bf16), computing in FP32. Each input geometry is worked out once and cached."""
from __future__ import annotations

import ctypes
import math

import torch

from kiln import native
from kiln.tactics.base import LINEAR, STORED_FLOATS, Bf16Storage, Kernel, LayerView, storage_dtype, unit_inner

ROTARY_TACTIC = "kiln.rotary"
X_BF16, Y_BF16, COS_BF16, SIN_BF16 = 1, 2, 4, 8   # rotary.c's RotaryCall.io
LEAD = 4       # rotary.c's ROT_LEAD
MAX_D = 1024   # rotary.c's ROT_MAX_D


class RotaryCall(ctypes.Structure):
    """rotary.c's RotaryCall: x's leading axes (outer first, 1 where absent), the element strides of cos and sin
    along them, the row width, the storage bits."""

    _fields_ = [("lead", ctypes.c_int64 * LEAD), ("cos_st", ctypes.c_int64 * LEAD), ("sin_st", ctypes.c_int64 * LEAD),
                ("d", ctypes.c_int64), ("io", ctypes.c_int64)]


def table_strides(t: torch.Tensor, x_shape: torch.Size) -> tuple[int, ...]:
    """`t`'s element strides along x's leading axes once broadcast to x (0 where it repeats), left-padded to LEAD."""
    strides = t.expand(x_shape).stride()[:-1]
    return (0,) * (LEAD - len(strides)) + tuple(strides)


def rotary_call(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, y_dtype: torch.dtype) -> RotaryCall:
    """The C call for these inputs; a row width rotary.c cannot stage (odd, or over MAX_D) is refused here, whatever
    the plan said."""
    if x.shape[-1] % 2 or not 0 < x.shape[-1] <= MAX_D or x.dim() > LEAD + 1:
        raise ValueError(f"{ROTARY_TACTIC}: x shaped {list(x.shape)}: rows must be even and at most {MAX_D} wide, "
                         f"with at most {LEAD} leading axes")
    lead = (1,) * (LEAD - x.dim() + 1) + tuple(x.shape[:-1])
    io = (X_BF16 * (x.dtype == torch.bfloat16) | Y_BF16 * (y_dtype == torch.bfloat16)
          | COS_BF16 * (cos.dtype == torch.bfloat16) | SIN_BF16 * (sin.dtype == torch.bfloat16))
    call = RotaryCall(d=x.shape[-1], io=io)
    call.lead[:] = lead
    call.cos_st[:] = table_strides(cos, x.shape)
    call.sin_st[:] = table_strides(sin, x.shape)
    return call


class RotaryTactic:
    """FP32 in and out; row-major."""

    name = ROTARY_TACTIC
    source = "kiln"
    needs_c_compiler = True
    stored_types = ("float32",)

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "RotaryEmbedding" or layer.domain != "kiln" or len(layer.input_shapes) != 3:
            return False
        x = layer.input_shapes[0]
        if not x or len(x) > LEAD + 1 or x[-1] % 2 or not 0 < x[-1] <= MAX_D or \
                any(s is None or not s or len(s) > len(x) or s[-1] != x[-1] for s in layer.input_shapes[1:]):
            return False
        types = (*layer.input_dtypes, *layer.output_dtypes)
        return all(t in self.stored_types for t in types) and native.available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [LINEAR] * 3

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        entry = native.library("rotary").kiln_rotary
        y_dtype = storage_dtype(layer.output_dtypes[0])
        calls: dict[tuple, tuple[RotaryCall, object]] = {}
        consts = {i: t.contiguous() for i, t in layer.const_inputs.items()}   # cos and sin folded (static positions)

        def run(xs):
            x, cos, sin = [consts.get(i, t) for i, t in enumerate(xs)] if consts else xs
            x = x if x.is_contiguous() else x.contiguous()
            cos, sin = unit_inner(cos), unit_inner(sin)
            key = (x.shape, x.dtype, cos.shape, cos.stride(), cos.dtype, sin.shape, sin.stride(), sin.dtype)
            found = calls.get(key)
            if found is None:
                call = rotary_call(x, cos, sin, y_dtype)
                found = calls.setdefault(key, (call, ctypes.byref(call)))
            y = torch.empty(x.shape, dtype=y_dtype)
            if math.prod(x.shape):
                entry(found[1], x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr())
            return [y]
        return run


class RotaryBf16Tactic(Bf16Storage, RotaryTactic):
    """Granted BF16: x, cos, sin and y FP32 or bf16 as the plan stores them, the arithmetic FP32."""

    name = ROTARY_TACTIC + "_bf16"
    stored_types = STORED_FLOATS
    bf16_inputs = frozenset({0, 1, 2})
