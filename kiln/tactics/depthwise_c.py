"""kiln's depthwise convolution in C (`kiln_depthwise`, kiln/native/csrc/depthwise.c): a Conv with one group per
channel and one output channel each (MobileNet's and EfficientNet's 3x3 and 5x5 layers), NHWC, any kernel size,
stride, dilation and padding, with the bias, ReLU, Clip (ReLU6), Swish and HardSwish applied as it stores.

`kiln.conv2d_depthwise_nhwc` is FP32; `kiln.conv2d_depthwise_nhwc_bf16` reads and writes FP32 or bf16 as a BF16
plan stores them, computing in FP32. Why: the other kernel for such a layer is oneDNN's through torch, whose ~45 µs
of descriptor work a call (benchmarks/overhead.py) is more than a depthwise layer's whole compute at MobileNet's
sizes; a MobileNetV3-Large has 15 of them."""
from __future__ import annotations

import ctypes
import math

import torch

from kiln import native
from kiln.tactics.base import HWC, STORED_FLOATS, Bf16Storage, Kernel, LayerView, batch_dynamic_only, bf16_io, \
    has_residual, storage_dtype
from kiln.tactics.gemm_c import ACT_HARDSWISH, ACT_SWISH, fused_activation

LANES = 16   # channels padded to whole vectors of the widest build (AVX-512); an AVX2 build reads half at a time


class DepthwiseCall(ctypes.Structure):
    """depthwise.c's DepthwiseCall: the layer's constants, built once at load."""

    _fields_ = [("weights", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                *((name, ctypes.c_int64) for name in ("h", "w", "c", "lanes", "kh", "kw", "sh", "sw", "dh", "dw",
                                                      "pt", "pl", "oh", "ow", "act", "io")),
                ("lo", ctypes.c_float), ("hi", ctypes.c_float)]


def stored_activation(spec: dict | None) -> tuple[float, float, int] | None:
    """(clamp low, clamp high, activation.h's ACT_* code) the kernel applies after the bias: the INT8 epilogue's
    activations (gemm_c.fused_activation) but GELU, and HardSwish; None for an activation it has not."""
    if spec and spec["op"] == "HardSwish":
        return -math.inf, math.inf, ACT_HARDSWISH
    fused = fused_activation(spec)
    return None if fused is None or fused[2] not in (0, ACT_SWISH) else fused


def depthwise_shape(layer: LayerView) -> bool:
    """Whether a 2-D convolution (Conv or QConv) has one input and one output channel per group, constant weights
    [c, 1, kh, kw], no fused residual, explicit pads, a window inside the padded image, and inputs that vary along
    the batch at most: the layers both depthwise kernels take."""
    if len(layer.input_shapes[0] or ()) != 4:
        return False
    a, w, c = layer.attrs, layer.const_inputs.get(1), layer.input_shapes[0][1]
    if w is None or w.dim() != 4 or a.get("group", 1) != c or tuple(w.shape[:2]) != (c, 1) or has_residual(layer):
        return False
    if a.get("auto_pad", "NOTSET") not in ("NOTSET", "", b"NOTSET") or not batch_dynamic_only(layer):
        return False
    *_, pt, pl, oh, ow = geometry(layer)
    return oh >= 1 and ow >= 1 and min(pt, pl) >= 0


def geometry(layer: LayerView) -> tuple[int, ...]:
    """(kh, kw, sh, sw, dh, dw, pad top, pad left, out h, out w)."""
    _, _, h, w = layer.input_shapes[0]
    kh, kw = layer.const_inputs[1].shape[2:]
    sh, sw = layer.attrs.get("strides") or [1, 1]
    dh, dw = layer.attrs.get("dilations") or [1, 1]
    pt, pl, pb, pr = layer.attrs.get("pads") or [0, 0, 0, 0]
    return kh, kw, sh, sw, dh, dw, pt, pl, (h + pt + pb - dh * (kh - 1) - 1) // sh + 1, \
        (w + pl + pr - dw * (kw - 1) - 1) // sw + 1


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [c, 1, kh, kw] as [taps][lanes] and the bias as [lanes], FP32, channels padded with zeros."""
    c, _, kh, kw = weight.shape
    lanes = -(-c // LANES) * LANES
    taps = torch.zeros((kh * kw, lanes), dtype=torch.float32)
    taps[:, :c] = weight.reshape(c, kh * kw).t().float()
    padded = torch.zeros(lanes, dtype=torch.float32)
    if bias is not None:
        padded[:c] = bias.reshape(-1).float()
    return taps.contiguous(), padded


class DepthwiseConvTactic:
    """A 2-D Conv with group = input channels = output channels, constant weights and bias, no fused residual."""

    name = "kiln.conv2d_depthwise_nhwc"
    source = "kiln"
    needs_c_compiler = True
    stored_types = ("float32",)

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "Conv" or layer.domain not in ("", "ai.onnx") or not depthwise_shape(layer):
            return False
        if len(layer.input_shapes) > 2 and layer.input_shapes[2] is not None and 2 not in layer.const_inputs:
            return False
        if layer.input_dtypes[0] not in self.stored_types or layer.output_dtypes[0] not in self.stored_types:
            return False
        return stored_activation(layer.attrs.get("activation")) is not None and native.available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [HWC] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC

    def prepare(self, layer: LayerView) -> Kernel:
        entry = native.library("depthwise").kiln_depthwise
        _, c, h, w = layer.input_shapes[0]
        kh, kw, *_, oh, ow = shape = geometry(layer)
        taps, bias = pack(layer.const_inputs[1], layer.const_inputs.get(2))
        lo, hi, act = stored_activation(layer.attrs.get("activation"))
        call = DepthwiseCall(taps.data_ptr(), bias.data_ptr(), h, w, c, taps.shape[1], *shape, act, bf16_io(layer),
                             lo, hi)
        call_ptr = ctypes.addressof(call)
        in_dtype, out_dtype = storage_dtype(layer.input_dtypes[0]), storage_dtype(layer.output_dtypes[0])
        tail, strides = (c, h, w), (oh * ow * c, 1, ow * c, c)   # NHWC; torch.empty_strided is the cheapest

        def run(xs):
            x = xs[0] if xs[0].dtype == in_dtype else xs[0].to(in_dtype)
            x = x.contiguous(memory_format=torch.channels_last)
            if tuple(x.shape[1:]) != tail:
                raise ValueError(f"{self.name}: input shaped {list(x.shape)}, the plan's is {['N', *tail]}")
            y = torch.empty_strided((x.shape[0], c, oh, ow), strides, dtype=out_dtype)
            entry(call_ptr, x.data_ptr(), y.data_ptr(), x.shape[0])
            return [y]
        run.constants = (call, taps, bias)   # read through raw pointers
        return run


class DepthwiseConvBf16Tactic(Bf16Storage, DepthwiseConvTactic):
    """Granted BF16: input and output FP32 or bf16 as the plan stores them, the arithmetic FP32 (its only rounding is
    its output's)."""

    name = "kiln.conv2d_depthwise_nhwc_bf16"
    stored_types = STORED_FLOATS
    bf16_inputs = frozenset({0})
