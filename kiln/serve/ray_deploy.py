"""`kiln serve --ray`: the Open Inference Protocol's REST app as a Ray Serve deployment of R replicas, on a local
Ray cluster (RAY_ADDRESS unset) or the cluster at RAY_ADDRESS. Engine bytes travel through Ray's object store, so
replicas on other machines need kiln installed, not the engine files. Each response names its replica in the
`Kiln-Replica` header. Runs until SIGINT/SIGTERM, then removes what it deployed and exits 0."""
from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from kiln.serve.repository import ModelRepository, ServeOptions

log = logging.getLogger("kiln.serve")
APP_NAME = "kiln"
REPLICA_HEADER = "kiln-replica"
SHUTDOWN_TIMEOUT_S = 30


@dataclass(frozen=True)
class RayPlan:
    """What `kiln serve --ray` deploys and where its HTTP proxy listens; `cpus_per_replica` is Ray's logical
    CPU request per replica (the scheduler's unit), `threads` the intra-op threads inside it."""

    replicas: int
    host: str
    http_port: int
    cpus_per_replica: int = 1
    threads: int | None = None


class KilnReplica:
    """One Ray Serve replica: fetches the engines from the object store, loads them, and serves the REST app
    (its lifespan starts and drains the batchers)."""

    def __init__(self, engines: dict, options: ServeOptions, allow_other_device: bool, threads: int | None):
        import ray

        from kiln.runtime.engine import set_threads

        set_threads(threads)
        with tempfile.TemporaryDirectory(prefix="kiln-replica-") as folder:
            specs = []
            for name, ref in engines.items():
                path = Path(folder) / f"{name}.kiln"
                path.write_bytes(ray.get(ref))
                specs.append((name, path))
            self.repository = ModelRepository.load(specs, options, allow_other_device)   # read into memory

    def __serve_build_asgi_app__(self):
        from ray import serve

        from kiln.serve.http_app import create_app

        app = create_app(self.repository, manage_lifecycle=True)
        app.add_middleware(ReplicaHeader, replica=serve.get_replica_context().replica_id.unique_id)
        return app


class ReplicaHeader:
    """ASGI middleware adding `Kiln-Replica: <Ray Serve replica id>` to every HTTP response."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        return await self.app(scope, receive, send_named)


def run(specs: list[tuple[str, Path]], options: ServeOptions, plan: RayPlan, allow_other_device: bool = False) -> int:
    """Deploy, serve until SIGINT/SIGTERM, then tear down and return 0."""
    import ray
    from ray import serve

    from kiln.runtime.engine import load

    for _, path in specs:   # a bad or foreign engine fails here (exit 2), before Ray starts
        load(path, allow_other_device)
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=plan.replicas * plan.cpus_per_replica, include_dashboard=False,
                 logging_level=logging.WARNING)
    stop = _stop_on_signals()
    try:
        port = _serve(specs, options, plan, allow_other_device)
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        log.info("Deployed %d replica%s on %s", plan.replicas, "" if plan.replicas == 1 else "s", where)
        log.info("Started HTTPService at %s:%d (Ray Serve's HTTP proxy)", plan.host, port)
        log.info("Started Metrics Service at %s:%d/metrics (per replica: the replica that answers)", plan.host, port)
        stop.wait()
    finally:
        log.info("Shutting down Ray Serve (replicas drain in-flight requests)")
        _bounded(lambda: serve.delete(APP_NAME) if address else serve.shutdown())   # theirs: remove only ours
        ray.shutdown()   # a local cluster's processes stop with it
    log.info("Stopped")
    return 0


def _bounded(teardown, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Run `teardown` for at most `timeout_s`: Serve's shutdown waits forever if a Ray process was killed under it
    (say by a SIGTERM sent to the whole process group)."""
    worker = threading.Thread(target=teardown, name="kiln-serve-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        log.warning("Ray Serve did not shut down within %d s; stopping Ray anyway", timeout_s)


def _serve(specs, options: ServeOptions, plan: RayPlan, allow_other_device: bool) -> int:
    import ray
    from ray import serve

    port = plan.http_port or _free_port(plan.host)
    serve.start(http_options={"host": plan.host, "port": port})
    engines = {name: ray.put(Path(path).read_bytes()) for name, path in specs}
    deployment = serve.deployment(serve.ingress()(KilnReplica), name="KilnReplica", num_replicas=plan.replicas,
                                  ray_actor_options={"num_cpus": plan.cpus_per_replica})
    serve.run(deployment.bind(engines, options, allow_other_device, plan.threads), name=APP_NAME, route_prefix="/")
    running = serve.status().applications[APP_NAME].deployments["KilnReplica"].replica_states
    log.info("Ray Serve replicas: %s", ", ".join(f"{n} {state}" for state, n in sorted(running.items())))
    return port


def _free_port(host: str) -> int:
    """A port free now on `host` (Ray Serve's proxy cannot report an ephemeral port back)."""
    from kiln.serve.server import bind_socket

    sock = bind_socket(host, 0, "HTTP")
    try:
        return sock.getsockname()[1]
    finally:
        sock.close()


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def on_signal(sig, _frame):
        log.info("Received %s", signal.Signals(sig).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return stop
