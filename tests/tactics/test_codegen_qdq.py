"""Q/DQ inside generated pointwise kernels: QuantizeLinear and DequantizeLinear of one scale as program steps
(INT8 inputs and outputs stored as such), and kiln's INT8 sum (QAdd) as its program, against onnxruntime's
unfused Q/DQ ops; programs reading or writing INT8 in other ways are declined."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.tactics import codegen
from kiln.tactics.base import LayerView
from kiln.tactics.codegen import CodegenPointWiseTactic
from tests.conftest import assert_one_step_at_most, make_model, unfused_onnxruntime

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler that builds OpenMP shared libraries")

TACTIC = CodegenPointWiseTactic()
ONNX_TYPES = {np.int8: TensorProto.INT8, np.uint8: TensorProto.UINT8, np.float32: TensorProto.FLOAT}


def qparams(name, scale, zp, dtype):
    return [numpy_helper.from_array(np.float32(scale), f"{name}_s"), numpy_helper.from_array(dtype(zp), f"{name}_z")]


def gelu_chain_model():
    """BERT's GELU as onnxruntime's quantize_static leaves it: s8 in, Q/DQ between Div, Erf, Add, Mul, s8 out."""
    h = helper.make_node
    nodes = [h("DequantizeLinear", ["x", "x_s", "x_z"], ["xf"]),
             h("Div", ["xf", "sqrt2"], ["d"]), h("Erf", ["d"], ["e"]),
             h("QuantizeLinear", ["e", "e_s", "e_z"], ["eq"]), h("DequantizeLinear", ["eq", "e_s", "e_z"], ["ef"]),
             h("Add", ["ef", "one"], ["a"]), h("Mul", ["xf", "a"], ["m"]),
             h("QuantizeLinear", ["m", "m_s", "m_z"], ["mq"]), h("DequantizeLinear", ["mq", "m_s", "m_z"], ["mf"]),
             h("Mul", ["mf", "half"], ["g"]), h("QuantizeLinear", ["g", "y_s", "y_z"], ["y"])]
    inits = [*qparams("x", 0.05, -3, np.int8), *qparams("e", 1 / 127, 0, np.int8), *qparams("m", 0.1, 5, np.uint8),
             *qparams("y", 0.04, -100, np.int8)] + [numpy_helper.from_array(np.float32(v), n) for n, v in
                                                    (("sqrt2", 2 ** 0.5), ("one", 1.0), ("half", 0.5))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.INT8, [2, 64, 96])],
                      [helper.make_tensor_value_info("y", TensorProto.INT8, [2, 64, 96])], inits)


def test_a_quantized_gelu_chain_is_one_generated_kernel_reading_and_writing_int8():
    """The input's DequantizeLinear has two readers (Div and the Mul); once the chain from Div to the last
    QuantizeLinear is one PointWise, that is its only reader and it joins: one generated kernel, INT8 in and out."""
    model = gelu_chain_model()
    engine = kiln.build(model, tactic_sources="codegen,torch", autotune=False)   # kiln's own: a table lookup
    assert [(l.op_type, l.tactic_name) for l in engine.plan.layers] == [("PointWise", "codegen.pointwise_c_simd")]
    assert [t.dtype for t in engine.plan.layers[0].inputs] == ["int8"]
    x = {"x": np.random.default_rng(0).integers(-128, 128, (2, 64, 96)).astype(np.int8)}
    # the generated erf is a rational approximation a few ulps from onnxruntime's: a rare value a step apart
    assert_one_step_at_most(engine.run(x)["y"], unfused_onnxruntime(model, x))


@pytest.mark.parametrize("activation", [None, "Relu"])
def test_a_quantized_sum_runs_as_its_program_exactly(activation):
    """DQ(u8 a) + DQ(s8 b, broadcast) [-> Relu] -> Q: kiln's QAdd as one generated kernel, rounding each operation
    as onnxruntime's separate ops do."""
    h = helper.make_node
    nodes = [h("DequantizeLinear", ["a", "a_s", "a_z"], ["af"]), h("DequantizeLinear", ["b", "b_s", "b_z"], ["bf"]),
             h("Add", ["af", "bf"], ["s"])]
    nodes += [h("Relu", ["s"], ["r"])] if activation else []
    nodes.append(h("QuantizeLinear", ["r" if activation else "s", "y_s", "y_z"], ["y"]))
    inits = [*qparams("a", 0.03, 120, np.uint8), *qparams("b", 0.07, -5, np.int8), *qparams("y", 0.06, 10, np.uint8)]
    model = make_model(nodes, [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 16, 40]),
                               helper.make_tensor_value_info("b", TensorProto.INT8, [16, 1])],
                       [helper.make_tensor_value_info("y", TensorProto.UINT8, [2, 16, 40])], inits)
    engine = kiln.build(model, tactic_sources="codegen,torch", autotune=False)
    assert [(l.op_type, l.tactic_name) for l in engine.plan.layers] == [("QAdd", "codegen.pointwise_c_simd")]
    rng = np.random.default_rng(1)
    feeds = {"a": rng.integers(0, 256, (2, 16, 40)).astype(np.uint8),
             "b": rng.integers(-128, 128, (16, 1)).astype(np.int8)}
    got = engine.run(feeds)["y"]
    assert got.dtype == np.uint8 and len(np.unique(got)) > 50
    np.testing.assert_array_equal(got, unfused_onnxruntime(model, feeds))   # no FMA: each rounding as onnxruntime's


def qdq_view(program, input_dtypes, output_dtype, consts):
    shapes = tuple(() if i in consts else (4, 8) for i in range(len(input_dtypes)))
    return LayerView("PointWise", "kiln", {"program": program}, shapes, tuple(input_dtypes), consts, (output_dtype,),
                     17, ((),) * len(shapes))


def test_programs_reading_or_writing_int8_otherwise_are_declined():
    import torch

    s, z = torch.tensor(0.1), torch.tensor(3, dtype=torch.int8)
    dq = {"op": "DequantizeLinear", "attrs": {}, "args": ["x0", "x1", "x2"]}
    q = {"op": "QuantizeLinear", "attrs": {}, "args": ["t1", "x1", "x2"]}
    relu = {"op": "Relu", "attrs": {}, "args": ["t0"]}
    ok = qdq_view([dq, relu, q], ("int8", "float32", "int8"), "int8", {1: s, 2: z})
    assert TACTIC.supports(ok)
    cases = {
        "an INT8 input read by a float op": qdq_view([{**relu, "args": ["x0"]}], ("int8",), "float32", {}),
        "an INT8 output not quantized last": qdq_view([dq, relu], ("int8", "float32", "int8"), "int8", {1: s, 2: z}),
        "an output of the other INT8 type": qdq_view([dq, relu, q], ("int8", "float32", "int8"), "uint8",
                                                     {1: s, 2: z}),
        "per-channel scales": qdq_view([dq, relu, q], ("int8", "float32", "int8"), "int8",
                                       {1: torch.tensor([0.1, 0.2]), 2: z}),
        "a zero point read per call": qdq_view([dq, relu, q], ("int8", "float32", "int8"), "int8", {1: s}),
    }
    for name, view in cases.items():
        assert not TACTIC.supports(view), name
