"""`kiln export triton`: config.pbtxt parsed with Triton's own model-config proto (from tritonclient) matches the
engine; the generated model.py, imported with a stand-in of Triton's `triton_python_backend_utils`, answers
requests as Engine.run does (batched requests split back, a bad request failing alone); the CLI's refusals."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.cli.main import main
from tests.conftest import init, make_model, rand

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
from google.protobuf import json_format, text_format  # noqa: E402  (protobuf comes with tritonclient)

BATCH_PROFILE = {"x": ((1, 1, 4), (2, 4, 4), (8, 16, 4)), "m": ((1, 1), (2, 4), (8, 16))}


def batching_model():
    """x [N, T, 4] float32, m [N, T] int64 -> y = x @ W + m[..., None] [N, T, 3] and count = sum_T m [N]."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]),
             helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mf", "last"], ["mu"]),
             helper.make_node("Add", ["xw", "mu"], ["y"]),
             helper.make_node("ReduceSum", ["mf", "seq"], ["count"], keepdims=0)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", 4]),
                              helper.make_tensor_value_info("m", TensorProto.INT64, ["N", "T"])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T", 3]),
                       helper.make_tensor_value_info("count", TensorProto.FLOAT, ["N"])],
                      [init("W", rand((4, 3), 1)), init("last", np.array([-1], np.int64)),
                       init("seq", np.array([1], np.int64))])


def static_conv_model():
    nodes = [helper.make_node("Conv", ["image", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["features"])]
    return make_model(nodes, [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 8, 8])],
                      [helper.make_tensor_value_info("features", TensorProto.FLOAT, [1, 4, 8, 8])],
                      [init("w", rand((4, 3, 3, 3), 2)), init("b", rand((4,), 3))])


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """name -> (Engine, path of its saved .kiln)."""
    folder = tmp_path_factory.mktemp("triton_engines")
    built = {"batching": kiln.build(batching_model(), autotune=False, profiles=[BATCH_PROFILE]),
             "conv": kiln.build(static_conv_model(), autotune=False)}
    for name, engine in built.items():
        engine.save(folder / f"{name}.kiln")
    return {name: (engine, folder / f"{name}.kiln") for name, engine in built.items()}


def export(engine_path, repository, *options: str) -> int:
    return main(["export", "triton", str(engine_path), "-o", str(repository), *options])


def parse_config(model_dir):
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def tensors(entries):
    return [(t.name, model_config_pb2.DataType.Name(t.data_type), list(t.dims),
             list(t.reshape.shape) if t.HasField("reshape") else None) for t in entries]


def test_batching_engine_config_parses_with_tritons_proto(engines, tmp_path):
    _, path = engines["batching"]
    assert export(path, tmp_path / "repo", "--instances", "2", "--max-queue-delay-us", "250", "--threads", "3") == 0
    model_dir = tmp_path / "repo" / "batching"
    config = parse_config(model_dir)
    assert (config.name, config.backend, config.max_batch_size) == ("batching", "python", 8)   # the profile's max
    # batch axis left out of dims; the dynamic sequence axis is -1; count [N] becomes dims [1] seen as []
    assert tensors(config.input) == [("x", "TYPE_FP32", [-1, 4], None), ("m", "TYPE_INT64", [-1], None)]
    assert tensors(config.output) == [("y", "TYPE_FP32", [-1, 3], None), ("count", "TYPE_FP32", [1], [])]
    assert config.dynamic_batching.max_queue_delay_microseconds == 250
    assert [(g.kind, g.count) for g in config.instance_group] == [(model_config_pb2.ModelInstanceGroup.KIND_CPU, 2)]
    assert {k: v.string_value for k, v in config.parameters.items()} == {"intra_op_threads": "3"}
    assert sorted(p.name for p in (model_dir / "1").iterdir()) == ["model.kiln", "model.py"]
    assert (model_dir / "1" / "model.kiln").read_bytes() == path.read_bytes()
    assert sorted(p.name for p in (tmp_path / "repo").iterdir()) == ["batching"]   # no temp folder left


def test_static_engine_config_has_full_dims_and_no_batching(engines, tmp_path):
    _, path = engines["conv"]
    assert export(path, tmp_path, "--name", "conv:v2") == 0
    config = parse_config(tmp_path / "conv:v2")
    assert (config.name, config.max_batch_size, config.HasField("dynamic_batching")) == ("conv:v2", 0, False)
    assert tensors(config.input) == [("image", "TYPE_FP32", [1, 3, 8, 8], None)]
    assert tensors(config.output) == [("features", "TYPE_FP32", [1, 4, 8, 8], None)]
    assert [(g.kind, g.count) for g in config.instance_group] == [(model_config_pb2.ModelInstanceGroup.KIND_CPU, 1)]


