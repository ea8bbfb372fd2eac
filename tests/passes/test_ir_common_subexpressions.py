"""CommonSubexpressionElimination as before/expected IR: equal computations merge (constants compared by value);
different attributes, inputs, random ops, Q/DQ and graph outputs stay apart. One model check against onnxruntime."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

import kiln
from kiln.passes.cleanup import merge_common_subexpressions
from tests.conftest import assert_close_to_ort, init, make_model, run_ort
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

NAME = "CommonSubexpressionElimination"


def test_per_layer_copies_of_a_mask_computation_become_one():
    """As an exporter writes each attention block: Where(mask, 0, -inf) with the block's own (equal) constants."""
    b = IRBuilder()
    mask = b.input("mask", (1, 1, 4, 4), np.bool_)
    s0, s1 = b.input("s0", (1, 2, 4, 4)), b.input("s1", (1, 2, 4, 4))
    w0 = b.node("Where", [mask, b.const("zero0", 0.0), b.const("ninf0", -np.inf)], "w0", (1, 1, 4, 4),
                dtype=np.float32)
    w1 = b.node("Where", [mask, b.const("zero1", 0.0), b.const("ninf1", -np.inf)], "w1", (1, 1, 4, 4),
                dtype=np.float32)
    a0 = b.node("Add", [s0, w0], "a0", (1, 2, 4, 4))
    a1 = b.node("Add", [s1, w1], "a1", (1, 2, 4, 4))
    g = b.graph(a0, a1)

    run = run_pass(g, NAME, merge_common_subexpressions)

    assert run.stat.matches == 1
    assert "CommonSubexpressionElimination: w1 computes what w0 does: merged into it" in run.lines
    assert str(g) == expected("""
        graph g(%mask: bool[1x1x4x4], %s0: float32[1x2x4x4], %s1: float32[1x2x4x4]):
          %w0: float32[1x1x4x4] = Where(%mask, const %zero0, const %ninf0)  # w0
          %a0: float32[1x2x4x4] = Add(%s0, %w0)  # a0
          %a1: float32[1x2x4x4] = Add(%s1, %w0)  # a1
          return %a0, %a1
        """)


def test_chains_merge_from_the_first_node_down():
    """Shape(x) -> Gather read twice (a dynamic model's per-layer shape arithmetic): both steps merge, in order."""
    b = IRBuilder()
    x = b.input("x", (2, 8), dyn_dims=(0,))
    shapes = [b.node("Shape", [x], f"shape{i}", (2,), dtype=np.int64) for i in range(2)]
    dims = [b.node("Gather", [s, b.const(f"at{i}", 0, np.int64)], f"dim{i}", (), axis=0) for i, s in enumerate(shapes)]
    outs = [b.node("Reshape", [x, b.node("Concat", [d, b.const(f"rest{i}", [-1], np.int64)], f"cat{i}", (2,),
                                         axis=0, dyn_dims=())], f"y{i}", (2, 8), dyn_dims=(0,))
            for i, d in enumerate(dims)]
    g = b.graph(*outs)

    run = run_pass(g, NAME, merge_common_subexpressions)

    assert run.stat.matches == 3   # Shape, Gather, Concat; the Reshapes are graph outputs: both kept
    assert str(g) == expected("""
        graph g(%x: float32[-1x8]):
          %shape0: int64[2] = Shape(%x)  # shape0
          %dim0: int64[scalar] = Gather(%shape0, const %at0) axis=0  # dim0
          %cat0: int64[2] = Concat(%dim0, const %rest0) axis=0  # cat0
          %y0: float32[-1x8] = Reshape(%x, %cat0)  # y0
          %y1: float32[-1x8] = Reshape(%x, %cat0)  # y1
          return %y0, %y1
        """)


def test_different_attributes_inputs_or_constant_values_stay_apart():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    y = b.input("y", (2, 3))
    outs = [b.node("Softmax", [x], "soft_last", (2, 3), axis=-1),
            b.node("Softmax", [x], "soft_first", (2, 3), axis=0),    # another attribute
            b.node("Relu", [x], "relu_x", (2, 3)),
            b.node("Relu", [y], "relu_y", (2, 3)),                    # another input
            b.node("Add", [x, b.const("one", 1.0)], "plus_one", (2, 3)),
            b.node("Add", [x, b.const("two", 2.0)], "plus_two", (2, 3)),   # another constant value
            b.node("Shrink", [x], "shrink_zero", (2, 3), bias=0.0),
            b.node("Shrink", [x], "shrink_minus_zero", (2, 3), bias=-0.0)]   # -0.0 is not 0.0
    g = b.graph(*(read(b, v) for v in outs))   # not graph outputs themselves: those are never merged
    run_pass_unchanged(g, NAME, merge_common_subexpressions)


def read(b: IRBuilder, v):
    """A reader of `v` (so `v` is no graph output); readers of different values never merge."""
    return b.node("Neg", [v], f"{v.name}_read", v.shape, dtype=v.dtype)


def test_random_ops_quantize_nodes_and_graph_outputs_are_not_merged():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    draws = [b.node("RandomNormalLike", [x], f"noise{i}", (2, 3)) for i in range(2)]
    qs = [b.node("QuantizeLinear", [x, b.const(f"s{i}", 0.1), b.const(f"z{i}", 0, np.uint8)], f"q{i}", (2, 3),
                 dtype=np.uint8) for i in range(2)]
    outs = [b.node("Exp", [x], f"exp{i}", (2, 3)) for i in range(2)]   # both graph outputs
    g = b.graph(*(read(b, v) for v in draws + qs), *outs)
    run_pass_unchanged(g, NAME, merge_common_subexpressions)


def test_a_model_with_repeated_mask_arithmetic_builds_fewer_layers_and_matches_onnxruntime():
    h = helper.make_node
    nodes, outs = [], []
    for i in range(3):
        nodes += [h("Constant", [], [f"zero{i}"], value=helper.make_tensor("z", TensorProto.FLOAT, [], [0.0])),
                  h("Constant", [], [f"big{i}"], value=helper.make_tensor("b", TensorProto.FLOAT, [], [-1e4])),
                  h("Where", ["keep", f"zero{i}", f"big{i}"], [f"bias{i}"], name=f"where{i}"),
                  h("Add", [f"s{i}", f"bias{i}"], [f"masked{i}"]), h("Softmax", [f"masked{i}"], [f"y{i}"], axis=-1)]
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [2, 4, 6]))
    inputs = [helper.make_tensor_value_info("keep", TensorProto.BOOL, [2, 1, 6])] + \
        [helper.make_tensor_value_info(f"s{i}", TensorProto.FLOAT, [2, 4, 6]) for i in range(3)]
    model = make_model(nodes, inputs, outs)
    rng = np.random.default_rng(0)
    feeds = {"keep": rng.random((2, 1, 6)) > 0.3, **{f"s{i}": rng.standard_normal((2, 4, 6)).astype(np.float32)
                                                    for i in range(3)}}
    merged = kiln.build(model, autotune=False, tactic_sources="-openvino,-onnxruntime")
    apart = kiln.build(model, autotune=False, tactic_sources="-openvino,-onnxruntime", disabled_passes=[NAME])
    wheres = [l.name for l in merged.plan.layers if "where" in l.name]
    assert len(wheres) == 1 and len([l for l in apart.plan.layers if "where" in l.name]) == 3
    for i, want in enumerate(run_ort(model, feeds)):
        assert_close_to_ort(merged.run(feeds)[f"y{i}"], want)
