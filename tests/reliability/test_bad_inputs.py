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
    engine = kiln.load(FIXTURE, allow_other_device=True)   # checksum valid: only the conv's stride was mutated (strides [0, 1])
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


def _conv_model(shape):
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    return make_model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                      [init("w", np.ones((2, 3, 3, 3), np.float32))])


def test_enormous_dimensions_are_refused_at_build_time():
    with pytest.raises(kiln.ModelError, match=r"node 'conv' \(Conv\) would produce 'y' of shape \[1, 2, 100000, "
                                              r"100000\]: 74\.5 GiB, more than kiln allows for one tensor"):
        kiln.build(_conv_model([1, 3, 100000, 100000]), autotune=False)


def test_zero_size_dimension_is_refused():
    with pytest.raises(kiln.ModelError, match=r"input 'x': given shape \[1, 3, 0, 8\] has a dimension < 1"):
        kiln.build(_conv_model([1, 3, "h", 8]), autotune=False, input_shapes={"x": (1, 3, 0, 8)})


def test_cycle_is_refused():
    nodes = [helper.make_node("Relu", ["b"], ["a"], name="first"), helper.make_node("Relu", ["a"], ["b"], name="second")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                       [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    with pytest.raises(kiln.ModelError, match="graph has a cycle or reads undefined values at nodes: first, second"):
        kiln.build(model, autotune=False)


def test_engine_from_another_device_is_refused_unless_allowed(tmp_path):
    import dataclasses

    from kiln.plan.serialize import save_plan

    engine = kiln.build(_conv_model([1, 3, 8, 8]), autotune=False)
    info = {**engine.plan.build_info, "device_description": {"cpu": "Some Other CPU 9000", "threads": 2}}
    path = tmp_path / "other.kiln"
    save_plan(dataclasses.replace(engine.plan, build_info=info), path)
    with pytest.raises(kiln.EngineFormatError, match=r"engine was built on 'Some Other CPU 9000'; this machine is "
                                                     r"'.*'\. Its kernels were chosen by timing there"):
        kiln.load(path)
    loaded = kiln.load(path, allow_other_device=True)
    x = np.ones((1, 3, 8, 8), np.float32)
    np.testing.assert_array_equal(loaded.run({"x": x})["y"], engine.run({"x": x})["y"])


def test_engine_needing_an_extension_this_cpu_lacks_is_refused_naming_it(tmp_path, monkeypatch):
    """Same CPU name (virtual machines often say just 'AMD EPYC'), fewer extensions: the ISA decides."""
    import dataclasses

    from kiln import hardware
    from kiln.plan.serialize import save_plan

    engine = kiln.build(_conv_model([1, 3, 8, 8]), autotune=False)
    described = engine.plan.build_info["device_description"]
    assert described["isa"] == sorted(hardware.cpu_isa())   # the build records the ISA it ran on
    info = {**engine.plan.build_info, "device_description": {**described, "isa": ["amx_bf16", "avx2", "avx512f"]}}
    path = tmp_path / "amx.kiln"
    save_plan(dataclasses.replace(engine.plan, build_info=info), path)
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2", "avx512f"}))
    with pytest.raises(kiln.EngineFormatError, match=r"engine was built on '.*' with amx_bf16, which this CPU lacks; "
                                                     r"this machine is '.*'\. Its kernels were chosen by timing"):
        kiln.load(path)
    assert kiln.load(path, allow_other_device=True).run({"x": np.ones((1, 3, 8, 8), np.float32)})["y"].shape


def test_disk_full_and_read_only_targets_are_clean_errors(tmp_path, monkeypatch):
    import errno
    import os

    engine = kiln.build(_conv_model([1, 3, 8, 8]), autotune=False)
    target = tmp_path / "e.kiln"
    target.write_bytes(b"previous")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(kiln.Error, match=r"cannot write .*e\.kiln: No space left on device"):
        engine.save(target)
    monkeypatch.undo()
    assert target.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == ["e.kiln"]

    def read_only(*args, **kwargs):
        raise PermissionError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr("tempfile.mkstemp", read_only)
    with pytest.raises(kiln.Error, match=r"cannot write .*e\.kiln: Read-only file system"):
        engine.save(target)