def test_batching_turned_off_keeps_the_batch_axis_as_minus_one(engines, tmp_path):
    _, path = engines["batching"]
    assert export(path, tmp_path, "--max-batch-size", "0") == 0
    config = parse_config(tmp_path / "batching")
    assert (config.max_batch_size, config.HasField("dynamic_batching")) == (0, False)
    assert tensors(config.input) == [("x", "TYPE_FP32", [-1, -1, 4], None), ("m", "TYPE_INT64", [-1, -1], None)]
    assert tensors(config.output) == [("y", "TYPE_FP32", [-1, -1, 3], None), ("count", "TYPE_FP32", [-1], None)]


# --- model.py under a stand-in of triton_python_backend_utils ------------------------------------------------

def stand_in_pb_utils() -> types.ModuleType:
    """The part of Triton's Python-backend utilities a model uses, behaving as Triton's does."""
    pb = types.ModuleType("triton_python_backend_utils")

    class Tensor:
        def __init__(self, name, array):
            if not isinstance(array, np.ndarray):
                raise TypeError("pb_utils.Tensor takes a numpy array")
            self._name, self._array = name, array

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

    class TritonError(Exception):
        UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG = 0, 1, 2, 3

        def __init__(self, message, code=0):
            super().__init__(message)
            self._message, self._code = message, code

        def message(self):
            return self._message

        def code(self):
            return self._code

    class InferenceResponse:
        def __init__(self, output_tensors, error=None):
            self._outputs, self._error = list(output_tensors), error

        def output_tensors(self):
            return self._outputs

        def has_error(self):
            return self._error is not None

        def error(self):
            return self._error

    class InferenceRequest:
        def __init__(self, inputs):
            self._inputs = [Tensor(n, a) for n, a in inputs.items()]

        def inputs(self):
            return self._inputs

    def by_name(tensors, name):
        return next((t for t in tensors if t.name() == name), None)

    pb.Tensor, pb.TritonError, pb.InferenceResponse, pb.InferenceRequest = Tensor, TritonError, InferenceResponse, \
        InferenceRequest
    pb.get_input_tensor_by_name = lambda request, name: by_name(request.inputs(), name)
    pb.get_output_tensor_by_name = lambda response, name: by_name(response.output_tensors(), name)
    pb.get_output_config_by_name = lambda config, name: next((o for o in config["output"] if o["name"] == name), {})
    return pb


def load_model(model_dir, monkeypatch):
    """Import model.py as Triton's Python backend does and call initialize with the args Triton passes."""
    pb = stand_in_pb_utils()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    spec = importlib.util.spec_from_file_location(f"triton_model_{model_dir.name}", model_dir / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = json_format.MessageToDict(parse_config(model_dir), preserving_proto_field_name=True)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_instance_kind": "CPU",
                      "model_instance_name": f"{model_dir.name}_0_0", "model_instance_device_id": "0",
                      "model_repository": str(model_dir), "model_version": "1", "model_name": model_dir.name})
    return model, pb


class ExecuteSpy:
    """Wraps the model's execution context to record the batch size of each engine call."""

    def __init__(self, context):
        self.context, self.batches = context, []

    def execute(self, feeds):
        self.batches.append(next(iter(feeds.values())).shape[0])
        return self.context.execute(feeds)


def sequence_feeds(batch, seq, seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, seq, 4)).astype(np.float32),
            "m": rng.integers(0, 3, (batch, seq)).astype(np.int64)}


def outputs_of(response, pb):
    assert not response.has_error(), response.error().message()
    return {name: pb.get_output_tensor_by_name(response, name).as_numpy() for name in ("y", "count")}


