"""kiln's INT8 depthwise convolution (kiln.tactics.qdepthwise_c): against the quantized formula in float64, against
oneDNN's INT8 kernel, which layers it takes, and a quantize_static MobileNetV2-style network on it against
onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.tactics.base import LayerView
from kiln.tactics.onednn_int8 import OneDnnInt8ConvTactic
from kiln.tactics.qdepthwise_c import MAX_TAPS, QDepthwiseConvTactic
from tests.conftest import cosine, run_ort
from tests.tactics.test_qgemm_c import TORCH, assert_requantized_equal, assert_spread, needs_vnni, quant, \
    quantize_static_export, rand_q, requantize

CLIP6 = {"op": "Clip", "attrs": {"min": 0.0, "max": 6.0}}


def depthwise_view(x_shape, w, q, pads, stride=(1, 1), dilation=1, act=None, group=None):
    """A depthwise QConv's LayerView: weights [c * multiplier, 1, kh, kw], `group` channels groups (default c)."""
    c, cout = x_shape[1], w.shape[0]
    attrs = {"pads": list(pads), "strides": list(stride), "dilations": [dilation] * 2, "group": group or c,
             "kernel_shape": list(w.shape[2:]), "quant": q, **({"activation": act} if act else {})}
    out = q["y_dtype"] if "y_scale" in q else "float32"
    return LayerView("QConv", "kiln", attrs, (x_shape, tuple(w.shape), (cout,)), (q["x_dtype"], "int8", "float32"),
                     {1: w, 2: torch.linspace(-2, 2, cout)}, (out,))


def depthwise_formula(view, x):
    """Dequantize, pad with zeros, depthwise convolution in float64, activation, requantize."""
    q, a = view.attrs["quant"], view.attrs
    w = view.const_inputs[1].double() * torch.tensor(q["w_scale"], dtype=torch.float64).view(-1, 1, 1, 1)
    pads = [a["pads"][1], a["pads"][3], a["pads"][0], a["pads"][2]]
    xf = F.pad((x.double() - q["x_zero_point"]) * q["x_scale"], pads)
    y = F.conv2d(xf, w, view.const_inputs[2].double(), a["strides"], dilation=a["dilations"], groups=a["group"])
    spec = a.get("activation")
    if spec and spec["op"] == "Relu":
        y = torch.relu(y)
    elif spec and spec["op"] == "Swish":
        y = F.silu(y)
    elif spec:
        y = torch.clamp(y, spec["attrs"]["min"], spec["attrs"]["max"])
    return requantize(y.float(), q)


CASES = {
    # name: (x shape, k, pads, stride, dilation, x (dtype, zp, scale), y (or None: FP32 out), per channel, act)
    "3x3_relu6_u8": ((2, 32, 17, 15), 3, (1, 1, 1, 1), 1, 1, ("uint8", 3, 0.02), ("uint8", 5, 0.05), True, CLIP6),
    "3x3_s2_96_channels": ((1, 96, 28, 28), 3, (1, 1, 1, 1), 2, 1, ("uint8", 120, 0.02), ("uint8", 0, 0.06), True,
                           CLIP6),
    "5x5_s8_in_and_out_19_channels": ((1, 19, 9, 11), 5, (2, 2, 2, 2), 1, 1, ("int8", -5, 0.02), ("int8", 2, 0.05),
                                      True, None),
    "5x5_s2_asym_pads": ((1, 144, 14, 13), 5, (1, 2, 2, 1), 2, 1, ("int8", 90, 0.02), ("uint8", 7, 0.04), False,
                         {"op": "Relu", "attrs": {}}),
    "3x3_dilated_fp32_out": ((1, 70, 10, 10), 3, (2, 2, 2, 2), 1, 2, ("uint8", 200, 0.02), None, True, CLIP6),
    "3x3_960_channels": ((1, 960, 7, 7), 3, (1, 1, 1, 1), 1, 1, ("uint8", 3, 0.02), ("uint8", 5, 0.05), True, CLIP6),
    "7x7_no_pad": ((1, 40, 12, 12), 7, (0, 0, 0, 0), 1, 1, ("uint8", 60, 0.02), ("uint8", 128, 0.05), True, None),
    "3x3_swish_s8_out": ((1, 48, 9, 9), 3, (1, 1, 1, 1), 1, 1, ("uint8", 10, 0.02), ("int8", -30, 0.02), True,
                         {"op": "Swish", "attrs": {}}),   # store16's path: no QPlain for an activation function
}
NO_VBMI = ("3x3_relu6_u8", "5x5_s8_in_and_out_19_channels", "3x3_dilated_fp32_out", "3x3_swish_s8_out")


@needs_vnni
@pytest.mark.parametrize("case", list(CASES))
def test_depthwise_matches_its_formula_and_onednn(case):
    x_shape, k, pads, stride, dilation, xq, yq, per_channel, act = CASES[case]
    c = x_shape[1]
    g = torch.Generator().manual_seed(len(case))
    w = torch.randint(-128, 128, (c, 1, k, k), generator=g, dtype=torch.int8)
    x = rand_q(x_shape, xq[0], g).contiguous(memory_format=torch.channels_last)
    view = depthwise_view(x_shape, w, quant(c, xq, yq, per_channel), pads, (stride, stride), dilation, act)
    tactic = QDepthwiseConvTactic()
    assert tactic.supports(view)
    got = tactic.prepare(view)([x, None, None])[0]
    want = depthwise_formula(view, x)
    assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    if yq is None:   # FP32 out: the exact integer sum, scaled once (float32 rounding of scale * sum + bias)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    assert got.dtype == TORCH[yq[0]]
    assert_spread(got)
    assert_requantized_equal(got, want)
    if OneDnnInt8ConvTactic().supports(view):
        assert_requantized_equal(got, OneDnnInt8ConvTactic().prepare(view)([x, None, None])[0])


