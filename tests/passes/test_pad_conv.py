"""PaddingConvFusion end to end: a Keras-style stem (ZeroPadding2D(3), a valid 7x7/2 convolution + ReLU,
ZeroPadding2D(1), MaxPool) and a tf2onnx-style SAME convolution (an asymmetric Pad before a stride-2 convolution)
build into fewer layers, named for what they fused, and equal onnxruntime; a reflection Pad and a Pad before a
MaxPool stay layers of their own."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

import kiln
from tests.conftest import assert_close_to_ort, init, make_model, rand, run_ort


def keras_stem() -> bytes:
    nodes = [helper.make_node("Pad", ["x", "pads3"], ["p1"], name="conv1_pad"),
             helper.make_node("Conv", ["p1", "w1", "b1"], ["c1"], name="conv1_conv", strides=[2, 2],
                              kernel_shape=[7, 7]),
             helper.make_node("Relu", ["c1"], ["r1"], name="conv1_relu"),
             helper.make_node("Pad", ["r1", "pads1"], ["p2"], name="pool1_pad"),
             helper.make_node("MaxPool", ["p2"], ["m"], name="pool1_pool", kernel_shape=[3, 3], strides=[2, 2]),
             helper.make_node("Pad", ["m", "same", "zero"], ["p3"], name="conv2_pad"),   # TF's SAME for 3x3/2
             helper.make_node("Conv", ["p3", "w2", "b2"], ["c2"], name="conv2_conv", strides=[2, 2],
                              kernel_shape=[3, 3]),
             helper.make_node("Pad", ["c2", "pads1"], ["p4"], name="refl_pad", mode="reflect"),
             helper.make_node("Conv", ["p4", "w3"], ["y"], name="refl_conv", kernel_shape=[3, 3])]
    inits = [init("pads3", np.array([0, 0, 3, 3, 0, 0, 3, 3], np.int64)),
             init("pads1", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)),
             init("same", np.array([0, 0, 0, 0, 0, 0, 1, 1], np.int64)), init("zero", np.array(0.0, np.float32)),
             init("w1", rand((8, 3, 7, 7), seed=1) * 0.1), init("b1", rand((8,), seed=2) * 0.1),
             init("w2", rand((8, 8, 3, 3), seed=3) * 0.1), init("b2", rand((8,), seed=4) * 0.1),
             init("w3", rand((4, 8, 3, 3), seed=5) * 0.1)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=17)


def test_zero_pads_fold_into_their_convolutions_and_match_onnxruntime():
    model = keras_stem()
    engine = kiln.build(model, tactic_sources="-openvino,-onnxruntime")   # layers of its own, not one region
    names = [layer.name for layer in engine.plan.layers if not layer.name.startswith("Reformatting")]
    assert "conv1_pad + conv1_conv + conv1_relu" in names and "conv2_pad + conv2_conv" in names
    assert {"pool1_pad", "refl_pad", "refl_conv"} <= set(names)   # before MaxPool, and in reflect mode: not zeros
    x = rand((1, 3, 32, 32), seed=6)
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])


def test_the_build_log_names_the_fusions_and_the_misses(caplog):
    with caplog.at_level("DEBUG", logger="kiln.build"):
        kiln.build(keras_stem())
    lines = [r.getMessage() for r in caplog.records if "PaddingConvFusion" in r.getMessage()]
    assert "PaddingConvFusion: Fusing conv1_pad with conv1_conv" in lines
    assert "PaddingConvFusion: Fusing conv2_pad with conv2_conv" in lines
    assert "PaddingConvFusion: Not fusing refl_pad with refl_conv: refl_pad pads in mode 'reflect', not with a " \
           "constant" in lines
