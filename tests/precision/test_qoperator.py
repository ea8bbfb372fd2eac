"""QOperator-format INT8 models (onnxruntime's quantize_static with QuantFormat.QOperator: QLinearConv, QLinearAdd,
QLinearGlobalAveragePool, QGemm) build onto kiln's own INT8 kernels, as their Q/DQ twins do, under the QOperator
nodes' names, and match onnxruntime's own execution of the model."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

import kiln
from tests.conftest import cosine, run_ort
from tests.precision.test_qdq import quantized_resnet18

KILN_ONLY = "-openvino,-onnxruntime"


@pytest.fixture(scope="module")
def qoperator_resnet(tmp_path_factory):
    return quantized_resnet18(tmp_path_factory.mktemp("qoperator"), "QOperator")


def test_qoperator_resnet_runs_on_kilns_int8_kernels_and_matches_onnxruntime(qoperator_resnet):
    path, fp32 = qoperator_resnet
    nodes = onnx.load(path).graph.node
    ops = Counter(n.op_type for n in nodes)
    assert (ops["QLinearConv"], ops["QLinearAdd"], ops["QGemm"]) == (20, 8, 1)
    engine = kiln.build(path, int8=True, tactic_sources=KILN_ONLY)
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


def test_without_unfolding_the_qoperator_nodes_run_as_they_are_and_layer_info_describes_them(qoperator_resnet):
    path, _ = qoperator_resnet
    engine = kiln.build(path, int8=True, tactic_sources=KILN_ONLY, disable_pass="QOperatorUnfolding",
                        autotune=False)
    layers = {l["Name"]: l for l in engine.layer_info("detailed")["Layers"]}
    pool = next(l for l in layers.values() if "GlobalAveragePool" in l["Name"])
    assert pool["LayerType"] == "Pooling" and pool["WindowSize"] == [2, 2] and pool["PoolingType"] == "AVERAGE"
    assert sum(l.get("TacticName") == "torch.reference" for l in layers.values()) >= 29   # dequantize, FP32, quantize