def assert_outputs_equal(actual, expected):
    assert set(actual) == set(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype and actual[name].shape == expected[name].shape, name
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.fixture
def batching_model_dir(engines, tmp_path):
    _, path = engines["batching"]
    assert export(path, tmp_path) == 0
    return tmp_path / "batching"


def test_model_batches_requests_of_one_shape_and_splits_outputs_back(engines, batching_model_dir, monkeypatch):
    engine, _ = engines["batching"]
    model, pb = load_model(batching_model_dir, monkeypatch)
    model.context = spy = ExecuteSpy(model.context)
    feeds = [sequence_feeds(1, 5, 0), sequence_feeds(3, 5, 1), sequence_feeds(2, 7, 2), sequence_feeds(2, 5, 3)]
    responses = model.execute([pb.InferenceRequest(f) for f in feeds])
    assert len(responses) == 4
    for response, f in zip(responses, feeds):
        assert_outputs_equal(outputs_of(response, pb), engine.run(f))
    assert spy.batches == [6, 2]   # the three requests of length 5 ran as one batch, the length-7 one alone
    model.finalize()


def test_bad_requests_get_errors_and_the_others_their_outputs(engines, batching_model_dir, monkeypatch):
    engine, _ = engines["batching"]
    model, pb = load_model(batching_model_dir, monkeypatch)
    good = [sequence_feeds(2, 4, 10), sequence_feeds(1, 4, 11)]
    wrong_dtype = {**sequence_feeds(1, 4, 12), "m": np.ones((1, 4), np.int32)}
    missing = {"x": sequence_feeds(1, 4, 13)["x"]}
    too_long = sequence_feeds(1, 20, 14)           # the profile's sequence axis stops at 16
    ragged = {"x": sequence_feeds(2, 4, 15)["x"], "m": sequence_feeds(1, 4, 15)["m"]}
    requests = [good[0], wrong_dtype, missing, too_long, ragged, good[1]]
    responses = model.execute([pb.InferenceRequest(f) for f in requests])
    assert_outputs_equal(outputs_of(responses[0], pb), engine.run(good[0]))
    assert_outputs_equal(outputs_of(responses[5], pb), engine.run(good[1]))
    errors = [(r.error().message(), r.error().code(), r.output_tensors()) for r in responses[1:5]]
    assert errors == [
        ("input 'm': data type int32 given, the model takes int64", pb.TritonError.INVALID_ARG, []),
        ("the request has no input 'm'; the model's inputs are ['x', 'm']", pb.TritonError.INVALID_ARG, []),
        (errors[2][0], pb.TritonError.INVALID_ARG, []),
        ("inputs disagree on the batch size (first axis): {'x': 2, 'm': 1}", pb.TritonError.INVALID_ARG, []),
    ]
    assert "input 'x': shape [1, 20, 4] is outside the engine's optimization profile" in errors[2][0], errors[2][0]


def test_a_batch_the_engine_refuses_runs_request_by_request(engines, batching_model_dir, monkeypatch):
    engine, _ = engines["batching"]
    model, pb = load_model(batching_model_dir, monkeypatch)
    model.context = spy = ExecuteSpy(model.context)
    feeds = [sequence_feeds(6, 3, 20), sequence_feeds(5, 3, 21)]   # 11 together: over the profile's 8
    responses = model.execute([pb.InferenceRequest(f) for f in feeds])
    for response, f in zip(responses, feeds):
        assert_outputs_equal(outputs_of(response, pb), engine.run(f))
    assert spy.batches == [11, 6, 5]


def test_static_model_runs_each_request_alone(engines, tmp_path, monkeypatch):
    engine, path = engines["conv"]
    assert export(path, tmp_path) == 0
    model, pb = load_model(tmp_path / "conv", monkeypatch)
    model.context = spy = ExecuteSpy(model.context)
    images = [rand((1, 3, 8, 8), seed) for seed in (30, 31)]
    responses = model.execute([pb.InferenceRequest({"image": image}) for image in images])
    for response, image in zip(responses, images):
        actual = pb.get_output_tensor_by_name(response, "features").as_numpy()
        np.testing.assert_allclose(actual, engine.run({"image": image})["features"], rtol=1e-5, atol=1e-6)
    assert spy.batches == [1, 1]


# --- the command line ------------------------------------------------------------------------------------------

def test_existing_model_folder_is_refused_unless_forced(engines, tmp_path, capsys):
    _, path = engines["conv"]
    (tmp_path / "conv").mkdir()
    (tmp_path / "conv" / "old.txt").write_text("keep me")
    assert export(path, tmp_path) == 2
    assert f"{tmp_path / 'conv'} already exists; give --force to replace it, or another --name" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "conv").iterdir()] == ["old.txt"]
    assert export(path, tmp_path, "--force") == 0
    assert sorted(p.name for p in (tmp_path / "conv").iterdir()) == ["1", "config.pbtxt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv"]


def test_bad_engine_file_is_named_and_nothing_is_written(tmp_path, capsys):
    bad = tmp_path / "broken.kiln"
    bad.write_bytes(b"not an engine at all" * 10)
    assert export(bad, tmp_path / "repo") == 2
    err = capsys.readouterr().err
    assert str(bad) in err, err
    assert not (tmp_path / "repo" / "broken").exists()
    assert export(tmp_path / "absent.kiln", tmp_path / "repo") == 2
    assert f"{tmp_path / 'absent.kiln'}: cannot read engine file" in capsys.readouterr().err


@pytest.mark.parametrize("engine, options, message", [
    ("batching", ["--max-batch-size", "9"], "max batch size 9 exceeds what engine 'test' accepts: its optimization "
                                            "profile takes batches of 1 to 8 on the first axis"),
    ("conv", ["--max-batch-size", "4"], "max batch size 4: engine 'test' cannot batch: the engine has static shapes"),
    ("conv", ["--instances", "0"], "bad Triton settings: max batch size 0 (>= 0), instances 0 (>= 1)"),
    ("conv", ["--name", "../elsewhere"], "bad model name '../elsewhere'"),
])
def test_settings_the_engine_cannot_take_exit_2(engines, tmp_path, capsys, engine, options, message):
    assert export(engines[engine][1], tmp_path, *options) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_in_a_fresh_process(engines, tmp_path):
    _, path = engines["batching"]
    done = subprocess.run([sys.executable, "-m", "kiln", "export", "triton", str(path), "-o", str(tmp_path / "r"),
                           "--name", "seq", "--max-batch-size", "4"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"Triton model 'seq' written to {tmp_path / 'r' / 'seq'}" in done.stdout
    assert parse_config(tmp_path / "r" / "seq").max_batch_size == 4
