"""QOperator-format INT8 models (onnxruntime's quantize_static with QuantFormat.QOperator: QLinearConv, QLinearAdd,
QLinearGlobalAveragePool, QGemm) build onto kiln's own INT8 kernels, as their Q/DQ twins do, under the QOperator
nodes' names, and match onnxruntime's own execution of the model."""
from __future__ import annotations

import re
from collections import Counter

import numpy as np
import onnx
import pytest

import kiln
from kiln.tactics.onednn_int8 import int8_available
from kiln.tactics.qgemm_c import vnni_available
from tests.conftest import cosine, run_ort
from tests.precision.test_qdq import quantized_resnet18

KILN_ONLY = "-openvino,-onnxruntime"
# the INT8 kernels alone: torch's reference QConv/QGemm (dequantize, FP32, quantize) would race them, and which wins
# is the timing's call (3-50x slower on a Zen 4, but still a candidate), not what the test is about
INT8_KERNELS = "kiln,torch-onednn"
needs_int8_kernels = pytest.mark.skipif(not (int8_available() or vnni_available()), reason="no INT8 dot products "
                                        "here (VNNI or AMX-INT8): only torch's reference kernels run QConv")


@pytest.fixture(scope="module")
def qoperator_resnet(tmp_path_factory):
    return quantized_resnet18(tmp_path_factory.mktemp("qoperator"), "QOperator")


@needs_int8_kernels
def test_qoperator_resnet_runs_on_kilns_int8_kernels_and_matches_onnxruntime(qoperator_resnet):
    path, fp32 = qoperator_resnet
    nodes = onnx.load(path).graph.node
    ops = Counter(n.op_type for n in nodes)
    assert (ops["QLinearConv"], ops["QLinearAdd"], ops["QGemm"]) == (20, 8, 1)
    engine = kiln.build(path, int8=True, tactic_sources=INT8_KERNELS)
    convs = [l for l in engine.plan.layers if l.op_type == "QConv"]
    assert len(convs) == 20 and all(l.precision == "INT8" and l.tactic_name.startswith(("kiln.qconv2d_",
                                                                                          "onednn.qconv2d_"))
                                    for l in convs)
    # each layer is named after its QLinearConv; the 8 QLinearAdd nodes fuse into the conv before them
    qlinear = {n.name for n in nodes if n.op_type == "QLinearConv"}
    adds = {n.name for n in nodes if n.op_type == "QLinearAdd"}
    assert {l.name.split(" + ")[0] for l in convs} == qlinear
    assert {l.name.split(" + ")[1] for l in convs if " + " in l.name} == adds
    fc = next(l for l in engine.plan.layers if l.op_type == "QGemm")
    assert fc.precision == "INT8" and fc.tactic_name.startswith(("kiln.qmatmul_", "onednn.q"))
    assert not any(l.tactic_name == "torch.reference" and l.op_type.startswith("QLinear") for l in engine.plan.layers)
    x = np.random.default_rng(7).standard_normal((1, 3, 64, 64)).astype(np.float32)
    got = engine.run({"input": x})[engine.output_names[0]]
    assert cosine(got, run_ort(path, {"input": x})[0]) > 0.999      # onnxruntime running the QOperator model
    assert cosine(got, run_ort(fp32, {"input": x})[0]) > 0.999      # and the FP32 network it came from


def test_each_layers_metadata_names_the_qoperator_nodes_it_runs_and_no_neighbour(qoperator_resnet):
    """A ResNet block's conv1 and downsample read one INT8 tensor through DequantizeLinear nodes the unfolding made
    and HorizontalMergeQNodes merged; the downsample layer's Metadata (and the conv2 + residual-add layer's) named
    conv1 too. Every such layer now names exactly the QOperator nodes in its name, and each of them once."""
    path, _ = qoperator_resnet
    engine = kiln.build(path, int8=True, tactic_sources=KILN_ONLY, autotune=False)
    named = []
    for layer in engine.layer_info()["Layers"]:
        metadata = re.findall(r"\[ONNX Layer: (.*?)\]", layer.get("Metadata", ""))
        if layer["LayerType"] in ("Convolution", "MatrixMultiply"):
            assert sorted(metadata) == sorted(layer["Name"].split(" + ")), layer["Name"]
            named += metadata
    weighted = [n.name for n in onnx.load(path).graph.node if n.op_type in ("QLinearConv", "QLinearAdd", "QGemm")]
    assert sorted(named) == sorted(weighted)   # each convolution, residual add and the classifier: once


