"""Bad requests over raw HTTP and gRPC: each gets its status and an error naming the input and what the model
expects; a kernel exception fails only its request; a client that hangs up costs nothing; the server stays ready."""
from __future__ import annotations

import http.client
import json
import socket
import time

import numpy as np
import pytest

tritongrpc = pytest.importorskip("tritonclient.grpc")


def post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("POST", path, body, headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def get(server, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def tensor(name="image", datatype="FP32", shape=(1, 3, 8, 8), data=None) -> dict:
    return {"name": name, "datatype": datatype, "shape": list(shape),
            "data": data if data is not None else [0.5] * int(np.prod(shape))}


def infer_body(*inputs, **extra) -> bytes:
    return json.dumps({"inputs": list(inputs), **extra}).encode()


BAD_REQUESTS = {
    "unknown model": ("/v2/models/nonexistent/infer", infer_body(tensor()), 404,
                      "unknown model 'nonexistent'; this server serves ['conv', 'lookup', 'mlp']"),
    "unknown version": ("/v2/models/conv/versions/2/infer", infer_body(tensor()), 404,
                        "model 'conv' has no version '2'; its versions are ['1']"),
    "unknown input": ("/v2/models/conv/infer", infer_body(tensor("pixels")), 400,
                      "unknown input 'pixels' for model 'conv'; its inputs are ['image']"),
    "missing input": ("/v2/models/conv/infer", infer_body(), 400,
                      "missing input(s) ['image'] for model 'conv'; its inputs are ['image']"),
    "wrong datatype": ("/v2/models/conv/infer", infer_body(tensor(datatype="FP64")), 400,
                       "input 'image': datatype FP64 does not match the model's FP32"),
    "wrong rank": ("/v2/models/conv/infer", infer_body(tensor(shape=(3, 8, 8))), 400,
                   "input 'image': shape [3, 8, 8] has rank 3; the model expects rank 4 [-1, 3, -1, -1]"),
    "outside the profile": ("/v2/models/conv/infer", infer_body(tensor(shape=(1, 3, 40, 8))), 400,
                            "input 'image': shape [1, 3, 40, 8] is outside the model's optimization profile "
                            "(profile 0: [1..8, 3, 8..32, 8..32])"),
    "static shape": ("/v2/models/mlp/infer", infer_body(tensor("x", shape=(1, 6))), 400,
                     "input 'x': shape [1, 6] does not match the model's [2, 6]"),
    "element count": ("/v2/models/conv/infer", infer_body(tensor(data=[1.0, 2.0])), 400,
                      "input 'image': 'data' has 2 element(s) but shape [1, 3, 8, 8] needs 192"),
    "unknown output": ("/v2/models/mlp/infer", infer_body(tensor("x", shape=(2, 6)), outputs=[{"name": "z"}]),
                       400, "unknown output 'z' requested from model 'mlp'; its outputs are ['hidden', 'y']"),
    "malformed JSON": ("/v2/models/conv/infer", b'{"inputs": [', 400,
                       "malformed JSON in the request body: Expecting value: line 1 column 13 (char 12)"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_names_the_fault(server, case):
    path, body, status, message = BAD_REQUESTS[case]
    assert post(server, path, body) == (status, {"error": message})


def test_truncated_binary_body(server):
    header = json.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 3, 8, 8],
                                     "parameters": {"binary_data_size": 768}}]}).encode()
    status, body = post(server, "/v2/models/conv/infer", header + b"\0" * 100,
                        {"Inference-Header-Content-Length": str(len(header))})
    assert (status, body) == (400, {"error": "input 'image': binary_data_size 768 but only 100 byte(s) remain in "
                                             "the body (truncated body?)"})
    status, body = post(server, "/v2/models/conv/infer", header, {"Inference-Header-Content-Length": "9999"})
    assert status == 400 and "Inference-Header-Content-Length 9999 exceeds the body's" in body["error"]


def test_body_over_the_size_limit(server):
    status, body = post(server, "/v2/models/conv/infer", b" " * ((1 << 20) + 1))
    assert (status, body) == (400, {"error": f"request body of {(1 << 20) + 1} bytes exceeds the server's limit of "
                                             f"{1 << 20} bytes (--max-request-bytes)"})


def test_kernel_exception_fails_only_its_request(server, loaded):
    status, body = post(server, "/v2/models/lookup/infer", infer_body(tensor("idx", "INT64", (2,), [1, 12])))
    assert status == 500
    assert body["error"] == "layer '(Unnamed Layer* 0) [Gather]' (Gather) failed: IndexError: index out of range " \
                            "in self"
    assert get(server, "/v2/health/ready") == 200
    status, body = post(server, "/v2/models/lookup/infer", infer_body(tensor("idx", "INT64", (2,), [1, 2])))
    assert status == 200 and body["outputs"][0]["data"] == loaded["lookup"].run(
        {"idx": np.array([1, 2])})["rows"].reshape(-1).tolist()


def test_client_hanging_up_costs_nothing(server):
    body = infer_body(tensor(shape=(1, 3, 16, 16)))
    for cut in (len(body) // 2, len(body)):   # mid-body, and after the whole request while it waits in the queue
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:
            sock.sendall(f"POST /v2/models/conv/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
                         "Content-Type: application/json\r\n\r\n".encode() + body[:cut])
        time.sleep(0.05)
    time.sleep(0.1)
    assert get(server, "/v2/health/ready") == 200
    status, answer = post(server, "/v2/models/conv/infer", body)
    assert status == 200 and answer["outputs"][0]["shape"] == [1, 5]


def test_grpc_status_codes(server):
    import grpc

    client = tritongrpc.InferenceServerClient(server.grpc_url)
    item = tritongrpc.InferInput("image", [1, 3, 8, 8], "FP32")
    item.set_data_from_numpy(np.zeros((1, 3, 8, 8), np.float32))
    with pytest.raises(tritongrpc.InferenceServerException) as missing:
        client.infer("nonexistent", [item])
    assert missing.value.status() == str(grpc.StatusCode.NOT_FOUND)
    wrong = tritongrpc.InferInput("image", [1, 3, 8, 8], "FP64")
    wrong.set_data_from_numpy(np.zeros((1, 3, 8, 8), np.float64))
    with pytest.raises(tritongrpc.InferenceServerException) as invalid:
        client.infer("conv", [wrong])
    assert invalid.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    assert invalid.value.message() == "input 'image': datatype FP64 does not match the model's FP32"
    bad = tritongrpc.InferInput("idx", [1], "INT64")
    bad.set_data_from_numpy(np.array([99], np.int64))
    with pytest.raises(tritongrpc.InferenceServerException) as internal:
        client.infer("lookup", [bad])
    assert internal.value.status() == str(grpc.StatusCode.INTERNAL)
    assert client.is_server_ready()
