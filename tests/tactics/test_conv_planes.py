"""kiln's 1x1 convolution on NCHW planes (kiln.tactics.conv_planes) against torch's in float64: output channels
across register blocks, pixel tails, bias or none, ReLU, a batch read per call, FP32/bf16 storage, an AVX2 build;
declined where it does not apply; and a DFL-style model against onnxruntime."""
from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from kiln import hardware
from kiln.tactics import codegen
from kiln.tactics.base import LINEAR, LayerView
from kiln.tactics.conv_planes import Conv1x1PlanesBf16Tactic, Conv1x1PlanesTactic, PlaneCall
from tests.tactics.avx2 import avx2_build

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")
bf16_cpu = pytest.mark.skipif(not hardware.has_any(hardware.BF16_ISA),
                              reason="no native BF16 (BF16 tactics are offered only there)")


def conv_layer(n, cin, h, w, cout, bias=True, relu=False, in_dtype="float32", out_dtype="float32", seed=0, **attrs):
    g = torch.Generator().manual_seed(seed)
    consts = {1: torch.randn(cout, cin, 1, 1, generator=g)}
    shapes = [(n, cin, h, w), (cout, cin, 1, 1)]
    if bias:
        consts[2] = torch.randn(cout, generator=g)
        shapes.append((cout,))
    attrs = {"kernel_shape": [1, 1], **attrs, **({"activation": {"op": "Relu", "attrs": {}}} if relu else {})}
    return LayerView("Conv", "", attrs, tuple(shapes), (in_dtype,) + ("float32",) * (len(shapes) - 1), consts,
                     (out_dtype,), 17, tuple(() for _ in shapes))


def want(layer: LayerView, x: torch.Tensor) -> torch.Tensor:
    bias = layer.const_inputs.get(2)
    y = F.conv2d(x.double(), layer.const_inputs[1].double(), None if bias is None else bias.double())
    return y.clamp_min(0) if layer.attrs.get("activation") else y


@pytest.mark.parametrize("n,cin,h,w,cout,bias,relu", [
    (1, 16, 4, 8400, 1, False, False),   # YOLOv8's DFL
    (1, 64, 13, 13, 21, True, False),    # a segmentation head: three register blocks of output channels, tails
    (2, 5, 7, 9, 3, True, True),         # fewer pixels than a register block
    (1, 3, 1, 1000, 32, True, True),
])
def test_fp32_matches_torch(n, cin, h, w, cout, bias, relu):
    layer = conv_layer(n, cin, h, w, cout, bias, relu)
    tactic = Conv1x1PlanesTactic()
    assert tactic.supports(layer) and tactic.input_formats(layer)[0] == LINEAR
    x = torch.randn(n, cin, h, w, generator=torch.Generator().manual_seed(cout))
    got = tactic.prepare(layer)([x])[0]
    assert got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got.double(), want(layer, x), atol=1e-5 * cin ** 0.5, rtol=1e-5)


def test_the_batch_is_read_per_call_and_other_shapes_are_refused():
    layer = conv_layer(1, 8, 5, 6, 4)
    layer = LayerView(layer.op_type, "", layer.attrs, layer.input_shapes, layer.input_dtypes, layer.const_inputs,
                      layer.output_dtypes, 17, ((0,), (), ()))
    kernel = Conv1x1PlanesTactic().prepare(layer)
    for batch in (1, 3):
        x = torch.randn(batch, 8, 5, 6)
        torch.testing.assert_close(kernel([x])[0].double(), want(layer, x), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"input shaped \[1, 8, 5, 7\], the plan's is \['N', 8, 5, 6\]"):
        kernel([torch.randn(1, 8, 5, 7)])


@bf16_cpu
@pytest.mark.parametrize("in_dtype,out_dtype", [("bfloat16", "float32"), ("float32", "bfloat16"),
                                                ("bfloat16", "bfloat16")])
