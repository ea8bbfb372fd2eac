"""kiln's own oneDNN floating-point convolution primitives (source "onednn"): FP32 against torch's convolution
(asymmetric pads, strides, groups, dilation, every fused activation oneDNN has, a residual summed in place), BF16
against the formula on bf16-rounded operands for every mix of stored types, layers oneDNN has no activation for
left to other tactics, models on the source alone against onnxruntime through save and load, and the fallback to
torch's oneDNN ops where oneDNN's C API is missing."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

import kiln
from kiln.native import external
from kiln.ops.nn import apply_activation
from kiln.tactics import onednn_prim
from kiln.tactics.base import LayerView
from kiln.tactics.onednn_conv import bf16_available
from kiln.tactics.onednn_prim_float import PrimitiveBf16ConvTactic, PrimitiveConvTactic
from tests.conftest import cosine, init, make_model, rand, run_ort

pytestmark = pytest.mark.skipif(not onednn_prim.available(), reason="oneDNN's C API is not installed here (pip "
                                f"install {external.ONEDNN_WHEELS})")
needs_bf16 = pytest.mark.skipif(not bf16_available(), reason="this CPU has no native BF16 (AVX512-BF16 or AMX): "
                                "oneDNN's BF16 convolution is not offered")
LAST = torch.channels_last


def conv_view(x_shape, weight, bias, pads, strides=(1, 1), dilations=(1, 1), group=1, activation=None,
              residual=False, dtypes=("float32", "float32", "float32")) -> LayerView:
    """A fused Conv layer; `dtypes`: how the plan stores its input, residual and output."""
    (kh, kw), (sh, sw), (dh, dw) = weight.shape[2:], strides, dilations
    out = (x_shape[0], weight.shape[0], (x_shape[2] + pads[0] + pads[2] - (kh - 1) * dh - 1) // sh + 1,
           (x_shape[3] + pads[1] + pads[3] - (kw - 1) * dw - 1) // sw + 1)
    shapes = [tuple(x_shape), tuple(weight.shape), None if bias is None else tuple(bias.shape)]
    ins = [dtypes[0], "float32", "float32"]
    if residual:
        shapes.append(out)
        ins.append(dtypes[1])
    attrs = {"kernel_shape": [kh, kw], "pads": list(pads), "strides": list(strides), "dilations": list(dilations),
             "group": group}
    if activation:
        attrs["activation"] = activation
    consts = {1: weight} if bias is None else {1: weight, 2: bias}
    return LayerView("Conv", "", attrs, tuple(shapes), tuple(ins), consts, (dtypes[2],), 17,
                     tuple(() for _ in shapes))


def formula(view: LayerView, x: torch.Tensor, r: torch.Tensor | None, rounded=False) -> torch.Tensor:
    """ONNX's Conv, the residual, the activation, in FP32; on bf16-rounded input and weights where `rounded`."""
    a, w = view.attrs, view.const_inputs[1]
    p = a["pads"]
    x = F.pad(x.float(), [p[1], p[3], p[0], p[2]])
    if rounded:
        x, w = x.bfloat16().float(), w.bfloat16().float()
    y = F.conv2d(x, w, view.const_inputs.get(2), a["strides"], 0, a["dilations"], a["group"])
    return apply_activation(a.get("activation"), y if r is None else y + r.float())


ACTIVATIONS = [None, {"op": "Relu"}, {"op": "LeakyRelu", "attrs": {"alpha": 0.1}},
               {"op": "Clip", "attrs": {"min": 0.0, "max": 6.0}}, {"op": "HardSwish"},
               {"op": "Swish", "attrs": {"alpha": 1.5}}, {"op": "Sigmoid"}, {"op": "Tanh"},
               {"op": "HardSigmoid", "attrs": {"alpha": 0.3, "beta": 0.4}}, {"op": "Elu", "attrs": {"alpha": 0.5}},
               {"op": "Softplus"}, {"op": "Mish"}, {"op": "Gelu", "attrs": {}},
               {"op": "Gelu", "attrs": {"approximate": "tanh"}}]
