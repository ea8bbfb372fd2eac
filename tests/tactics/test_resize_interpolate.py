"""kiln's linear and cubic Resize in C (kiln.tactics.resize_c.InterpolateResizeTactic): every coordinate
transformation mode it takes, antialiasing and exclude_outside, up and down, by scales and by sizes, on channel-major
and row-major maps, against onnxruntime; bf16 storage in and out against the formula on the bf16 input; what it
declines; a segmentation-style head built by kiln picks it and, under --bf16, is granted BF16 on it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln import hardware
from kiln.ops.registry import host_value
from kiln.tactics import codegen
from kiln.tactics.base import LayerView
from kiln.tactics.resize_c import INTERPOLATE_TACTIC, InterpolateResizeBf16Tactic, InterpolateResizeTactic
from tests.conftest import assert_close_to_ort, cosine, init, make_model, rand, run_ort
from tests.tactics.test_resize_c import onnxruntime_resize, view

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")
needs_bf16 = pytest.mark.skipif(not hardware.has_any(hardware.BF16_ISA),
                                reason="no native BF16 (avx512_bf16/amx_bf16): BF16 tactics are offered only there")

SHAPE = (2, 24, 7, 9)
CASES = [  # attrs, scales, sizes
    ({"mode": "linear"}, [1, 1, 2, 2], None),                                       # half_pixel
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, None, [2, 24, 15, 4]),
    ({"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, [1, 1, 0.5, 1.5], None),
    ({"mode": "linear", "coordinate_transformation_mode": "asymmetric"}, [1, 1, 3, 1], None),   # one axis only
    ({"mode": "linear", "antialias": 1}, [1, 1, 0.4, 0.7], None),                   # antialiased downsampling
    ({"mode": "cubic"}, [1, 1, 2, 3], None),
    ({"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1}, [1, 1, 1.7, 0.6], None),
]


def _inputs(v: LayerView, x: torch.Tensor) -> list:
    return [x] + [None if i not in v.const_inputs else host_value(v.const_inputs[i])
                  for i in (1, 2, 3)][:len(v.input_shapes) - 1]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1] or c[2]}")
def test_matches_onnxruntime_in_both_layouts(case):
    attrs, scales, sizes = case
    v = view(attrs, scales, sizes)
    tactic = InterpolateResizeTactic()
    assert tactic.supports(v)
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    want = onnxruntime_resize(attrs, x, scales, sizes)
    kernel = tactic.prepare(v)
    for layout in (torch.channels_last, torch.contiguous_format):
        got = kernel(_inputs(v, torch.from_numpy(x).contiguous(memory_format=layout)))[0]
        assert got.shape == want.shape and got.is_contiguous(memory_format=layout)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


@needs_bf16
@pytest.mark.parametrize("in_dtype, out_dtype", [("bfloat16", "bfloat16"), ("float32", "bfloat16"),
                                                 ("bfloat16", "float32")])
@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format], ids=["nhwc", "nchw"])
def test_bf16_storage_sums_in_fp32(in_dtype, out_dtype, layout):
    """bf16 pixels are widened as they are read and the FP32 sum rounded once as it is stored: the result is the
    FP32 formula on the bf16 input, within one bf16 rounding where the output is bf16."""
    attrs, scales = CASES[0][0], CASES[0][1]
    base = view(attrs, scales, shape=(1, 13, 5, 6))
    v = LayerView("Resize", "", attrs, base.input_shapes, (in_dtype,) + base.input_dtypes[1:], base.const_inputs,
                  (out_dtype,), input_dynamic=base.input_dynamic)
    assert InterpolateResizeBf16Tactic().supports(v) and not InterpolateResizeTactic().supports(v)
    x = torch.randn(1, 13, 5, 6).to(getattr(torch, in_dtype)).contiguous(memory_format=layout)
    got = InterpolateResizeBf16Tactic().prepare(v)(_inputs(v, x))[0]
    want = onnxruntime_resize(attrs, x.float().numpy(), scales)
    assert got.dtype == getattr(torch, out_dtype) and got.is_contiguous(memory_format=layout)
    tolerance = 2 ** -8 if out_dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(got.float().numpy(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("attrs, scales", [
    ({"mode": "nearest"}, [1, 1, 2, 2]),
    ({"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize"}, [1, 1, 2, 2]),
    ({"mode": "linear"}, [1, 2, 2, 2]),
], ids=["nearest", "crop", "channels"])
def test_declines_what_it_cannot_run(attrs, scales):
    assert not InterpolateResizeTactic().supports(view(attrs, scales))


def test_declines_scales_known_only_at_run_time():
    v = view({"mode": "linear"}, [1, 1, 2, 2])
    runtime_scales = LayerView("Resize", "", v.attrs, v.input_shapes, v.input_dtypes, {1: v.const_inputs[1]},
                               input_dynamic=v.input_dynamic)
    assert not InterpolateResizeTactic().supports(runtime_scales)


def segmentation_head(channels: int = 16, size: int = 12) -> bytes:
    """Conv + Relu, a 2x bilinear Resize (half_pixel, as torch exports F.interpolate), Conv: an FPN or
    segmentation decoder's upsample between two convolutions."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Resize", ["r1", "", "scales"], ["up"], name="upsample", mode="linear"),
             helper.make_node("Conv", ["up", "w2", "b2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    inits = [init("w1", rand((channels, 8, 3, 3), seed=1) * 0.2), init("b1", rand((channels,), seed=2) * 0.1),
             init("scales", np.array([1, 1, 2, 2], np.float32)),
             init("w2", rand((channels, channels, 3, 3), seed=3) * 0.1), init("b2", rand((channels,), seed=4) * 0.1)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, size, size])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=19)


def test_a_segmentation_head_upsamples_on_it():
    model = segmentation_head()
    engine = kiln.build(model, tactic_sources={"kiln"})
    info = {l["Name"]: l for l in engine.layer_info()["Layers"]}
    assert info["upsample"]["TacticName"] == INTERPOLATE_TACTIC and info["upsample"]["LayerType"] == "Resize"
    x = rand((1, 8, 12, 12), seed=5)
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])


@needs_bf16
def test_a_segmentation_head_is_granted_bf16_on_it():
    model = segmentation_head()
    engine = kiln.build(model, bf16=True, tactic_sources={"kiln"}, precision_constraints="prefer", accuracy="off")
    upsample = next(l for l in engine.plan.layers if l.name == "upsample")
    assert (upsample.tactic_name, upsample.precision) == (INTERPOLATE_TACTIC + "_bf16", "BF16")
    x = rand((1, 8, 12, 12), seed=6)
    got, want = engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]
    assert got.dtype == np.float32 and cosine(got, want) > 0.9999
