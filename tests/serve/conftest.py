"""Serving test fixtures: the small engines (built once), a `kiln serve` subprocess on free loopback ports (read
from its log), always stopped at the end."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("tritonclient")

ROOT = Path(__file__).resolve().parents[2]
STARTED = re.compile(r"Started (HTTPService|GRPCInferenceService) at ([\w.:\[\]-]+):(\d+)")


@dataclass
class ServerProcess:
    process: subprocess.Popen
    log_path: Path
    http_port: int = 0
    grpc_port: int = 0

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(args: list[str], log_path: Path, timeout_s: float = 60) -> ServerProcess:
    """`python -m kiln serve ARGS --http-port 0 --grpc-port 0`, waiting for both 'Started' lines."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "kiln", "serve", *args, "--http-port", "0",
                                    "--grpc-port", "0"], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    server = ServerProcess(process, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ports = {m.group(1): int(m.group(3)) for m in STARTED.finditer(server.log())}
        if len(ports) == 2:
            server.http_port, server.grpc_port = ports["HTTPService"], ports["GRPCInferenceService"]
            return server
        if process.poll() is not None:
            break
        time.sleep(0.05)
    server.stop()
    raise AssertionError(f"kiln serve did not start:\n{server.log()}")


@pytest.fixture(scope="session")
def engines(tmp_path_factory) -> dict[str, Path]:
    from tests.serve.models import build_engines

    return build_engines(tmp_path_factory.mktemp("serve_engines"))


@pytest.fixture(scope="session")
def server(engines, tmp_path_factory):
    """conv (dynamic batch, batching up to 8 with a 20 ms queue delay, 2 instances), mlp (static) and lookup
    (INT64 -> FP32 + BOOL) behind one server; the request limit is 1 MiB so the size test stays small."""
    args = [str(engines["conv"]), f"mlp={engines['mlp']}", str(engines["lookup"]), "--max-batch-size", "8",
            "--max-queue-delay-us", "20000", "--instances", "2", "--max-request-bytes", str(1 << 20)]
    process = start_server(args, tmp_path_factory.mktemp("serve_log") / "server.log")
    yield process
    code = process.stop()
    assert code == 0, f"kiln serve exited with {code}:\n{process.log()}"


@pytest.fixture(scope="session")
def loaded(engines):
    """The same engines loaded in this process, for Engine.run references."""
    import kiln

    return {name: kiln.load(path) for name, path in engines.items()}
