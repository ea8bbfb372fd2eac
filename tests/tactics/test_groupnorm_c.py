"""Instance and group normalization in C (kiln.tactics.groupnorm_c: the row-major and the channel-major kernel, and
their BF16 forms): both against torch's F.group_norm in float64 for 3-D and 4-D maps, per-channel and opset-18
per-group scales, with a fused ReLU or SiLU; bf16 storage in and out; what they decline; torch's GroupNorm as it
exports (Reshape, InstanceNormalization, Reshape, Mul, Add: one layer after GroupNormFusion) and ONNX's
GroupNormalization built by kiln against onnxruntime, and granted BF16 under --bf16."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

import kiln
from kiln import hardware
from kiln.tactics import codegen
from kiln.tactics.base import LayerView
from kiln.tactics.groupnorm_c import (GroupNormBf16Tactic, GroupNormNhwcBf16Tactic, GroupNormNhwcTactic,
                                     GroupNormTactic)
from tests.conftest import assert_close_to_ort, cosine, init, make_model, rand, run_ort

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")
needs_bf16 = pytest.mark.skipif(not hardware.has_any(hardware.BF16_ISA),
                                reason="no native BF16 (avx512_bf16/amx_bf16): BF16 tactics are offered only there")
OWN = "-openvino,-onnxruntime"
KILN = "kiln,codegen,torch-onednn"   # without torch's reference: the tactic asserted is chosen by rule, not timing
CASES = [   # op, shape, num_groups (None: instance), scale size
    ("InstanceNormalization", (2, 16, 300), None, 16),      # wav2vec2's first feature layer
    ("InstanceNormalization", (1, 4, 8192), None, 4),       # a GroupNorm export's [N, G, C/G*H*W]
    ("InstanceNormalization", (1, 8, 5, 7), None, 8),
    ("GroupNormalization", (2, 32, 9, 9), 8, 32),           # opset 21: one scale per channel
    ("GroupNormalization", (1, 32, 9, 9), 8, 8),            # opset 18: one scale per group
]


ROWS, NHWC = GroupNormTactic(), GroupNormNhwcTactic()
ACTIVATIONS = {None: lambda y: y, "Relu": F.relu, "Swish": F.silu}


def _view(op, shape, groups, scale, bias, dtypes=("float32", "float32"), act=None):
    attrs = {"epsilon": 1e-5} | ({"num_groups": groups} if groups else {}) | \
        ({"activation": {"op": act, "attrs": {"alpha": 1.0} if act == "Swish" else {}}} if act else {})
    return LayerView(op, "", attrs, (shape, tuple(scale.shape), tuple(bias.shape)), (dtypes[0], "float32", "float32"),
                     {1: scale, 2: bias}, (dtypes[1],), input_dynamic=((0,), (), ()))


def _expected(op, x, groups, scale, bias):
    """torch's group norm in float64 (instance norm: a group per channel), opset 18's per-group scale and bias
    repeated over each group's channels."""
    channels = x.shape[1]
    groups = groups or channels
    scale, bias = (t.double().repeat_interleave(channels // t.numel()) for t in (scale, bias))
    return F.group_norm(x.double(), groups, scale, bias, eps=1e-5)


@pytest.mark.parametrize("op, shape, groups, params", CASES)
def test_matches_float64(op, shape, groups, params):
    torch.manual_seed(0)
    x, scale, bias = torch.randn(*shape) * 3 + 1, torch.randn(params), torch.randn(params)
    v = _view(op, shape, groups, scale, bias)
    assert GroupNormTactic().supports(v)
    y = GroupNormTactic().prepare(v)([x, None, None])[0]
    assert y.dtype == torch.float32 and y.is_contiguous()
    torch.testing.assert_close(y.double(), _expected(op, x, groups, scale, bias), rtol=1e-5, atol=1e-5)


NHWC_CASES = [   # shape, num_groups, scale size, activation
    ((1, 32, 16, 16), 8, 32, "Swish"),    # a U-Net block: 32 channels, 8 groups
    ((2, 20, 7, 9), 5, 20, "Relu"),       # channels not a whole vector, two images
    ((1, 24, 3, 3), 24, 24, None),        # one channel a group (instance norm)
    ((1, 64, 9, 9), 8, 8, "Swish"),       # opset 18's per-group scale
]


@pytest.mark.parametrize("shape, groups, params, act", NHWC_CASES)
@pytest.mark.parametrize("tactic", [ROWS, NHWC], ids=["rows", "nhwc"])
def test_fused_activation_and_both_layouts_match_float64(tactic, shape, groups, params, act):
    torch.manual_seed(2)
    x, scale, bias = torch.randn(*shape) * 3 + 1, torch.randn(params), torch.randn(params)
    v = _view("GroupNormalization", shape, groups, scale, bias, act=act)
    assert tactic.supports(v)
    layout = torch.channels_last if tactic is NHWC else torch.contiguous_format
    y = tactic.prepare(v)([x.contiguous(memory_format=layout), None, None])[0]
    assert y.is_contiguous(memory_format=layout)
    want = ACTIVATIONS[act](_expected("GroupNormalization", x, groups, scale, bias))
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


def test_channel_major_statistics_hold_far_from_zero():
    """Sums of squares about each channel's first value, not about 0: a mean of 1000 and a spread of 0.01 keep
    their variance (the float sums of squares about 0, ~1e6 each, would cancel it entirely). What is left is the
    float32 rounding of the mean itself (6e-5 at 1000): ~3e-3 in the output, where torch's own float32
    group_norm is off by 6e-3."""
    torch.manual_seed(3)
    x, scale, bias = 1000 + torch.randn(1, 16, 40, 40) * 0.01, torch.rand(16) + 0.5, torch.randn(16)
    v = _view("GroupNormalization", (1, 16, 40, 40), 4, scale, bias)
    y = NHWC.prepare(v)([x.contiguous(memory_format=torch.channels_last), None, None])[0]
    want = _expected("GroupNormalization", x.double(), 4, scale, bias)
    torch_error = (F.group_norm(x, 4, scale, bias, eps=1e-5).double() - want).abs().max()
    assert (y.double() - want).abs().max() <= torch_error


@needs_bf16
@pytest.mark.parametrize("dtypes", [("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("bfloat16", "float32")])
def test_channel_major_bf16_storage_computes_in_fp32(dtypes):
    torch.manual_seed(4)
    x, scale, bias = torch.randn(1, 32, 10, 10), torch.randn(32), torch.randn(32)
    v = _view("GroupNormalization", (1, 32, 10, 10), 8, scale, bias, dtypes, act="Swish")
    assert GroupNormNhwcBf16Tactic().supports(v) and not NHWC.supports(v)
    stored = x.to(getattr(torch, dtypes[0])).contiguous(memory_format=torch.channels_last)
    y = GroupNormNhwcBf16Tactic().prepare(v)([stored, None, None])[0]
    assert y.dtype == getattr(torch, dtypes[1]) and y.is_contiguous(memory_format=torch.channels_last)
    want = F.silu(_expected("GroupNormalization", stored.float(), 8, scale, bias))
    tolerance = 2 ** -7 if dtypes[1] == "bfloat16" else 1e-5
    torch.testing.assert_close(y.double(), want, rtol=tolerance, atol=tolerance)


@needs_bf16
@pytest.mark.parametrize("dtypes", [("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("bfloat16", "float32")])
def test_bf16_storage_computes_in_fp32(dtypes):
    torch.manual_seed(1)
    x, scale, bias = torch.randn(2, 16, 300), torch.randn(16), torch.randn(16)
    v = _view("InstanceNormalization", (2, 16, 300), None, scale, bias, dtypes)
    assert GroupNormBf16Tactic().supports(v) and not GroupNormTactic().supports(v)
    stored = x.to(getattr(torch, dtypes[0]))
    y = GroupNormBf16Tactic().prepare(v)([stored, None, None])[0]
    want = _expected("InstanceNormalization", stored.float(), None, scale, bias)
    assert y.dtype == getattr(torch, dtypes[1])
    tolerance = 2 ** -7 if dtypes[1] == "bfloat16" else 1e-5   # one rounding of values up to ~4
    torch.testing.assert_close(y.double(), want, rtol=tolerance, atol=tolerance)


def test_declines_what_it_cannot_run():
    scale, bias = torch.ones(8), torch.zeros(8)
    ok = _view("InstanceNormalization", (1, 8, 20), None, scale, bias)
    dynamic_length = LayerView(ok.op_type, "", ok.attrs, ok.input_shapes, ok.input_dtypes, ok.const_inputs,
                               input_dynamic=((0, 2), (), ()))
    runtime_scale = LayerView(ok.op_type, "", ok.attrs, ok.input_shapes, ok.input_dtypes, {2: bias})
    double_stash = _view("GroupNormalization", (1, 8, 20), 4, scale, bias)
    double_stash = LayerView(double_stash.op_type, "", dict(double_stash.attrs, stash_type=11),
                             double_stash.input_shapes, double_stash.input_dtypes, double_stash.const_inputs)
    gelu = _view("InstanceNormalization", (1, 8, 20), None, scale, bias, act="Gelu")
    three_d = _view("GroupNormalization", (1, 8, 20), 4, scale, bias)
    assert ROWS.supports(ok) and ROWS.supports(three_d) and not NHWC.supports(three_d)   # channel-major: 4-D only
    for v in (dynamic_length, runtime_scale, double_stash, gelu):
        assert not ROWS.supports(v) and not NHWC.supports(v)


def torch_group_norm_block(channels: int = 16, groups: int = 4, size: int = 8) -> bytes:
    """Conv, then nn.GroupNorm as torch exports it (Reshape [N, G, -1], InstanceNormalization with unit scale,
    Reshape back, Mul by the weight, Add the bias), then Conv: a diffusion U-Net's resnet block head."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["c1", "grouped"], ["g"], name="to_groups"),
             helper.make_node("InstanceNormalization", ["g", "ones", "zeros"], ["n"], name="norm", epsilon=1e-5),
             helper.make_node("Reshape", ["n", "back"], ["r"], name="to_channels"),
             helper.make_node("Mul", ["r", "gamma"], ["m"], name="scale"),
             helper.make_node("Add", ["m", "beta"], ["a"], name="shift"),
             helper.make_node("Conv", ["a", "w2", "b2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    inits = [init("w1", rand((channels, 8, 3, 3), seed=1) * 0.2), init("b1", rand((channels,), seed=2) * 0.1),
             init("grouped", np.array([1, groups, -1], np.int64)), init("ones", np.ones(groups, np.float32)),
             init("zeros", np.zeros(groups, np.float32)), init("back", np.array([1, channels, size, size], np.int64)),
             init("gamma", rand((channels, 1, 1), seed=3)), init("beta", rand((channels, 1, 1), seed=4)),
             init("w2", rand((8, channels, 3, 3), seed=5) * 0.1), init("b2", rand((8,), seed=6) * 0.1)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, size, size])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=17)


def test_torchs_group_norm_export_runs_on_it_and_matches_onnxruntime():
    model = torch_group_norm_block()
    engine = kiln.build(model, tactic_sources=KILN)
    fused = "to_groups + norm + to_channels + scale + shift"
    norm = next(l for l in engine.layer_info()["Layers"] if l["Name"] == fused)
    assert norm["TacticName"] in ("kiln.groupnorm_rows", "kiln.groupnorm_nhwc")
    x = rand((1, 8, 8, 8), seed=7)
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])


@needs_bf16
def test_torchs_group_norm_export_is_granted_bf16():
    model = torch_group_norm_block()
    engine = kiln.build(model, bf16=True, tactic_sources=OWN, precision_constraints="prefer", accuracy="off")
    norm = next(l for l in engine.plan.layers if l.name == "to_groups + norm + to_channels + scale + shift")
    assert norm.precision == "BF16" and norm.tactic_name in ("kiln.groupnorm_rows_bf16", "kiln.groupnorm_nhwc_bf16")
    x = rand((1, 8, 8, 8), seed=8)
    got, want = engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]
    assert got.dtype == np.float32 and cosine(got, want) > 0.9999


def test_onnx_group_normalization_opset21_matches_onnxruntime():
    nodes = [helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], name="gn", num_groups=4, epsilon=1e-5)]
    inits = [init("s", rand((16,), seed=1)), init("b", rand((16,), seed=2))]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 6, 6])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=21)
    engine = kiln.build(model, tactic_sources=KILN)
    assert [l.tactic_name for l in engine.plan.layers if l.op_type != "Reformat"] in (["kiln.groupnorm_rows"],
                                                                                      ["kiln.groupnorm_nhwc"])
    x = rand((2, 16, 6, 6), seed=3) * 2
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])
