"""Load on `kiln serve` (issue 20, item 9): N concurrent tritonclient.grpc.aio clients, each sending one row per
request back to back for T seconds, against a served ResNet-18 (224x224) and a 2-layer BERT (seq 128), both with
a dynamic batch axis (optimization profile 1..8), once with batching off (--max-batch-size 1) and once on (8).
Reports QPS, p50/p99 latency, errors (must be 0), outputs checked against Engine.run on every response (must
match within tolerance) and the server's RSS after start-up and at the end (/proc/PID/status VmRSS).

    .venv/bin/python benchmarks/serve_load.py [--models resnet18,bert,tiny] [--clients 4] [--seconds 10]
        [--threads T] [--max-queue-delay-us U]

The clients share the machine with the server: on 2 cores they take CPU the server would otherwise use.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_info import cpu_line  # noqa: E402

PROFILE_MAX_BATCH = 8
STARTED = re.compile(r"Started GRPCInferenceService at [\w.:\[\]-]+:(\d+)")
RTOL, ATOL = 1e-4, 1e-4   # a row computed inside a batch of 8 may round differently from the same row alone


@dataclass(frozen=True)
class Workload:
    """A served model: its engine, one request's feeds per client, and the outputs to check."""

    name: str
    engine: Path
    feeds: tuple[dict[str, np.ndarray], ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class LoadResult:
    model: str
    max_batch_size: int
    clients: int
    requests: int
    qps: float
    p50_ms: float
    p99_ms: float
    errors: int
    mismatches: int
    max_abs_diff: float
    rss_start_mib: float
    rss_end_mib: float


def build_resnet18(folder: Path, clients: int) -> Workload:
    import torch

    import kiln
    from tests.models.nets import load_for_ort, make

    onnx_path, engine_path = folder / "resnet18.onnx", folder / "resnet18.kiln"
    if not engine_path.exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the legacy exporter's deprecation notice
            torch.onnx.export(make("resnet18"), (torch.zeros(2, 3, 224, 224),), str(onnx_path), dynamo=False,
                              opset_version=17, input_names=["input"], output_names=["output"],
                              dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
        load_for_ort(onnx_path)
        shape = (3, 224, 224)
        profile = {"input": ((1, *shape), (4, *shape), (PROFILE_MAX_BATCH, *shape))}
        kiln.build(str(onnx_path), profiles=[profile], autotune=False).save(engine_path)
    rng = np.random.default_rng(0)
    feeds = tuple({"input": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)} for _ in range(clients))
    return Workload("resnet18", engine_path, feeds, ("output",))


def build_bert(folder: Path, clients: int, seq: int = 128) -> Workload:
    import kiln
    from tests.models.encoders import export, inputs, make_bert

    model = make_bert(hidden=128, heads=4, intermediate=512, max_positions=seq)
    onnx_path, engine_path = folder / "bert.onnx", folder / "bert.kiln"
    if not engine_path.exists():
        export(model, inputs(model, batch=2, seq=seq), onnx_path, dynamic=True)
        profile = {n: ((1, seq), (4, seq), (PROFILE_MAX_BATCH, seq)) for n in model.input_names}
        kiln.build(str(onnx_path), profiles=[profile], autotune=False).save(engine_path)
    feeds = tuple(inputs(model, batch=1, seq=seq, seed=i) for i in range(clients))
    return Workload("bert", engine_path, feeds, tuple(model.output_names))


def build_tiny(folder: Path, clients: int) -> Workload:
    """The serving tests' small conv net (dynamic batch 1..8): for the smoke test."""
    import kiln
    from tests.serve.models import CONV_PROFILE, conv_model

    onnx_path, engine_path = folder / "conv.onnx", folder / "conv.kiln"
    conv_model(onnx_path)
    kiln.build(str(onnx_path), profiles=[CONV_PROFILE], autotune=False).save(engine_path)
    rng = np.random.default_rng(0)
    feeds = tuple({"image": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(clients))
    return Workload("conv", engine_path, feeds, ("probs",))


BUILDERS = {"resnet18": build_resnet18, "bert": build_bert, "tiny": build_tiny}


def start_server(engine: Path, max_batch_size: int, log_path: Path, server_args: list[str], timeout_s: float = 120):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "kiln", "serve", str(engine), "--http-port", "0",
                                    "--grpc-port", "0", "--max-batch-size", str(max_batch_size), *server_args],
                                   stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        found = STARTED.search(log_path.read_text(errors="replace"))
        if found and "Started HTTPService" in log_path.read_text(errors="replace"):
            return process, int(found.group(1))
        time.sleep(0.05)
    stop_server(process)
    raise RuntimeError(f"kiln serve did not start:\n{log_path.read_text(errors='replace')}")


def stop_server(process: subprocess.Popen) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


async def client_loop(url: str, work: Workload, index: int, expected: dict, stop_at: float, tally: dict) -> None:
    import tritonclient.grpc.aio as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    client = grpcclient.InferenceServerClient(url)
    feeds = work.feeds[index]
    inputs = []
    for name, array in feeds.items():
        item = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        item.set_data_from_numpy(array)
        inputs.append(item)
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                result = await client.infer(work.name, inputs)
            except Exception as exc:   # counted and reported; a load test must not stop at the first failure
                tally["errors"] += 1
                tally.setdefault("first_error", repr(exc))
                continue
            tally["latencies_s"].append(time.perf_counter() - t0)
            for name in work.outputs:
                got, want = result.as_numpy(name), expected[name]
                diff = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("inf")
                tally["max_abs_diff"] = max(tally["max_abs_diff"], diff)
                if not (got.shape == want.shape and np.allclose(got, want, rtol=RTOL, atol=ATOL)):
                    tally["mismatches"] += 1
    finally:
        await client.close()


async def drive(url: str, work: Workload, references: list[dict], seconds: float) -> tuple[dict, float]:
    tally = {"errors": 0, "mismatches": 0, "max_abs_diff": 0.0, "latencies_s": []}
    start = time.perf_counter()
    await asyncio.gather(*(client_loop(url, work, i, references[i], start + seconds, tally)
                           for i in range(len(work.feeds))))
    return tally, time.perf_counter() - start


def measure(work: Workload, references: list[dict], max_batch_size: int, seconds: float, warmup_s: float,
            folder: Path, server_args: list[str]) -> LoadResult:
    process, grpc_port = start_server(work.engine, max_batch_size, folder / f"{work.name}-{max_batch_size}.log",
                                      server_args)
    try:
        url = f"127.0.0.1:{grpc_port}"
        asyncio.run(drive(url, work, references, warmup_s))   # first calls: connections, lazy set-up
        rss_start = rss_mib(process.pid)
        tally, elapsed_s = asyncio.run(drive(url, work, references, seconds))
        rss_end = rss_mib(process.pid)
    finally:
        code = stop_server(process)
    if code != 0:
        raise RuntimeError(f"kiln serve exited with {code}")
    if "first_error" in tally:
        print(f"  first error: {tally['first_error']}")
    lat_ms = sorted(1000 * s for s in tally["latencies_s"]) or [float("nan")]
    return LoadResult(work.name, max_batch_size, len(work.feeds), len(tally["latencies_s"]),
                      len(tally["latencies_s"]) / elapsed_s, statistics.median(lat_ms),
                      lat_ms[min(len(lat_ms) - 1, int(0.99 * len(lat_ms)))], tally["errors"], tally["mismatches"],
                      tally["max_abs_diff"], rss_start, rss_end)


def main(argv: list[str] | None = None) -> list[LoadResult]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet18,bert", help=f"comma list of {sorted(BUILDERS)}")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (one row per request)")
    p.add_argument("--seconds", type=float, default=10, help="measured seconds per model and batching setting")
    p.add_argument("--warmup-seconds", type=float, default=1)
    p.add_argument("--batch-sizes", default="1,8", help="--max-batch-size settings to compare (1: batching off)")
    p.add_argument("--workdir", type=Path, default=None, help="where engines are built (reused if present)")
    p.add_argument("--threads", type=int, default=None, help="kiln serve --threads (default: kiln serve's)")
    p.add_argument("--max-queue-delay-us", type=int, default=0, help="kiln serve --max-queue-delay-us")
    args = p.parse_args(argv)
    server_args = ["--max-queue-delay-us", str(args.max_queue_delay_us)]
    server_args += ["--threads", str(args.threads)] if args.threads else []
    print(cpu_line())
    import kiln

    folder = args.workdir or Path(tempfile.mkdtemp(prefix="kiln-serve-load-"))
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    print(f"{'model':9} {'max_batch':>9} {'clients':>7} {'requests':>8} {'QPS':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'errors':>6} {'mismatch':>8} {'max|diff|':>9} {'RSS MiB start->end':>19}")
    for name in args.models.split(","):
        work = BUILDERS[name](folder, args.clients)
        engine = kiln.load(work.engine)
        references = [engine.run(feeds) for feeds in work.feeds]
        del engine
        for max_batch in (int(b) for b in args.batch_sizes.split(",")):
            r = measure(work, references, max_batch, args.seconds, args.warmup_seconds, folder,
                        server_args)
            results.append(r)
            print(f"{r.model:9} {r.max_batch_size:9d} {r.clients:7d} {r.requests:8d} {r.qps:8.1f} {r.p50_ms:8.2f} "
                  f"{r.p99_ms:8.2f} {r.errors:6d} {r.mismatches:8d} {r.max_abs_diff:9.2e} "
                  f"{r.rss_start_mib:8.0f} -> {r.rss_end_mib:6.0f}", flush=True)
    return results


if __name__ == "__main__":
    outcome = main()
    sys.exit(1 if any(r.errors or r.mismatches for r in outcome) else 0)
