"""ONNX import failures and dynamic shapes: bad models and bad run-time inputs give clear kiln errors."""
import logging
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.errors import InputError, ModelError, UnsupportedOpError
from tests.conftest import assert_close_to_ort, make_model, run_ort

F32 = TensorProto.FLOAT


def vi(name, shape, dtype=F32):
    return helper.make_tensor_value_info(name, dtype, shape)


def relu_model(shape=(1, 3, 8, 8)):
    return make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [vi("x", list(shape))], [vi("y", list(shape))])


def conv_model(batch="N"):
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    return make_model(nodes, [vi("x", [batch, 3, 8, 8])], [vi("y", [batch, 4, 8, 8])], [w])


# ---------------------------------------------------------------- unsupported operators
def test_unsupported_default_domain_op():
    nodes = [helper.make_node("NonMaxSuppression", ["boxes", "scores"], ["y"], name="nms")]
    model = make_model(nodes, [vi("boxes", [1, 4, 4]), vi("scores", [1, 1, 4])], [vi("y", [3, 3], TensorProto.INT64)],
                       opset=17)
    with pytest.raises(UnsupportedOpError) as info:
        kiln.build(model)
    msg = str(info.value)
    assert "'nms'" in msg and "'NonMaxSuppression'" in msg and "ai.onnx" in msg and "opset 17" in msg
    assert (info.value.node_name, info.value.op_type, info.value.domain, info.value.opset) == (
        "nms", "NonMaxSuppression", "", 17)
    assert isinstance(info.value, ModelError) and isinstance(info.value, kiln.Error)


def test_unsupported_custom_domain_op():
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="my_relu", domain="com.example")]
    graph = helper.make_graph(nodes, "g", [vi("x", [2])], [vi("y", [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 3)])
    model.ir_version = 8
    with pytest.raises(UnsupportedOpError) as info:
        kiln.build(model)
    msg = str(info.value)
    assert "'my_relu'" in msg and "'Relu'" in msg and "com.example" in msg and "opset 3" in msg


def test_unnamed_unsupported_node_gets_trt_style_name():
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Hardmax", ["r"], ["y"])]
    model = make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])])
    with pytest.raises(UnsupportedOpError, match=r"\(Unnamed Layer\* 1\) \[Hardmax\]"):
        kiln.build(model)


# ---------------------------------------------------------------- unreadable files
def test_uint16_is_read_only_as_qdq_data_and_moved():
    """16-bit Q/DQ models load (uint16 between QuantizeLinear, data movement and DequantizeLinear); any other reader of
    a uint16 tensor is refused at import, naming the node (torch has no CPU arithmetic on uint16)."""
    scale, zero = numpy_helper.from_array(np.float32(0.01), "s"), numpy_helper.from_array(np.uint16(300), "z")
    qdq = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q"),
           helper.make_node("Transpose", ["q"], ["t"], name="t", perm=[1, 0]),
           helper.make_node("DequantizeLinear", ["t", "s", "z"], ["y"], name="dq")]
    model = make_model(qdq, [vi("x", [2, 3])], [vi("y", [3, 2])], [scale, zero], opset=21)
    model.ir_version = 10
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(kiln.build(model).run({"x": x})["y"], run_ort(model, {"x": x})[0], atol=1e-6)
    summed = qdq[:2] + [helper.make_node("Add", ["t", "t"], ["y"], name="twice")]
    bad = make_model(summed, [vi("x", [2, 3])], [vi("y", [3, 2], TensorProto.UINT16)], [scale, zero], opset=21)
    with pytest.raises(ModelError, match=r"node 'twice' \(Add\) reads the uint16 tensor 't' as input 0: kiln reads "
                                         r"uint16 only as Q/DQ data"):
        kiln.build(bad)


def test_truncated_onnx_file(tmp_path):
    path = tmp_path / "truncated.onnx"
    data = conv_model(1).SerializeToString()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError) as info:
        kiln.build(str(path))
    assert "truncated.onnx" in str(info.value)


