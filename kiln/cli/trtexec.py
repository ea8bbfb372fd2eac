"""kiln trtexec --onnx=M.onnx --saveEngine=E.kiln ...: trtexec's own flags, so existing scripts port by renaming."""
from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

from kiln.cli.build import add_layer_info_schema_argument, add_precision_arguments, add_profile_arguments
from kiln.errors import Error


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--onnx", help="ONNX model to build")
    a("--saveEngine", help="write the built engine here")
    a("--loadEngine", help="load an engine instead of building")
    a("--exportLayerInfo", help="layer info JSON")
    a("--exportProfile", help="per-layer profile JSON")
    a("--exportTimes", help="per-inference times JSON")
    a("--exportOutput", help="outputs (.npz; trtexec writes JSON)")
    a("--loadInputs", help="inputs: an .npz file (trtexec's name:file.bin lists are not supported)")
    a("--profilingVerbosity", default="detailed", choices=["none", "layer_names_only", "detailed"])
    add_layer_info_schema_argument(p, "--layerInfoSchema", "--layer-info-schema")
    a("--verbose", action="store_true")
    a("--dumpLayerInfo", action="store_true")
    a("--dumpProfile", action="store_true")
    a("--separateProfileRun", action="store_true", help="accepted; kiln always profiles in a separate run")
    a("--iterations", type=int, default=10)
    a("--warmUp", type=float, default=200.0, help="warm-up time in ms")
    a("--duration", type=float, default=3.0, help="minimum timed seconds")
    a("--avgRuns", type=int, default=10, help="accepted for compatibility")
    a("--percentile", default="90,95,99")
    a("--shapes", help="name:1x3x224x224,...: run-time shapes; with no --min/opt/maxShapes also the build's shapes")
    add_profile_arguments(p, spelling="camel")
    add_precision_arguments(p, spelling="camel")
    a("--threads", type=int, default=None, help="kiln: intra-op CPU threads")
    a("--skipInference", action="store_true", help="build only")
    a("--tacticSources", help="e.g. -onnxruntime,+torch-onednn")
    a("--timingCacheFile", help="timing cache JSON")
    a("--avgTiming", type=int, default=8)
    a("--minTiming", type=int, default=3)
    a("--builderOptimizationLevel", type=int, default=3)


def _warmup_iterations(engine, feeds, warmup_ms: float) -> None:
    import time

    ctx = engine.create_execution_context()
    start = time.perf_counter()
    ctx.execute(feeds)
    while (time.perf_counter() - start) * 1e3 < warmup_ms:
        ctx.execute(feeds)


def run(args: argparse.Namespace) -> int:
    import kiln
    from kiln.cli import console
    from kiln.cli.build import parse_shapes
    from kiln.cli.run import load_inputs, parse_percentiles, report
    from kiln.trt.layer_info import dumps
    from kiln.plan.serialize import atomic_write_text
    from kiln.runtime.engine import set_threads

    set_threads(args.threads)
    console.info("&&&& RUNNING kiln.trtexec # kiln trtexec " + " ".join(sys.argv[2:]))
    if bool(args.onnx) == bool(args.loadEngine):
        raise Error("give exactly one of --onnx=MODEL.onnx or --loadEngine=ENGINE.kiln")
    if args.onnx:
        from kiln.cli.build import tactic_options

        ns = SimpleNamespace(tactic_sources=args.tacticSources, timing_cache=args.timingCacheFile, deterministic=False,
                             avg_timing=args.avgTiming, min_timing=args.minTiming,
                             builder_optimization_level=args.builderOptimizationLevel)
        from kiln.cli.build import profile_options

        profiles = profile_options(args)
        fixed = {} if profiles["profiles"] else parse_shapes(args.shapes)
        from kiln.cli.build import precision_options

        engine = kiln.build(args.onnx, input_shapes=fixed, **profiles, **tactic_options(ns), **precision_options(args))
        if args.saveEngine:
            engine.save(args.saveEngine)
            console.info(f"Engine saved to {args.saveEngine}")
    else:
        engine = kiln.load(args.loadEngine)
    if args.exportLayerInfo:   # with --shapes, dynamic dimensions are resolved as trtexec's context does
        info = engine.layer_info(args.profilingVerbosity, parse_shapes(args.shapes) or None, args.layer_info_schema)
        atomic_write_text(args.exportLayerInfo, dumps(info))
    if not args.skipInference:
        feeds = load_inputs(args.loadInputs, engine, parse_shapes(args.shapes))
        _warmup_iterations(engine, feeds, args.warmUp)
        ns = SimpleNamespace(export_output=args.exportOutput, iterations=args.iterations, warmup=0,
                             duration=args.duration, export_times=args.exportTimes, export_profile=args.exportProfile,
                             dump_profile=args.dumpProfile, dump_layer_info=args.dumpLayerInfo,
                             profiling_verbosity=args.profilingVerbosity, layer_info_schema=args.layer_info_schema)
        report(engine, ns, feeds, parse_percentiles(args.percentile))
    elif args.dumpLayerInfo:
        from kiln.trt.layer_info import oneline

        console.info("Layer Information:")
        print(oneline(engine.layer_info("detailed", schema=args.layer_info_schema)))
    console.info("&&&& PASSED kiln.trtexec # kiln trtexec " + " ".join(sys.argv[2:]))
    return 0
