"""Pooling on channel-major (NHWC) activations in C (kiln/native/csrc/pool.c): 2-D MaxPool (any kernel, stride,
dilation, padding, ceil mode; FP32, u8, s8 or bf16) and GlobalAveragePool / GlobalMaxPool, vectorized over channels,
OpenMP over output rows.

The layer takes its input in whatever layout the producer wrote, so choosing it never adds Reformat layers: a
channel-major input runs the C loops, a channel-planar one (e.g. between INT8 layers) torch's own kernel.

torch's channels-last pooling spends most of its time outside the loop that matters on small maps: ResNet-50's
stem MaxPool takes 0.22 ms there and its global average pool 0.10 ms, against 0.09 and 0.03 ms in OpenVINO.
NaN propagates as in torch (a window holding NaN gives NaN); averages accumulate in double.
"""
from __future__ import annotations

import dataclasses

import torch

from kiln import native
from kiln.ops.nn import global_average_pool, global_max_pool, max_pool, pool_output_size
from kiln.tactics.base import ANY, HWC, LINEAR, STORED_FLOATS, Bf16Storage, Kernel, LayerView, batch_dynamic_only, \
    storage_dtype

POOL_TACTIC = "kiln.pool2d_nhwc"
MAXPOOL_TYPES = {"float32": ("kiln_maxpool", torch.float32), "uint8": ("kiln_maxpool_u8", torch.uint8),
                 "int8": ("kiln_maxpool_s8", torch.int8),   # the global pools: float32 only
                 "bfloat16": ("kiln_maxpool_bf16", torch.bfloat16)}   # NhwcMaxPoolBf16Tactic's


class NhwcPoolTactic:
    name = POOL_TACTIC
    source = "kiln"
    needs_c_compiler = True
    stored_types = ("float32", "uint8", "int8")

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type not in ("MaxPool", "GlobalAveragePool", "GlobalMaxPool") or layer.domain not in ("", "ai.onnx"):
            return False
        x = layer.input_shapes[0]
        if x is None or len(x) != 4 or layer.input_dtypes[0] not in self.stored_types or \
                layer.output_dtypes != (layer.input_dtypes[0],):
            return False
        if layer.input_dtypes[0] != "float32" and layer.op_type != "MaxPool":
            return False
        if not batch_dynamic_only(layer):   # the batch is read per call
            return False
        if layer.op_type == "MaxPool" and (len(layer.attrs.get("kernel_shape") or ()) != 2
                                           or layer.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "", b"NOTSET")):
            return False
        return native.available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [ANY]

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC if HWC in input_formats else LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        lib = native.library("pool")
        _, c, h, w = layer.input_shapes[0]   # the batch: per call
        last = torch.channels_last
        planar = {"MaxPool": max_pool, "GlobalAveragePool": global_average_pool,
                  "GlobalMaxPool": global_max_pool}[layer.op_type]
        if layer.op_type != "MaxPool":
            mean = int(layer.op_type == "GlobalAveragePool")

            def run_global(xs):
                x = xs[0]
                if not x.is_contiguous(memory_format=last):
                    return planar(layer.attrs, xs)
                y = torch.empty((x.shape[0], c, 1, 1), memory_format=last)
                lib.kiln_global_pool(x.data_ptr(), y.data_ptr(), x.shape[0], h * w, c, mean)
                return [y]
            return run_global
        a = layer.attrs
        kh, kw = a["kernel_shape"]
        sh, sw = a.get("strides") or [1, 1]
        dh, dw = a.get("dilations") or [1, 1]
        pt, pl, pb, pr = a.get("pads") or [0, 0, 0, 0]
        ceil = bool(a.get("ceil_mode", 0))
        oh = pool_output_size(h, kh, sh, dh, pt, pb, ceil)
        ow = pool_output_size(w, kw, sw, dw, pl, pr, ceil)

        entry, dtype = MAXPOOL_TYPES[layer.input_dtypes[0]]
        pool = getattr(lib, entry)

        def run(xs):
            x = xs[0]
            if not x.is_contiguous(memory_format=last):
                return planar(a, xs)   # channel-planar input: torch's kernel, output in the same layout
            y = torch.empty((x.shape[0], c, oh, ow), dtype=dtype, memory_format=last)
            pool(x.data_ptr(), y.data_ptr(), x.shape[0], h, w, c, oh, ow, kh, kw, sh, sw, dh, dw, pt, pl)
            return [y]
        return run


class NhwcMaxPoolBf16Tactic(Bf16Storage, NhwcPoolTactic):
    """MaxPool granted BF16, on tensors as the plan stores them, so a pool between BF16 layers (ResNet's stem, YOLO's
    SPPF) keeps their tensors bf16. Exact: the maximum of bf16 values is one of them, and an FP32 input rounded to a
    bf16 output first gives the rounded FP32 maximum (rounding is monotonic)."""

    name = POOL_TACTIC + "_bf16"
    stored_types = STORED_FLOATS
    bf16_inputs = frozenset({0})

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "MaxPool" or len(layer.output_dtypes) != 1:
            return False
        stored = layer.input_dtypes[0] in self.stored_types and layer.output_dtypes[0] in self.stored_types
        return stored and super().supports(self._typed(layer))

    @staticmethod
    def _typed(layer: LayerView) -> LayerView:
        """`layer` read in its output's type (the kernel's: an input stored otherwise is converted first)."""
        return dataclasses.replace(layer, input_dtypes=(layer.output_dtypes[0], *layer.input_dtypes[1:]))

    def prepare(self, layer: LayerView) -> Kernel:
        kernel = super().prepare(self._typed(layer))
        if layer.input_dtypes[0] == layer.output_dtypes[0]:
            return kernel
        dtype = storage_dtype(layer.output_dtypes[0])
        return lambda xs: kernel([xs[0].to(dtype), *xs[1:]])
