"""PRelu, LayerNormalization, InstanceNormalization, GroupNormalization, ConvTranspose and Resize vs onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from tests.conftest import assert_close_to_ort, make_model, run_ort

RNG = np.random.default_rng(7)


def check(node, x_shape, inits=(), opset=17, extra_inputs=()):
    x = RNG.standard_normal(x_shape).astype(np.float32)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))]
    model = make_model([node], inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                       [numpy_helper.from_array(a, n) for n, a in inits], opset=opset)
    got = kiln.build(model).run({"x": x})["y"]
    assert_close_to_ort(got, run_ort(model, {"x": x})[0])


def test_prelu_per_channel():
    slope = RNG.uniform(0, 0.5, (4, 1, 1)).astype(np.float32)
    check(helper.make_node("PRelu", ["x", "s"], ["y"]), (2, 4, 5, 5), [("s", slope)])


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_normalization(axis):
    shape = (2, 3, 4, 5)
    norm = shape[axis:] if axis >= 0 else shape[axis:]
    inits = [("g", RNG.standard_normal(norm).astype(np.float32)), ("b", RNG.standard_normal(norm).astype(np.float32))]
    check(helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=axis, epsilon=1e-5), shape, inits)


def test_instance_normalization():
    inits = [("g", RNG.standard_normal(4).astype(np.float32)), ("b", RNG.standard_normal(4).astype(np.float32))]
    check(helper.make_node("InstanceNormalization", ["x", "g", "b"], ["y"], epsilon=1e-5), (2, 4, 6, 6), inits)


def test_group_normalization_opset21():
    inits = [("g", RNG.standard_normal(8).astype(np.float32)), ("b", RNG.standard_normal(8).astype(np.float32))]
    check(helper.make_node("GroupNormalization", ["x", "g", "b"], ["y"], num_groups=2, epsilon=1e-5),
          (2, 8, 5, 5), inits, opset=21)


@pytest.mark.parametrize("attrs, w_shape", [
    ({"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, (4, 3, 3, 3)),
    ({"strides": [2, 2]}, (4, 6, 2, 2)),
    ({"strides": [1, 1], "pads": [0, 1, 1, 0]}, (4, 3, 3, 3)),
    ({"strides": [2, 2], "group": 2}, (4, 2, 3, 3)),
    ({"strides": [2, 2], "output_shape": [10, 10]}, (4, 3, 3, 3)),
    ({"strides": [2, 2], "auto_pad": "SAME_UPPER"}, (4, 3, 3, 3)),
])
def test_conv_transpose(attrs, w_shape):
    inits = [("w", RNG.standard_normal(w_shape).astype(np.float32)),
             ("b", RNG.standard_normal(w_shape[1] * attrs.get("group", 1)).astype(np.float32))]
    check(helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs), (1, 4, 5, 5), inits)


@pytest.mark.parametrize("attrs, scales, sizes", [
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, [1, 1, 2, 2], None),
    ({"mode": "nearest"}, None, [1, 3, 7, 9]),
    ({"mode": "nearest", "coordinate_transformation_mode": "half_pixel", "nearest_mode": "round_prefer_ceil"},
     [1, 1, 1.5, 2.5], None),
    ({"mode": "linear"}, [1, 1, 2, 2], None),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, None, [1, 3, 9, 11]),
    ({"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}, [1, 1, 0.5, 0.5], None),
    ({"mode": "linear", "coordinate_transformation_mode": "asymmetric"}, [1, 1, 3, 3], None),
])
def test_resize(attrs, scales, sizes):
    inits = [("roi", np.array([], np.float32))]
    names = ["x", "roi"]
    if scales is not None:
        inits.append(("scales", np.array(scales, np.float32)))
        names.append("scales")
    else:
        inits += [("scales", np.array([], np.float32)), ("sizes", np.array(sizes, np.int64))]
        names += ["scales", "sizes"]
    check(helper.make_node("Resize", names, ["y"], **attrs), (1, 3, 4, 6), inits, opset=13)


def run_both(model, feeds):
    engine = kiln.build(model, autotune=False)
    got = engine.run(feeds)
    for out, want in zip(model.graph.output, run_ort(model, feeds)):
        assert_close_to_ort(got[out.name], want)


@pytest.mark.parametrize("equation, shapes", [
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("bhqd,bhkd->bhqk", [(1, 2, 5, 4), (1, 2, 6, 4)]),
    ("ij->ji", [(3, 4)]),
    ("i,i->", [(5,), (5,)]),
])
def test_einsum(equation, shapes):
    names = [f"x{i}" for i in range(len(shapes))]
    model = make_model([helper.make_node("Einsum", names, ["y"], equation=equation)],
                       [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in zip(names, shapes)],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], opset=13)
    run_both(model, {n: RNG.standard_normal(s).astype(np.float32) for n, s in zip(names, shapes)})


@pytest.mark.parametrize("axis, largest", [(-1, 1), (1, 0)])
def test_topk(axis, largest):
    k = numpy_helper.from_array(np.array([3], np.int64), "k")
    model = make_model([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest)],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 7])],
                       [helper.make_tensor_value_info("v", TensorProto.FLOAT, None),
                        helper.make_tensor_value_info("i", TensorProto.INT64, None)], [k], opset=13)
    x = RNG.permutation(84).reshape(2, 6, 7).astype(np.float32)   # distinct values: indices are unambiguous
    run_both(model, {"x": x})


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("keepdims, last", [(1, 0), (0, 1)])
def test_arg_reduce(op, keepdims, last):
    model = make_model([helper.make_node(op, ["x"], ["y"], axis=1, keepdims=keepdims, select_last_index=last)],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5, 4])],
                       [helper.make_tensor_value_info("y", TensorProto.INT64, None)], opset=13)
    x = RNG.integers(0, 3, (3, 5, 4)).astype(np.float32)          # ties: select_last_index matters
    run_both(model, {"x": x})