def test_without_unfolding_the_qoperator_nodes_run_as_they_are_and_layer_info_describes_them(qoperator_resnet):
    path, _ = qoperator_resnet
    engine = kiln.build(path, int8=True, tactic_sources=KILN_ONLY, disable_pass="QOperatorUnfolding",
                        autotune=False)
    layers = {l["Name"]: l for l in engine.layer_info("detailed")["Layers"]}
    pool = next(l for l in layers.values() if "GlobalAveragePool" in l["Name"])
    assert pool["LayerType"] == "Pooling" and pool["WindowSize"] == [2, 2] and pool["PoolingType"] == "AVERAGE"
    assert sum(l.get("TacticName") == "torch.reference" for l in layers.values()) >= 29   # dequantize, FP32, quantize


def test_a_qoperator_encoder_with_qlinear_softmax_builds_and_matches_onnxruntime(tmp_path):
    """quantize_static in QOperator format on a BERT-shaped encoder writes com.microsoft QLinearSoftmax (kiln once
    refused the whole model for it), QLinearMatMul, QLinearAdd and QLinearMul: all unfold into Q/DQ."""
    import warnings

    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    from tests.models import encoders

    model = encoders.make("bert")
    feeds = encoders.inputs(model, 1, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoders.export(model, feeds, tmp_path / "fp32.onnx", "legacy")

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([dict(feeds)])

        def get_next(self):
            return next(self.batches, None)
    quantize_static(str(tmp_path / "fp32.onnx"), str(tmp_path / "qop.onnx"), Reader(),
                    quant_format=QuantFormat.QOperator, per_channel=True)
    ops = Counter(n.op_type for n in onnx.load(tmp_path / "qop.onnx").graph.node)
    assert ops["QLinearSoftmax"] and ops["QLinearMatMul"] and ops["QLinearAdd"]
    engine = kiln.build(str(tmp_path / "qop.onnx"), int8=True, tactic_sources=KILN_ONLY, autotune=False)
    assert not [l for l in engine.plan.layers if l.op_type.startswith("QLinear")]   # every one unfolded
    got, want = engine.run(feeds), run_ort(str(tmp_path / "qop.onnx"), feeds)
    for name, ref in zip(engine.output_names, want):
        assert cosine(got[name], ref) > 0.9999


def single_node(op: str, attrs: dict, shape: list[int], y_scale: float, y_zero: int) -> onnx.ModelProto:
    from onnx import TensorProto, helper

    inits = [helper.make_tensor("xs", TensorProto.FLOAT, [], [0.05]),
             helper.make_tensor("xz", TensorProto.UINT8, [], [128]),
             helper.make_tensor("ys", TensorProto.FLOAT, [], [y_scale]),
             helper.make_tensor("yz", TensorProto.UINT8, [], [y_zero])]
    node = helper.make_node(op, ["x", "xs", "xz", "ys", "yz"], ["y"], domain="com.microsoft", name="q", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.UINT8, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize("op, attrs, shape, y_scale, y_zero", [
    ("QLinearAveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, [1, 4, 9, 9], 0.05,
     128),
    ("QLinearAveragePool", {"kernel_shape": [2, 2], "strides": [2, 2], "channels_last": 1}, [1, 8, 8, 4], 0.05, 128),
    ("QLinearSoftmax", {"axis": -1, "opset": 13}, [2, 3, 5], 1 / 256, 0),
    ("QLinearSoftmax", {"axis": 1, "opset": 11}, [2, 3, 5], 1 / 256, 0),   # the old form: axes 1 and 2 together
], ids=["avgpool", "avgpool_nhwc", "softmax", "softmax_opset11"])
@pytest.mark.parametrize("unfold", [True, False], ids=["unfolded", "as_is"])
def test_qlinear_pooling_and_softmax_match_onnxruntime(op, attrs, shape, y_scale, y_zero, unfold):
    model = single_node(op, attrs, shape, y_scale, y_zero)
    x = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    engine = kiln.build(model, autotune=False, **({} if unfold else {"disable_pass": "QOperatorUnfolding"}))
    got, want = engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]
    assert got.shape == want.shape and np.abs(got.astype(int) - want.astype(int)).max() <= 1   # one rounding step
