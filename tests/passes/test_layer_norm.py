"""LayerNormFusion on real exports: the decomposed LayerNorm (legacy exporter, opset 13) becomes one layer;
the native op (opset 17, dynamo) passes through; a pattern with a foreign reader of an intermediate does not fuse."""
from __future__ import annotations

import logging
import warnings

import numpy as np
import onnx
import pytest
import torch

import kiln
from tests.conftest import assert_close_to_ort, run_ort
from kiln.trt.vocab import parameter_type


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


def export(tmp_path, opset: int | None, dynamo: bool) -> onnx.ModelProto:
    torch.manual_seed(0)
    model = Block().eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    path = tmp_path / "block.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(model, (torch.randn(2, 5, 16),), str(path), dynamo=True)
        else:
            torch.onnx.export(model, (torch.randn(2, 5, 16),), str(path), dynamo=False, opset_version=opset)
    proto = onnx.load(str(path))
    proto.ir_version = min(proto.ir_version, 10)
    return proto


@pytest.mark.parametrize("opset, dynamo", [(13, False), (17, False), (None, True)])
def test_layer_norm_is_one_layer_and_correct(tmp_path, caplog, opset, dynamo):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    proto = export(tmp_path, opset, dynamo)
    engine = kiln.build(proto, autotune=False)
    norms = [l for l in engine.plan.layers if l.op_type == "LayerNormalization"]
    assert len(norms) == 1, [l.name for l in engine.plan.layers]
    if opset == 13:
        assert "LayerNormFusion: Fusing" in caplog.text
        assert len(norms[0].origin) == 9   # ReduceMean Sub Pow ReduceMean Add Sqrt Div Mul Add
        # the whole block: MatMul+bias, LayerNorm, GELU (Div Erf Add Mul Mul) as one Gelu layer, MatMul+bias
        assert [parameter_type(l) for l in engine.plan.layers] == ["MatrixMultiply", "Normalization", "Activation",
                                                                  "MatrixMultiply"]
        assert engine.plan.layers[2].name == "/Div + /Erf + /Add + /Mul + /Mul_1"
        assert engine.plan.layers[2].op_type == "Gelu"
    x = np.random.default_rng(0).standard_normal((2, 5, 16)).astype(np.float32)
    feeds = {engine.input_names[0]: x}
    assert_close_to_ort(engine.run(feeds)[engine.output_names[0]], run_ort(proto, feeds)[0])
    tuned = kiln.build(proto, avg_timing=1, min_timing=1)   # regions re-emit the fused layer as ONNX too
    assert_close_to_ort(tuned.run(feeds)[tuned.output_names[0]], run_ort(proto, feeds)[0])


def test_no_fusion_when_an_intermediate_is_read_elsewhere(tmp_path, caplog):
    from onnx import TensorProto, helper, numpy_helper

    from tests.conftest import make_model

    c = lambda name, v: numpy_helper.from_array(np.array(v, np.float32), name)   # noqa: E731
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[-1], name="mean"),
             helper.make_node("Sub", ["x", "m"], ["d"], name="sub"),
             helper.make_node("Pow", ["d", "two"], ["p"], name="pow"),
             helper.make_node("ReduceMean", ["p"], ["v"], axes=[-1], name="var"),
             helper.make_node("Add", ["v", "eps"], ["ve"], name="add_eps"),
             helper.make_node("Sqrt", ["ve"], ["s"], name="sqrt"),
             helper.make_node("Div", ["d", "s"], ["y"], name="div")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                        helper.make_tensor_value_info("v", TensorProto.FLOAT, None)], [c("two", 2.0), c("eps", 1e-5)],
                       opset=13)
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    engine = kiln.build(model, autotune=False)
    assert not any(l.op_type == "LayerNormalization" for l in engine.plan.layers)
    assert "LayerNormFusion: Not fusing" in caplog.text and "used outside the pattern" in caplog.text
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    got = engine.run({"x": x})
    for out, want in zip(model.graph.output, run_ort(model, {"x": x})):
        assert_close_to_ort(got[out.name], want)


