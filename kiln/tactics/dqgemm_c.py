"""kiln's dynamically quantized INT8 layers (DynamicQMatMul and DynamicQConv, from kiln.passes.dynamic_quant;
onnxruntime's DynamicQuantizeMatMul) in C, one call a layer: kiln_dqgemm and kiln_dqconv
(kiln/native/csrc/qgemm_dynamic.h) find the FP32 activation's range, quantize it to u8 as DynamicQuantizeLinear
does, and run kiln's INT8 GEMM or direct convolution (`vpdpbusd`, or AMX-INT8 tiles in the AMX variants) with the
epilogue made for that scale and zero point: FP32 out, the bias added, the activation applied. s8 weights
(quantize_dynamic's QInt8 default) and u8 ones (QUInt8, read as s8 shifted by 128), per tensor or per output
channel, with zero points or without.

quantize_dynamic on ResNet-50 (s8 weights, per tensor) runs 144 ms in onnxruntime, whose ConvInteger takes u8
weights fast and s8 ones on a slow path."""
from __future__ import annotations

import ctypes
import math

import torch

from kiln import native
from kiln.ops.nn import apply_activation
from kiln.tactics.base import Kernel, LayerView, batch_dynamic_only, has_residual
from kiln.tactics.conv_direct import conv_geometry
from kiln.tactics.gemm_c import nhwc_kernel
from kiln.tactics.qgemm_amx import AmxInt8, pack_amx_quads, pack_amx_segments
from kiln.tactics.qgemm_c import (OUT_KINDS, Epilogue, QConvDirectTactic, QLinearGemmTactic,
                                  _padded, column_sums, fused_activation, k_fits, pack_quads, pack_segments,
                                  rows_kernel, s8_weights, vnni_available)


def dynamic_constants(layer: LayerView, w_kn: torch.Tensor) -> tuple[Epilogue, tuple[torch.Tensor, ...]]:
    """The epilogue's load-time part for weights `w_kn` ([k, n] `s8_weights`) and the tensors the call reads
    through raw pointers (column sums, weight scales, bias, weight zero points): comp, scale and the padding byte are
    made per call for the activation's own range. The activation goes in where the kernel has it (`with_activation`
    applies the rest)."""
    n = w_kn.shape[1]
    colsum, w_zp = column_sums(layer, w_kn)
    w_scale = _padded(torch.tensor(layer.attrs["quant"]["w_scale"], dtype=torch.float32), n, torch.float32)
    bias = layer.const_inputs.get(2)
    bias = None if bias is None else _padded(bias.float(), n, torch.float32)
    lo, hi, act = fused_activation(layer.attrs.get("activation")) or (-math.inf, math.inf, 0)
    e = Epilogue(None, None, None if bias is None else bias.data_ptr(), lo, hi, 1.0, 1.0, 0, 0, act,
                 OUT_KINDS[None], 0, 0, OUT_KINDS[None], None if w_zp is None else w_zp.data_ptr())   # FP32 out
    return e, (colsum, w_scale) + tuple(t for t in (bias, w_zp) if t is not None)


def _int8_weights(layer: LayerView) -> bool:
    w = layer.const_inputs.get(1)
    return w is not None and w.dtype in (torch.int8, torch.uint8)


def with_activation(layer: LayerView, run: Kernel) -> Kernel:
    """`run`, then the layer's activation where the kernel's epilogue has it not (LeakyRelu, Sigmoid, ...)."""
    spec = layer.attrs.get("activation")
    if fused_activation(spec) is not None:
        return run

    def activated(xs):
        return [apply_activation(spec, run(xs)[0])]
    activated.constants = run.constants
    if hasattr(run, "into_input"):   # the variant writing over a dead residual, then the activation
        index, into = run.into_input
        activated.into_input = (index, lambda xs: [apply_activation(spec, into(xs)[0])])
    return activated


def _bias_fits(layer: LayerView, channels: int) -> bool:
    """No bias, or a constant one of `channels` FP32 values."""
    bias = layer.const_inputs.get(2)
    return len(layer.input_shapes) < 3 or layer.input_shapes[2] is None or \
        (bias is not None and bias.numel() == channels and bias.dtype == torch.float32)


def dynamic_supported(layer: LayerView) -> bool:
    """A DynamicQMatMul by a constant 2-D INT8 matrix, K fixed, and a bias (if any) of N FP32 values."""
    if layer.op_type != "DynamicQMatMul" or layer.domain != "kiln" or not layer.input_shapes[0]:
        return False
    w = layer.const_inputs.get(1)
    if not _int8_weights(layer) or w.dim() != 2 or not k_fits(layer, w.shape[0]) or \
            layer.input_dtypes[0] != "float32" or not _bias_fits(layer, w.shape[1]):
        return False
    dynamic = layer.input_dynamic[0] if layer.input_dynamic else ()
    return len(layer.input_shapes[0]) - 1 not in dynamic


