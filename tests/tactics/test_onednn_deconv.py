"""ConvTranspose on oneDNN's deconvolution (kiln.tactics.onednn_conv.OneDnnDeconvTactic, its 1-D form and BF16
variants): every ONNX geometry (strides, dilations, groups, output_padding, asymmetric pads, auto_pad, output_shape)
against onnxruntime; what it declines; a U-Net-style up block against onnxruntime in FP32
(tactic and LayerType) and granted BF16."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln.tactics.base import LayerView
from kiln.tactics.onednn_conv import (OneDnnBf16DeconvTactic, OneDnnDeconv1dTactic, OneDnnDeconvTactic,
                                     bf16_available)
from tests.conftest import assert_close_to_ort, cosine, init, make_model, rand, run_ort

needs_bf16 = pytest.mark.skipif(not bf16_available(), reason="no native BF16 (avx512_bf16/amx_bf16) with oneDNN here: "
                                "the BF16 deconvolution is not offered")
GEOMETRIES = [   # (C, O, size, kernel, attrs, groups)
    (8, 4, 10, 2, {"strides": [2, 2]}, 1),                                          # U-Net's up-convolution
    (8, 4, 10, 4, {"strides": [2, 2], "pads": [1, 1, 1, 1]}, 1),                    # DCGAN's
    (8, 6, 9, 3, {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, 2),
    (8, 4, 9, 3, {"strides": [2, 2], "pads": [0, 1, 1, 0]}, 1),                     # end pad above begin pad
    (8, 4, 9, 3, {"strides": [2, 2], "auto_pad": "SAME_UPPER"}, 1),
    (8, 4, 9, 3, {"strides": [2, 2], "output_shape": [18, 19]}, 1),
    (8, 4, 9, 3, {"strides": [1, 1], "dilations": [2, 2], "pads": [2, 2, 2, 2]}, 1),
    (8, 8, 9, 4, {"strides": [2, 2], "pads": [1, 1, 1, 1]}, 8),                     # depthwise
]


def _view(shape, w, b, attrs, groups, dtype="float32"):
    shapes = (tuple(shape), tuple(w.shape), tuple(b.shape))
    return LayerView("ConvTranspose", "", dict(attrs, group=groups), shapes, ("float32",) * 3, {1: w, 2: b},
                     (dtype,))


def _expected(x, w, b, attrs, groups):
    """onnxruntime's ConvTranspose of x (one node: its reading of every ONNX attribute), as a float64 tensor."""
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], group=groups, **attrs)
    model = make_model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                       [init("w", w.numpy()), init("b", b.numpy())])
    return torch.from_numpy(run_ort(model, {"x": x.float().numpy()})[0]).double()


@pytest.mark.parametrize("c, o, size, k, attrs, groups", GEOMETRIES)
def test_every_geometry_matches_float64(c, o, size, k, attrs, groups):
    torch.manual_seed(0)
    x, w, b = torch.randn(2, c, size, size), torch.randn(c, o // groups, k, k) * 0.2, torch.randn(o)
    v = _view(x.shape, w, b, attrs, groups)
    assert OneDnnDeconvTactic().supports(v)
    y = OneDnnDeconvTactic().prepare(v)([x.contiguous(memory_format=torch.channels_last), None, None])[0]
    want = _expected(x, w, b, attrs, groups)
    assert y.shape == want.shape and y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attrs", [{"strides": [2], "pads": [1, 1], "output_padding": [1]},
                                   {"strides": [4], "pads": [0, 2]}, {"strides": [1], "dilations": [3]}])
def test_1d_matches_float64(attrs):
    torch.manual_seed(1)
    x, w, b = torch.randn(2, 6, 17), torch.randn(6, 5, 4) * 0.2, torch.randn(5)
    v = _view(x.shape, w, b, attrs, 1)
    assert OneDnnDeconv1dTactic().supports(v) and not OneDnnDeconvTactic().supports(v)
    y = OneDnnDeconv1dTactic().prepare(v)([x, None, None])[0]
    want = _expected(x, w, b, attrs, 1)
    assert y.shape == want.shape and y.is_contiguous()
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)


def test_declines_what_onednn_cannot_express():
    w, b = torch.randn(4, 4, 3, 3), torch.randn(4)
    past_stride = _view((1, 4, 6, 6), w, b, {"strides": [2, 2], "pads": [2, 2, 0, 0]}, 1)   # 2 rows given back
    runtime_weights = LayerView("ConvTranspose", "", {"strides": [2, 2]}, ((1, 4, 6, 6), (4, 4, 3, 3), (4,)),
                                ("float32",) * 3, {2: b})
    runtime_bias = LayerView("ConvTranspose", "", {"strides": [2, 2]}, ((1, 4, 6, 6), (4, 4, 3, 3), (4,)),
                             ("float32",) * 3, {1: w})
    dynamic_size = LayerView("ConvTranspose", "", {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
                             ((1, 4, 6, 6), (4, 4, 3, 3), (4,)), ("float32",) * 3, {1: w, 2: b},
                             input_dynamic=((0, 2, 3), (), ()))   # SAME's pads depend on the size met at run time
    for v in (past_stride, runtime_weights, runtime_bias, dynamic_size):
        assert not OneDnnDeconvTactic().supports(v)


@needs_bf16
def test_bf16_reads_and_writes_the_stored_type():
    torch.manual_seed(2)
    x, w, b = torch.randn(1, 8, 9, 9), torch.randn(8, 4, 4, 4) * 0.2, torch.randn(4)
    attrs = {"strides": [2, 2], "pads": [1, 1, 1, 1]}
    v = _view(x.shape, w, b, attrs, 1, dtype="bfloat16")
    y = OneDnnBf16DeconvTactic().prepare(v)([x.bfloat16().contiguous(memory_format=torch.channels_last), None,
                                             None])[0]
    want = _expected(x.bfloat16().float(), w.bfloat16().float(), b.bfloat16().float(), attrs, 1)
    assert y.dtype == torch.bfloat16 and y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)   # one bf16 rounding of the output