def test_random_bytes_file(tmp_path):
    path = tmp_path / "noise.onnx"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelError) as info:
        kiln.build(path)
    assert "noise.onnx" in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ModelError, match="no such ONNX file") as info:
        kiln.build(tmp_path / "absent.onnx")
    assert "absent.onnx" in str(info.value)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ModelError):
        kiln.build(tmp_path)


def test_valid_file_path_builds(tmp_path):
    path = tmp_path / "ok.onnx"
    onnx.save(relu_model(), str(path))
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(kiln.build(str(path)).run({"x": x})["y"], np.maximum(x, 0))


# ---------------------------------------------------------------- opsets
def test_opset_too_new():
    model = relu_model()
    model.opset_import[0].version = 26
    with pytest.raises(ModelError, match="opset 26 is newer"):
        kiln.build(model)


def test_opset_too_old():
    model = relu_model()
    model.opset_import[0].version = 5
    with pytest.raises(ModelError, match="opset 5 is too old"):
        kiln.build(model)


def test_old_opset_is_upgraded():
    model = relu_model()
    model.opset_import[0].version = 11
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8)).astype(np.float32)
    engine = kiln.build(model)
    np.testing.assert_array_equal(engine.run({"x": x})["y"], np.maximum(x, 0))


def test_no_default_domain_opset():
    model = relu_model()
    model.opset_import[0].domain = "com.example"
    with pytest.raises(ModelError, match="no default-domain"):
        kiln.build(model)


# ---------------------------------------------------------------- malformed graphs
def test_node_reads_undefined_value():
    nodes = [helper.make_node("Add", ["x", "ghost"], ["y"], name="add")]
    model = make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])])
    with pytest.raises(ModelError) as info:
        kiln.build(model)
    assert "ghost" in str(info.value) and "add" in str(info.value)


def test_two_nodes_write_same_output():
    nodes = [helper.make_node("Relu", ["x"], ["t"], name="first"), helper.make_node("Tanh", ["x"], ["t"], name="second"),
             helper.make_node("Sigmoid", ["t"], ["y"], name="sig")]
    model = make_model(nodes, [vi("x", [2, 3])], [vi("y", [2, 3])])
    with pytest.raises(ModelError, match="already defined") as info:
        kiln.build(model)
    assert "'second'" in str(info.value) and "'t'" in str(info.value)


def test_node_overwrites_graph_input():
    model = make_model([helper.make_node("Relu", ["x"], ["x"], name="self")], [vi("x", [2])], [vi("x", [2])])
    with pytest.raises(ModelError, match="already defined"):
        kiln.build(model)


def test_graph_output_not_produced():
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [vi("x", [2])], [vi("y", [2]), vi("z", [2])])
    with pytest.raises(ModelError, match="'z' is not produced"):
        kiln.build(model)


def test_unsupported_input_dtype():
    model = make_model([helper.make_node("Identity", ["x"], ["y"])], [vi("x", [2], TensorProto.STRING)],
                       [vi("y", [2], TensorProto.STRING)])
    with pytest.raises(ModelError, match="input 'x'.*STRING"):
        kiln.build(model)


# ---------------------------------------------------------------- external data
def _model_with_external_weight(tmp_path, location):
    model = make_model([helper.make_node("Add", ["x", "w"], ["y"], name="add")], [vi("x", [4])], [vi("y", [4])],
                       [numpy_helper.from_array(np.arange(4, dtype=np.float32), "w")])
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", "16")):
        entry = tensor.external_data.add()
        entry.key, entry.value = k, v
    path = tmp_path / "model" / "m.onnx"
    path.parent.mkdir()
    path.write_bytes(model.SerializeToString())
    return path


