"""kiln build MODEL.onnx -o ENGINE.kiln: optimize an ONNX model into an engine file."""
from __future__ import annotations

import argparse

from kiln.errors import Error


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="ONNX model file")
    p.add_argument("-o", "--output", required=True, help="engine file to write (.kiln)")
    p.add_argument("--verbose", action="store_true", help="log every pass, fusion and non-fusion")
    p.add_argument("--quiet", action="store_true", help="print warnings and errors only: no live progress display "
                                                        "(shown on a terminal otherwise), no info lines")
    p.add_argument("--export-layer-info", metavar="F", help="write layer info JSON (trtexec --exportLayerInfo schema)")
    p.add_argument("--profiling-verbosity", default="detailed", choices=["none", "layer_names_only", "detailed"],
                   help="layer-info verbosity (default: detailed, unlike trtexec)")
    add_layer_info_schema_argument(p)
    p.add_argument("--shapes", metavar="SPEC", help="fixed input shapes, e.g. input:1x3x224x224,mask:1x128")
    add_profile_arguments(p)
    add_precision_arguments(p)
    p.add_argument("--disable-pass", action="append", default=[], metavar="NAME", help="skip a pass by name")
    p.add_argument("--verify-each", action="store_true", help="verify the IR after every pass")
    add_tactic_arguments(p)


def add_layer_info_schema_argument(p: argparse.ArgumentParser, *flags: str) -> None:
    """--layer-info-schema 10|11: write layer info as TensorRT 10 (default) or TensorRT 11 writes it."""
    p.add_argument(*(flags or ("--layer-info-schema",)), dest="layer_info_schema", type=int, choices=[10, 11],
                   default=10, help="layer-info JSON schema: 10 (Bindings, Format/Datatype; default) or 11 (TensorRT "
                                    "11: I/O Tensors, Format and Datatype apart, ProfilingVerbosity)")


def add_profile_arguments(p: argparse.ArgumentParser, spelling: str = "kebab") -> None:
    """Optimization profiles: the k-th --min/--opt/--max-shapes flags make profile k (trtexec's rule)."""
    for bound in ("min", "opt", "max"):
        flag = f"--{bound}-shapes" if spelling == "kebab" else f"--{bound}Shapes"
        p.add_argument(flag, dest=f"{bound}_shapes", action="append", default=[], metavar="SPEC",
                       help=f"{bound} shapes of a dynamic-shape profile, e.g. input_ids:1x16,attention_mask:1x16; "
                            "repeat the min/opt/max trio for more profiles" if bound == "min" else
                            f"{bound} shapes of the profile (see --min-shapes)")


def add_precision_arguments(p: argparse.ArgumentParser, spelling: str = "kebab") -> None:
    kebab = spelling == "kebab"
    p.add_argument("--fp16", action="store_true", help="allow FP16 layers (granted only where faster kernels exist)")
    p.add_argument("--bf16", action="store_true", help="allow BF16 layers (granted only where faster kernels exist)")
    p.add_argument("--best", action="store_true", help="allow every precision kiln has kernels for (trtexec --best): "
                                                       "INT8 where the model's Q/DQ gives scales, BF16 elsewhere")
    p.add_argument("--int8", action="store_true", help="INT8 for conv/matmul layers: from the model's Q/DQ, or "
                                                       "calibrated with --calib")
    p.add_argument("--strongly-typed" if kebab else "--stronglyTyped", dest="strongly_typed", action="store_true",
                   help="compute in the model's own float16/bfloat16 types (default: weakly typed, as TensorRT: "
                        "such models build in FP32 unless --fp16/--bf16 allow less)")
    p.add_argument("--calib", metavar="DATA", help="calibration data (.npz or a folder of .npz; needs onnxruntime: "
                                                   "pip install 'kiln[onnxruntime]') or a calibration cache (.json) "
                                                   "for --int8")
    p.add_argument("--calib-method" if kebab else "--calibMethod", dest="calib_method", default="entropy",
                   choices=["entropy", "minmax", "percentile"], help="calibrator for --int8 --calib")
    p.add_argument("--calib-cache" if kebab else "--calibCache", dest="calib_cache", metavar="F",
                   help="write the calibration scales to this JSON cache (read it back with --calib F)")
    p.add_argument("--layer-precisions" if kebab else "--layerPrecisions", dest="layer_precisions", metavar="SPEC",
                   help="per-layer precision, e.g. conv1:fp16,*:fp32")
    p.add_argument("--layer-output-types" if kebab else "--layerOutputTypes", dest="layer_output_types",
                   metavar="SPEC", help="per-layer output type (same spelling; recorded as the layer's request)")
    p.add_argument("--accuracy", metavar="METRIC:T",
                   help="accuracy budget for reduced precisions against the FP32 model (cos, l0, l1, l2, linf; "
                        "default cos:0.999 with --bf16/--best, 'off' for none): the fewest layers are kept in FP32 "
                        "to meet it")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance of the l0 accuracy metric")
    p.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance of the l0 accuracy metric")
    p.add_argument("--precision-constraints" if kebab else "--precisionConstraints", dest="precision_constraints",
                   default="none", choices=["none", "prefer", "obey"],
                   help="obey: an unmet precision request fails the build, naming the layer and why")


