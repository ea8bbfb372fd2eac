"""What an OpenVINO region reports each inner layer ran in: OpenVINO's execution graph names its ops after the
emitted ONNX nodes ("<layer>|<k>", with suffixes and names of its own), and a layer's precision is its compute
ops'. Checked on OpenVINO itself for a quantize_static model's fully connected layer, whose node names carry
OpenVINO's suffixes."""
from __future__ import annotations

import re

import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from tests.conftest import init, make_model, rand


def test_openvino_layer_names_with_commas_map_back_to_their_layers():
    from kiln.tactics.openvino_source import _emitted_layers

    known = frozenset({"PWN(/Add, /Relu_1)", "conv + bn", "/Relu_1)"})
    assert _emitted_layers("PWN(/Add, /Relu_1)|0,PWN(/Add, /Relu_1)|1,conv + bn|12", known) == [
        "PWN(/Add, /Relu_1)", "PWN(/Add, /Relu_1)", "conv + bn"]


def test_openvino_suffixes_and_names_of_its_own_map_back_to_the_layers():
    """OpenVINO appends to a node's name ("<layer>|<k>/WithoutBiases/DequantizationMultiply") and puts names of its
    own between them ("Multiply_14796"); ONNX names hold "/" too. Names no layer has are left out."""
    from kiln.tactics.openvino_source import _emitted_layers

    fc = "node_MatMul_1/MatMulAddFusion + gemm_QuantizeLinear"
    conv = "node_conv2d + conv2d_QuantizeLinear"
    known = frozenset({fc, conv})
    assert _emitted_layers(f"{fc}|47/WithoutBiases/DequantizationMultiply,{fc}|49", known) == [fc, fc]
    assert _emitted_layers(f"{conv}|11/WithoutBiases,Multiply_14796,{conv}|11,{conv}|14", known) == [conv] * 3
    assert _emitted_layers("linear_2 + q|103/WithoutBiases,linear_2", known) == []


class _Info:
    def __init__(self, value):
        self.value = value

    def astype(self, _type):
        return self.value


class _Op:
    def __init__(self, layer_type, precision, names):
        self.info = {"layerType": _Info(layer_type), "runtimePrecision": _Info(precision),
                     "originalLayersNames": _Info(names)}

    def get_rt_info(self):
        return self.info


def test_an_openvino_layer_reads_its_compute_ops_precision():
    """A convolution OpenVINO ran in f32 (u8 weights, which its CPU plugin does not run in INT8) with the residual
    add fused into it in u8 is FP32: the compute op decides. A layer without one (a pooling) reads all of its ops;
    reorders and names of other regions do not count."""
    from kiln.tactics.openvino_source import runtime_precisions

    ops = [_Op("Convolution", "f32", "conv + add|0,conv + add|1"), _Op("Eltwise", "u8", "conv + add|2"),
           _Op("Reorder", "u8", "conv + add|0"), _Op("Pooling", "u8", "pool|3"), _Op("FullyConnected", "i8",
           "fc + q|4/WithoutBiases/DequantizationMultiply,Multiply_7,fc + q|5"), _Op("Eltwise", "f32", "other|6")]
    compiled = type("Compiled", (), {"get_runtime_model": lambda self: type(
        "Model", (), {"get_ordered_ops": lambda self: ops})()})()
    assert runtime_precisions(compiled, frozenset({"conv + add", "pool", "fc + q"})) == {
        "conv + add": frozenset({"FP32"}), "pool": frozenset({"INT8"}), "fc + q": frozenset({"INT8"})}


