"""kiln export model-explorer FILE -o DIR: Google Model Explorer's graph JSON of an engine (one node per layer,
grouped by the module path of its ONNX nodes, edges from tensors) and node-data overlays: precision and tactic as
labels, latency as a gradient with --profile. Open them with the command it prints (pip install 'kiln[explorer]')."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help=".kiln engine, trtexec --exportLayerInfo JSON, or a log with a layer dump")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="folder for graph.json, precision.json, tactic.json (and latency.json with --profile)")
    p.add_argument("--profile", metavar="P", help="trtexec/kiln --exportProfile JSON: latency.json, a gradient")
    p.add_argument("--name", help="graph id and label in Model Explorer (default: FILE's name without suffix)")


def graph_name(path: str) -> str:
    """"resnet18.layers.json" -> "resnet18"; "demo.kiln" -> "demo"."""
    name = Path(path).name
    for suffix in (".json", ".log", ".txt", ".kiln", ".layers"):
        name = name.removesuffix(suffix)
    return name or Path(path).name


def run(args: argparse.Namespace) -> int:
    from kiln.cli import console
    from kiln.cli.inspect_cmd import load_engine_info, load_profile
    from kiln.tools.model_explorer import write_model_explorer

    engine = load_engine_info(args.file)
    profile = load_profile(args.profile)
    files = write_model_explorer(engine, args.output, args.name or graph_name(args.file), profile or engine.profile,
                                 args.profile or args.file)
    for path in files.removed:
        console.info(f"removed {path}: this export has no data for it")
    console.info(f"wrote {files.graph} ({len(engine.layers)} layers) and "
                 f"{', '.join(p.name for p in files.overlays) or 'no overlays'}")
    console.info(f"open with: {files.command()}")
    return 0
