"""1-D convolution on oneDNN (kiln.tactics.onednn_conv.OneDnnConv1dTactic and its BF16 variant): every geometry
(stride, dilation, symmetric and asymmetric pads, groups), bias, fused activation and residual against float64
torch; a Whisper-style stem (two Conv1d + GELU, then a Transpose into a MatMul) against onnxruntime in FP32 and BF16,
with the layers, tactics and granted precisions it reports."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

import kiln
from kiln.tactics.base import LayerView
from kiln.tactics.onednn_conv import OneDnnBf16Conv1dTactic, OneDnnConv1dTactic, OneDnnConvTactic, bf16_available
from tests.conftest import assert_close_to_ort, cosine, init, make_model, rand, run_ort

needs_bf16 = pytest.mark.skipif(not bf16_available(), reason="no native BF16 (avx512_bf16/amx_bf16) with oneDNN here: "
                                "the BF16 1-D convolution is not offered")
GEOMETRIES = [   # (C, O, L, kernel, stride, dilation, pads [begin, end], groups)
    (8, 16, 40, 3, 1, 1, [1, 1], 1),
    (8, 16, 41, 3, 2, 1, [1, 1], 1),
    (6, 12, 33, 5, 1, 2, [4, 4], 3),
    (16, 16, 30, 3, 1, 1, [2, 0], 16),    # depthwise, causal (left) padding
    (1, 32, 400, 10, 5, 1, [0, 0], 1),    # wav2vec2's first layer: one channel of raw audio
]


def _view(c, o, length, k, stride, dilation, pads, groups, w, b, activation=None, residual=False, dtype="float32"):
    attrs = {"kernel_shape": [k], "strides": [stride], "dilations": [dilation], "pads": pads, "group": groups}
    if activation:
        attrs["activation"] = {"op": activation, "attrs": {}}
    out_len = (length + sum(pads) - dilation * (k - 1) - 1) // stride + 1
    shapes = [(2, c, length), tuple(w.shape), tuple(b.shape)] + ([(2, o, out_len)] if residual else [])
    return LayerView("Conv", "", attrs, tuple(shapes), tuple(["float32"] * len(shapes)), {1: w, 2: b}, (dtype,))


def _expected(x, w, b, stride, dilation, pads, groups, activation=None, residual=None):
    y = F.conv1d(F.pad(x.double(), pads), w.double(), b.double(), stride, 0, dilation, groups)
    if residual is not None:
        y = y + residual.double()
    return {"Relu": torch.relu, "Gelu": F.gelu, None: lambda t: t}[activation](y)


@pytest.mark.parametrize("c, o, length, k, stride, dilation, pads, groups", GEOMETRIES)
def test_every_geometry_matches_float64(c, o, length, k, stride, dilation, pads, groups):
    torch.manual_seed(0)
    x, w, b = torch.randn(2, c, length), torch.randn(o, c // groups, k) * 0.2, torch.randn(o)
    kernel = OneDnnConv1dTactic().prepare(_view(c, o, length, k, stride, dilation, pads, groups, w, b))
    y = kernel([x, None, None])[0]
    want = _expected(x, w, b, stride, dilation, pads, groups)
    assert y.dtype == torch.float32 and y.is_contiguous() and y.shape == want.shape
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation, residual", [("Relu", False), ("Gelu", False), ("Relu", True), (None, True)])
def test_fused_activation_and_residual(activation, residual):
    torch.manual_seed(1)
    x, w, b = torch.randn(2, 8, 40), torch.randn(16, 8, 3) * 0.2, torch.randn(16)
    r = torch.randn(2, 16, 40) if residual else None
    kernel = OneDnnConv1dTactic().prepare(_view(8, 16, 40, 3, 1, 1, [1, 1], 1, w, b, activation, residual))
    y = kernel([x, None, None] + ([r] if residual else []))[0]
    torch.testing.assert_close(y.double(), _expected(x, w, b, 1, 1, [1, 1], 1, activation, r), rtol=1e-4, atol=1e-4)


def test_each_tactic_takes_its_own_rank_only():
    w1, w2, b = torch.randn(4, 4, 3), torch.randn(4, 4, 3, 3), torch.randn(4)
    one_d = _view(4, 4, 10, 3, 1, 1, [1, 1], 1, w1, b)
    two_d = LayerView("Conv", "", {"pads": [1, 1, 1, 1], "strides": [1, 1], "dilations": [1, 1], "group": 1},
                      ((1, 4, 10, 10), (4, 4, 3, 3), (4,)), ("float32",) * 3, {1: w2, 2: b})
    runtime_weights = LayerView("Conv", "", one_d.attrs, one_d.input_shapes, one_d.input_dtypes, {2: b})
    assert OneDnnConv1dTactic().supports(one_d) and not OneDnnConv1dTactic().supports(two_d)
    assert OneDnnConvTactic().supports(two_d) and not OneDnnConvTactic().supports(one_d)
    assert not OneDnnConv1dTactic().supports(runtime_weights)


@needs_bf16
def test_bf16_reads_and_writes_the_stored_type():
    torch.manual_seed(2)
    x, w, b = torch.randn(2, 8, 41), torch.randn(16, 8, 3) * 0.2, torch.randn(16)
    kernel = OneDnnBf16Conv1dTactic().prepare(_view(8, 16, 41, 3, 2, 1, [1, 1], 1, w, b, "Relu", dtype="bfloat16"))
    y = kernel([x.bfloat16(), None, None])[0]
    want = _expected(x.bfloat16().float(), w.bfloat16().float(), b.bfloat16().float(), 2, 1, [1, 1], 1, "Relu")
    assert y.dtype == torch.bfloat16 and y.is_contiguous()
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)   # one bf16 rounding of the output


def whisper_stem(mels: int = 16, frames: int = 64, width: int = 32) -> bytes:
    """Whisper's encoder stem: Conv1d(k3, pad 1) + GELU, Conv1d(k3, stride 2, pad 1) + GELU, Transpose to
    [N, frames/2, width], a MatMul. GELU as ONNX Gelu (opset 20)."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1]),
             helper.make_node("Gelu", ["c1"], ["g1"], name="gelu1"),
             helper.make_node("Conv", ["g1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1], strides=[2]),
             helper.make_node("Gelu", ["c2"], ["g2"], name="gelu2"),
             helper.make_node("Transpose", ["g2"], ["t"], name="to_tokens", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t", "wp"], ["y"], name="proj")]
    inits = [init("w1", rand((width, mels, 3), seed=1) * 0.2), init("b1", rand((width,), seed=2) * 0.1),
             init("w2", rand((width, width, 3), seed=3) * 0.1), init("b2", rand((width,), seed=4) * 0.1),
             init("wp", rand((width, width), seed=5) * 0.2)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, mels, frames])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=20)


def test_a_whisper_stem_runs_on_onednn_and_matches_onnxruntime():
    model = whisper_stem()
    engine = kiln.build(model, tactic_sources={"torch-onednn"})   # alone: tiny layers time faster on torch
    convs = [l for l in engine.layer_info()["Layers"] if l["Name"].startswith("conv")]
    assert [(l["Name"], l["TacticName"], l["LayerType"]) for l in convs] == [
        ("conv1 + gelu1", "onednn.conv1d_prepacked", "OneDnnConvolution"),
        ("conv2 + gelu2", "onednn.conv1d_prepacked", "OneDnnConvolution")]
    x = rand((1, 16, 64), seed=6)
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])


@needs_bf16
def test_a_whisper_stem_is_granted_bf16():
    model = whisper_stem()
    engine = kiln.build(model, bf16=True, tactic_sources={"torch-onednn"}, precision_constraints="prefer",
                        accuracy="off")
    convs = {l.name: l for l in engine.plan.layers if l.op_type == "Conv"}
    assert {(l.tactic_name, l.precision) for l in convs.values()} == {("onednn.conv1d_prepacked_bf16", "BF16")}
    x = rand((1, 16, 64), seed=7)
    got, want = engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]
    assert got.dtype == np.float32 and cosine(got, want) > 0.9999