def test_bf16_storage_computes_in_fp32(in_dtype, out_dtype):
    layer = conv_layer(1, 16, 4, 37, 5, in_dtype=in_dtype, out_dtype=out_dtype)
    assert Conv1x1PlanesBf16Tactic().supports(layer) and not Conv1x1PlanesTactic().supports(layer)
    x = torch.randn(1, 16, 4, 37).to(getattr(torch, in_dtype))
    got = Conv1x1PlanesBf16Tactic().prepare(layer)([x])[0]
    assert got.dtype == getattr(torch, out_dtype)
    expected = want(layer, x.float())   # the stored input's exact values, FP32 arithmetic
    rtol = 2 ** -8 if out_dtype == "bfloat16" else 1e-5   # one rounding of the output, to nearest even
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=rtol)


@pytest.mark.parametrize("attrs,cout,bias_input,residual", [
    ({"strides": [2, 2]}, 4, True, False),
    ({"pads": [0, 0, 1, 1]}, 4, True, False),
    ({"group": 2}, 4, True, False),
    ({}, 33, True, False),                                         # too many output planes
    ({"activation": {"op": "Swish", "attrs": {"alpha": 1.0}}}, 4, True, False),
    ({}, 4, False, False),                                         # a bias computed at run time
    ({}, 4, True, True),                                           # a fused residual
], ids=["stride", "pads", "group", "33 planes", "swish", "runtime bias", "residual"])
def test_declines_what_it_does_not_compute(attrs, cout, bias_input, residual):
    layer = conv_layer(1, 8, 4, 4, cout, **attrs)
    consts = dict(layer.const_inputs)
    shapes, dtypes = list(layer.input_shapes), list(layer.input_dtypes)
    if not bias_input:
        del consts[2]
    if residual:
        shapes.append((1, cout, 4, 4))
        dtypes.append("float32")
    view = LayerView("Conv", "", layer.attrs, tuple(shapes), tuple(dtypes), consts, ("float32",), 17,
                     tuple(() for _ in shapes))
    assert not Conv1x1PlanesTactic().supports(view)


@pytest.mark.skipif(not hardware.has_any(("avx2",)), reason="no AVX2")
def test_the_avx2_build_matches_torch(tmp_path):
    """conv_planes.c compiled for AVX2 alone (-march=x86-64-v3: 8-lane vectors, 16-pixel blocks)."""
    lib = avx2_build("conv_planes", tmp_path)
    layer = conv_layer(2, 7, 5, 11, 10, relu=True)
    x = torch.randn(2, 7, 5, 11)
    w, b = layer.const_inputs[1].reshape(10, 7).contiguous(), layer.const_inputs[2]
    y = torch.empty(2, 10, 5, 11)
    call = PlaneCall(7, 10, 55, 1, 0)
    lib.kiln_conv_planes(ctypes.addressof(call), x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), 2)
    torch.testing.assert_close(y.double(), want(layer, x), atol=1e-5, rtol=1e-5)


def test_a_dfl_model_runs_the_planes_without_a_reformat(monkeypatch):
    """YOLOv8's DFL (reshape, transpose, softmax on axis 1, 16 -> 1 convolution) with the planes kernel made the
    fastest: it reads the softmax's row-major output directly (no Reformat layer), and the engine matches
    onnxruntime."""
    import numpy as np

    import kiln
    from kiln.tactics.autotune import Autotuner
    from tests.conftest import run_ort
    from tests.tactics.test_softmax_c import dfl_model

    def measure(self, view, tactics, signature, have, dying):
        return {t.name: (0.001 if t.name.startswith("kiln.conv2d_1x1_planes") else 1.0) for t in tactics}
    monkeypatch.setattr(Autotuner, "_measure", measure)
    model = dfl_model()
    engine = kiln.build(model, tactic_sources="kiln")
    layers = engine.layer_info()["Layers"]
    conv = next(l for l in layers if l["LayerType"] == "Convolution")
    assert conv["TacticName"] == "kiln.conv2d_1x1_planes"
    assert not [l for l in layers if l["LayerType"] == "Reformat"]
    x = np.random.default_rng(4).standard_normal((1, 64, 336)).astype(np.float32) * 3
    np.testing.assert_allclose(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0], atol=1e-4, rtol=0)
