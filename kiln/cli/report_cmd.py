"""kiln report FILE -o out.html: one self-contained HTML page about a kiln or TensorRT engine description.
Summary, sortable layer table, time charts, lint findings, the ONNX nodes' layers, precisions and time shares
(`--model` resolves regions and splits by FLOPs), and the layer graph when Graphviz `dot` is installed."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help=".kiln engine, trtexec --exportLayerInfo JSON, or a log with a layer dump")
    p.add_argument("--profile", metavar="P", help="trtexec/kiln --exportProfile JSON (times, charts, time rules)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="the HTML file to write")
    p.add_argument("--title", help="page title (default: kiln report: FILE)")
    p.add_argument("--model", metavar="MODEL.onnx", help="the ONNX model, for the by-ONNX-node table: resolves "
                   "{ForeignNode[...]} ranges and splits fused layers' time by FLOPs")


def graph(engine, profile) -> tuple[str | None, str | None]:
    """(svg, None) when Graphviz can draw the engine, else (None, why not)."""
    from kiln.errors import Error
    from kiln.inspect.render import render_svg, to_dot

    try:
        return render_svg(to_dot(engine, profile)), None
    except Error as exc:
        return None, f"Graph not included: {exc}. `kiln draw FILE -o out.dot` writes the DOT text instead."


def run(args: argparse.Namespace) -> int:
    from kiln.cli import console
    from kiln.cli.inspect_cmd import load_engine_info, load_profile
    from kiln.inspect.lint import lint
    from kiln.cli.by_onnx_output import load_model_nodes
    from kiln.inspect.report import write_report

    engine = load_engine_info(args.file)
    profile = load_profile(args.profile) or engine.profile
    svg, note = graph(engine, profile)
    if note:
        console.info(note)
    write_report(args.output, engine, profile=profile, findings=lint(engine, profile), svg=svg,
                 title=args.title or f"kiln report: {Path(args.file).name}", graph_note=note,
                 model=load_model_nodes(args.model))
    console.info(f"wrote {args.output}")
    return 0
