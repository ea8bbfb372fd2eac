"""Inputs that once crashed or could crash native code are refused with a clean kiln.Error naming the layer or
node: a zero conv stride (found by `make fuzz`: SIGFPE inside oneDNN before the check existed), in an engine
and in an ONNX model; NaN inputs are reported by --check-nan at the first layer producing them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from tests.conftest import init, make_model

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "fuzz" / "engine_zero_stride.kiln"


def test_engine_with_zero_stride_is_refused_before_native_code_runs():
    engine = kiln.load(FIXTURE)   # checksum valid: only the conv's stride was mutated (strides [0, 1])
    with pytest.raises(kiln.EngineFormatError, match=r"strides must be integers >= 1, got \[0, 1\]"):
        engine.run(engine.random_inputs())


@pytest.mark.parametrize("attrs, message", [
    ({"strides": [0, 1]}, r"strides must be integers >= 1"),
    ({"dilations": [1, -2]}, r"dilations must be integers >= 1"),
    ({"pads": [1, 1, -1, 1]}, r"pads must be integers >= 0"),
    ({"group": 0}, r"group must be an integer >= 1"),
])
def test_onnx_conv_with_invalid_window_is_refused(attrs, message):
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="bad_conv", kernel_shape=[3, 3], **attrs)
    model = make_model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 8, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                       [init("w", np.ones((2, 2, 3, 3), np.float32))])
    with pytest.raises(kiln.ModelError, match=r"node 'bad_conv' \(Conv\): " + message):
        kiln.build(model, autotune=False)


def test_check_nan_names_the_first_layer_producing_nan(tmp_path):
    import subprocess
    import sys

    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Log", ["a"], ["b"], name="log"),          # log(0) = -inf
             helper.make_node("Mul", ["b", "zero"], ["y"], name="mul")]  # -inf * 0 = NaN
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                       [init("zero", np.zeros(4, np.float32))])
    engine = kiln.build(model, autotune=False, disabled_passes=frozenset({"PointWiseFusion"}))
    assert engine.first_nonfinite({"x": np.array([1, 2, -1, 3], np.float32)}) == ("log", "b", 0, 1)
    assert engine.first_nonfinite({"x": np.array([1, np.nan, 1, 1], np.float32)}) == ("(input)", "x", 1, 0)
    assert engine.first_nonfinite({"x": np.ones(4, np.float32)}) is None
    path = tmp_path / "m.kiln"
    engine.save(path)
    np.savez(tmp_path / "in.npz", x=np.array([1, 2, -1, 3], np.float32))
    done = subprocess.run([sys.executable, "-m", "kiln.cli.main", "run", str(path), "--inputs", str(tmp_path / "in.npz"),
                           "--check-nan"], capture_output=True, text=True)
    assert done.returncode == 1
    assert "first non-finite values: layer 'log' (output 'b') has 0 NaN and 1 Inf" in done.stdout + done.stderr


def test_onnx_with_non_utf8_names_is_refused():   # found by make fuzz: a traceback from str.join before
    path = Path(__file__).resolve().parents[1] / "fixtures" / "fuzz" / "model_non_utf8_name.onnx"
    with pytest.raises(kiln.ModelError, match="not valid UTF-8 text"):
        kiln.build(str(path), autotune=False)
