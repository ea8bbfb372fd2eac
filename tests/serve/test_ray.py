"""`kiln serve --ray --replicas 2`: a real Ray Serve deployment on a local Ray cluster, started as a subprocess;
tritonclient (JSON and binary) gets Engine.run's outputs, both replicas answer (the `Kiln-Replica` header names
Ray Serve's replica id), and SIGTERM stops it with exit 0 leaving no Ray process behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.serve.conftest import ROOT, ServerProcess

pytest.importorskip("ray.serve", reason="ray[serve] is not installed; kiln serve --ray needs it")
tritonhttp = pytest.importorskip("tritonclient.http")

IMAGE = np.random.default_rng(5).standard_normal((2, 3, 16, 16)).astype(np.float32)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (Ray's raylet, GCS, workers and actors while the driver runs)."""
    children: dict[int, list[int]] = {}
    for line in subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def ray_server(engines, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("ray_log") / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "kiln", "serve", str(engines["conv"]), "--ray",
                                    "--replicas", "2", "--http-port", str(port), "--max-batch-size", "4",
                                    "--threads", "1"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    server = ServerProcess(process, log_path, http_port=port)
    deadline = time.monotonic() + 90
    while f"Started HTTPService at 127.0.0.1:{port}" not in server.log():
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise AssertionError(f"kiln serve --ray did not start:\n{server.log()}")
        time.sleep(0.2)
    yield server
    ray_processes = descendants(process.pid)
    assert ray_processes, "no Ray processes ran under kiln serve --ray"
    code = server.stop(timeout_s=60)
    assert code == 0, f"kiln serve --ray exited with {code}:\n{server.log()}"
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in ray_processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in ray_processes if alive(pid)]
    for pid in left:   # do not leave them to the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not left, f"Ray processes left after kiln serve --ray stopped: {left}"


def test_ready_and_metadata(ray_server):
    client = tritonhttp.InferenceServerClient(ray_server.http_url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("conv")
    assert client.get_model_metadata("conv")["inputs"] == [{"name": "image", "datatype": "FP32",
                                                            "shape": [-1, 3, -1, -1]}]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_tritonclient_matches_engine_run(ray_server, loaded, binary):
    client = tritonhttp.InferenceServerClient(ray_server.http_url)
    image = tritonhttp.InferInput("image", list(IMAGE.shape), "FP32")
    image.set_data_from_numpy(IMAGE, binary_data=binary)
    result = client.infer("conv", [image], outputs=[tritonhttp.InferRequestedOutput("probs", binary_data=binary)])
    np.testing.assert_array_equal(result.as_numpy("probs"), loaded["conv"].run({"image": IMAGE})["probs"])


def test_both_replicas_answer(ray_server):
    url = f"http://{ray_server.http_url}/v2/models/conv/ready"

    def replica(_):
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.status == 200
            return response.headers["Kiln-Replica"]

    with ThreadPoolExecutor(8) as pool:
        replicas = set(pool.map(replica, range(48)))
    assert len(replicas) == 2, f"expected 2 Ray Serve replicas to answer, got {replicas}"
    assert "Ray Serve replicas: 2 RUNNING" in ray_server.log()


def test_grpc_port_is_refused_under_ray(engines):
    done = subprocess.run([sys.executable, "-m", "kiln", "serve", str(engines["conv"]), "--ray", "--grpc-port", "8001"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert done.returncode == 2
    assert "--grpc-port: gRPC is not served with --ray" in done.stderr