def test_external_data_escaping_folder_refused(tmp_path):
    (tmp_path / "secret.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    path = _model_with_external_weight(tmp_path, "../secret.bin")
    with pytest.raises(ModelError, match="escapes the model's folder") as info:
        kiln.build(path)
    assert "../secret.bin" in str(info.value) and "'w'" in str(info.value)


def test_external_data_absolute_path_refused(tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    with pytest.raises(ModelError, match="escapes"):
        kiln.build(_model_with_external_weight(tmp_path, str(secret)))


def test_external_data_missing_file(tmp_path):
    with pytest.raises(ModelError, match="missing"):
        kiln.build(_model_with_external_weight(tmp_path, "weights.bin"))


def test_external_data_inside_folder_loads(tmp_path):
    path = _model_with_external_weight(tmp_path, "weights.bin")
    (path.parent / "weights.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    x = np.ones(4, dtype=np.float32)
    np.testing.assert_array_equal(kiln.build(path).run({"x": x})["y"], x + np.arange(4, dtype=np.float32))


# ---------------------------------------------------------------- dynamic shapes
def test_dynamic_batch_defaults_to_one_with_warning(caplog):
    caplog.set_level(logging.WARNING, logger="kiln")
    engine = kiln.build(conv_model("N"))
    assert engine.input_shapes() == {"x": (1, 3, 8, 8)}
    assert "Dynamic dimensions required for input: x" in caplog.text
    assert "1x3x8x8" in caplog.text


def test_input_shapes_override_batch(caplog):
    caplog.set_level(logging.WARNING, logger="kiln")
    model = conv_model("N")
    engine = kiln.build(model, input_shapes={"x": (2, 3, 8, 8)})
    assert "Dynamic dimensions" not in caplog.text
    assert engine.input_shapes() == {"x": (2, 3, 8, 8)}
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])


def test_input_shapes_conflicting_with_static_dims():
    with pytest.raises(ModelError, match="does not match"):
        kiln.build(conv_model("N"), input_shapes={"x": (2, 3, 9, 8)})


def test_input_shapes_unknown_name():
    with pytest.raises(ModelError, match="unknown input"):
        kiln.build(conv_model(1), input_shapes={"nope": (1, 3, 8, 8)})


# ---------------------------------------------------------------- run-time input errors
@pytest.fixture(scope="module")
def engine():
    return kiln.build(conv_model(1))


def test_wrong_input_shape(engine):
    with pytest.raises(InputError, match="input 'x': shape \\[1, 3, 9, 9\\]"):
        engine.run({"x": np.zeros((1, 3, 9, 9), np.float32)})


def test_wrong_input_name(engine):
    with pytest.raises(InputError, match="unknown input name\\(s\\) \\['data'\\]"):
        engine.run({"data": np.zeros((1, 3, 8, 8), np.float32)})


def test_missing_input(engine):
    with pytest.raises(InputError, match="missing input\\(s\\) \\['x'\\]"):
        engine.run({})


@pytest.mark.parametrize("dtype", ["complex64", "<U1"])
def test_wrong_input_dtype(engine, dtype):
    with pytest.raises(InputError, match=f"input 'x': dtype {np.dtype(dtype)}"):
        engine.run({"x": np.zeros((1, 3, 8, 8), dtype)})


def test_integer_input_for_float_binding_rejected(engine):
    with pytest.raises(InputError, match="input 'x': dtype int64"):
        engine.run({"x": np.zeros((1, 3, 8, 8), np.int64)})


def test_float64_input_is_converted(engine):
    x = np.random.default_rng(0).standard_normal((1, 3, 8, 8))
    out = engine.run({"x": x})["y"]
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, engine.run({"x": x.astype(np.float32)})["y"])


def test_input_error_is_kiln_error(engine):
    assert issubclass(InputError, kiln.Error)
    with pytest.raises(kiln.Error):
        engine.run({"x": np.zeros((2, 3, 8, 8), np.float32)})


def test_no_temp_files_left_by_build(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(relu_model(), str(path))
    kiln.build(path)
    assert os.listdir(tmp_path) == ["m.onnx"]
