"""oneDNN INT8 convolution and inner product through torch (`torch.ops.onednn.qconv2d_pointwise`,
`qlinear_pointwise`): 8-bit activations (u8; s8 ones shifted to u8 on the way in), signed 8-bit weights with a scale per output channel prepacked
once at load, the requantization to the output scale, the activation and (convolutions) the INT8 residual sum
fused as post-ops. A layer without an output scale (the classic INT8-in/FP32-out convolution) writes FP32.

Offered only where the CPU has VNNI or AMX-INT8 dot products: without them oneDNN multiplies u8 by s8 with
`vpmaddubsw`, whose 16-bit pair sums saturate (255 * 127 * 2 > 32767) unless weights are cut to 7 bits.

A 3x3 64-channel convolution at 56x56 (Zen 4, 2 threads): 0.38 ms against 1.08 ms for the FP32 oneDNN kernel."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln import hardware
from kiln.ops.nn import _torch_pad
from kiln.tactics.base import HWC, LINEAR, Kernel, LayerView, RowMajor1d, conv1d_as_2d, has_residual
from kiln.tactics.lookup_c import table_mapper
from kiln.tactics.onednn_conv import _BINARY_UNARY, fused_unary

INT8_DOT_ISA = ("avx512_vnni", "avx_vnni", "amx_int8")
# The activations torch's oneDNN INT8 ops take as post-ops (probed: others raise "unsupported post op" at run time)
QCONV_UNARY = ("Relu", "Clip", "HardSwish", "Swish")
QLINEAR_UNARY = ("Relu", "Clip", "HardSwish", "Swish", "Tanh", "LeakyRelu", "Gelu")
OUTPUT_DTYPES = {"uint8": None, "int8": torch.int8}   # None: oneDNN's default, the input's u8


def int8_available() -> bool:
    return hardware.has_any(INT8_DOT_ISA) and torch.backends.mkldnn.is_available() and \
        hasattr(torch.ops.onednn, "qconv2d_pointwise")


def _quant_supported(layer: LayerView, zero_points: bool = False, mid: bool = False) -> bool:
    """u8 or s8 activations (s8 ones read as u8: see `unsigned_input`), symmetric s8 weights (per tensor, or per
    output channel; with `zero_points`, also asymmetric s8 and u8 ones), an output that is u8, s8 or FP32, and a
    constant FP32 bias or none; with `mid`, also a product rounded to u8/s8 before its bias (`mid_scale`), which
    oneDNN's post-ops cannot express."""
    q = layer.attrs.get("quant")
    w = layer.const_inputs.get(1)
    weight_types = (torch.int8, torch.uint8) if zero_points else (torch.int8,)
    if not q or w is None or w.dtype not in weight_types or layer.input_dtypes[0] not in ("uint8", "int8") or \
            q.get("x_dtype") != layer.input_dtypes[0]:
        return False
    if "mid_scale" in q and (not mid or q.get("mid_dtype") not in OUTPUT_DTYPES):
        return False
    per_channel = max(len(q["w_scale"]), len(q["w_zero_point"])) > 1
    if (not zero_points and any(z != 0 for z in q["w_zero_point"])) or \
            (per_channel and q["w_axis"] != _channel_axis(layer)):
        return False
    if ("y_scale" in q and q["y_dtype"] not in OUTPUT_DTYPES) or ("y_scale" not in q and
                                                                   layer.output_dtypes[0] != "float32"):
        return False
    bias = layer.const_inputs.get(2)
    has_bias = len(layer.input_shapes) > 2 and layer.input_shapes[2] is not None
    return not has_bias or (bias is not None and bias.dtype == torch.float32 and bias.numel() == _out_channels(layer))


def unsigned_input(q: dict):
    """(zero point oneDNN sees, convert): oneDNN's INT8 kernels read u8 activations only; an s8 tensor (kiln's
    calibration writes symmetric s8) is the same numbers as u8 shifted by 128, its byte with the top bit flipped."""
    if q["x_dtype"] == "uint8":
        return int(q["x_zero_point"]), (lambda x: x)
    return int(q["x_zero_point"]) + 128, (lambda x: x.view(torch.uint8).bitwise_xor(128))


