"""`same_extent` / `same_shape`: whether two axes have one size at every input shape, from the opt and probe
points the importer records, and what the importer records."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from kiln.frontend.onnx_import import import_onnx
from kiln.ir import Value, same_extent, same_shape
from tests.conftest import init, make_model


def value(shape, dyn_dims=(), probe=None) -> Value:
    return Value("v", tuple(shape), tuple(dyn_dims), probe_shape=None if probe is None else tuple(probe))


def test_axes_are_one_only_where_both_points_agree():
    batch, merged = value((2, 1, 8), (0, 1), (8, 3, 8)), value((2, 8), (0,), (24, 8))
    assert not same_extent(batch, 0, merged, 0)            # 2 and 2 at the opt point, 8 and 24 at the probe point
    assert same_extent(batch, 2, merged, 1)                # static, equal
    assert not same_extent(batch, 1, value((1,), probe=(1,)), 0)   # dynamic against static, though both 1 here
    static, dynamic = value((4,), probe=(4,)), value((4,), (0,), (4,))   # a probe that happens to agree
    assert not same_extent(static, 0, dynamic, 0) and not same_extent(dynamic, 0, static, 0)
    rows, cols = value((2, 3), (0, 1), (8, 5)), value((3, 2), (0, 1), (5, 8))   # axes at different indices
    assert same_extent(rows, 1, cols, 0) and same_extent(rows, 0, cols, 1) and not same_extent(rows, 0, cols, 0)
    assert same_extent(batch, 0, value((2, 4), (0,), (8, 4)), 0)
    assert not same_extent(batch, 0, value((2,), (0,)), 0)  # no probe size: equal opt sizes may be a coincidence
    assert same_shape(batch, value((2, 1, 8), (0, 1), (8, 3, 8)))
    assert not same_shape(batch, value((2, 1, 8), (0, 1), (8, 1, 8)))
    assert not same_shape(batch, value((2, 1), (0, 1), (8, 3)))


def test_the_importer_records_the_probe_shape_of_every_dynamic_value():
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["rows"], name="rows"),
             helper.make_node("Relu", ["rows"], ["y"], name="relu")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                       [init("flat", np.array([-1, 8], np.int64))])
    g = import_onnx(model, profiles=[{"x": ((1, 1, 8), (2, 1, 8), (8, 3, 8))}])
    x, rows = g.values["x"], g.values["rows"]
    assert (x.shape, x.dyn_dims, x.probe_shape) == ((2, 1, 8), (0, 1), (8, 3, 8))
    assert (rows.shape, rows.dyn_dims, rows.probe_shape) == ((2, 8), (0,), (24, 8))
    assert g.values["flat"].probe_shape is None
