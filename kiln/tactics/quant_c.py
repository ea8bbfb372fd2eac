"""QuantizeLinear and DequantizeLinear with one scale and zero point in C (kiln/native/csrc/quant.c): the Q/DQ
layers Q/DQ fusion leaves at an INT8 network's edges (its input, the classifier's, its output).

torch's reference spends 0.19 ms quantizing ResNet-50's 1x3x224x224 input and 0.23 ms dequantizing its last
1x2048x7x7 map (2 threads); one C pass takes a few µs. A 4-D input is quantized into the channel-major layout
kiln's INT8 convolutions read, so the Reformat that followed the input's QuantizeLinear is gone (TensorRT's int8
input reformat likewise writes a channel-vectorized format); dequantizing keeps the layout it is given.
Per-axis scales, blocked quantization and other types stay on the reference kernel.
"""
from __future__ import annotations

import torch

from kiln import native
from kiln.tactics.base import ANY, HWC, LINEAR, Kernel, LayerView

QUANT_TACTIC = "kiln.quantize_linear"
INT8_TYPES = {"uint8": ("u8", torch.uint8), "int8": ("s8", torch.int8)}


def _scalar_params(layer: LayerView) -> tuple[float, int] | None:
    """(scale, zero point) of a per-tensor float32 Q/DQ layer with constant parameters, else None."""
    if layer.domain not in ("", "ai.onnx") or layer.attrs.get("block_size") or len(layer.input_shapes) < 2:
        return None
    scale, zp = layer.const_inputs.get(1), layer.const_inputs.get(2)
    if scale is None or scale.numel() != 1 or scale.dtype != torch.float32:
        return None
    if len(layer.input_shapes) > 2 and layer.input_shapes[2] is not None and (zp is None or zp.numel() != 1):
        return None
    return float(scale.reshape(())), 0 if zp is None else int(zp.reshape(()))


def _quantized_type(layer: LayerView) -> str | None:
    if layer.op_type == "QuantizeLinear" and layer.input_dtypes[0] == "float32":
        return layer.output_dtypes[0]
    if layer.op_type == "DequantizeLinear" and layer.output_dtypes == ("float32",):
        return layer.input_dtypes[0]
    return None


class QuantizeLinearTactic:
    name = QUANT_TACTIC
    source = "kiln"
    needs_c_compiler = True

    def supports(self, layer: LayerView) -> bool:
        return (_quantized_type(layer) in INT8_TYPES and _scalar_params(layer) is not None
                and layer.input_shapes[0] is not None and 0 not in layer.const_inputs and native.available())

    def input_formats(self, layer: LayerView) -> list[str]:
        return [ANY] + [LINEAR] * (len(layer.input_shapes) - 1)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        if layer.op_type == "QuantizeLinear" and len(layer.input_shapes[0]) == 4:
            return HWC
        return input_formats[0]

    def prepare(self, layer: LayerView) -> Kernel:
        lib = native.library("quant")
        scale, zero_point = _scalar_params(layer)
        suffix, qtype = INT8_TYPES[_quantized_type(layer)]
        if layer.op_type == "DequantizeLinear":
            dequantize = getattr(lib, f"kiln_dequantize_{suffix}")

            def run_dequantize(xs):
                q = xs[0].contiguous() if not dense_layout(xs[0]) else xs[0]
                y = torch.empty_like(q, dtype=torch.float32)   # the same strides: the layout is kept
                dequantize(q.data_ptr(), y.data_ptr(), q.numel(), scale, zero_point)
                return [y]
            return run_dequantize
        quantize = getattr(lib, f"kiln_quantize_{suffix}")
        to_nhwc = getattr(lib, f"kiln_quantize_nhwc_{suffix}")

        def run_quantize(xs):
            x = xs[0] if dense_layout(xs[0]) else xs[0].contiguous()
            if x.dim() == 4 and x.is_contiguous():   # channel-planar in, channel-major out
                n, c, h, w = x.shape
                y = torch.empty(x.shape, dtype=qtype, memory_format=torch.channels_last)
                to_nhwc(x.data_ptr(), y.data_ptr(), n, c, h * w, scale, zero_point)
                return [y]
            y = torch.empty_like(x, dtype=qtype)   # channels-last in: the same layout out
            quantize(x.data_ptr(), y.data_ptr(), x.numel(), scale, zero_point)
            return [y]
        return run_quantize


def dense_layout(x: torch.Tensor) -> bool:
    """Whether `x` is a row-major or channels-last block of memory (elementwise loops may walk its storage)."""
    return x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))