def unet_up_block(channels: int = 16, size: int = 10) -> bytes:
    """A U-Net up block: ConvTranspose k2 s2, concatenated with the skip connection, Conv + Relu."""
    nodes = [helper.make_node("ConvTranspose", ["x", "wt", "bt"], ["up"], name="up", strides=[2, 2]),
             helper.make_node("Concat", ["up", "skip"], ["cat"], name="cat", axis=1),
             helper.make_node("Conv", ["cat", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    half = channels // 2
    inits = [init("wt", rand((channels, half, 2, 2), seed=1) * 0.2), init("bt", rand((half,), seed=2) * 0.1),
             init("w", rand((half, channels, 3, 3), seed=3) * 0.1), init("b", rand((half,), seed=4) * 0.1)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size, size]),
              helper.make_tensor_value_info("skip", TensorProto.FLOAT, [1, half, 2 * size, 2 * size])]
    return make_model(nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=17)


def _feeds(seed: int) -> dict[str, np.ndarray]:
    return {"x": rand((1, 16, 10, 10), seed=seed), "skip": rand((1, 8, 20, 20), seed=seed + 1)}


def test_a_unet_up_block_runs_on_onednn_and_matches_onnxruntime():
    model = unet_up_block()
    engine = kiln.build(model, tactic_sources={"torch-onednn"})
    up = next(l for l in engine.layer_info()["Layers"] if l["Name"] == "up")
    assert (up["TacticName"], up["LayerType"]) == ("onednn.deconv2d_nhwc_prepacked", "OneDnnDeconvolution")
    feeds = _feeds(5)
    assert_close_to_ort(engine.run(feeds)["y"], run_ort(model, feeds)[0])


@needs_bf16
def test_a_unet_up_block_is_granted_bf16():
    model = unet_up_block()
    engine = kiln.build(model, bf16=True, tactic_sources={"torch-onednn"}, precision_constraints="prefer",
                        accuracy="off")
    up = next(l for l in engine.plan.layers if l.name == "up")
    assert (up.tactic_name, up.precision) == ("onednn.deconv2d_nhwc_prepacked_bf16", "BF16")
    feeds = _feeds(7)
    got, want = engine.run(feeds)["y"], run_ort(model, feeds)[0]
    assert got.dtype == np.float32 and cosine(got, want) > 0.9999


def generator_block(groups: int = 1) -> bytes:
    """DCGAN's generator stage: ConvTranspose k4 s2 p1 (no bias), BatchNorm, ReLU; then ConvTranspose and Tanh."""
    h = helper.make_node
    nodes = [h("ConvTranspose", ["x", "w1"], ["u"], name="up1", strides=[2, 2], pads=[1, 1, 1, 1], group=groups),
             h("BatchNormalization", ["u", "gamma", "beta", "mean", "var"], ["n"], name="bn"),
             h("Relu", ["n"], ["r"], name="relu"),
             h("ConvTranspose", ["r", "w2", "b2"], ["t"], name="up2", strides=[2, 2], pads=[1, 1, 1, 1]),
             h("Tanh", ["t"], ["y"], name="tanh")]
    inits = [init("w1", rand((16, 12 // groups, 4, 4), seed=1) * 0.2), init("gamma", rand((12,), 2, positive=True)),
             init("beta", rand((12,), seed=3) * 0.1), init("mean", rand((12,), seed=4) * 0.1),
             init("var", rand((12,), 5, positive=True)), init("w2", rand((12, 3, 4, 4), seed=6) * 0.2),
             init("b2", rand((3,), seed=7) * 0.1)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 6, 6])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=17)


@pytest.mark.parametrize("groups", [1, 4])
def test_batchnorm_and_activations_fold_into_the_deconvolutions(groups):
    model = generator_block(groups)
    engine = kiln.build(model, tactic_sources={"torch-onednn"})
    layers = [layer for layer in engine.plan.layers if layer.op_type != "Reformat"]
    assert [(layer.name, layer.op_type, layer.attrs["activation"]["op"]) for layer in layers] == [
        ("up1 + bn + relu", "ConvTranspose", "Relu"), ("up2 + tanh", "ConvTranspose", "Tanh")]
    assert {layer.tactic_name for layer in layers} == {"onednn.deconv2d_nhwc_prepacked"}
    x = rand((1, 16, 6, 6), seed=8)
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])


def test_an_activation_onednn_lacks_runs_after_the_deconvolution():
    torch.manual_seed(3)
    x, w, b = torch.randn(1, 6, 7, 7), torch.randn(6, 4, 3, 3) * 0.3, torch.randn(4)
    attrs = {"strides": [2, 2], "pads": [1, 1, 1, 1]}
    v = _view(x.shape, w, b, dict(attrs, activation={"op": "Softplus", "attrs": {}}), 1)
    y = OneDnnDeconvTactic().prepare(v)([x.contiguous(memory_format=torch.channels_last), None, None])[0]
    want = torch.nn.functional.softplus(_expected(x, w, b, attrs, 1))
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)