def conv_then_fc() -> onnx.ModelProto:
    """x [1, 4, 6, 6] -> 3x3 conv + ReLU -> Flatten -> Gemm (a fully connected layer) -> y [1, 10]."""
    h = helper.make_node
    nodes = [h("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]), h("Relu", ["c"], ["r"], name="relu"),
             h("Flatten", ["r"], ["f"], name="flatten"), h("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1)]
    inits = [init("w", rand((8, 4, 3, 3), 1) * 0.3), init("b", rand((8,), 2)),
             init("fw", rand((10, 288), 3) * 0.1), init("fb", rand((10,), 4))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)


def test_an_openvino_region_grants_what_its_execution_graph_ran(monkeypatch, tmp_path, caplog):
    """OpenVINO names a quantized fully connected layer's ops "<node>/WithoutBiases/DequantizationMultiply": the
    Gemm is granted what OpenVINO ran it in (read here from the quantized model compiled by OpenVINO directly), not
    a default FP32, and a layer granted less than it asked for is logged."""
    ov = pytest.importorskip("openvino")
    from onnxruntime.quantization import QuantFormat, quantize_static

    from tests.conftest import force_plan
    from tests.precision.test_qdq import calibration_reader

    fp32, path = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(conv_then_fc(), fp32)
    quantize_static(str(fp32), str(path), calibration_reader("x", (1, 4, 6, 6), 3), quant_format=QuantFormat.QDQ,
                    per_channel=True)
    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    ran = {str(info["layerType"].astype(str)): str(info["runtimePrecision"].astype(str))
           for info in (op.get_rt_info() for op in compiled.get_runtime_model().get_ordered_ops())
           if "layerType" in info}
    force_plan(monkeypatch, "openvino")
    caplog.set_level("INFO", logger="kiln")
    engine = kiln.build(path, int8=True, tactic_sources="-onnxruntime")
    granted = {l["Name"].split(" + ")[0]: l["GrantedPrecision"] for l in engine.layer_info()["Layers"]
               if l["LayerType"] in ("OpenVINOConvolution", "OpenVINOFullyConnected", "OpenVINOMatrixMultiply")}
    want = {"i8": "INT8", "u8": "INT8", "f32": "FP32"}
    assert granted.keys() == {"conv", "fc"}, granted
    product = ran.get("FullyConnected") or ran["MatMul"]   # (OpenVINO's CPU plugin names a Gemm FullyConnected)
    assert granted == {"conv": want[ran["Convolution"]], "fc": want[product]}, (granted, ran)
    denied = [r.getMessage() for r in caplog.records if "the OpenVINO region ran it in" in r.getMessage()]
    assert len(denied) == sum(g != "INT8" for g in granted.values()), denied


def test_an_openvino_bf16_region_that_misses_the_budget_is_left_out_saying_so(monkeypatch, caplog):
    """Under --bf16 an OpenVINO region runs bf16 and joins the plan race only if it meets the accuracy budget; one
    that misses it is left out with its score (here its outputs are perturbed by 5%)."""
    pytest.importorskip("openvino")
    import torch

    from kiln.tactics import openvino_source
    from kiln.tactics.onednn_conv import bf16_available
    from tests.precision.models import conv_net

    if not bf16_available():
        pytest.skip("this CPU has no native BF16 arithmetic: no BF16 layer, so no bf16 region races")
    real = openvino_source.region_kernel

    def perturbed(*args, **kwargs):
        kernel = real(*args, **kwargs)

        def run(xs):
            return [y + 0.05 * y.abs().mean() * torch.randn(y.shape, generator=torch.Generator().manual_seed(0))
                    for y in kernel(xs)]
        run.runtime_precisions = kernel.runtime_precisions
        return run
    monkeypatch.setattr(openvino_source, "region_kernel", perturbed)
    caplog.set_level("WARNING", logger="kiln.build")
    engine = kiln.build(conv_net(), bf16=True, tactic_sources="-onnxruntime", avg_timing=1, min_timing=1)
    assert re.search(r"The openvino plan misses the accuracy budget cos:0\.999 \(checked as cos:0\.9992\) on the "
                     r"timing input \(cos 0\.9\d+ against the original model in onnxruntime\); leaving it out",
                     caplog.text), caplog.text
    assert not any(l.tactic_name == openvino_source.OPENVINO_REGION_TACTIC for l in engine.plan.layers)