GEOMETRIES = {   # x shape, weight shape, pads (top, left, bottom, right), strides, dilations, groups
    "3x3": ((1, 16, 13, 11), (32, 16, 3, 3), (1, 1, 1, 1), (1, 1), (1, 1), 1),
    "asymmetric pads, stride 2x1": ((2, 16, 13, 11), (24, 16, 3, 3), (0, 1, 2, 1), (2, 1), (1, 1), 1),
    "depthwise": ((1, 32, 9, 9), (32, 1, 3, 3), (1, 1, 1, 1), (1, 1), (1, 1), 32),
    "grouped, dilated": ((1, 32, 9, 9), (64, 8, 3, 3), (2, 2, 2, 2), (1, 1), (2, 2), 4),
    "7x7 stride 2": ((1, 3, 30, 30), (16, 3, 7, 7), (3, 3, 3, 3), (2, 2), (1, 1), 1),
}


def case(geometry: str, seed=0, bias=True, **kwargs):
    x_shape, w_shape, pads, strides, dilations, group = GEOMETRIES[geometry]
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(w_shape, generator=g) * 0.2
    b = torch.randn(w_shape[0], generator=g) if bias else None
    view = conv_view(x_shape, weight, b, pads, strides, dilations, group, **kwargs)
    x = torch.randn(x_shape, generator=g).contiguous(memory_format=LAST)
    r = torch.randn(view.input_shapes[3], generator=g).contiguous(memory_format=LAST) if len(view.input_shapes) > 3 \
        else None
    return view, x, r


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_fp32_matches_torchs_convolution(geometry):
    view, x, _ = case(geometry, activation={"op": "Relu"})
    tactic = PrimitiveConvTactic()
    assert tactic.supports(view)
    got = tactic.prepare(view)([x, None, None])[0]
    assert got.dtype == torch.float32 and got.is_contiguous(memory_format=LAST)
    torch.testing.assert_close(got, formula(view, x, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=lambda a: a and a["op"] + str(a.get("attrs", "")))
def test_fp32_fuses_each_activation_after_a_residual_summed_in_place(activation):
    view, x, r = case("3x3", seed=1, bias=activation is None, activation=activation, residual=True)
    kernel = PrimitiveConvTactic().prepare(view)
    want = formula(view, x, r)
    index, into = kernel.into_input
    accum = r.clone(memory_format=LAST)
    got = into([x, None, None, accum])[0]
    assert index == 3 and got.data_ptr() == accum.data_ptr()   # the output written over the dead residual
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    live = r.clone()
    torch.testing.assert_close(kernel([x, None, None, r])[0], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(r, live)   # the plain call sums into a copy: the live residual is left alone


@pytest.mark.parametrize("op", ["Selu", "Softsign", "ThresholdedRelu"])
def test_an_activation_onednn_has_no_algorithm_for_is_left_to_other_tactics(op):
    view, _, _ = case("3x3", activation={"op": op, "attrs": {}})
    assert not PrimitiveConvTactic().supports(view) and not PrimitiveBf16ConvTactic().supports(view)


@needs_bf16
@pytest.mark.parametrize("dtypes", [("float32",) * 3, ("bfloat16",) * 3, ("bfloat16", "float32", "bfloat16"),
                                    ("float32", "bfloat16", "float32"), ("bfloat16", "bfloat16", "float32")],
                         ids=lambda d: "-".join(t[0] for t in d))   # x, residual, output: f(loat32) or b(float16)
@pytest.mark.parametrize("geometry", ["asymmetric pads, stride 2x1", "grouped, dilated"])
def test_bf16_computes_on_rounded_operands_for_every_mix_of_stored_types(dtypes, geometry):
    """The residual joins as the sum post-op where it has the output's type, else as a binary add read from its own
    buffer: in FP32 either way, so r = ±1000 + noise keeps its low bits until the output's own rounding."""
    view, x, r = case(geometry, seed=2, activation={"op": "Relu"}, residual=True, dtypes=dtypes)
    r = r + 1000 * r.sign()
    x, r = (x.bfloat16() if dtypes[0] == "bfloat16" else x), (r.bfloat16() if dtypes[1] == "bfloat16" else r)
    got = PrimitiveBf16ConvTactic().prepare(view)([x, None, None, r])[0]
    assert got.dtype == (torch.bfloat16 if dtypes[2] == "bfloat16" else torch.float32)
    assert got.is_contiguous(memory_format=LAST)
    want = formula(view, x, r, rounded=True)
    tol = dict(rtol=1 / 128, atol=1e-3) if dtypes[2] == "bfloat16" else dict(rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(got.float(), want, **tol)


@needs_bf16
@pytest.mark.parametrize("activation", ACTIVATIONS[1:], ids=lambda a: a["op"] + str(a.get("attrs", "")))
def test_bf16_fuses_each_activation(activation):
    view, x, _ = case("3x3", seed=3, activation=activation)
    got = PrimitiveBf16ConvTactic().prepare(view)([x, None, None])[0]
    torch.testing.assert_close(got, formula(view, x, None, rounded=True), rtol=1e-4, atol=1e-4)


def small_cnn(folder) -> str:
    """Conv+Relu -> depthwise Conv+HardSwish -> 1x1 Conv, + the first's output -> Sigmoid: three fused convolutions,
    one with a residual."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], group=16),
             helper.make_node("HardSwish", ["c2"], ["h2"]),
             helper.make_node("Conv", ["h2", "w3", "b3"], ["c3"]),
             helper.make_node("Add", ["c3", "r1"], ["s"]),
             helper.make_node("Sigmoid", ["s"], ["y"])]
    inits = [init("w1", rand((16, 3, 3, 3), 1) * 0.3), init("b1", rand(16, 2)), init("w2", rand((16, 1, 3, 3), 3)),
             init("b2", rand(16, 4)), init("w3", rand((16, 16, 1, 1), 5) * 0.2), init("b3", rand(16, 6))]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 20, 20])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 20, 20])], inits)
    path = str(folder / "cnn.onnx")
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=needs_bf16)], ids=["fp32", "bf16"])
def test_a_cnn_on_the_onednn_source_alone_matches_onnxruntime_and_reloads(tmp_path, bf16):
    path = small_cnn(tmp_path)
    engine = kiln.build(path, tactic_sources="onednn", bf16=bf16, precision_constraints="prefer" if bf16 else "none")
    convs = [l for l in engine.plan.layers if l.op_type == "Conv"]
    name = "onednn.conv2d_primitive_bf16" if bf16 else "onednn.conv2d_primitive"
    assert len(convs) == 3 and {(l.tactic_name, l.source, l.precision) for l in convs} == \
        {(name, "onednn", "BF16" if bf16 else "FP32")}
    assert [len(l.inputs) for l in convs] == [1, 1, 2]   # the residual fused into the last
    x = rand((1, 3, 20, 20), 9)
    got, want = engine.run({"x": x})["y"], run_ort(path, {"x": x})[0]
    if bf16:
        assert cosine(got, want) >= 0.9999 and np.abs(got - want).max() < 0.02
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    engine.save(tmp_path / "cnn.kiln")
    np.testing.assert_array_equal(kiln.load(tmp_path / "cnn.kiln").run({"x": x})["y"], got)


def test_without_onednns_c_api_the_engine_runs_on_torchs_onednn_ops(tmp_path, monkeypatch, caplog):
    path = small_cnn(tmp_path)
    engine = kiln.build(path, tactic_sources="onednn")
    engine.save(tmp_path / "cnn.kiln")
    monkeypatch.setattr(external, "onednn_prefix", lambda: None)
    x = rand((1, 3, 20, 20), 10)
    with caplog.at_level("WARNING", logger="kiln"):
        got = kiln.load(tmp_path / "cnn.kiln").run({"x": x})["y"]   # kernels are prepared at the first run
    assert "onednn.conv2d_primitive links onednn, which is not installed here" in caplog.text
    assert "its layers run on onednn.conv2d_nhwc_prepacked, in the same precision" in caplog.text
    np.testing.assert_allclose(got, run_ort(path, {"x": x})[0], rtol=1e-5, atol=1e-5)
