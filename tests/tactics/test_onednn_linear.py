"""oneDNN inner product (source "torch-onednn"): Gemm and MatMul with constant weights match onnxruntime with
every bias form and fused activation, odd Gemms are declined, and a model forced onto it stays correct."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.tactics.base import LayerView
from kiln.tactics.onednn_linear import OneDnnLinearTactic
from tests.conftest import assert_close_to_ort, make_model, run_ort

RNG = np.random.default_rng(0)


def _gemm_model(trans_b: int, bias_shape, m: int = 3, k: int = 64, n: int = 40):
    b = RNG.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    inits = [numpy_helper.from_array(b, "B")]
    inputs = ["x", "B"]
    if bias_shape is not None:
        inits.append(numpy_helper.from_array(RNG.standard_normal(bias_shape).astype(np.float32), "C"))
        inputs.append("C")
    nodes = [helper.make_node("Gemm", inputs, ["g"], name="fc", transB=trans_b),
             helper.make_node("Relu", ["g"], ["y"], name="act")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], inits)


def _matmul_model(k: int = 48, n: int = 32):
    nodes = [helper.make_node("MatMul", ["x", "B"], ["m"], name="proj"),
             helper.make_node("Add", ["m", "bias"], ["a"], name="bias_add"),
             helper.make_node("Gelu", ["a"], ["y"], name="gelu")]
    inits = [numpy_helper.from_array(RNG.standard_normal((k, n)).astype(np.float32), "B"),
             numpy_helper.from_array(RNG.standard_normal(n).astype(np.float32), "bias")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 7, k])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 7, n])], inits, opset=20)
    return model


def _built_on_onednn(model):
    engine = kiln.build(model, tactic_sources={"torch-onednn"})   # alone: tiny layers time faster on torch
    names = {l.name: l.tactic_name for l in engine.plan.layers}
    return engine, names


@pytest.mark.parametrize("trans_b, bias_shape", [(1, (40,)), (0, (40,)), (1, (1, 40)), (0, None)])
def test_gemm_forms_match_onnxruntime(trans_b, bias_shape):
    model = _gemm_model(trans_b, bias_shape)
    engine, names = _built_on_onednn(model)
    assert list(names.values()) == ["onednn.linear_prepacked"], names   # bias and Relu fused into one layer
    x = RNG.standard_normal((3, 64)).astype(np.float32)
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])


def test_batched_matmul_with_fused_bias_and_gelu_matches_onnxruntime():
    model = _matmul_model()
    engine, names = _built_on_onednn(model)
    assert list(names.values()) == ["onednn.linear_prepacked"], names
    x = RNG.standard_normal((2, 7, 48)).astype(np.float32)
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])


def _view(op, attrs, shapes, consts):
    return LayerView(op, "", attrs, tuple(shapes), tuple("float32" if s else None for s in shapes), consts)


@pytest.mark.parametrize("op, attrs, shapes, consts, why", [
    ("Gemm", {"transA": 1}, [(8, 3), (8, 5)], {1: torch.ones(8, 5)}, "transA"),
    ("Gemm", {"alpha": 2.0}, [(3, 8), (8, 5)], {1: torch.ones(8, 5)}, "alpha"),
    ("Gemm", {}, [(3, 8), (8, 5), (3, 5)], {1: torch.ones(8, 5), 2: torch.ones(3, 5)}, "a full C matrix"),
    ("Gemm", {}, [(3, 8), (8, 5), (5,)], {1: torch.ones(8, 5)}, "a C computed at run time"),
    ("MatMul", {}, [(3, 8), (8, 5)], {}, "B computed at run time"),
    ("MatMul", {}, [(2, 3, 8), (2, 8, 5)], {1: torch.ones(2, 8, 5)}, "a batched B"),
])
def test_unsupported_layers_are_declined(op, attrs, shapes, consts, why):
    assert not OneDnnLinearTactic().supports(_view(op, attrs, shapes, consts)), why
