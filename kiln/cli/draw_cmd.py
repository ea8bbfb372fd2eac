"""kiln draw FILE -o OUT.svg|OUT.dot: the engine's layer graph, drawn by Graphviz (or as DOT text for .dot/.gv).
Nodes are coloured by precision, fused names stacked, regions clustered; --profile adds average times."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help=".kiln engine, trtexec --exportLayerInfo JSON, or a log with a layer dump")
    p.add_argument("--profile", metavar="P", help="trtexec/kiln --exportProfile JSON to show average times")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="out.svg, or out.dot for Graphviz text")


def run(args: argparse.Namespace) -> int:
    from kiln.cli import console
    from kiln.cli.inspect_cmd import load_engine_info, load_profile
    from kiln.errors import Error
    from kiln.fileio import atomic_write_text
    from kiln.inspect.render import render_svg, to_dot

    out = args.output
    as_dot = out.lower().endswith((".dot", ".gv"))
    if not as_dot and not out.lower().endswith(".svg"):
        raise Error(f"{out}: unknown output kind; hint: name it .svg (drawn with Graphviz) or .dot (DOT text)")
    engine = load_engine_info(args.file)
    dot = to_dot(engine, load_profile(args.profile))
    atomic_write_text(out, dot if as_dot else render_svg(dot))
    console.info(f"wrote {out} ({len(engine.layers)} layers)")
    return 0
