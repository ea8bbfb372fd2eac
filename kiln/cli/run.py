"""kiln run ENGINE.kiln: run an engine, print trtexec's performance summary, export profile/times/outputs."""
from __future__ import annotations

import argparse
import time

import numpy as np

from kiln.errors import Error, InputError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("engine", help="engine file (.kiln)")
    p.add_argument("--inputs", metavar="IN.npz", help="inputs by name (default: random values)")
    p.add_argument("--allow-other-device", action="store_true",
                   help="load an engine built on another CPU model (its tactic timings came from there)")
    p.add_argument("--check-nan", action="store_true",
                   help="report the first layer whose output holds NaN/Inf (or an input that does); exit 1 if any")
    p.add_argument("--shapes", metavar="SPEC", help="run-time shapes of dynamic inputs for random values, "
                                                    "e.g. input_ids:4x77 (default: the profile's opt shapes)")
    p.add_argument("--export-output", metavar="OUT.npz", help="write the outputs of the first inference")
    p.add_argument("--iterations", type=int, default=10, help="timed inferences (at least)")
    p.add_argument("--duration", type=float, default=0.0, help="run at least this many seconds")
    p.add_argument("--warmup", type=int, default=2, help="untimed inferences first")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    p.add_argument("--percentile", default="90,95,99", help="latency percentiles to report")
    p.add_argument("--export-profile", metavar="F", help="per-layer profile JSON (trtexec --exportProfile)")
    p.add_argument("--export-times", metavar="F", help="per-inference times JSON (trtexec --exportTimes)")
    p.add_argument("--dump-profile", action="store_true", help="print the per-layer profile table")
    p.add_argument("--dump-layer-info", action="store_true", help="print layer info (one line per layer)")
    p.add_argument("--profiling-verbosity", default="detailed", choices=["layer_names_only", "detailed"],
                   help="detailed: a region's profile entry is split into its inner layers")


def load_inputs(path: str | None, engine, shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
    if not path:
        from kiln.runtime.executor import check_shapes

        unknown = sorted(set(shapes or {}) - set(engine.input_names))
        if unknown:
            raise InputError(f"--shapes names unknown input(s) {unknown}; the engine's inputs are {engine.input_names}")
        feeds = engine.random_inputs(shapes=shapes)
        check_shapes(engine.plan, {k: v.shape for k, v in feeds.items()})
        return feeds
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read inputs ({exc}); expected an .npz with one array per input name") from None


def measure(engine, feeds, iterations: int, warmup: int, duration_s: float):
    from kiln.runtime.profiler import InferenceTime

    ctx = engine.create_execution_context()
    for _ in range(warmup):
        ctx.execute(feeds)
    times, origin = [], time.perf_counter()
    while len(times) < iterations or (time.perf_counter() - origin) < duration_s:
        t0 = time.perf_counter()
        ctx.execute(feeds)
        times.append(InferenceTime((t0 - origin) * 1e3, (time.perf_counter() - origin) * 1e3))
    return times


def profile(engine, feeds, iterations: int):
    from kiln.runtime.profiler import LayerProfiler

    prof = LayerProfiler()
    ctx = engine.create_execution_context()
    for _ in range(iterations):
        ctx.execute(feeds, prof)
        prof.end_inference()
    prof.finish()
    return prof


def report(engine, args, feeds, percentiles) -> int:
    from kiln.cli import console
    from kiln.trt.layer_info import oneline
    from kiln.plan.serialize import atomic_write_bytes, atomic_write_text
    from kiln.trt.profile import performance_summary, profile_json, profile_table, times_json

    if getattr(args, "check_nan", False):
        bad = engine.first_nonfinite(feeds)
        if bad:
            layer, tensor, nans, infs = bad
            where = f"input '{tensor}'" if layer == "(input)" else f"layer '{layer}' (output '{tensor}')"
            console.error(f"first non-finite values: {where} has {nans} NaN and {infs} Inf")
            return 1
        console.info("check-nan: every layer output is finite")
    outputs = engine.run(feeds)
    if args.export_output:
        import io

        buf = io.BytesIO()
        np.savez(buf, **outputs)
        atomic_write_bytes(args.export_output, [buf.getvalue()])
    times = measure(engine, feeds, max(args.iterations, 1), args.warmup, args.duration)
    console.info(f"Timing trace has {len(times)} queries over {(times[-1].end_ms - times[0].start_ms) / 1000:g} s")
    console.info()
    for line in performance_summary(times, percentiles):
        console.info(line)
    if args.export_times:
        atomic_write_text(args.export_times, times_json(times))
    if args.export_profile or args.dump_profile:
        prof = profile(engine, feeds, max(args.iterations, 1))
        verbosity = getattr(args, "profiling_verbosity", "detailed")
        if args.export_profile:
            atomic_write_text(args.export_profile, profile_json(prof, verbosity))
        if args.dump_profile:
            console.info()
            for line in profile_table(prof, verbosity).splitlines():
                console.info(line)
    if args.dump_layer_info:
        console.info("Layer Information:")
        print(oneline(engine.layer_info("detailed", schema=getattr(args, "layer_info_schema", 10))))
    return 0


def parse_percentiles(spec: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in spec.split(",") if p.strip())
    except ValueError:
        raise Error(f"bad --percentile '{spec}': expected numbers like 90,95,99") from None


def run(args: argparse.Namespace) -> int:
    import kiln
    from kiln.runtime.engine import set_threads

    set_threads(args.threads)
    engine = kiln.load(args.engine, allow_other_device=args.allow_other_device)
    from kiln.cli.build import parse_shapes

    feeds = load_inputs(args.inputs, engine, parse_shapes(args.shapes))
    return report(engine, args, feeds, parse_percentiles(args.percentile))
