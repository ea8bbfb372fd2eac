"""Graph shapes that trip planners: several outputs (one also used inside), an output that is an input,
an output folded to a constant, integer inputs. Default builds (timed plans, regions allowed) vs onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import kiln
from tests.conftest import assert_close_to_ort, make_model, run_ort

vi = helper.make_tensor_value_info
RNG = np.random.default_rng(0)


def two_outputs():
    w = numpy_helper.from_array(RNG.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"), helper.make_node("Sigmoid", ["r"], ["s"], name="sig")]
    return make_model(nodes, [vi("x", T.FLOAT, [1, 3, 8, 8])], [vi("r", T.FLOAT, None), vi("s", T.FLOAT, None)], [w])


def identity_output():
    nodes = [helper.make_node("Identity", ["x"], ["y"], name="id"), helper.make_node("Relu", ["x"], ["z"], name="relu")]
    return make_model(nodes, [vi("x", T.FLOAT, [2, 3])], [vi("y", T.FLOAT, None), vi("z", T.FLOAT, None)])


def constant_output():
    c = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "c")
    nodes = [helper.make_node("Identity", ["c"], ["k"], name="idc"), helper.make_node("Add", ["x", "c"], ["z"], name="add")]
    return make_model(nodes, [vi("x", T.FLOAT, [2, 3])], [vi("k", T.FLOAT, None), vi("z", T.FLOAT, None)], [c])


def integer_input():
    emb = numpy_helper.from_array(RNG.standard_normal((10, 4)).astype(np.float32), "emb")
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e"], name="gather"),
             helper.make_node("ReduceSum", ["e"], ["y"], keepdims=0, name="sum")]
    return make_model(nodes, [vi("ids", T.INT64, [1, 5])], [vi("y", T.FLOAT, None)], [emb], opset=13)


@pytest.mark.parametrize("factory", [two_outputs, identity_output, constant_output, integer_input])
def test_default_build_matches_onnxruntime(factory, tmp_path):
    model = factory()
    engine = kiln.build(model, avg_timing=1, min_timing=1)
    engine.save(tmp_path / "e.kiln")
    engine = kiln.load(tmp_path / "e.kiln")
    feeds = {t.name: RNG.integers(0, 10, t.dims).astype(t.dtype) if t.dtype == "int64"
             else RNG.standard_normal(t.dims).astype(t.dtype) for t in engine.plan.inputs}
    got = engine.run(feeds)
    assert list(got) == [o.name for o in model.graph.output]
    for out, want in zip(model.graph.output, run_ort(model, feeds)):
        assert_close_to_ort(got[out.name], want)
