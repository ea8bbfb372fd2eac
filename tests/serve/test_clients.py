"""Triton's own clients against `kiln serve`: tritonclient.http (JSON and binary tensors) and tritonclient.grpc
(raw contents), health, metadata and config; outputs equal Engine.run exactly and onnxruntime within tolerance."""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import assert_close_to_ort, run_ort

tritonhttp = pytest.importorskip("tritonclient.http")
tritongrpc = pytest.importorskip("tritonclient.grpc")

IMAGE = np.random.default_rng(3).standard_normal((2, 3, 16, 16)).astype(np.float32)


def http_infer(url, model, feeds, binary, outputs=None, request_id=""):
    client = tritonhttp.InferenceServerClient(url)
    inputs = []
    for name, array in feeds.items():
        item = tritonhttp.InferInput(name, list(array.shape), tritonhttp_dtype(array))
        item.set_data_from_numpy(array, binary_data=binary)
        inputs.append(item)
    wanted = [tritonhttp.InferRequestedOutput(n, binary_data=binary) for n in outputs] if outputs else None
    return client.infer(model, inputs, outputs=wanted, request_id=request_id)


def tritonhttp_dtype(array):
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(array.dtype)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_http_matches_engine_and_onnxruntime(server, loaded, engines, binary):
    result = http_infer(server.http_url, "conv", {"image": IMAGE}, binary, ["probs"], request_id="req-7")
    probs = result.as_numpy("probs")
    np.testing.assert_array_equal(probs, loaded["conv"].run({"image": IMAGE})["probs"])
    assert_close_to_ort(probs, run_ort(str(engines["conv"].with_suffix(".onnx")), {"image": IMAGE})[0])
    response = result.get_response()
    assert (response["id"], response["model_name"], response["model_version"]) == ("req-7", "conv", "1")
    assert response["outputs"][0]["datatype"] == "FP32" and response["outputs"][0]["shape"] == [2, 5]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_int64_input_and_bool_output_over_http(server, loaded, binary):
    idx = np.array([0, 9, 4], dtype=np.int64)
    result = http_infer(server.http_url, "lookup", {"idx": idx}, binary, ["rows", "positive"])
    expected = loaded["lookup"].run({"idx": idx})
    assert result.as_numpy("positive").dtype == np.bool_
    for name in ("rows", "positive"):
        np.testing.assert_array_equal(result.as_numpy(name), expected[name])
    assert [o["datatype"] for o in result.get_response()["outputs"]] == ["FP32", "BOOL"]


def test_requested_outputs_subset(server, loaded):
    x = np.random.default_rng(4).standard_normal((2, 6)).astype(np.float32)
    result = http_infer(server.http_url, "mlp", {"x": x}, True, ["y"])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["y"]
    assert result.as_numpy("hidden") is None
    np.testing.assert_array_equal(result.as_numpy("y"), loaded["mlp"].run({"x": x})["y"])
    everything = http_infer(server.http_url, "mlp", {"x": x}, False)   # no outputs named: all of them, JSON
    assert [o["name"] for o in everything.get_response()["outputs"]] == ["hidden", "y"]


def test_tritonclient_grpc(server, loaded, engines):
    client = tritongrpc.InferenceServerClient(server.grpc_url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("conv")
    assert not client.is_model_ready("nonexistent")
    item = tritongrpc.InferInput("image", list(IMAGE.shape), "FP32")
    item.set_data_from_numpy(IMAGE)
    result = client.infer("conv", [item], request_id="g-1", model_version="1")
    np.testing.assert_array_equal(result.as_numpy("probs"), loaded["conv"].run({"image": IMAGE})["probs"])
    assert result.get_response().id == "g-1"
    idx = np.array([3, 7], dtype=np.int64)
    item = tritongrpc.InferInput("idx", [2], "INT64")
    item.set_data_from_numpy(idx)
    result = client.infer("lookup", [item], outputs=[tritongrpc.InferRequestedOutput("positive")])
    np.testing.assert_array_equal(result.as_numpy("positive"), loaded["lookup"].run({"idx": idx})["positive"])
    assert result.as_numpy("rows") is None
    metadata = client.get_model_metadata("conv", as_json=True)
    assert metadata["platform"] == "kiln_engine" and metadata["versions"] == ["1"]
    assert metadata["inputs"] == [{"name": "image", "datatype": "FP32", "shape": ["-1", "3", "-1", "-1"]}]
    assert client.get_server_metadata(as_json=True)["name"] == "kiln"


def test_http_health_and_metadata(server):
    client = tritonhttp.InferenceServerClient(server.http_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("conv") and client.is_model_ready("conv", "1")
    assert not client.is_model_ready("conv", "2") and not client.is_model_ready("nonexistent")
    assert client.get_model_metadata("conv") == {
        "name": "conv", "versions": ["1"], "platform": "kiln_engine",
        "inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 3, -1, -1]}],
        "outputs": [{"name": "probs", "datatype": "FP32", "shape": [-1, 5]}]}
    assert client.get_model_metadata("mlp", "1")["outputs"][0]["shape"] == [2, 4]
    config = client.get_model_config("conv")
    assert config["max_batch_size"] == 8 and config["input"][0]["dims"] == [3, -1, -1]
    assert config["dynamic_batching"] == {"max_queue_delay_microseconds": 20000}
    assert client.get_model_config("mlp")["max_batch_size"] == 0
    assert {m["name"] for m in client.get_model_repository_index()} == {"conv", "mlp", "lookup"}
    assert client.get_server_metadata()["name"] == "kiln"


def test_compressed_request_and_response(server, loaded):
    result = tritonhttp.InferenceServerClient(server.http_url)
    item = tritonhttp.InferInput("image", list(IMAGE.shape), "FP32")
    item.set_data_from_numpy(IMAGE)
    out = result.infer("conv", [item], request_compression_algorithm="gzip", response_compression_algorithm="deflate")
    np.testing.assert_array_equal(out.as_numpy("probs"), loaded["conv"].run({"image": IMAGE})["probs"])


def test_raw_json_nested_and_flat_data_agree(server, loaded):
    """What curl sends: nested `data` and flat `data` are the same tensor; no `id` in, none out."""
    import http.client
    import json

    x = np.random.default_rng(6).standard_normal((2, 6)).astype(np.float32)
    answers = []
    for data in (x.tolist(), x.reshape(-1).tolist()):
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        conn.request("POST", "/v2/models/mlp/infer", json.dumps(
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 6], "data": data}]}),
            {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("Content-Type") == "application/json"
        answers.append(json.loads(response.read()))
        conn.close()
    assert answers[0] == answers[1] and "id" not in answers[0]
    y = next(o for o in answers[0]["outputs"] if o["name"] == "y")
    assert y["shape"] == [2, 3]
    np.testing.assert_array_equal(np.array(y["data"], np.float32).reshape(2, 3), loaded["mlp"].run({"x": x})["y"])
