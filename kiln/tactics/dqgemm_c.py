"""kiln's dynamically quantized INT8 product (DynamicQMatMul, from kiln.passes.dynamic_quant; onnxruntime's
DynamicQuantizeMatMul) in C, one call a layer: kiln_dqgemm (kiln/native/csrc/qgemm.c) finds the FP32 activation's
range, quantizes it to u8 as DynamicQuantizeLinear does, and runs kiln's INT8 GEMM (`vpdpbusd`, or AMX-INT8 tiles in
the AMX variant) with the epilogue made for that scale and zero point: FP32 out, the bias added. Symmetric s8
weights (quantize_dynamic's QInt8 default) per tensor or per column; others run on the reference kernel."""
from __future__ import annotations

import ctypes
import math

import torch

from kiln import native
from kiln.tactics.base import Kernel, LayerView
from kiln.tactics.gemm_c import ONE_LINE
from kiln.tactics.qgemm_amx import AmxInt8, pack_amx_quads
from kiln.tactics.qgemm_c import (MAX_K, OUT_KINDS, Epilogue, GemmCall, QLinearGemmTactic, _padded, pack_quads,
                                  vnni_available)


def dynamic_supported(layer: LayerView) -> bool:
    """A DynamicQMatMul by a constant 2-D s8 matrix with zero weight zero points, K fixed, and a bias (if any) of N
    FP32 values."""
    if layer.op_type != "DynamicQMatMul" or layer.domain != "kiln" or not layer.input_shapes[0]:
        return False
    w, bias = layer.const_inputs.get(1), layer.const_inputs.get(2)
    if w is None or w.dim() != 2 or w.dtype != torch.int8 or w.shape[0] > MAX_K:
        return False
    if any(layer.attrs["quant"]["w_zero_point"]) or layer.input_dtypes[0] != "float32":
        return False
    if len(layer.input_shapes) > 2 and layer.input_shapes[2] is not None and \
            (bias is None or bias.numel() != w.shape[1] or bias.dtype != torch.float32):
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
        w = layer.const_inputs[1]
        k, n = w.shape
        packed = self.pack(w)
        colsum = _padded(w.to(torch.int32).sum(0), n, torch.int32)
        w_scale = _padded(torch.tensor(layer.attrs["quant"]["w_scale"], dtype=torch.float32), n, torch.float32)
        bias = layer.const_inputs.get(2)
        bias = None if bias is None else _padded(bias.float(), n, torch.float32)
        e = Epilogue(None, None, None if bias is None else bias.data_ptr(), -math.inf, math.inf, 1.0, 1.0, 0, 0, 0,
                     OUT_KINDS[None], 0, 0)   # comp and scale: made per call for the activation's own range
        call = GemmCall(packed.data_ptr(), 0, ONE_LINE, k, 0, 0, 1, k, n, e)
        call_ptr, colsum_ptr, scale_ptr = ctypes.addressof(call), colsum.data_ptr(), w_scale.data_ptr()

        def run(xs):
            x = xs[0] if xs[0].is_contiguous() else xs[0].contiguous()
            rows = x.numel() // k
            y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
            if rows:
                gemm(call_ptr, x.data_ptr(), y.data_ptr(), rows, colsum_ptr, scale_ptr)
            return [y]
        run.constants = (packed, call, colsum, w_scale, bias)   # read through raw pointers
        return run


class DynamicQLinearGemmAmxTactic(AmxInt8, DynamicQLinearGemmTactic):
    name = "kiln.dynamic_qmatmul_gemm_amx_int8"
    entry_point = "kiln_dqgemm_amx"
    pack = staticmethod(pack_amx_quads)
    fallback_tactic = DynamicQLinearGemmTactic()
