"""Softmax and LogSoftmax in C (kiln/native/csrc/softmax.c), along any axis, in either layout.

In memory order the input is [outer][n][inner] with the reduced axes the n-run: the last axis reduces contiguous
rows; ONNX's axis 1 of an NCHW tensor (a segmentation head's classes, YOLOv8's DFL bins) reduces `inner`
independent columns at once, VW lanes wide, where torch's softmax on an inner axis is slow; the same axis of a
channel-major tensor is contiguous rows again, so the tactic takes the producer's layout (opset < 13's flattened
axes too, where they are contiguous in it). Sizes are read per call, so dynamic shapes are fine.

`kiln.softmax` is FP32; `kiln.softmax_bf16` reads and writes FP32 or bf16 as a BF16 plan stores them and computes
in FP32; `kiln.softmax_int8` runs kiln's QSoftmax (INT8 in and out, the last axis). 2 threads of a Zen 4, hot
caches: YOLOv8n's DFL ([1, 16, 4, 8400], axis 1) 0.18 ms against torch's 0.22; [1, 21, 256, 256] on axis 1 0.46
against 0.79 (torch on the channel-major tensor: 1.45); rows of 128 at par."""
from __future__ import annotations

import math

import torch

from kiln import native
from kiln.native.catalog import header_constant
from kiln.ops.dtypes import INT8_TORCH
from kiln.ops.fused import quantized_softmax
from kiln.tactics.base import ANY, HWC, LINEAR, MEMORY_ORDER, STORED_FLOATS, Bf16Storage, Kernel, LayerView, bf16_io, \
    storage_dtype

SOFTMAX_TACTIC = "kiln.softmax"
SOFTMAX_OPS = ("Softmax", "LogSoftmax")
LOG = 4   # softmax.c's `io` bit above the storage bits (kiln.tactics.base.bf16_io)


def reduced_axes(layer: LayerView) -> tuple[int, ...]:
    """The axes the layer normalizes over: one from opset 13, all from `axis` on before it (ONNX's coercion to
    2-D)."""
    rank = len(layer.input_shapes[0])
    axis = layer.attrs.get("axis", -1 if layer.opset >= 13 else 1) % rank
    return (axis,) if layer.opset >= 13 else tuple(range(axis, rank))


def run_of_axes(order: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, int] | None:
    """(first position, length) of `axes` in memory order `order`, or None where they are not one contiguous run."""
    positions = sorted(order.index(a) for a in axes)
    return (positions[0], len(positions)) if positions == list(range(positions[0], positions[0] + len(axes))) else None


class SoftmaxTactic:
    """FP32 in and out."""

    name = SOFTMAX_TACTIC
    source = "kiln"
    needs_c_compiler = True
    stored_types = ("float32",)
    outputs_as_planned = True   # the input's layout is the output's; the runtime checks it against the plan

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type not in SOFTMAX_OPS or layer.domain not in ("", "ai.onnx") or len(layer.output_dtypes) != 1:
            return False
        x = layer.input_shapes[0] if layer.input_shapes else None
        if not x or layer.input_dtypes[0] not in self.stored_types or layer.output_dtypes[0] not in self.stored_types:
            return False
        return native.available()

    def _channel_major_run(self, layer: LayerView) -> tuple[int, int] | None:
        if len(layer.input_shapes[0]) != 4:
            return None
        return run_of_axes(MEMORY_ORDER[HWC], reduced_axes(layer))

    def input_formats(self, layer: LayerView) -> list[str]:
        return [ANY if self._channel_major_run(layer) else LINEAR]

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC if input_formats[0] == HWC and self._channel_major_run(layer) else LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        entry = native.library("softmax").kiln_softmax
        in_dtype, out_dtype = storage_dtype(layer.input_dtypes[0]), storage_dtype(layer.output_dtypes[0])
        io = bf16_io(layer) | (LOG if layer.op_type == "LogSoftmax" else 0)
        axes = reduced_axes(layer)
        linear = (min(axes), len(axes))
        channel_major = self._channel_major_run(layer)
        last = torch.channels_last

        def run(xs):
            x = xs[0] if xs[0].dtype == in_dtype else xs[0].to(in_dtype)
            if x.is_contiguous():
                dims, (first, count) = x.shape, linear
            elif channel_major and x.is_contiguous(memory_format=last):
                n, c, h, w = x.shape
                dims, (first, count) = (n, h, w, c), channel_major
            else:
                x = x.contiguous()
                dims, (first, count) = x.shape, linear
            y = torch.empty_like(x, dtype=out_dtype)
            entry(x.data_ptr(), y.data_ptr(), math.prod(dims[:first]), math.prod(dims[first:first + count]),
                  math.prod(dims[first + count:]), io)
            return [y]
        return run


class SoftmaxBf16Tactic(Bf16Storage, SoftmaxTactic):
    """Granted BF16: input and output FP32 or bf16 as the plan stores them, the arithmetic FP32."""

    name = SOFTMAX_TACTIC + "_bf16"
    stored_types = STORED_FLOATS
    bf16_inputs = frozenset({0})


QSOFTMAX_TACTIC = "kiln.softmax_int8"
MAX_QUANTIZED_ROW = header_constant("softmax.c", "KEPT")   # a row's exponentials are kept on the stack


class QuantizedSoftmaxTactic:
    """kiln's QSoftmax (DequantizeLinear -> Softmax -> QuantizeLinear, kiln.passes.quantization) on the last axis:
    INT8 in and out, FP32 inside, row-major; the row length is read per call, rows longer than the kernel keeps on
    its stack run torch's formula. In quantize_static BERT-base the three layers it replaces took ~310 µs per
    1x12x128x128 block with the Reformat between them; it takes ~100 µs (2 threads of a Zen 4)."""

    name = QSOFTMAX_TACTIC
    source = "kiln"
    needs_c_compiler = True

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "QSoftmax" or layer.domain != "kiln" or not layer.input_shapes[0]:
            return False
        shape, q = layer.input_shapes[0], layer.attrs.get("quant", {})
        last = layer.attrs.get("axis", -1) % len(shape) == len(shape) - 1
        return last and q.get("x_dtype") in INT8_TORCH and q.get("y_dtype") in INT8_TORCH and native.available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [LINEAR]

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        entry = native.library("softmax").kiln_softmax_q8
        attrs, q = layer.attrs, layer.attrs["quant"]
        types = int(q["x_dtype"] == "int8") | 2 * int(q["y_dtype"] == "int8")
        params = (q["x_scale"], q["x_zero_point"], q["y_scale"], q["y_zero_point"], types)
        out_dtype = INT8_TORCH[q["y_dtype"]]

        def run(xs):
            x = xs[0].contiguous()
            n = x.shape[-1]   # read per call: the sequence length may vary
            if n > MAX_QUANTIZED_ROW or x.numel() == 0:   # rows the kernel's stack does not hold: torch's way
                return quantized_softmax(attrs, [x])
            y = torch.empty(x.shape, dtype=out_dtype)
            entry(x.data_ptr(), y.data_ptr(), x.numel() // n, n, *params)
            return [y]
        return run
