"""kiln's nearest Resize on NHWC (kiln.tactics.resize_c): every coordinate transformation and nearest mode it
takes matches onnxruntime's Resize bit for bit (a copy, no arithmetic), scales and sizes, up and down; a
row-major input runs torch's kernel; it declines what it cannot run; a detector forced onto kiln uses it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from kiln.ops.registry import host_value
from kiln.tactics import codegen
from kiln.tactics.base import LayerView
from kiln.tactics.resize_c import RESIZE_TACTIC, NhwcResizeTactic
from tests.conftest import init, make_model, run_ort

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")

SHAPE = (2, 24, 7, 9)


def view(attrs, scales=None, sizes=None, shape=SHAPE):
    consts = {1: torch.tensor([], dtype=torch.float32)}
    shapes = [shape, (0,)]
    if scales is not None:
        consts[2] = torch.tensor(scales, dtype=torch.float32)
        shapes.append((4,))
    if sizes is not None:
        consts[3] = torch.tensor(sizes, dtype=torch.int64)
        shapes += [None] * (scales is None) + [(4,)]
    dtypes = tuple(None if s is None else "float32" for s in shapes)
    return LayerView("Resize", "", attrs, tuple(shapes), dtypes, consts, input_dynamic=((),) * len(shapes))


def onnxruntime_resize(attrs, x, scales=None, sizes=None):
    names = ["x", "roi", "scales" if scales is not None else "", "sizes" if sizes is not None else ""]
    inits = [init("roi", np.zeros(0, np.float32))]
    if scales is not None:
        inits.append(init("scales", np.array(scales, np.float32)))
    if sizes is not None:
        inits.append(init("sizes", np.array(sizes, np.int64)))
    node = helper.make_node("Resize", [n for n in names if n] if sizes is None else names, ["y"], **attrs)
    model = make_model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=19)
    return run_ort(model, {"x": x})[0]


CASES = [  # attrs, scales, sizes
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, [1, 1, 2, 2], None),
    ({"mode": "nearest"}, [1, 1, 2, 3], None),                                   # half_pixel, round_prefer_floor
    ({"mode": "nearest", "nearest_mode": "round_prefer_ceil"}, [1, 1, 0.5, 0.6], None),   # downsampling
    ({"mode": "nearest", "coordinate_transformation_mode": "align_corners"}, None, [2, 24, 12, 5]),
    ({"mode": "nearest", "coordinate_transformation_mode": "pytorch_half_pixel", "nearest_mode": "ceil"},
     None, [2, 24, 1, 13]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c[1] or c[2]))
def test_matches_onnxruntime_exactly(case):
    attrs, scales, sizes = case
    v = view(attrs, scales, sizes)
    tactic = NhwcResizeTactic()
    assert tactic.supports(v) and tactic.output_format(v, ["hwc", "any", "any"]) == "hwc"
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    want = onnxruntime_resize(attrs, x, scales, sizes)
    kernel = tactic.prepare(v)
    xs = [torch.from_numpy(x).contiguous(memory_format=torch.channels_last)] + [
        None if i not in v.const_inputs else host_value(v.const_inputs[i]) for i in (1, 2, 3)][:len(v.input_shapes) - 1]
    got = kernel(xs)[0]
    assert got.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_array_equal(got.numpy(), want)
    planar = kernel([torch.from_numpy(x)] + xs[1:])[0]   # row-major input: torch's kernel, row-major out
    assert planar.is_contiguous()
    np.testing.assert_array_equal(planar.numpy(), want)


@pytest.mark.skipif(not __import__("kiln.hardware", fromlist=["has_any"]).has_any(("avx512_bf16", "amx_bf16")),
                    reason="no native BF16 (BF16 tactics are offered only there)")
@pytest.mark.parametrize("in_dtype,out_dtype", [("bfloat16", "bfloat16"), ("float32", "bfloat16"),
                                                ("bfloat16", "float32")])
def test_bf16_pixels_move_exactly(in_dtype, out_dtype):
    """The BF16 form moves bf16 pixels (odd channel counts too: 2-byte pixels of any size); an input stored
    otherwise than the output is converted once, as torch rounds."""
    from kiln.tactics.resize_c import NhwcResizeBf16Tactic

    attrs, scales = CASES[1][0], CASES[1][1]
    base = view(attrs, scales, shape=(1, 13, 5, 6))
    v = LayerView("Resize", "", attrs, base.input_shapes, (in_dtype,) + base.input_dtypes[1:], base.const_inputs,
                  (out_dtype,), input_dynamic=base.input_dynamic)
    assert NhwcResizeBf16Tactic().supports(v) and not NhwcResizeTactic().supports(v)
    x = torch.randn(1, 13, 5, 6).to(getattr(torch, in_dtype)).contiguous(memory_format=torch.channels_last)
    xs = [x] + [host_value(v.const_inputs[i]) for i in (1, 2)]
    got = NhwcResizeBf16Tactic().prepare(v)(xs)[0]
    want = onnxruntime_resize(attrs, x.float().numpy(), scales)
    assert got.dtype == getattr(torch, out_dtype) and got.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_array_equal(got.float().numpy(), torch.from_numpy(want).to(getattr(torch, out_dtype)).float())


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_int8_pixels_move_exactly_and_only_a_nearest_resize_takes_them(dtype):
    """INT8 bytes (a nearest Resize whose Q/DQ pair the quantization pass moved past it) are copied as they are, odd
    channel counts too; the interpolating tactic declines INT8 (an interpolation of bytes rounds: torch's kernel),
    and so does the nearest one where input and output types differ."""
    from kiln.tactics.resize_c import InterpolateResizeTactic

    attrs, scales = CASES[1][0], CASES[1][1]
    base = view(attrs, scales, shape=(1, 13, 5, 6))
    v = LayerView("Resize", "", attrs, base.input_shapes, (dtype,) + base.input_dtypes[1:], base.const_inputs,
                  (dtype,), input_dynamic=base.input_dynamic)
    assert NhwcResizeTactic().supports(v)
    x = torch.randint(-128 if dtype == "int8" else 0, 128 if dtype == "int8" else 256, (1, 13, 5, 6),
                      dtype=getattr(torch, dtype)).contiguous(memory_format=torch.channels_last)
    got = NhwcResizeTactic().prepare(v)([x] + [host_value(v.const_inputs[i]) for i in (1, 2)])[0]
    want = onnxruntime_resize(attrs, x.float().numpy(), scales)
    assert got.dtype == getattr(torch, dtype) and got.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_array_equal(got.float().numpy(), want)
    linear = LayerView("Resize", "", {"mode": "linear"}, v.input_shapes, v.input_dtypes, v.const_inputs, (dtype,),
                       input_dynamic=v.input_dynamic)
    mixed = LayerView("Resize", "", attrs, v.input_shapes, v.input_dtypes, v.const_inputs, ("float32",),
                      input_dynamic=v.input_dynamic)
    assert not InterpolateResizeTactic().supports(linear) and not NhwcResizeTactic().supports(mixed)


@pytest.mark.parametrize("attrs, scales", [({"mode": "linear"}, [1, 1, 2, 2]),
                                           ({"mode": "nearest", "coordinate_transformation_mode": "tf_crop_and_resize"},
                                            [1, 1, 2, 2]),
                                           ({"mode": "nearest"}, [1, 2, 2, 2])], ids=["linear", "crop", "channels"])
def test_declines_what_it_cannot_run(attrs, scales):
    assert not NhwcResizeTactic().supports(view(attrs, scales))


def test_detector_forced_onto_kiln_upsamples_with_it(tmp_path):
    from tests.models import detectors
    from tests.tactics.forced import build_forced_onto

    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    engine = build_forced_onto(detectors.make("yolov8").eval(), x, tmp_path)
    resizes = [l for l in engine.plan.layers if l.op_type == "Resize"]
    assert len(resizes) == 2 and all(l.tactic_name == RESIZE_TACTIC for l in resizes)
