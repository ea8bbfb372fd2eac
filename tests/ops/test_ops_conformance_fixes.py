"""Regressions for op bugs the ONNX node conformance run found: the fixed semantics vs onnxruntime (or numpy)
on inputs larger than onnx's own examples."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from tests.conftest import assert_close_to_ort, make_model, run_ort

RNG = np.random.default_rng(11)
F32 = TensorProto.FLOAT


def build_and_compare(node, x, inits=(), outputs=("y",), opset=19):
    model = make_model([node], [helper.make_tensor_value_info("x", F32, list(x.shape))],
                       [helper.make_empty_tensor_value_info(n) for n in outputs],
                       [numpy_helper.from_array(np.asarray(a), n) for n, a in inits], opset=opset)
    got = kiln.build(model, autotune=False).run({"x": x})
    for name, expected in zip(outputs, run_ort(model, {"x": x})):
        assert got[name].dtype == expected.dtype
        assert_close_to_ort(got[name], expected)


@pytest.mark.parametrize("attrs", [
    dict(kernel_shape=[3, 3], dilations=[2, 2]),
    dict(kernel_shape=[3, 3], dilations=[2, 1], pads=[1, 2, 2, 1], count_include_pad=1),
    dict(kernel_shape=[2, 3], strides=[2, 2], pads=[0, 1, 1, 0], ceil_mode=1),
    dict(kernel_shape=[3, 3], strides=[3, 3], pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1),
])
def test_average_pool_dilations_and_uneven_pads(attrs):
    x = RNG.standard_normal((2, 3, 11, 12), np.float32)
    build_and_compare(helper.make_node("AveragePool", ["x"], ["y"], **attrs), x)


@pytest.mark.parametrize("axis, largest", [(-1, 1), (1, 0), (0, 1)])
def test_topk_ties_go_to_lower_indices(axis, largest):
    x = RNG.integers(0, 4, (6, 40, 5)).astype(np.float32)   # many ties, also across the k-th place
    model = make_model([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest)],
                       [helper.make_tensor_value_info("x", F32, list(x.shape))],
                       [helper.make_empty_tensor_value_info("v"), helper.make_empty_tensor_value_info("i")],
                       [numpy_helper.from_array(np.array([4], np.int64), "k")], opset=13)
    got = kiln.build(model, autotune=False).run({"x": x})
    order = np.argsort(-x if largest else x, axis=axis, kind="stable").take(range(4), axis=axis)
    np.testing.assert_array_equal(got["i"], order)
    np.testing.assert_array_equal(got["v"], np.take_along_axis(x, order, axis=axis))


CROP = dict(mode="linear", coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-1.0)


@pytest.mark.parametrize("attrs, scales, sizes", [
    (dict(mode="cubic"), [1, 1, 1.7, 0.6], None),
    (dict(mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1, coordinate_transformation_mode="align_corners"),
     [1, 1, 2, 2], None),
    (dict(mode="linear", antialias=1), [1, 1, 0.4, 0.7], None),
    (dict(mode="cubic", antialias=1), None, [2, 3, 5, 7]),
    (dict(mode="nearest", keep_aspect_ratio_policy="not_larger", axes=[2, 3]), None, [7, 20]),
    (dict(mode="linear", keep_aspect_ratio_policy="not_smaller", axes=[3, 2]), None, [5, 20]),
    (dict(mode="linear", coordinate_transformation_mode="align_corners"), [1, 1, 0.6, 0.7], None),
    (dict(mode="cubic", coordinate_transformation_mode="align_corners"), [1, 1, 0.6, 1.3], None),
    ({**CROP, "roi": [0, 0, 0.25, -0.1, 1, 1, 1.15, 0.9]}, [1, 1, 0.7, 1.3], None),
    ({**CROP, "axes": [3, 2], "roi": [0.1, 0.3, 0.8, 1.1]}, None, [6, 4]),
])
def test_resize_modes(attrs, scales, sizes):
    attrs = dict(attrs)
    roi = np.array(attrs.pop("roi", []), np.float32)
    inits = [("roi", roi), ("scales", np.array(scales or [], np.float32))]
    if sizes:
        inits.append(("sizes", np.array(sizes, np.int64)))
    names = ["x", "roi", "scales"] + (["sizes"] if sizes else [])
    build_and_compare(helper.make_node("Resize", names, ["y"], **attrs), RNG.standard_normal((2, 3, 9, 13), np.float32),
                      inits)


def test_layer_normalization_mean_and_inv_std_dev():
    g, b = RNG.standard_normal((5, 6), np.float32), RNG.standard_normal((5, 6), np.float32)
    node = helper.make_node("LayerNormalization", ["x", "g", "b"], ["y", "mean", "inv_std"], axis=-2, epsilon=1e-3)
    build_and_compare(node, RNG.standard_normal((2, 4, 5, 6), np.float32), [("g", g), ("b", b)],
                      outputs=("y", "mean", "inv_std"), opset=17)


@pytest.mark.parametrize("op, attrs, inputs", [
    ("BatchNormalization", dict(training_mode=1), ["x", "s", "s", "s", "s"]),
    ("Dropout", {}, ["x", "r", "t"]),
])
def test_training_mode_is_refused(op, attrs, inputs):
    inits = [numpy_helper.from_array(a, n) for n, a in
             (("s", np.ones(3, np.float32)), ("r", np.array(0.3, np.float32)), ("t", np.array(True)))]
    outs = ["y", "m", "v"] if op == "BatchNormalization" else ["y"]
    model = make_model([helper.make_node(op, inputs, outs, **attrs)],
                       [helper.make_tensor_value_info("x", F32, [2, 3, 4])],
                       [helper.make_empty_tensor_value_info(n) for n in outs], inits, opset=15)
    with pytest.raises(kiln.ModelError, match="training_mode"):
        kiln.build(model, autotune=False)
