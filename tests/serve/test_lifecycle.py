"""`kiln serve` as a process: a request whose client hung up is dropped unrun; SIGTERM while a request is in
flight lets it finish and exits 0; a bad engine path, a port in use and bad --ray options exit 2 naming the culprit."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.request

from tests.serve.conftest import start_server


def test_hang_up_costs_nothing_and_sigterm_drains_the_in_flight_request(engines, tmp_path):
    # a 1 s queue delay keeps a lone request in flight long enough to signal the server under it
    server = start_server([str(engines["conv"]), "--max-queue-delay-us", "1000000"], tmp_path / "server.log")
    try:
        body = json.dumps({"id": "last", "inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 3, 8, 8],
                                                     "data": [0.25] * 192}]}).encode()
        answer: dict = {}

        def request():
            url = f"http://{server.http_url}/v2/models/conv/infer"
            with urllib.request.urlopen(urllib.request.Request(url, body), timeout=30) as response:
                answer.update(status=response.status, body=json.loads(response.read()))
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=10) as sock:   # sent, then gone
            sock.sendall(f"POST /v2/models/conv/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
                         .encode() + body)
            time.sleep(0.1)
        client = threading.Thread(target=request)
        client.start()
        time.sleep(0.5)
        metrics = urllib.request.urlopen(f"http://{server.http_url}/metrics", timeout=10).read().decode()
        server.process.terminate()
        client.join(30)
        code = server.process.wait(30)
    finally:
        server.stop()
    # the abandoned request was dropped from the queue unrun; the other one is still queued when the signal comes
    assert 'nv_inference_exec_count{model="conv",version="1"} 0' in metrics
    assert 'nv_inference_request_failure{model="conv",version="1"} 1' in metrics
    assert answer["status"] == 200 and answer["body"]["id"] == "last"
    assert answer["body"]["outputs"][0]["shape"] == [1, 5]
    assert code == 0, server.log()
    log = server.log()
    assert "Received SIGTERM" in log and "Shutting down: draining in-flight requests" in log and "Stopped" in log


def kiln_serve(capsys, *args: str) -> tuple[int, str]:
    """`kiln serve ARGS` in this process (each start-up here fails before serving): exit code and stderr."""
    from kiln.cli.main import main

    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = main(["serve", *args])
    finally:
        signal.signal(signal.SIGTERM, previous)
    return code, capsys.readouterr().err


def test_bad_engine_path_exits_2(tmp_path, capsys):
    code, stderr = kiln_serve(capsys, str(tmp_path / "missing.kiln"))
    assert code == 2 and f"{tmp_path / 'missing.kiln'}: no such engine file" in stderr


def test_damaged_engine_exits_2(tmp_path, capsys):
    damaged = tmp_path / "damaged.kiln"
    damaged.write_bytes(b"KILNPLAN" + b"\0" * 40)
    code, stderr = kiln_serve(capsys, f"model={damaged}")
    assert code == 2 and str(damaged) in stderr


def test_port_in_use_exits_2(engines, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        http = kiln_serve(capsys, str(engines["mlp"]), "--http-port", str(port), "--grpc-port", "0")
        grpc = kiln_serve(capsys, str(engines["mlp"]), "--http-port", "0", "--grpc-port", str(port))
    assert http[0] == 2 and f"HTTP port {port} on 127.0.0.1 cannot be used" in http[1]
    assert grpc[0] == 2 and f"gRPC port {port} on 127.0.0.1 cannot be used" in grpc[1]


def test_ray_options_are_checked_before_anything_starts(engines, capsys):
    code, stderr = kiln_serve(capsys, str(engines["mlp"]), "--replicas", "2")
    assert code == 2 and "--replicas: only with --ray" in stderr
    code, stderr = kiln_serve(capsys, str(engines["mlp"]), "--ray", "--replicas", "0")
    assert code == 2 and "--replicas 0: must be at least 1" in stderr
