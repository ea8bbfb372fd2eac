"""kiln.backend itself: devices, lazily built engines per input shapes, build-time inputs frozen per value."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.backend import KilnBackend, prepare, run_model
from tests.conftest import make_model

F32 = TensorProto.FLOAT


def test_devices():
    assert KilnBackend.supports_device("CPU")
    assert not any(KilnBackend.supports_device(d) for d in ("CUDA", "CUDA:1", "TPU"))
    with pytest.raises(kiln.Error, match="CPU only"):
        prepare(make_model([helper.make_node("Relu", ["x"], ["y"])],
                           [helper.make_tensor_value_info("x", F32, [2])],
                           [helper.make_tensor_value_info("y", F32, [2])]), "CUDA")


def test_dynamic_dims_build_one_engine_per_shape():
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Cast", ["y"], ["z"], to=TensorProto.INT64)]
    model = make_model(nodes,
                       [helper.make_tensor_value_info("x", F32, ["N", 3])],
                       [helper.make_tensor_value_info("z", TensorProto.INT64, ["N", 3]),
                        helper.make_tensor_value_info("y", F32, ["N", 3])])
    rep = prepare(model)
    assert not rep.engines   # nothing to build before the first run
    for n in (2, 5, 2):
        x = np.linspace(-3, 3, n * 3, dtype=np.float32).reshape(n, 3)
        z, y = rep.run([x])
        np.testing.assert_array_equal(y, np.maximum(x, 0))
        assert z.dtype == np.int64 and z.shape == (n, 3)
    assert len(rep.engines) == 2


def test_build_time_inputs_are_frozen_per_value():
    model = make_model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
                       [helper.make_tensor_value_info("x", F32, [2, 3]),
                        helper.make_tensor_value_info("shape", TensorProto.INT64, [None])],
                       [helper.make_tensor_value_info("y", F32, None)])
    rep = prepare(model)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for shape in ([3, 2], [6], [3, 2]):
        out = rep.run({"x": x, "shape": np.array(shape, dtype=np.int64)})
        np.testing.assert_array_equal(out["y"], x.reshape(shape))
    assert len(rep.engines) == 2


def test_static_model_builds_at_prepare():
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", F32, [2])],
                       [helper.make_tensor_value_info("y", F32, [2])])
    assert len(prepare(model).engines) == 1
    np.testing.assert_array_equal(run_model(model, [np.array([-1, 2], np.float32)])[0], [0, 2])
    bad = make_model([helper.make_node("NonZero", ["x"], ["y"])], [helper.make_tensor_value_info("x", F32, [2])],
                     [helper.make_tensor_value_info("y", TensorProto.INT64, [1, None])])
    with pytest.raises(kiln.UnsupportedOpError):
        prepare(bad)