def precision_options(args) -> dict:
    from kiln.precision.policy import PrecisionOptions, parse_layer_precisions

    layers = {**parse_layer_precisions(getattr(args, "layer_output_types", None)),
              **parse_layer_precisions(getattr(args, "layer_precisions", None))}
    options = {"precision": PrecisionOptions(args.fp16, args.bf16, args.int8, layers, args.precision_constraints,
                                             getattr(args, "best", False), getattr(args, "strongly_typed", False))}
    if getattr(args, "accuracy", None):   # checked with the other options, before the model is read
        options.update(accuracy=args.accuracy, atol=args.atol, rtol=args.rtol)
    if getattr(args, "calib", None):
        options.update(calibration=args.calib, calibration_method=args.calib_method,
                       calibration_cache=args.calib_cache)
    return options


def profile_options(args) -> dict:
    from kiln.frontend.profiles import profiles_from_specs

    return {"profiles": tuple(profiles_from_specs(args.min_shapes, args.opt_shapes, args.max_shapes))}


def add_tactic_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tactic-sources", metavar="SPEC",
                   help="kernel sources: '+onnxruntime,-torch-onednn' edits the default set, 'torch' alone replaces it "
                        "(sources: onednn, torch-onednn, kiln, codegen, torch, onnxruntime, openvino)")
    p.add_argument("--timing-cache", metavar="F", help="read and update this timing cache file (JSON)")
    p.add_argument("--deterministic", action="store_true",
                   help="use only timings recorded in --timing-cache (same choices as the build that recorded them)")
    p.add_argument("--avg-timing", type=int, default=8, help="runs averaged per timing measurement")
    p.add_argument("--min-timing", type=int, default=3, help="measurement rounds per tactic (the fastest round counts)")
    p.add_argument("--builder-optimization-level", type=int, default=3, choices=range(0, 6), metavar="0-5",
                   help="0: no timing, take each layer's first eligible kernel; >=1: time every candidate")
    p.add_argument("--threads", type=int, default=None, help="CPU threads to tune and run with")


def parse_shapes(spec: str | None) -> dict[str, tuple[int, ...]]:
    """`name:1x3x224x224,other:1x16` (trtexec spelling; quotes around names allowed)."""
    from kiln.frontend.profiles import parse_shape_list

    return parse_shape_list(spec) if spec else {}


def tactic_options(args) -> dict:
    from kiln.tactics.registry import parse_sources

    return {"tactic_sources": parse_sources(args.tactic_sources), "timing_cache": args.timing_cache,
            "avg_timing": max(1, args.avg_timing), "min_timing": max(1, args.min_timing),
            "autotune": args.builder_optimization_level > 0, "deterministic": getattr(args, "deterministic", False)}


def build_engine(args, progress=None):
    import kiln
    from kiln.runtime.engine import set_threads

    set_threads(args.threads)
    return kiln.build(args.model, input_shapes=parse_shapes(args.shapes), disabled_passes=frozenset(args.disable_pass),
                      verify_each=args.verify_each, progress=progress, **profile_options(args),
                      **tactic_options(args), **precision_options(args))


def run(args: argparse.Namespace) -> int:
    import logging

    from kiln.cli import console
    from kiln.cli.progress_display import live_build_display, wants_live_display
    from kiln.trt.layer_info import dumps
    from kiln.plan.serialize import atomic_write_text

    quiet = getattr(args, "quiet", False)
    if quiet:
        logging.getLogger("kiln").setLevel(logging.WARNING)
    with live_build_display(wants_live_display(quiet, args.verbose)) as display:
        engine = build_engine(args, display)
    engine.save(args.output)
    say = (lambda message: None) if quiet else console.info
    mem = engine.plan.memory
    say(f"Engine: {len(engine.plan.layers)} layers, activation memory {mem.total_bytes} bytes "
        f"({mem.unshared_bytes} without reuse), weights {engine.plan.weight_bytes} bytes")
    say(f"Saved engine to {args.output}")
    if args.export_layer_info:
        info = engine.layer_info(args.profiling_verbosity, schema=args.layer_info_schema)
        atomic_write_text(args.export_layer_info, dumps(info))
        say(f"Layer info written to {args.export_layer_info}")
    return 0