class DynamicQLinearGemmTactic(QLinearGemmTactic):
    """DynamicQMatMul on AVX512-VNNI: the activation's rows are the GEMM's, counted per call (the static INT8
    product's formats and constants, its own entry point)."""

    name = "kiln.dynamic_qmatmul_gemm_int8"
    entry_point = "kiln_dqgemm"          # the AMX variant swaps these two
    pack = staticmethod(pack_quads)

    def supports(self, layer: LayerView) -> bool:
        return dynamic_supported(layer) and vnni_available()

    def prepare(self, layer: LayerView) -> Kernel:
        gemm = getattr(native.library("qgemm"), self.entry_point)
        packed, call, kept = self.packed_call(layer, s8_weights(layer), dynamic_constants)
        call_ptr, colsum_ptr, scale_ptr = ctypes.addressof(call), kept[0].data_ptr(), kept[1].data_ptr()
        run = rows_kernel(call.k, call.n, torch.float32,
                          lambda x, y, rows: gemm(call_ptr, x, y, rows, colsum_ptr, scale_ptr))
        run.constants = (packed, call, kept)   # read through raw pointers
        return with_activation(layer, run)


class DynamicQLinearGemmAmxTactic(AmxInt8, DynamicQLinearGemmTactic):
    name = "kiln.dynamic_qmatmul_gemm_amx_int8"
    entry_point = "kiln_dqgemm_amx"
    pack = staticmethod(pack_amx_quads)
    fallback_tactic = DynamicQLinearGemmTactic()


def dynamic_conv_supported(layer: LayerView) -> bool:
    """A 2-D DynamicQConv with constant INT8 weights, one group, dilation 1, explicit pads, the batch its only
    dynamic axis, a bias (if any) of Cout FP32 values and a residual (if any) FP32 of the output's shape."""
    if layer.op_type != "DynamicQConv" or layer.domain != "kiln" or len(layer.input_shapes[0] or ()) != 4:
        return False
    a, w = layer.attrs, layer.const_inputs.get(1)
    if not _int8_weights(layer) or w.dim() != 4 or a.get("group", 1) != 1 or \
            any(d != 1 for d in a.get("dilations") or [1, 1]) or a.get("auto_pad", "NOTSET") not in ("NOTSET", ""):
        return False
    if layer.input_dtypes[0] != "float32" or not batch_dynamic_only(layer) or not _bias_fits(layer, w.shape[0]):
        return False
    kh, kw, _, _, pt, pl, oh, ow = conv_geometry(layer)
    if has_residual(layer) and (layer.input_dtypes[3] != "float32" or
                                 tuple(layer.input_shapes[3][1:]) != (w.shape[0], oh, ow)):
        return False
    return oh >= 1 and ow >= 1 and min(pt, pl) >= 0 and k_fits(layer, kh * kw * layer.input_shapes[0][1])


class DynamicQConvTactic(QConvDirectTactic):
    """DynamicQConv on AVX512-VNNI, NHWC: the static INT8 direct convolution's packing and windows (any kernel,
    stride and padding; padded pixels hold the call's zero point), its own entry point; the FP32 residual is added
    as each output is stored. Activations the epilogue lacks (it has clamps, Swish and GELU) run after it."""

    name = "kiln.dynamic_qconv2d_direct_nhwc_int8"
    entry_point = "kiln_dqconv"          # the AMX variant swaps these two
    pack = staticmethod(pack_segments)

    def supports(self, layer: LayerView) -> bool:
        return dynamic_conv_supported(layer) and vnni_available()

    def prepare(self, layer: LayerView) -> Kernel:
        conv = getattr(native.library("qgemm"), self.entry_point)
        packed, calls, kept, out_shape = self.packed_calls(layer, s8_weights(layer), dynamic_constants)
        colsum_ptr, scale_ptr = kept[0].data_ptr(), kept[1].data_ptr()

        def launch(x, out, res):
            conv(calls(x.shape[0]), x.data_ptr(), out.data_ptr(), None if res is None else res.data_ptr(), colsum_ptr,
                 scale_ptr)
        run = nhwc_kernel(launch, out_shape, None, has_residual(layer))
        run.constants = (packed, calls, kept)   # read through raw pointers
        return with_activation(layer, run)


class DynamicQConvAmxTactic(AmxInt8, DynamicQConvTactic):
    name = "kiln.dynamic_qconv2d_direct_nhwc_amx_int8"
    entry_point = "kiln_dqconv_amx"
    pack = staticmethod(pack_amx_segments)
    fallback_tactic = DynamicQConvTactic()
