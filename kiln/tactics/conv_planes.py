"""1x1 convolution on row-major (NCHW) activations with few output channels (kiln/native/csrc/conv_planes.c): each
output plane is a weighted sum of the input planes, computed along the planes' rows, so the layer needs neither a
reformat into channel-major order nor a GEMM's packing. That is the shape of YOLOv8's DFL expectation (16 -> 1
channel over [4, 8400], after a softmax on axis 1 of a row-major tensor) and of segmentation heads' last layer.

`kiln.conv2d_1x1_planes` is FP32; `kiln.conv2d_1x1_planes_bf16` reads and writes FP32 or bf16 as a BF16 plan stores
them, computing in FP32. 2 threads of a Zen 4, the DFL layer: 0.03 ms, against oneDNN's 0.08 ms plus a 0.04 ms
reformat of its input."""
from __future__ import annotations

import ctypes

import torch

from kiln import native
from kiln.tactics.base import LINEAR, STORED_FLOATS, Bf16Storage, Kernel, LayerView, batch_dynamic_only, bf16_io, \
    has_residual, storage_dtype

PLANES_TACTIC = "kiln.conv2d_1x1_planes"
MAX_OUT_CHANNELS = 32   # each output channel reads the input planes again (from cache): beyond, the GEMMs win


class PlaneCall(ctypes.Structure):
    """conv_planes.c's PlaneCall."""

    _fields_ = [(name, ctypes.c_int64) for name in ("cin", "cout", "hw", "relu", "io")]


class Conv1x1PlanesTactic:
    """FP32 in and out."""

    name = PLANES_TACTIC
    source = "kiln"
    needs_c_compiler = True
    stored_types = ("float32",)

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "Conv" or layer.domain not in ("", "ai.onnx") or 1 not in layer.const_inputs:
            return False
        a, w, x = layer.attrs, layer.const_inputs[1], layer.input_shapes[0]
        if x is None or len(x) != 4 or w.dim() != 4 or tuple(w.shape[2:]) != (1, 1) or w.shape[0] > MAX_OUT_CHANNELS:
            return False
        if a.get("group", 1) != 1 or any(a.get("pads") or [0]) or any(s != 1 for s in a.get("strides") or [1]):
            return False
        if layer.input_dtypes[0] not in self.stored_types or layer.output_dtypes[0] not in self.stored_types:
            return False
        if has_residual(layer):
            return False   # a fused residual: the channel-major kernels take those
        if len(layer.input_shapes) > 2 and layer.input_shapes[2] is not None and 2 not in layer.const_inputs:
            return False
        activation = a.get("activation")
        if activation and activation.get("op") != "Relu":
            return False
        return batch_dynamic_only(layer) and native.available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        entry = native.library("conv_planes").kiln_conv_planes
        _, cin, h, w = layer.input_shapes[0]
        weight = layer.const_inputs[1].reshape(layer.const_inputs[1].shape[0], cin).float().contiguous()
        bias = layer.const_inputs.get(2)
        bias = None if bias is None else bias.reshape(-1).float().contiguous()
        cout = weight.shape[0]
        in_dtype, out_dtype = storage_dtype(layer.input_dtypes[0]), storage_dtype(layer.output_dtypes[0])
        io = bf16_io(layer)
        call = PlaneCall(cin, cout, h * w, int(bool(layer.attrs.get("activation"))), io)
        call_ptr, w_ptr, b_ptr = ctypes.addressof(call), weight.data_ptr(), None if bias is None else bias.data_ptr()
        tail, strides = (cin, h, w), (cout * h * w, h * w, w, 1)   # torch.empty_strided: ~0.6 µs less a call

        def run(xs):
            x = xs[0] if xs[0].dtype == in_dtype else xs[0].to(in_dtype)
            x = x.contiguous()
            if tuple(x.shape[1:]) != tail:
                raise ValueError(f"{self.name}: input shaped {list(x.shape)}, the plan's is {['N', *tail]}")
            y = torch.empty_strided((x.shape[0], cout, h, w), strides, dtype=out_dtype)
            entry(call_ptr, x.data_ptr(), w_ptr, b_ptr, y.data_ptr(), x.shape[0])
            return [y]
        run.constants = (call, weight, bias)   # read through raw pointers
        return run


class Conv1x1PlanesBf16Tactic(Bf16Storage, Conv1x1PlanesTactic):
    """Granted BF16: input and output FP32 or bf16 as the plan stores them, the arithmetic FP32 (its only rounding is
    its output's)."""

    name = PLANES_TACTIC + "_bf16"
    stored_types = STORED_FLOATS
    bf16_inputs = frozenset({0})
