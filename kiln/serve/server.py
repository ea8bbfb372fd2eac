"""`kiln serve`'s process: uvicorn (HTTP) and grpcio's asyncio server (gRPC) on one event loop, sharing one
model repository; ports are bound before anything is announced, and SIGINT/SIGTERM drain in-flight requests."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from dataclasses import dataclass

import grpc
import uvicorn

from kiln.errors import Error
from kiln.serve.repository import ModelRepository

log = logging.getLogger("kiln.serve")
DRAIN_TIMEOUT_S = 30


class ServeError(Error):
    """The server cannot start: a port in use, an address that does not resolve."""


@dataclass(frozen=True)
class Listen:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001


def run(repository: ModelRepository, listen: Listen) -> int:
    """Serve until SIGINT/SIGTERM, then drain and return 0. Raises ServeError if a port cannot be bound."""
    http_socket = bind_socket(listen.host, listen.http_port, "HTTP")
    try:
        asyncio.run(_serve(repository, listen, http_socket))
    finally:
        http_socket.close()
    return 0


def bind_socket(host: str, port: int, what: str) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ServeError(f"--host {host}: cannot resolve it ({exc})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # restart at once after a stop (TIME_WAIT)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ServeError(f"{what} port {port} on {host} cannot be used: {exc.strerror or exc}; is another server "
                         f"listening there? Pick another with --{what.lower()}-port") from None
    sock.setblocking(False)
    return sock


async def _serve(repository: ModelRepository, listen: Listen, http_socket: socket.socket) -> None:
    from kiln.serve.grpc_service import add_service
    from kiln.serve.http_app import create_app
    from kiln.version import __version__

    grpc_server = grpc.aio.server(options=[("grpc.max_receive_message_length", repository.options.max_request_bytes),
                                           ("grpc.max_send_message_length", -1), ("grpc.so_reuseport", 0)])
    add_service(grpc_server, repository, __version__)
    grpc_port = _bind_grpc(grpc_server, listen)
    repository.start()
    http = _Uvicorn(uvicorn.Config(create_app(repository, manage_lifecycle=False), log_config=None,
                                   log_level="warning", access_log=False, lifespan="on",
                                   timeout_graceful_shutdown=DRAIN_TIMEOUT_S))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _on_signal, sig, stop, http)
    await grpc_server.start()
    http_task = asyncio.create_task(http.serve(sockets=[http_socket]))
    while not http.started and not http_task.done():
        await asyncio.sleep(0.01)
    if not http_task.done():
        host, port = http_socket.getsockname()[:2]
        log.info("Started GRPCInferenceService at %s:%d", listen.host, grpc_port)
        log.info("Started HTTPService at %s:%d", host, port)
        log.info("Started Metrics Service at %s:%d/metrics", host, port)
        await asyncio.wait({http_task, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    log.info("Shutting down: draining in-flight requests (up to %d s)", DRAIN_TIMEOUT_S)
    http.should_exit = True
    await asyncio.gather(http_task, grpc_server.stop(DRAIN_TIMEOUT_S), return_exceptions=True)
    await loop.run_in_executor(None, repository.stop)
    log.info("Stopped")


def _bind_grpc(grpc_server, listen: Listen) -> int:
    address = f"[{listen.host}]:{listen.grpc_port}" if ":" in listen.host else f"{listen.host}:{listen.grpc_port}"
    try:
        port = grpc_server.add_insecure_port(address)
    except RuntimeError as exc:
        port, detail = 0, str(exc)
    else:
        detail = "bind failed"
    if not port:
        raise ServeError(f"gRPC port {listen.grpc_port} on {listen.host} cannot be used ({detail}); is another "
                         "server listening there? Pick another with --grpc-port")
    return port


def _on_signal(sig: int, stop: asyncio.Event, http) -> None:
    if stop.is_set():   # a second Ctrl-C: stop waiting for in-flight requests
        log.warning("%s again: exiting without waiting for in-flight requests", signal.Signals(sig).name)
        http.force_exit = True
        return
    log.info("Received %s", signal.Signals(sig).name)
    stop.set()


class _Uvicorn(uvicorn.Server):
    """uvicorn's server without its signal handling: `kiln serve` handles SIGINT/SIGTERM for both protocols
    (uvicorn would re-raise the signal after its shutdown, and the process would not exit 0)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield
