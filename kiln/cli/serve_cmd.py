"""kiln serve ENGINE.kiln [NAME=ENGINE2.kiln ...]: serve engines over the Open Inference Protocol (KServe v2):
HTTP/REST with Triton's binary-data extension and gRPC (inference.GRPCInferenceService), so tritonclient, KServe's
client and curl work unchanged. Dynamic batching for engines whose first axis is dynamic; Prometheus metrics at
/metrics. Runs until SIGINT/SIGTERM, then drains in-flight requests and exits 0."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from kiln.errors import InputError, MissingDependencyError

SERVE_MODULES = ("fastapi", "uvicorn", "grpc", "google.protobuf")
RAY_MODULES = ("ray",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("engines", nargs="+", metavar="[NAME=]ENGINE.kiln",
                   help="engine files; a model's name is the file's stem unless given as NAME=PATH")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                       "only; 0.0.0.0 for every interface)")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP/REST port (default 8000; 0: any free port)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="gRPC port (default 8001; 0: any free port; not served with --ray)")
    p.add_argument("--max-batch-size", type=int, default=None, metavar="N",
                   help="rows per dynamic batch (default: the optimization profile's batch maximum; 1: no batching)")
    p.add_argument("--max-queue-delay-us", type=int, default=0, metavar="U",
                   help="how long a request may wait for others to batch with (default 0: batch only what is "
                        "already queued while the instances are busy, as Triton does)")
    p.add_argument("--instances", type=int, default=1, metavar="K",
                   help="execution contexts per model, each on its own thread; weights are shared (default 1)")
    p.add_argument("--max-request-bytes", type=int, default=64 * 1024 * 1024, metavar="B",
                   help="largest request body accepted, HTTP and gRPC (default 64 MiB)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads per inference (default: (cores - 1) / instances, at least 1)")
    p.add_argument("--allow-other-device", action="store_true",
                   help="load engines built on another CPU model (their tactic timings came from there)")
    p.add_argument("--ray", action="store_true",
                   help="deploy as a Ray Serve application (REST only): on a local Ray cluster, or the one at "
                        "RAY_ADDRESS")
    p.add_argument("--replicas", type=int, default=None, metavar="R",
                   help="Ray Serve replicas, each a process with its own copy of the engines (with --ray; default 1)")
    p.add_argument("--verbose", action="store_true", help="debug log lines")


def model_specs(items: list[str]) -> list[tuple[str, Path]]:
    """(name, path) per argument: NAME=PATH or PATH (name: the file's stem); names must be unique."""
    specs: list[tuple[str, Path]] = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item).stem, item
        if not name or "/" in name:
            raise InputError(f"{item}: a model name must be non-empty and contain no '/' (NAME=PATH)")
        if not Path(path).is_file():
            raise InputError(f"{path}: no such engine file")
        if name in (n for n, _ in specs):
            raise InputError(f"model name '{name}' is given twice; name one of them with NAME=PATH")
        specs.append((name, Path(path)))
    return specs


def check_options(args) -> None:
    check_ray_options(args)
    for flag, value, least in (("--max-batch-size", args.max_batch_size, 1), ("--instances", args.instances, 1),
                               ("--max-queue-delay-us", args.max_queue_delay_us, 0),
                               ("--max-request-bytes", args.max_request_bytes, 1), ("--threads", args.threads, 1)):
        if value is not None and value < least:
            raise InputError(f"{flag} {value}: must be at least {least}")
    for flag, port in (("--http-port", args.http_port), ("--grpc-port", args.grpc_port or 0)):
        if not 0 <= port <= 65535:
            raise InputError(f"{flag} {port}: not a TCP port (0..65535)")
    needed = SERVE_MODULES + (RAY_MODULES if args.ray else ())
    missing = [m for m in needed if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        raise MissingDependencyError(missing[0], f"kiln serve needs {', '.join(missing)}, which is not installed "
                                                 "here; install it with: pip install 'kiln[serve]'")


def check_ray_options(args) -> None:
    if args.replicas is not None and not args.ray:
        raise InputError("--replicas: only with --ray (on one machine, --instances adds execution contexts)")
    if args.replicas is not None and args.replicas < 1:
        raise InputError(f"--replicas {args.replicas}: must be at least 1")
    if args.ray and args.grpc_port is not None:
        raise InputError("--grpc-port: gRPC is not served with --ray (Ray Serve's gRPC proxy cannot carry the "
                         "inference.GRPCInferenceService); use the REST port, or kiln serve without --ray")


def run(args) -> int:
    import logging

    from kiln.runtime.engine import set_threads
    from kiln.serve.repository import ModelRepository, ServeOptions, serving_threads
    from kiln.serve.server import Listen, run as serve

    check_options(args)
    specs = model_specs(args.engines)
    set_threads(args.threads or (None if args.ray else serving_threads(args.instances)))
    options = ServeOptions(args.max_batch_size, args.max_queue_delay_us, args.instances, args.max_request_bytes)
    if args.ray:
        from kiln.serve.ray_deploy import RayPlan, run as run_on_ray

        plan = RayPlan(args.replicas or 1, args.host, args.http_port, threads=args.threads)
        return run_on_ray(specs, options, plan, args.allow_other_device)
    repository = ModelRepository.load(specs, options, args.allow_other_device)
    log = logging.getLogger("kiln.serve")
    for model in repository.models.values():
        batching = f"dynamic batching up to {model.policy.max_batch_size}, queue delay " \
                   f"{model.policy.max_queue_delay_us} us" if model.policy.max_batch_size > 1 else "no batching"
        log.info("model '%s' version %s: %s (%s, %d instance%s)", model.name, model.version,
                 ", ".join(f"{t.name} {t.datatype}{list(t.shape)}" for t in model.inputs), batching,
                 model.instances, "" if model.instances == 1 else "s")
    return serve(repository, Listen(args.host, args.http_port, 8001 if args.grpc_port is None else args.grpc_port))
