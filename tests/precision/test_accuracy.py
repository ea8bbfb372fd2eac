"""`kiln.tools.compare.compare`: engine vs onnxruntime per output and, with layerwise, per visible tensor;
the first diverging layer is named exactly and the engine under test is left untouched."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.tools.compare import REPORT_KIND, CompareReport, compare, compare_tensor
from tests.conftest import force_plan, make_model
from tests.precision.models import conv_net, perturbed, transformer_net

COMPARISON_KEYS = {"name", "layer", "onnx_node", "shape", "dtype", "max_abs_err", "mean_abs_err", "max_rel_err",
                   "cosine", "argmax_agreement", "passed", "note"}
REPORT_KEYS = {"kind", "version", "model", "engine", "inputs", "rtol", "atol", "passed", "outputs", "layerwise",
               "layers", "skipped", "first_divergence"}


@pytest.fixture(scope="module")
def conv():
    model = conv_net()
    return model, kiln.build(model, autotune=False)


@pytest.fixture(scope="module")
def block():
    model = transformer_net()
    return model, kiln.build(model, autotune=False)


def relu_model(input_name: str) -> onnx.ModelProto:
    return make_model([helper.make_node("Relu", [input_name], ["out"], name="relu")],
                      [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, [2, 3])],
                      [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3])])


def first_layer_with(engine, onnx_node: str) -> str:
    return next(layer.name for layer in engine.plan.layers if onnx_node in layer.origin)


def test_conv_engine_matches_its_model(conv):
    model, engine = conv
    report = compare(model, engine)
    assert isinstance(report, CompareReport) and report.passed and not report.layerwise and report.layers == ()
    (y,) = report.outputs
    assert (y.name, y.layer, y.onnx_node, y.shape, y.dtype) == ("y", "head", "head", (1, 6), "float32")
    assert y.passed and y.max_rel_err < 1e-5 and y.cosine > 0.99999 and y.argmax_agreement == 1.0
    assert y.max_abs_err >= y.mean_abs_err >= 0 and report.inputs.startswith("random (seed 0")


def test_layerwise_conv_compares_channel_major_tensors_in_plan_order(conv):
    model, engine = conv
    report = compare(model, engine, layerwise=True)
    assert report.passed and report.first_divergence is None
    assert [t.name for t in report.layers] == ["r1", "r2", "g", "f", "m", "y"]   # c1, c2 are fused away
    formats = {d.name: d.format for layer in engine.plan.layers for d in layer.outputs}
    assert formats["r1"] == "hwc" and formats["g"] == "hwc"    # channels_last tensors are compared too
    assert all(t.passed and t.cosine > 0.99999 for t in report.layers)
    assert report.layers[0].layer == "conv1 + relu1" and report.layers[0].onnx_node == "relu1"


def test_layerwise_transformer_block_passes(block):
    model, engine = block
    report = compare(model, engine, layerwise=True)
    assert report.passed and report.first_divergence is None
    names = [t.name for t in report.layers]
    assert {"a", "res1", "n", "g", "y"} <= set(names) and names[-1] == "y"
    assert all(t.passed for t in report.layers) and report.skipped == ()


def test_perturbed_conv_weight_names_the_first_diverging_layer(conv):
    model, engine = conv
    report = compare(perturbed(model, "w2"), engine, layerwise=True)
    assert not report.passed and not report.outputs[0].passed
    first = report.first_divergence
    assert first.layer == first_layer_with(engine, "conv2") == "conv2 + relu2"
    assert (first.name, first.onnx_node) == ("r2", "relu2")
    assert report.layers[0].name == "r1" and report.layers[0].passed   # upstream of conv2: still exact
    assert all(not t.passed for t in report.layers[1:])


def test_perturbed_transformer_weight_names_the_ffn_layer(block):
    model, engine = block
    report = compare(perturbed(model, "w1", 0.2), engine, layerwise=True)
    first = report.first_divergence
    assert not report.passed and first.layer == first_layer_with(engine, "ffn1")
    before = report.layers[:report.layers.index(first)]
    assert [t.name for t in before] == ["a", "res1", "n"] and all(t.passed for t in before)   # o_proj + residual1


def test_layerwise_leaves_the_engine_unchanged(conv):
    model, engine = conv
    plan, kernels = engine.plan, engine.kernels
    layers, weights = plan.layers, {k: v.copy() for k, v in plan.weights.items()}
    feeds = engine.random_inputs(3)
    before = engine.run(feeds)["y"].copy()
    compare(perturbed(model, "w2"), engine, feeds, layerwise=True)
    assert engine.plan is plan and engine.kernels is kernels and engine.plan.layers == layers
    assert all(np.array_equal(weights[k], v) for k, v in engine.plan.weights.items())
    np.testing.assert_array_equal(engine.run(feeds)["y"], before)


def test_inputs_from_npz_and_from_a_dict(conv, tmp_path):
    model, engine = conv
    x = np.random.default_rng(5).standard_normal((1, 3, 16, 16))   # float64: converted to the engine's float32
    np.savez(tmp_path / "in.npz", x=x)
    from_file = compare(model, engine, tmp_path / "in.npz")
    from_dict = compare(model, engine, {"x": x})
    assert from_file.inputs == str(tmp_path / "in.npz") and from_dict.inputs == "given"
    assert from_file.outputs == from_dict.outputs and from_file.passed


def test_bad_inputs_name_the_file(conv, tmp_path):
    model, engine = conv
    np.savez(tmp_path / "wrong.npz", image=np.zeros((1, 3, 16, 16), np.float32))
    with pytest.raises(kiln.InputError, match=r"wrong\.npz.*missing \['x'\], unknown \['image'\]"):
        compare(model, engine, tmp_path / "wrong.npz")
    with pytest.raises(kiln.InputError, match="absent.npz"):
        compare(model, engine, tmp_path / "absent.npz")
    with pytest.raises(kiln.InputError, match="dtype"):
        compare(model, engine, {"x": np.zeros((1, 3, 16, 16), np.int64)})


def test_missing_files_and_a_foreign_model_raise_kiln_errors(conv, tmp_path):
    model, engine = conv
    engine.save(tmp_path / "m.kiln")
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(kiln.ModelError, match="nope.onnx"):
        compare(tmp_path / "nope.onnx", tmp_path / "m.kiln")
    with pytest.raises(kiln.EngineFormatError, match="nope.kiln"):
        compare(tmp_path / "m.onnx", tmp_path / "nope.kiln")
    with pytest.raises(kiln.ModelError, match=r"model inputs \['x'\] differ from the engine"):
        compare(tmp_path / "m.onnx", kiln.build(relu_model("image"), autotune=False))
    with pytest.raises(kiln.ModelError, match="onnxruntime cannot run the model: .*rank"):
        compare(transformer_net(), tmp_path / "m.kiln")
    assert compare(tmp_path / "m.onnx", tmp_path / "m.kiln").engine == str(tmp_path / "m.kiln")


def test_report_json_schema(conv):
    model, engine = conv
    doc = json.loads(json.dumps(compare(perturbed(model, "w2"), engine, layerwise=True).to_dict()))
    assert set(doc) == REPORT_KEYS and doc["kind"] == REPORT_KIND and doc["version"] == 1
    assert doc["passed"] is False and doc["layerwise"] is True and doc["rtol"] == 1e-4
    for entry in doc["outputs"] + doc["layers"] + [doc["first_divergence"]]:
        assert set(entry) == COMPARISON_KEYS
    assert doc["first_divergence"]["layer"] == "conv2 + relu2" and doc["outputs"][0]["shape"] == [1, 6]


def test_region_internal_tensors_are_skipped(conv, monkeypatch):
    model, _ = conv
    force_plan(monkeypatch, "onnxruntime")
    engine = kiln.build(model, tactic_sources={"onnxruntime"}, avg_timing=1, min_timing=1)
    assert len([layer for layer in engine.plan.layers if layer.inner]) == 1
    report = compare(model, engine, layerwise=True)
    visible = {d.name for layer in engine.plan.layers for d in layer.outputs}
    assert report.passed and {t.name for t in report.layers} <= visible
    assert report.skipped and all(s.reason.startswith("inside a region") and s.name not in visible
                                  for s in report.skipped)


def test_compare_tensor_rules():
    a = np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]], np.float32)
    same = compare_tensor(a, a.copy(), "t", "L", "n", 1e-4, 0.0)
    assert same.passed and same.max_abs_err == 0 and same.cosine == pytest.approx(1.0) and same.argmax_agreement == 1
    off = compare_tensor(a + np.float32(0.01), a, "t", "L", "n", 1e-4, 0.0)
    assert not off.passed and off.max_rel_err == pytest.approx(0.01 / 3, rel=1e-3)
    assert compare_tensor(a + np.float32(0.01), a, "t", "L", "n", 1e-2, 0.0).passed
    shape = compare_tensor(a, a.T, "t", "L", "n", 1e-4, 0.0)
    assert not shape.passed and "shape" in shape.note and np.isnan(shape.max_abs_err)
    ints = np.array([1, 2, 3], np.int64)
    assert not compare_tensor(ints + np.array([0, 0, 1]), ints, "i", "L", "n", 1.0, 1.0).passed
    assert compare_tensor(ints, ints, "i", "L", "n", 1e-4, 0.0).argmax_agreement is None
    nan = np.array([1.0, np.nan], np.float32)
    assert compare_tensor(nan, nan, "f", "L", "n", 1e-4, 0.0).passed
    assert not compare_tensor(nan, np.array([1.0, 2.0], np.float32), "f", "L", "n", 1e-4, 0.0).passed
    nhwc = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
    assert compare_tensor(nhwc.transpose(0, 2, 3, 1), nhwc, "h", "L", "n", 1e-4, 0.0, layout="hwc").passed
    assert not compare_tensor(nhwc.transpose(0, 2, 3, 1), nhwc, "h", "L", "n", 1e-4, 0.0).passed


def test_layerwise_skips_a_tensor_kiln_holds_as_int8_where_the_model_has_floats():
    """VanillaSwapWithFollowingQ moves a DequantizeLinear past the Reshape writing `r`: kiln holds `r` as INT8
    bytes, the model as floats. Compared as numbers they would "diverge" by the scale (a false first divergence);
    the tensor is listed as skipped with the reason instead, and the engine passes."""
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"], name="q1"),
             helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xd"], name="dq1"),
             helper.make_node("Reshape", ["xd", "shape"], ["r"], name="reshape"),
             helper.make_node("QuantizeLinear", ["r", "s", "zp"], ["rq"], name="q2"),
             helper.make_node("DequantizeLinear", ["rq", "s", "zp"], ["y"], name="dq2")]
    tensor = helper.make_tensor
    inits = [tensor("s", TensorProto.FLOAT, [], [0.05]), tensor("zp", TensorProto.UINT8, [], [7]),
             tensor("shape", TensorProto.INT64, [2], [6, 4])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 4])], inits)
    engine = kiln.build(model, autotune=False)
    held = {d.name: d.dtype for layer in engine.plan.layers for d in layer.outputs}
    assert held["r"] == "uint8"
    report = compare(model, engine, layerwise=True)
    assert report.passed and report.first_divergence is None and "r" not in [t.name for t in report.layers]
    (skipped,) = [s for s in report.skipped if s.name == "r"]
    assert "kiln holds it as uint8, the model as float32" in skipped.reason
