"""LayerNormalization, kiln's SkipLayerNormalization (the residual sum fused in) and RMSNormalization (T5's and
LLaMA's: no mean, no bias) over the trailing axes in C (kiln/native/csrc/layernorm.c): one pass per row for the
sum, two vectorized reductions in double (mean, then the centred variance, as torch and onnxruntime compute it;
RMSNormalization one, the mean of squares), one for the scaled output; OpenMP over rows. kiln's QLayerNorm (INT8
in and out, a post-LN residual QAdd optionally inside) runs the same rows. Instance and group normalization are in
kiln.tactics.groupnorm_c.

torch's layer_norm behind an Add costs BERT-base about 0.13 ms per 128x768 layer on this machine (two kernels,
an intermediate tensor, dispatch); the whole row fits in L1, so the fused loop runs at memory speed.
Dynamic leading axes are fine (rows are counted per call); the normalized size, scale and bias are fixed.
"""
from __future__ import annotations

import ctypes
import struct
import threading

import torch

from kiln import hardware, native
from kiln.ops.dtypes import INT8_TORCH
from kiln.ops.fused import quantized_layer_norm
from kiln.tactics.base import LINEAR, STORED_FLOATS, CallLink, Kernel, LayerView, bf16_io, row_major_strides, \
    storage_dtype

LAYERNORM_TACTIC = "kiln.layernorm_rows"
QLAYERNORM_TACTIC = "kiln.layernorm_rows_int8"
LN_SKIP_BF16 = 4   # layernorm.c's `io` bits above the storage bits (kiln.tactics.base.bf16_io): the skip in bf16,
LN_RMS = 8         # RMSNormalization


def _geometry(layer: LayerView) -> tuple[int, int] | None:
    """(normalized size, index of the scale input), or None when the layer is not a float32 (or kiln's INT8)
    LayerNorm over static trailing axes with constant per-element scale (and bias)."""
    skip = layer.op_type == "SkipLayerNormalization" and layer.domain == "kiln"
    onnx_op = layer.op_type in ("LayerNormalization", "RMSNormalization") and layer.domain in ("", "ai.onnx")
    quantized = layer.op_type == "QLayerNorm" and layer.domain == "kiln"
    if not (skip or onnx_op or quantized):
        return None
    first = 2 if skip or layer.attrs.get("skip_quant") else 1
    x = layer.input_shapes[0]
    if x is None or not x or len(layer.output_dtypes) != 1 or layer.attrs.get("stash_type", 1) != 1:
        return None
    acts = range(first)
    stored = INT8_TORCH if quantized else STORED_FLOATS
    if any(layer.input_dtypes[i] not in stored or layer.input_shapes[i] != x or i in layer.const_inputs
           for i in acts):
        return None
    axis = layer.attrs.get("axis", -1) % len(x)
    dynamic = [set(d) for d in layer.input_dynamic[:first]] if layer.input_dynamic else []
    if any(k >= axis for d in dynamic for k in d) or (first == 2 and len(dynamic) == 2 and dynamic[0] != dynamic[1]):
        return None   # the normalized axes must be static, and x and skip vary alike
    n = 1
    for d in x[axis:]:
        n *= d
    if n == 0:
        return None
    params = [i for i in range(first, len(layer.input_shapes)) if layer.input_shapes[i] is not None]
    if first not in params or any(i not in layer.const_inputs or layer.const_inputs[i].numel() != n
                                  or layer.const_inputs[i].dtype != torch.float32 for i in params):
        return None
    return n, first


def _params(layer: LayerView) -> tuple[int, int, torch.Tensor, torch.Tensor | None, float]:
    """(normalized size, index of the scale input, scale, bias or None, epsilon), the FP32 vectors contiguous."""
    n, first = _geometry(layer)
    gamma = layer.const_inputs[first].reshape(-1).contiguous().float()
    beta = layer.const_inputs.get(first + 1)
    beta = None if beta is None else beta.reshape(-1).contiguous().float()
    return n, first, gamma, beta, float(layer.attrs.get("epsilon", 1e-5))


