"""1-D convolution on kiln's direct GEMM kernel (kiln.tactics.conv_direct.DirectConv1dTactic and its BF16 variant):
geometries (stride, symmetric and asymmetric pads, one input channel, a 1-wide kernel), bias, fused activations and
residual against float64 torch; which layers it takes; a wav2vec2-style feature encoder against onnxruntime, after a
save and load."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import hardware
from kiln.tactics.base import LayerView
from kiln.tactics.conv_direct import DirectConv1dTactic, DirectConvTactic
from kiln.tactics.gemm_bf16 import BF16_DOT_ISA, DirectConv1dBf16Tactic
from tests.conftest import assert_close_to_ort, make_model, rand, run_ort, init
from onnx import TensorProto, helper

GEOMETRIES = [   # (C, O, L, kernel, stride, pads [begin, end])
    (8, 40, 41, 3, 1, [1, 1]),
    (8, 16, 41, 3, 2, [1, 1]),
    (5, 33, 30, 5, 1, [4, 0]),       # causal (left) padding; 33 outputs: a partial panel of 32
    (1, 32, 400, 10, 5, [0, 0]),     # wav2vec2's first layer: one channel of raw audio
    (24, 16, 12, 1, 1, [0, 0]),      # a pointwise (1-wide) convolution, which the 2-D 1x1 GEMM tactic leaves
]


def _view(c, o, length, k, stride, pads, w, b, activation=None, residual=False, dtype="float32", groups=1,
          dilation=1):
    attrs = {"kernel_shape": [k], "strides": [stride], "dilations": [dilation], "pads": pads, "group": groups}
    if activation:
        attrs["activation"] = {"op": activation, "attrs": {}}
    out_len = (length + sum(pads) - dilation * (k - 1) - 1) // stride + 1
    shapes = [(2, c, length), tuple(w.shape), tuple(b.shape)] + ([(2, o, out_len)] if residual else [])
    return LayerView("Conv", "", attrs, tuple(shapes), (dtype,) + ("float32",) * (len(shapes) - 1), {1: w, 2: b},
                     (dtype,))


def _expected(x, w, b, stride, pads, activation=None, residual=None):
    y = F.conv1d(F.pad(x.double(), pads), w.double(), b.double(), stride)
    if residual is not None:
        y = y + residual.double()
    return {"Relu": torch.relu, "Gelu": F.gelu, "Swish": F.silu, None: lambda t: t}[activation](y)


@pytest.mark.parametrize("c, o, length, k, stride, pads", GEOMETRIES)
def test_every_geometry_matches_float64(c, o, length, k, stride, pads):
    torch.manual_seed(0)
    x, w, b = torch.randn(2, c, length), torch.randn(o, c, k) * 0.2, torch.randn(o)
    view = _view(c, o, length, k, stride, pads, w, b)
    assert DirectConv1dTactic().supports(view)
    y = DirectConv1dTactic().prepare(view)([x, None, None])[0]
    want = _expected(x, w, b, stride, pads)
    assert y.dtype == torch.float32 and y.is_contiguous() and y.shape == want.shape
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation, residual", [("Relu", False), ("Swish", False), ("Gelu", False),
                                                  ("Relu", True), (None, True)])
def test_fused_activation_and_residual(activation, residual):
    """ReLU and Swish are applied as the C kernel stores; GELU after it; the residual before the activation."""
    torch.manual_seed(1)
    x, w, b = torch.randn(2, 8, 40), torch.randn(16, 8, 3) * 0.2, torch.randn(16)
    r = torch.randn(2, 16, 40) if residual else None
    kernel = DirectConv1dTactic().prepare(_view(8, 16, 40, 3, 1, [1, 1], w, b, activation, residual))
    y = kernel([x, None, None] + ([r] if residual else []))[0]
    assert y.is_contiguous()
    torch.testing.assert_close(y.double(), _expected(x, w, b, 1, [1, 1], activation, r), rtol=1e-4, atol=1e-4)


def test_it_takes_plain_1d_convolutions_with_constant_weights_only():
    w, b = torch.randn(4, 4, 3), torch.randn(4)
    plain = _view(4, 4, 10, 3, 1, [1, 1], w, b)
    grouped = _view(4, 4, 10, 3, 1, [1, 1], torch.randn(4, 2, 3), b, groups=2)
    dilated = _view(4, 4, 10, 3, 1, [2, 2], w, b, dilation=2)
    runtime_weights = LayerView("Conv", "", plain.attrs, plain.input_shapes, plain.input_dtypes, {2: b})
    two_d = LayerView("Conv", "", {"pads": [1, 1, 1, 1], "strides": [1, 1], "dilations": [1, 1], "group": 1},
                      ((1, 4, 10, 10), (4, 4, 3, 3), (4,)), ("float32",) * 3, {1: torch.randn(4, 4, 3, 3), 2: b})
    tactic = DirectConv1dTactic()
    assert tactic.supports(plain)
    assert not any(tactic.supports(v) for v in (grouped, dilated, runtime_weights, two_d))
    assert DirectConvTactic().supports(two_d) and not DirectConvTactic().supports(plain)


@pytest.mark.skipif(not hardware.has_any(BF16_DOT_ISA), reason="no avx512_bf16: the BF16 direct kernel is not offered")
def test_bf16_reads_and_writes_the_stored_type():
    torch.manual_seed(2)
    x, w, b = torch.randn(2, 8, 41), torch.randn(16, 8, 3) * 0.2, torch.randn(16)
    view = _view(8, 16, 41, 3, 2, [1, 1], w, b, "Relu", dtype="bfloat16")
    y = DirectConv1dBf16Tactic().prepare(view)([x.bfloat16(), None, None])[0]
    want = _expected(x.bfloat16().float(), w.bfloat16().float(), b, 2, [1, 1], "Relu")
    assert y.dtype == torch.bfloat16 and y.is_contiguous()
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)   # one bf16 rounding of the output


def feature_encoder() -> bytes:
    """wav2vec2's feature encoder, narrowed: Conv1d(1 -> 32, k10 s5) + GELU, Conv1d(32 -> 32, k3 s2) + GELU,
    Conv1d(32 -> 32, k2 s2) + GELU (no biases, as wav2vec2 exports them)."""
    nodes, prev = [], "x"
    for i, (k, s) in enumerate([(10, 5), (3, 2), (2, 2)]):
        nodes += [helper.make_node("Conv", [prev, f"w{i}"], [f"c{i}"], name=f"conv{i}", strides=[s]),
                  helper.make_node("Gelu", [f"c{i}"], [f"g{i}"], name=f"gelu{i}")]
        prev = f"g{i}"
    inits = [init(f"w{i}", rand((32, 1 if i == 0 else 32, k), seed=i) * 0.3) for i, k in enumerate([10, 3, 2])]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 800])],
                      [helper.make_tensor_value_info(prev, TensorProto.FLOAT, None)], inits, opset=20)


def test_a_feature_encoder_runs_on_the_direct_kernel_by_default(tmp_path):
    """Without timing each convolution takes the first tactic listed: kiln's direct kernel, ahead of oneDNN."""
    model = feature_encoder()
    engine = kiln.build(model, autotune=False, tactic_sources="-openvino,-onnxruntime")
    convs = [l for l in engine.layer_info()["Layers"] if l["Name"].startswith("conv")]
    assert [(l["Name"], l["TacticName"]) for l in convs] == [
        (f"conv{i} + gelu{i}", "kiln.conv1d_direct_gemm") for i in range(3)]
    x = rand((1, 1, 800), seed=7)
    got = engine.run({"x": x})["g2"]
    assert_close_to_ort(got, run_ort(model, {"x": x})[0])
    engine.save(tmp_path / "e.kiln")
    np.testing.assert_array_equal(kiln.load(tmp_path / "e.kiln").run({"x": x})["g2"], got)
