"""oneDNN matrix product by a constant matrix as a primitive of kiln's own (source "onednn"), in FP32 or BF16: a
linear layer (Gemm, or MatMul by a constant 2-D matrix; kiln.tactics.onednn_linear.by_constant_matrix) on oneDNN's
matmul (kiln/native/csrc/onednn.c), made once per input shape at load with the weights reordered into its kernel's
layout, each call its data pointers and an execute. Bias, residual and every activation oneDNN has fused, as for
kiln's convolution primitives (kiln.tactics.onednn_prim_float): BF16 reads bf16 rows (FP32 ones rounded as they are
made), writes the output as the plan stores it, and adds a residual of another type than the output from its own
buffer in FP32. torch's `_linear_pointwise` builds oneDNN's descriptors in every call.

The INT8 one (QGemm/QMatMul: u8 or s8 activations read as they are, s8 weights with a scale per output column,
the FP32 bias, the requantization to u8/s8 or an FP32 output, an activation) takes the layers torch's
`qlinear_pointwise` takes (kiln.tactics.onednn_int8), which also builds its descriptors per call."""
from __future__ import annotations

import ctypes
import math

import torch

from kiln.tactics.base import Kernel, LayerView, has_residual, row_major_strides
from kiln.tactics.gemm_c import tensor_address
from kiln.tactics.onednn_conv import Bf16Variant
from kiln.tactics.onednn_int8 import (OneDnnInt8LinearTactic, _channel_axis, _output, _scales, int8_available,
                                      linear_supported)
from kiln.tactics.onednn_linear import (OneDnnBf16LinearTactic, OneDnnLinearTactic, by_constant_matrix, linear_bias,
                                        linear_weight)
from kiln.tactics.onednn_prim import (R_NONE, TYPES, OwnPrimitive, available, eltwise, executor, float_fields,
                                      quantized_output, summing_kernel)


class MatmulCall(ctypes.Structure):
    """onednn.c's MatmulCall, field by field."""

    _fields_ = [*((f, ctypes.c_int64) for f in ("m", "k", "n")),
                *((f, ctypes.c_int32) for f in ("x_type", "w_type", "y_type", "r_type", "residual", "act")),
                *((f, ctypes.c_float) for f in ("act_alpha", "act_beta", "x_scale", "y_scale", "r_scale")),
                *((f, ctypes.c_int32) for f in ("x_zp", "y_zp", "r_zp", "w_scales", "any_rows")),
                *((f, ctypes.c_void_p) for f in ("w_scale", "weights", "bias"))]


def row_layout(n: int):
    """out_layout for executor: rows of `n` columns, row-major, for an input of any leading shape."""
    def layout(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        out = (*shape[:-1], n)
        return out, row_major_strides(out)
    return layout


def rows_vary(layer: LayerView) -> bool:
    """Whether the rows of a linear layer's input vary with the engine's input shapes (a leading axis is dynamic):
    then a product made for any number of rows serves the counts past the first few (kiln.tactics.onednn_prim's
    executor)."""
    dynamic = layer.input_dynamic[0] if layer.input_dynamic else ()
    rank = len(layer.input_shapes[0])
    return any(axis % rank != rank - 1 for axis in dynamic)


class PrimitiveLinearTactic(OwnPrimitive, OneDnnLinearTactic):
    name = "onednn.linear_primitive"
    library_fallback = OneDnnLinearTactic()

    def supports(self, layer: LayerView) -> bool:
        return by_constant_matrix(layer) and eltwise(layer.attrs.get("activation")) is not None and available()

    def prepare(self, layer: LayerView) -> Kernel:
        fields, x_dtype, y_dtype, residual = float_fields(layer, self.compute_dtype)
        w = linear_weight(layer).float().t().contiguous()   # [K, N]; rounded to bf16 by oneDNN's reorder
        k, n = w.shape
        bias = linear_bias(layer, n)[1]
        bias = None if bias is None else bias.float().contiguous()

        def make_call(shape: tuple[int, ...], any_rows: bool) -> MatmulCall:
            return MatmulCall(math.prod(shape[:-1]), k, n, *fields, 1, any_rows, None, w.data_ptr(),
                              tensor_address(bias))

        execute = executor(layer, "matmul", make_call, row_layout(n), y_dtype, x_dtype, torch.contiguous_format,
                           rows_vary(layer))
        return summing_kernel(execute, None, residual, torch.contiguous_format)


class PrimitiveBf16LinearTactic(Bf16Variant, PrimitiveLinearTactic):
    name = "onednn.linear_primitive_bf16"
    library_fallback = OneDnnBf16LinearTactic()


class PrimitiveInt8LinearTactic(OwnPrimitive, OneDnnInt8LinearTactic):
    name = "onednn.qlinear_primitive"
    library_fallback = OneDnnInt8LinearTactic()

    def supports(self, layer: LayerView) -> bool:
        return linear_supported(layer) and not has_residual(layer) and \
            eltwise(layer.attrs.get("activation")) is not None and int8_available() and available()

    def prepare(self, layer: LayerView) -> Kernel:
        q = layer.attrs["quant"]
        w = layer.const_inputs[1]
        w = (w.t() if _channel_axis(layer) == 0 else w).contiguous()   # [K, N] s8
        k, n = w.shape
        scales = _scales(layer)[0].contiguous()
        bias = layer.const_inputs.get(2)
        bias = None if bias is None else bias.reshape(-1).float().contiguous()
        y_scale, y_zp, _ = _output(layer)
        y_type, out_dtype = quantized_output(q)
        act = eltwise(layer.attrs.get("activation"))

        def make_call(shape: tuple[int, ...], any_rows: bool) -> MatmulCall:
            return MatmulCall(math.prod(shape[:-1]), k, n, TYPES[q["x_dtype"]], TYPES["int8"], y_type, -1, R_NONE,
                              *act, float(q["x_scale"]), y_scale, 1.0, int(q["x_zero_point"]), y_zp, 0, n,
                              any_rows, scales.data_ptr(), w.data_ptr(), tensor_address(bias))

        execute = executor(layer, "matmul", make_call, row_layout(n), out_dtype, None, torch.contiguous_format,
                           rows_vary(layer))
        return summing_kernel(execute, layer.attrs.get("out_table"), R_NONE, torch.contiguous_format)