class LayerNormTactic:
    name = LAYERNORM_TACTIC
    source = "kiln"
    needs_c_compiler = True

    def supports(self, layer: LayerView) -> bool:
        return _geometry(layer) is not None and native.available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        if layer.op_type == "RMSNormalization":
            return stored_rows_kernel(layer)   # its FP32 storage: the storage-aware loop, rows copied once
        lib = native.library("layernorm")
        n, first, gamma, beta, eps = _params(layer)

        def run(xs):
            x = xs[0].contiguous()
            skip = xs[1].contiguous() if first == 2 else None
            y = torch.empty_like(x, memory_format=torch.contiguous_format)
            lib.kiln_layernorm(x.data_ptr(), None if skip is None else skip.data_ptr(), gamma.data_ptr(),
                               None if beta is None else beta.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
            return [y]
        return run


class LayerNormBf16Tactic(LayerNormTactic):
    """The same rows with BF16 storage (`kiln_layernorm_bf16`): the input, the skip and the output are read and
    written in bf16 where the plan stores them so (kiln.tactics.storage), the statistics and the scaling computed
    in FP32. Offered with the BF16 kernels around it (native BF16 arithmetic), so a BF16 encoder's tensors stay
    bf16 from one GEMM to the next."""

    name = "kiln.layernorm_rows_bf16"
    reduced_precisions = frozenset({"BF16"})
    required_isa = hardware.BF16_ISA
    bf16_inputs = frozenset({0, 1})   # LayerNormalization's input 1 is its scale, a weight: never a tensor
    writes_bf16 = True

    def supports(self, layer: LayerView) -> bool:
        return super().supports(layer) and hardware.has_any(hardware.BF16_ISA)

    def prepare(self, layer: LayerView) -> Kernel:
        return stored_rows_kernel(layer)


def stored_rows_kernel(layer: LayerView) -> Kernel:
    """`kiln_layernorm_bf16`: each of the input, the skip and the output FP32 or bf16 as the layer's dtypes say,
    RMSNormalization's statistic where the layer is one."""
    lib = native.library("layernorm")
    n, first, gamma, beta, eps = _params(layer)
    io = bf16_io(layer) | (LN_SKIP_BF16 if first == 2 and layer.input_dtypes[1] == "bfloat16" else 0) | \
        (LN_RMS if layer.op_type == "RMSNormalization" else 0)
    out_dtype = storage_dtype(layer.output_dtypes[0])

    def run(xs):
        x = xs[0].contiguous()
        skip = xs[1].contiguous() if first == 2 else None
        y = torch.empty(x.shape, dtype=out_dtype)
        lib.kiln_layernorm_bf16(x.data_ptr(), None if skip is None else skip.data_ptr(), gamma.data_ptr(),
                                None if beta is None else beta.data_ptr(), y.data_ptr(), x.numel() // n, n, eps, io)
        return [y]
    run.constants = (gamma, beta)
    fixed = [gamma.data_ptr(), 0 if beta is None else beta.data_ptr()]
    eps_bits = struct.unpack("<q", struct.pack("<d", eps))[0]

    def bind(shape: torch.Size):   # the same call with its parameters made once per input shape
        params = torch.tensor([*fixed, shape.numel() // n, n, eps_bits, io], dtype=torch.int64)
        return params, tuple(shape), row_major_strides(shape)
    function = ctypes.cast(lib.kiln_layernorm_bf16_call, ctypes.c_void_p).value
    run.chain_link = CallLink(function, bind, first == 2, out_dtype, threading.Lock())
    return run


class QuantizedLayerNormTactic(LayerNormTactic):
    """kiln's QLayerNorm (DequantizeLinear -> LayerNormalization -> QuantizeLinear, kiln.passes.quantization):
    INT8 rows in and out, FP32 inside (`kiln_layernorm_q8`); with its residual QAdd, both INT8 inputs are added
    and the sum rounded to INT8 first, as the model's QuantizeLinear does. In quantize_static BERT-base the four
    layers it replaces (QAdd, DQ, LayerNorm, Q) took ~70 µs per 128x768 block."""

    name = QLAYERNORM_TACTIC

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "QLayerNorm" or layer.domain != "kiln" or _geometry(layer) is None:
            return False
        q, skip = layer.attrs.get("quant", {}), layer.attrs.get("skip_quant") or {}
        dtypes = [q.get("x_dtype"), q.get("y_dtype")] + [skip.get(k) for k in ("a_dtype", "b_dtype", "y_dtype")
                                                           if skip]
        same_x = not skip or skip.get("y_dtype") == q.get("x_dtype")   # the sum's type is what x is read as
        return all(d in INT8_TORCH for d in dtypes) and same_x and native.available()

    def prepare(self, layer: LayerView) -> Kernel:
        lib = native.library("layernorm")
        n, first, gamma, beta, eps = _params(layer)
        q, skip = layer.attrs["quant"], layer.attrs.get("skip_quant")
        params_as_given = [layer.const_inputs[first], layer.const_inputs.get(first + 1)]
        # kiln_layernorm_q8's slots: a, b, the sum (x itself three times without the residual), x, y
        slots = ([(skip, "a"), (skip, "b"), (skip, "y")] if skip else [(q, "x")] * 3) + [(q, "x"), (q, "y")]
        params = torch.tensor([v for d, k in slots for v in (d[f"{k}_scale"], d[f"{k}_zero_point"])],
                              dtype=torch.float32)
        signed = [d[f"{k}_dtype"] == "int8" for d, k in slots[:3] + slots[4:]]   # type bits: a, b, sum, y
        types = sum(bit << k for k, bit in enumerate(signed))
        out_dtype = INT8_TORCH[q["y_dtype"]]

        def run(xs):
            a = xs[0].contiguous()
            b = xs[1].contiguous() if first == 2 else None
            if b is not None and b.shape != a.shape:   # the kernel reads one row of b per row of a
                return quantized_layer_norm(layer.attrs, list(xs[:2]) + params_as_given)
            y = torch.empty(a.shape, dtype=out_dtype)
            lib.kiln_layernorm_q8(a.data_ptr(), None if b is None else b.data_ptr(), gamma.data_ptr(),
                                  None if beta is None else beta.data_ptr(), y.data_ptr(), a.numel() // n, n, eps,
                                  params.data_ptr(), types)
            return [y]
        run.constants = (gamma, beta, params)
        return run
