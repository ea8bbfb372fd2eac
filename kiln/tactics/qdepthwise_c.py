"""kiln's INT8 depthwise convolution in C (`kiln_qdepthwise`, kiln/native/csrc/qdepthwise.h): a QConv with one
group per channel and one output channel each (MobileNet's and EfficientNet's 3x3 and 5x5 layers), NHWC, u8 or s8
activations, symmetric s8 weights per tensor or per channel, any kernel size, stride, dilation and padding, the
activations and requantization of every kiln INT8 layer (qgemm.c's epilogue).

Why: the only other kernel for such a layer is oneDNN's through torch, whose ~50 µs of descriptor work a call
(benchmarks/overhead.py) is more than a depthwise layer's whole compute at MobileNet's sizes; a quantize_static
MobileNetV2 has 17 of them."""
from __future__ import annotations

import ctypes

import torch

from kiln import native
from kiln.tactics.base import HWC, Kernel, LayerView
from kiln.tactics.depthwise_c import depthwise_shape, geometry
from kiln.tactics.gemm_c import nhwc_kernel
from kiln.tactics.onednn_int8 import _quant_supported
from kiln.tactics.qgemm_c import I64, QUAD, VNNI_ISA, Epilogue, epilogue, fused_activation, output_dtype, per_batch, \
    s8_weights, vnni_available

LANES = 16                           # channels per vector of sums
# 514: taps a float sums exactly, within qdepthwise.h's per-call arrays (whole quads)
MAX_TAPS = min(2**24 // (255 * 128), native.header_constant("qdepthwise.h", "DW_MAX_TAPS") // 4 * 4)


class DepthwiseCall(ctypes.Structure):
    """qdepthwise.h's QDepthwiseCall: the layer's constants, built once at load."""

    _fields_ = [("b", ctypes.c_void_p), ("q", ctypes.c_void_p),
                *((name, I64) for name in ("n", "h", "w", "c", "kh", "kw", "sh", "sw", "dh", "dw", "pt", "pl", "oh",
                                           "ow")),
                ("e", Epilogue)]


def pack_depthwise(taps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """s8 weights [taps, c] as both of qdepthwise.h's layouts, channels padded to whole vectors with zeros: floats
    [taps][c] and quads [taps / 4][c][4] (lane i of a quad row: channel i's four taps; the spare taps 0)."""
    t, c = taps.shape
    lanes, groups = -(-c // LANES) * LANES, -(-t // QUAD)
    floats = torch.zeros((t, lanes), dtype=torch.float32)
    floats[:, :c] = taps.float()
    quads = torch.zeros((groups * QUAD, lanes), dtype=torch.int8)
    quads[:t, :c] = taps
    return floats, quads.view(groups, QUAD, lanes).permute(0, 2, 1).contiguous()


class QDepthwiseConvTactic:
    """A depthwise QConv (group = input channels = output channels) without a fused residual: taps read in place."""

    name = "kiln.qconv2d_depthwise_nhwc_int8"
    source = "kiln"
    needs_c_compiler = True
    required_isa = VNNI_ISA

    def supports(self, layer: LayerView) -> bool:
        """Symmetric s8 weights (the epilogue's weight zero-point term needs one row sum for all channels), at most
        MAX_TAPS taps, an activation the epilogue has, explicit pads and a window inside the padded image."""
        if layer.op_type != "QConv" or layer.domain != "kiln" or not depthwise_shape(layer):
            return False
        if not _quant_supported(layer, mid=True) or fused_activation(layer.attrs.get("activation")) is None:
            return False
        w = layer.const_inputs[1]
        return w.shape[2] * w.shape[3] <= MAX_TAPS and vnni_available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [HWC] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC

    def prepare(self, layer: LayerView) -> Kernel:
        conv = native.library("qgemm").kiln_qdepthwise
        n, c, h, w = layer.input_shapes[0]
        kh, kw, *_, oh, ow = window = geometry(layer)
        taps = s8_weights(layer).reshape(c, kh * kw).t()            # [kh * kw, c]: the epilogue's [k, n]
        weights, quads = pack_depthwise(taps)
        e, kept = epilogue(layer, taps)
        calls = per_batch(lambda batch: DepthwiseCall(weights.data_ptr(), quads.data_ptr(), batch, h, w, c, *window,
                                                      e))

        def launch(x, out, res):
            conv(calls(x.shape[0]), x.data_ptr(), out.data_ptr())
        run = nhwc_kernel(launch, (n, c, oh, ow), None, False, output_dtype(layer))
        run.constants = (weights, quads, calls, kept)   # read through raw pointers
        return run