def _channel_axis(layer: LayerView) -> int:
    """The weight axis holding output channels: 0 for Conv and transposed Gemm, 1 for MatMul and plain Gemm."""
    return 0 if layer.op_type == "QConv" or layer.attrs.get("transB", 0) else 1


def _out_channels(layer: LayerView) -> int:
    return int(layer.const_inputs[1].shape[_channel_axis(layer)])


def _scales(layer: LayerView) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel weight scales (a per-tensor scale repeated) and their (zero) zero points."""
    n, s = _out_channels(layer), layer.attrs["quant"]["w_scale"]
    scales = torch.tensor(s * n if len(s) == 1 else s, dtype=torch.float32)
    return scales, torch.zeros(n, dtype=torch.int64)


def _output(layer: LayerView) -> tuple[float, int, torch.dtype | None]:
    """(scale, zero point, dtype) oneDNN writes: requantized u8/s8, or FP32 (scale 1, zero point 0)."""
    q = layer.attrs["quant"]
    if "y_scale" in q:
        return float(q["y_scale"]), int(q["y_zero_point"]), OUTPUT_DTYPES[q["y_dtype"]]
    return 1.0, 0, torch.float32


class OneDnnInt8ConvTactic:
    name = "onednn.qconv2d_nhwc_prepacked"
    source = "torch-onednn"
    required_isa = INT8_DOT_ISA

    def supports(self, layer: LayerView) -> bool:
        if layer.op_type != "QConv" or layer.domain != "kiln" or len(layer.input_shapes[0] or ()) != 4:
            return False
        if layer.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "", b"NOTSET") or not _quant_supported(layer):
            return False
        spec, residual = layer.attrs.get("activation"), has_residual(layer)
        if spec and (spec["op"] not in QCONV_UNARY or fused_unary(spec) is None or
                     residual and spec["op"] not in _BINARY_UNARY):
            return False
        if residual and ("y_scale" not in layer.attrs["quant"] or layer.input_dtypes[3] != layer.attrs["quant"]["y_dtype"]):
            return False
        return int8_available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [HWC] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return HWC

    def prepare(self, layer: LayerView) -> Kernel:
        a, q = layer.attrs, layer.attrs["quant"]
        (x_zp, to_unsigned), x_scale = unsigned_input(q), float(q["x_scale"])
        pads, strides, dilations, groups = list(a["pads"]), list(a["strides"]), list(a["dilations"]), a.get("group", 1)
        explicit_pad = None if pads[:2] == pads[2:] else _torch_pad(pads)
        padding = pads[:2] if explicit_pad is None else [0, 0]
        n, c, h, w = layer.input_shapes[0]
        if explicit_pad is not None:
            h, w = h + pads[0] + pads[2], w + pads[1] + pads[3]
        w_scales, w_zps = _scales(layer)
        packed = torch.ops.onednn.qconv_prepack(layer.const_inputs[1].contiguous(), w_scales, x_scale, x_zp, strides,
                                                padding, dilations, groups, [n, c, h, w])
        bias = layer.const_inputs.get(2)
        y_scale, y_zp, y_dtype = _output(layer)
        unary, scalars, algorithm = fused_unary(a.get("activation")) or ("none", [], "")
        conv, last = torch.ops.onednn.qconv2d_pointwise, torch.channels_last
        geometry = (strides, padding, dilations, groups)
        mapped = table_mapper(a.get("out_table"))   # kiln.passes.qproduct_table: looked up after the call

        def padded(x):   # a quantized zero is the zero point: pad with it
            x = to_unsigned(x if x.is_contiguous(memory_format=last) else x.contiguous(memory_format=last))
            return x if explicit_pad is None else F.pad(x, explicit_pad, value=x_zp).contiguous(memory_format=last)

        if not has_residual(layer):
            def run(xs):
                return [mapped(conv(padded(xs[0]), x_scale, x_zp, packed, w_scales, w_zps, bias, *geometry, y_scale,
                                    y_zp, y_dtype, unary, scalars, algorithm or ""))]
            return run
        r_scale, r_zp = float(q["r_scale"]), int(q["r_zero_point"])
        binary = conv.binary

        def run_into_residual(xs):
            """The residual as oneDNN's sum post-op, accumulated in its own (dead) INT8 buffer: no clone first
            (torch hands back a copy of that buffer as the output)."""
            accum = xs[3] if xs[3].is_contiguous(memory_format=last) else xs[3].contiguous(memory_format=last)
            return [mapped(binary(padded(xs[0]), x_scale, x_zp, packed, w_scales, w_zps, accum, bias, *geometry,
                                  y_scale, y_zp, y_dtype, r_scale, r_zp, "sum", 1.0, unary, scalars, algorithm or ""))]

        def run(xs):
            return run_into_residual([xs[0], None, None, xs[3].clone(memory_format=last)])
        run.into_input = (3, run_into_residual)
        return run



class OneDnnInt8Conv1dTactic(RowMajor1d, OneDnnInt8ConvTactic):
    """A 1-D quantized convolution (Whisper's and wav2vec2's front ends) on the 2-D kernel: [N, C, L] viewed as
    [N, C, 1, L] (made channel-major for the call, the output copied back to row-major), weights [O, I/g, 1, K]."""

    name = "onednn.qconv1d_prepacked"

    def prepare(self, layer: LayerView) -> Kernel:
        planar = super().prepare(conv1d_as_2d(layer))

        def run(xs):
            ys = planar([x if x is None else x[:, :, None] for x in xs])
            return [y.squeeze(2).contiguous() for y in ys]
        return run


def linear_supported(layer: LayerView, zero_points: bool = False, mid: bool = False) -> bool:
    """A QGemm (plain: 2-D input, no transA, alpha = beta = 1) or QMatMul by a constant 2-D INT8 matrix with the
    quantization `_quant_supported` takes: what every INT8 linear kernel runs (the activation is each one's own)."""
    if layer.op_type not in ("QGemm", "QMatMul") or layer.domain != "kiln":
        return False
    x, w, a = layer.input_shapes[0], layer.const_inputs.get(1), layer.attrs
    if x is None or len(x) < 2 or w is None or w.dim() != 2 or not _quant_supported(layer, zero_points, mid):
        return False
    return layer.op_type != "QGemm" or (len(x) == 2 and not a.get("transA", 0) and a.get("alpha", 1.0) == 1.0
                                        and a.get("beta", 1.0) == 1.0)


class OneDnnInt8LinearTactic:
    name = "onednn.qlinear_prepacked"
    source = "torch-onednn"
    required_isa = INT8_DOT_ISA

    def supports(self, layer: LayerView) -> bool:
        spec = layer.attrs.get("activation")
        return linear_supported(layer) and (not spec or spec["op"] in QLINEAR_UNARY and fused_unary(spec) is not None) \
            and int8_available()

    def input_formats(self, layer: LayerView) -> list[str]:
        return [LINEAR] * len(layer.input_shapes)

    def output_format(self, layer: LayerView, input_formats: list[str]) -> str:
        return LINEAR

    def prepare(self, layer: LayerView) -> Kernel:
        q = layer.attrs["quant"]
        (x_zp, to_unsigned), x_scale = unsigned_input(q), float(q["x_scale"])
        w = layer.const_inputs[1]
        w = (w if _channel_axis(layer) == 0 else w.t()).contiguous()          # oneDNN wants [N, K]
        rows = math.prod(layer.input_shapes[0][:-1])
        packed = torch.ops.onednn.qlinear_prepack(w, [rows, w.shape[1]])
        w_scales, w_zps = _scales(layer)
        bias = layer.const_inputs.get(2)
        bias = None if bias is None else bias.reshape(-1)
        y_scale, y_zp, y_dtype = _output(layer)
        unary, scalars, algorithm = fused_unary(layer.attrs.get("activation")) or ("none", [], "")
        linear = torch.ops.onednn.qlinear_pointwise
        mapped = table_mapper(layer.attrs.get("out_table"))   # kiln.passes.qproduct_table: looked up after the call

        def run(xs):
            x = xs[0]
            flat = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
            y = linear(to_unsigned(flat.contiguous()), x_scale, x_zp, packed, w_scales, w_zps, bias, y_scale, y_zp, y_dtype,
                       unary, scalars, algorithm or "")
            y = mapped(y)
            return [y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])]
        return run
