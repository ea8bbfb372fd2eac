"""kiln inspect FILE: layers, types, precisions, tactics and memory of a kiln engine or of TensorRT's own
artifacts (layer info JSON of TensorRT 7-11, one-line dumps in logs, profiles); for a TensorRT 11.1 tuning cache
(--tuningCacheFile), every build route tried and the best one; --json for scripts. `--by onnx` lists the ONNX
nodes instead: the layer each one lives in, its precision and type, and its share of the layer's time."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kiln.cli.build import add_layer_info_schema_argument
from kiln.cli.by_onnx_output import add_by_onnx_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help=".kiln engine, trtexec --exportLayerInfo JSON, a log with a layer dump, or a "
                                "trtexec --tuningCacheFile tuning cache")
    p.add_argument("--profile", metavar="P", help="trtexec/kiln --exportProfile JSON to show times")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary")
    p.add_argument("--layer-info", metavar="VERBOSITY", choices=["none", "layer_names_only", "detailed"],
                   help="(.kiln engines) print layer info JSON in trtexec's schema instead")
    add_by_onnx_arguments(p)
    add_layer_info_schema_argument(p)


def is_kiln_engine(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == b"KILNPLAN"
    except OSError:
        return False


def load_engine_info(path: str):
    from kiln.errors import ArtifactError
    from kiln.trt.records import EngineInfo
    from kiln.trt.artifacts import read_artifact

    found = read_artifact(path)
    if type(found).__name__ == "TuningCache":
        raise ArtifactError(f"{path}: this is a TensorRT tuning cache, not an engine description; `kiln inspect "
                            f"{path}` shows its build routes")
    if not isinstance(found, EngineInfo):
        raise ArtifactError(f"{path}: this is a {type(found).__name__}, not an engine description; pass it with "
                            "--profile (profiles) or inspect the layer-info JSON / engine instead")
    return found


def load_profile(path: str | None):
    if not path:
        return None
    from kiln.errors import ArtifactError
    from kiln.trt.records import Profile
    from kiln.trt.artifacts import read_artifact

    found = read_artifact(path)
    if not isinstance(found, Profile):
        raise ArtifactError(f"{path}: not a profile (expected trtexec --exportProfile JSON)")
    return found


def kiln_summary(engine) -> dict:
    plan = engine.plan
    return {"activation_memory_bytes": plan.memory.total_bytes,
            "activation_memory_unshared_bytes": plan.memory.unshared_bytes,
            "weights_bytes": plan.weight_bytes, "build_info": plan.build_info,
            "inputs": [{"name": t.name, "dims": list(t.dims), "dtype": t.dtype} for t in plan.inputs],
            "outputs": [{"name": t.name, "dims": list(t.dims), "dtype": t.dtype} for t in plan.outputs]}


def run(args: argparse.Namespace) -> int:
    import kiln
    from kiln.cli import console
    from kiln.trt.layer_info import dumps
    from kiln.inspect.summary import engine_json

    kiln_engine = kiln.load(args.file, allow_other_device=True) if is_kiln_engine(args.file) or args.file.endswith(".kiln") else None
    if args.layer_info:
        if kiln_engine is None:
            from kiln.errors import ArtifactError

            raise ArtifactError(f"{args.file}: --layer-info re-exports kiln engines only")
        print(dumps(kiln_engine.layer_info(args.layer_info, schema=args.layer_info_schema)), end="")
        return 0
    if kiln_engine is None:
        from kiln.trt.artifacts import read_artifact
        from kiln.trt.tuning_cache import TuningCache

        found = read_artifact(args.file)
        if isinstance(found, TuningCache):
            return show_tuning_cache(found, args)
    info, profile = load_engine_info(args.file), load_profile(args.profile)
    if args.by == "onnx":
        return _by_onnx(args, info, profile)
    if args.model:
        from kiln.errors import Error

        raise Error("--model is used with --by onnx only")
    if args.json:
        doc = engine_json(info, profile)
        if kiln_engine is not None:
            doc.update(kiln_summary(kiln_engine))
        print(json.dumps(doc, indent=2, default=str))
        return 0
    if kiln_engine is not None:
        console.layer_table(kiln_engine.plan)
        mem = kiln_engine.plan.memory
        console.info(f"Activation memory: {mem.total_bytes} bytes planned ({mem.unshared_bytes} without buffer reuse)")
        console.info(f"Weights: {kiln_engine.plan.weight_bytes} bytes")
        return 0
    console.record_table(info, profile, Path(args.file).name)
    return 0


def _by_onnx(args: argparse.Namespace, info, profile) -> int:
    from kiln.cli.by_onnx_output import load_model_nodes, print_by_onnx, write_json
    from kiln.inspect.by_onnx import by_onnx, to_json

    result = by_onnx(info, profile, model=load_model_nodes(args.model))
    if args.json:
        write_json(to_json(result), "-")
    else:
        print_by_onnx(result, f"{Path(args.file).name} by ONNX node")
    return 0


def show_tuning_cache(cache, args: argparse.Namespace) -> int:
    from kiln.cli import console
    from kiln.inspect.summary import tuning_json

    if args.json:
        print(json.dumps(tuning_json(cache), indent=2))
    else:
        console.tuning_table(cache, Path(args.file).name)
    return 0
