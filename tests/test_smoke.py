"""End-to-end smoke: a tiny conv net builds, runs, matches onnxruntime and round-trips through a file."""
import numpy as np
import onnx
from onnx import helper, numpy_helper, TensorProto

import kiln
from tests.conftest import assert_close_to_ort, make_model, run_ort
from kiln.trt.vocab import parameter_type


def tiny_conv_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w, b])


def test_tiny_conv_relu_matches_ort_and_round_trips(tmp_engine):
    model = tiny_conv_model()
    engine = kiln.build(model, autotune=False)   # pin the plan: no timing-dependent choices
    assert [l.name for l in engine.plan.layers if parameter_type(l) == "Convolution"] == ["conv + relu"]
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    out = engine.run({"x": x})["y"]
    assert_close_to_ort(out, run_ort(model, {"x": x})[0])
    engine.save(tmp_engine)
    again = kiln.load(tmp_engine).run({"x": x})["y"]
    np.testing.assert_array_equal(again, out)
