"""kiln debug precision MODEL.onnx --bf16|--int8 --calib DATA [--accuracy cos:0.999]: the ONNX nodes that must
stay in FP32 for the reduced-precision build to meet the accuracy budget (Polygraphy's `debug precision`,
answered with ONNX node names). For --int8 a node kept in FP32 is one calibration leaves unquantized. Prints them,
one per line after a table of every reduced layer; --json writes the report.

kiln debug reduce MODEL.onnx --check "CMD {model}" [-o reduced.onnx]: the smallest subgraph of MODEL for which
CMD still fails (Polygraphy's `debug reduce`); writes it and prints the nodes left."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kiln.cli.build import add_precision_arguments, add_tactic_arguments

    sub = p.add_subparsers(dest="tool", required=True)
    precision = sub.add_parser("precision", help="find the layers (ONNX nodes) that must stay in FP32",
                               description=__doc__)
    precision.add_argument("model", help="ONNX model file")
    precision.add_argument("--json", metavar="OUT.json", help="write the report as JSON")
    add_precision_arguments(precision)
    add_tactic_arguments(precision)
    _add_reduce_arguments(sub)


def _add_reduce_arguments(sub) -> None:
    reduce = sub.add_parser(
        "reduce", help="reduce a model to the smallest subgraph for which a check command still fails",
        description="Bisect from the outputs, then from the inputs, then remove single nodes, keeping each smaller "
                    "model for which --check still fails; cut tensors become graph inputs/outputs with their "
                    "shape and dtype from ONNX shape inference or onnxruntime.")
    reduce.add_argument("model", help="ONNX model file")
    reduce.add_argument("--check", required=True, metavar="CMD",
                        help="command run on each candidate, {model} replaced by its path; it fails when it exits "
                             "non-zero (e.g. \"kiln build {model} -o /tmp/x.kiln\")")
    reduce.add_argument("--fail-regex", metavar="RE",
                        help="count a non-zero exit as a failure only when the command's output matches RE")
    reduce.add_argument("--shell", action="store_true", help="run CMD through the shell (pipes, globs, &&)")
    reduce.add_argument("--check-timeout", type=float, metavar="S",
                        help="seconds one check may run; a check that runs longer counts as failing")
    reduce.add_argument("-o", "--output", default="reduced.onnx", help="reduced model to write (reduced.onnx)")


def run(args: argparse.Namespace) -> int:
    if args.tool == "reduce":
        return _run_reduce(args)
    from kiln.cli import console
    from kiln.cli.build import precision_options, tactic_options
    from kiln.fileio import atomic_write_text
    from kiln.runtime.engine import set_threads
    from kiln.tools.debug_precision import debug_precision

    set_threads(args.threads)
    report = debug_precision(args.model, **tactic_options(args), **precision_options(args))
    _table(report)
    held = f" (checked as {report.checked_as})" if report.checked_as not in ("", report.budget) else ""
    console.info(f"Budget {report.budget}{held}: all reduced {report.score_all_reduced:.8g}, "
                 f"final {report.score_final:.8g}")
    nodes = report.keep_fp32_nodes
    console.info(f"{len(nodes)} ONNX node(s) must stay in FP32" + (":" if nodes else ""))
    for node in nodes:
        print(node)
    if args.json:
        atomic_write_text(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
        console.info(f"Report written to {args.json}")
    return 0


def _table(report) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(f"layers that ran in a reduced precision, most sensitive first ({report.budget})"))
    for col in ("Layer", "ONNX nodes", "Score, only it reduced", "Score, only it FP32", "Keep FP32", "Granted"):
        table.add_column(col, overflow="fold")
    for v in report.verdicts:
        scores = ["" if s is None else f"{s:.8g}" for s in (v.score_alone_reduced, v.score_alone_fp32)]
        table.add_row(*(Text(c) for c in (v.layer, ", ".join(v.onnx_nodes), *scores, "yes" if v.keep_fp32 else "",
                                          v.granted)))
    Console(width=200).print(table)


def _run_reduce(args: argparse.Namespace) -> int:
    from kiln.cli import console
    from kiln.fileio import atomic_write_bytes
    from kiln.tools.reduce import Check, reduce_model

    check = Check(args.check, shell=args.shell, fail_regex=args.fail_regex, timeout_s=args.check_timeout)
    result = reduce_model(args.model, check)
    atomic_write_bytes(args.output, [result.model.SerializeToString()])
    console.info(f"Reduced {args.model} from {result.original_node_count} to {len(result.nodes)} node(s) in "
                 f"{result.checks_run} checks; written to {args.output}")
    graph = result.model.graph
    console.info("Inputs: " + ", ".join(vi.name for vi in graph.input) + "; outputs: " +
                 ", ".join(vi.name for vi in graph.output))
    console.info("Nodes left:")
    for node in result.nodes:
        print(node)
    return 0