@needs_vnni
@pytest.mark.parametrize("case", NO_VBMI)
def test_the_float_sums_without_vbmi_give_the_same_bytes(case, tmp_path, monkeypatch):
    """qdepthwise.h without AVX512-VBMI (a Cascade Lake: VNNI, no VBMI) sums the taps as floats: compiled here with
    VBMI turned off, it gives the formula's bytes as the vpdpbusd path does."""
    import ctypes
    from types import SimpleNamespace

    from kiln import native
    from kiln.native.compiler import compile_unit
    from kiln.tactics import qdepthwise_c

    compile_unit(native.toolchain(), '#include "qgemm.c"\n', tmp_path / "novbmi.so", "novbmi.c", ("-mno-avx512vbmi",))
    lib = ctypes.CDLL(str(tmp_path / "novbmi.so"))
    lib.kiln_qdepthwise.argtypes = [ctypes.c_void_p] * 3
    monkeypatch.setattr(qdepthwise_c, "native", SimpleNamespace(library=lambda name: lib))
    x_shape, k, pads, stride, dilation, xq, yq, per_channel, act = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    w = torch.randint(-128, 128, (x_shape[1], 1, k, k), generator=g, dtype=torch.int8)
    x = rand_q(x_shape, xq[0], g).contiguous(memory_format=torch.channels_last)
    view = depthwise_view(x_shape, w, quant(x_shape[1], xq, yq, per_channel), pads, (stride, stride), dilation, act)
    got, want = QDepthwiseConvTactic().prepare(view)([x, None, None])[0], depthwise_formula(view, x)
    if yq is None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert_requantized_equal(got, want)


@needs_vnni
def test_a_zero_point_input_gives_the_bias_at_every_border():
    """An input equal to its zero point everywhere is zero, padded taps included: every output is the bias alone."""
    c, q = 20, quant(20, ("uint8", 77, 0.02), ("uint8", 100, 0.05))
    w = torch.randint(-128, 128, (c, 1, 5, 5), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    view = depthwise_view((1, c, 6, 7), w, q, (2, 2, 2, 2))
    x = torch.full((1, c, 6, 7), 77, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    got = QDepthwiseConvTactic().prepare(view)([x, None, None])[0]
    bias = requantize(torch.linspace(-2, 2, c).view(1, c, 1, 1).expand(1, c, 6, 7), q)
    assert torch.equal(got.float(), bias)


@needs_vnni
def test_only_one_channel_per_group_without_residual_or_weight_zero_points():
    g = torch.Generator().manual_seed(1)
    q = quant(8)
    w = torch.randint(-128, 128, (8, 1, 3, 3), generator=g, dtype=torch.int8)
    shape, pads = (1, 8, 6, 6), (1, 1, 1, 1)
    tactic = QDepthwiseConvTactic()
    grouped = depthwise_view(shape, torch.randint(-128, 128, (8, 2, 3, 3), generator=g, dtype=torch.int8), q, pads,
                             group=4)
    assert not tactic.supports(grouped)                                         # two channels per group
    doubled = depthwise_view(shape, torch.randint(-128, 128, (16, 1, 3, 3), generator=g, dtype=torch.int8),
                             quant(16), pads)
    assert not tactic.supports(doubled)                                         # a channel multiplier of 2
    assert not tactic.supports(depthwise_view(shape, w, q | {"w_zero_point": [3] * 8}, pads))
    huge = torch.zeros((8, 1, 23, 23), dtype=torch.int8)                       # 529 taps: a float sum could round
    assert 23 * 23 > MAX_TAPS and not tactic.supports(depthwise_view((1, 8, 30, 30), huge, q, pads))
    plain = depthwise_view(shape, w, q, pads)
    assert tactic.supports(plain)                                               # the layer the others vary
    residual = LayerView("QConv", "kiln", plain.attrs, (*plain.input_shapes, shape), (*plain.input_dtypes, "uint8"),
                         plain.const_inputs, plain.output_dtypes)
    assert not tactic.supports(residual)


@pytest.fixture(scope="module")
def qdq_mobilenet(tmp_path_factory):
    from tests.models.zoo import make_zoo

    return quantize_static_export(make_zoo("mobilenetv2").eval(), tmp_path_factory.mktemp("qdepthwise"))


@needs_vnni
def test_quantize_static_mobilenet_runs_its_depthwise_layers_here_and_matches_onnxruntime(qdq_mobilenet):
    # kiln's kernels only, so the depthwise layers have this kernel and torch's reference to choose from
    engine = kiln.build(qdq_mobilenet, tactic_sources="kiln", avg_timing=1, min_timing=1)
    x = np.random.default_rng(3).random((1, 3, 32, 32)).astype(np.float32)
    name = engine.input_names[0]
    got, want = engine.run({name: x})[engine.output_names[0]], run_ort(qdq_mobilenet, {name: x})[0]
    assert cosine(got, want) >= 0.999
    depthwise = [l for l in engine.layer_info()["Layers"] if l["TacticName"] == QDepthwiseConvTactic.name]
    assert len(depthwise) == 2                           # one per inverted residual block
    assert all(l["RequestedPrecision"] == l["GrantedPrecision"] == "INT8" for l in depthwise)