def test_the_mul_form_of_the_variance_fuses_and_matches_onnxruntime():
    """LayerNorm written with Mul(d, d) for the square (as some exporters and hand-written graphs do): one
    LayerNormalization layer, same numbers as onnxruntime runs the decomposed graph with."""
    from onnx import TensorProto, helper

    from tests.conftest import init, make_model

    h = helper.make_node
    nodes = [h("ReduceMean", ["x"], ["mean"], name="mean", axes=[-1]), h("Sub", ["x", "mean"], ["d"], name="sub"),
             h("Mul", ["d", "d"], ["sq"], name="square"), h("ReduceMean", ["sq"], ["var"], name="var", axes=[-1]),
             h("Add", ["var", "eps"], ["ve"], name="add_eps"), h("Sqrt", ["ve"], ["std"], name="sqrt"),
             h("Div", ["d", "std"], ["n"], name="div"), h("Mul", ["n", "gamma"], ["g"], name="scale"),
             h("Add", ["g", "beta"], ["y"], name="shift")]
    rng = np.random.default_rng(0)
    inits = [init("eps", np.float32(1e-5)), init("gamma", rng.uniform(0.5, 1.5, 16).astype(np.float32)),
             init("beta", rng.uniform(-0.5, 0.5, 16).astype(np.float32))]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 16])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 16])], inits, opset=13)
    engine = kiln.build(model, autotune=False)
    assert [l.op_type for l in engine.plan.layers] == ["LayerNormalization"]
    x = rng.standard_normal((3, 16)).astype(np.float32) * 3
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])


def tf_layer_norm(opset: int = 13, rsqrt: str = "Reciprocal", scaled: bool = True, extra_reader: bool = False):
    """Keras LayerNormalization as tf2onnx exports it (tf.nn.moments + tf.nn.batch_normalization):
    a = γ / √(var + ε), y = x·a + (β − mean·a); the mean is read by the centring Sub and by mean·a."""
    from onnx import TensorProto, helper

    from tests.conftest import init, make_model

    h = helper.make_node
    axes = {"axes": [-1]} if opset < 18 else {}
    reduce_inputs = [] if opset < 18 else ["axes"]
    inv = (h("Reciprocal", ["sd"], ["inv"], name="bn/Rsqrt") if rsqrt == "Reciprocal" else
           h("Div", ["one", "sd"], ["inv"], name="bn/Rsqrt"))
    nodes = [h("ReduceMean", ["x", *reduce_inputs], ["mean"], name="moments/mean", **axes),
             h("Sub", ["x", "mean"], ["d"], name="moments/sub"), h("Mul", ["d", "d"], ["sq"], name="moments/square"),
             h("ReduceMean", ["sq", *reduce_inputs], ["var"], name="moments/variance", **axes),
             h("Add", ["var", "eps"], ["ve"], name="bn/add"), h("Sqrt", ["ve"], ["sd"], name="bn/sqrt"), inv]
    nodes += [h("Mul", ["inv", "gamma"], ["a"], name="bn/mul")] if scaled else [h("Identity", ["inv"], ["a"])]
    nodes += [h("Mul", ["x", "a"], ["xa"], name="bn/mul_1"), h("Mul", ["mean", "a"], ["ma"], name="bn/mul_2"),
              h("Sub", ["beta", "ma"], ["b2"], name="bn/sub"), h("Add", ["xa", "b2"], ["y"], name="bn/add_1")]
    rng = np.random.default_rng(1)
    inits = [init("eps", np.float32(1e-3)), init("one", np.float32(1.0)), init("axes", np.array([-1], np.int64)),
             init("gamma", rng.uniform(0.5, 1.5, 16).astype(np.float32)),
             init("beta", rng.uniform(-0.5, 0.5, 16).astype(np.float32))]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 16])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("var", TensorProto.FLOAT, None))
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 16])], outputs, inits,
                      opset=opset)


@pytest.mark.parametrize("opset, rsqrt, scaled", [(13, "Reciprocal", True), (18, "Div", True),
                                                  (13, "Reciprocal", False)])
def test_tensorflows_batch_normalization_form_is_one_layer(opset, rsqrt, scaled):
    model = tf_layer_norm(opset, rsqrt, scaled)
    engine = kiln.build(model, autotune=False)
    (layer,) = engine.plan.layers
    assert layer.op_type == "LayerNormalization" and layer.attrs["epsilon"] == pytest.approx(1e-3)
    assert layer.name.startswith("moments/mean + moments/sub") and layer.name.endswith("bn/sub + bn/add_1")
    x = np.random.default_rng(2).standard_normal((2, 5, 16)).astype(np.float32) * 3 + 5
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])


def test_tensorflows_form_with_the_variance_read_elsewhere_stays_and_says_why(caplog):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    model = tf_layer_norm(extra_reader=True)
    engine = kiln.build(model, autotune=False)
    assert "LayerNormalization" not in [l.op_type for l in engine.plan.layers]
    assert "Not fusing moments/mean with bn/add_1: an intermediate value is also used outside the pattern" in caplog.text
    x = np.random.default_rng(3).standard_normal((2, 5, 16)).astype(np.float32)
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])
