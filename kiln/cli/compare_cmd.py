"""kiln compare MODEL.onnx ENGINE.kiln: check an engine's outputs (and, with --layerwise, its intermediates)
against onnxruntime on the same inputs. Exit 0 if every output is within tolerance, 1 if not. Needs onnxruntime
(an optional extra: pip install 'kiln[onnxruntime]'); without it, exit 2 saying so."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the ONNX model the engine was built from (the reference)")
    p.add_argument("engine", help="engine file (.kiln)")
    p.add_argument("--inputs", metavar="IN.npz", help="inputs by name (default: random values at the opt shapes)")
    p.add_argument("--layerwise", action="store_true",
                   help="also compare every engine tensor that is an ONNX tensor; name the first that diverges")
    p.add_argument("--rtol", type=float, default=1e-4, help="pass if max|kiln-ort| <= atol + rtol * max|ort|")
    p.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance (see --rtol)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--min-cosine", type=float, default=None,
                   help="also pass a float tensor whose cosine similarity is at least this (default 0.999 for "
                        "engines with INT8 layers, off otherwise)")
    p.add_argument("--json", metavar="OUT.json", help="write the report as JSON")


def run(args: argparse.Namespace) -> int:
    from kiln.cli import console
    from kiln.fileio import atomic_write_text
    from kiln.tools.compare import compare

    report = compare(args.model, args.engine, args.inputs, layerwise=args.layerwise, rtol=args.rtol,
                     atol=args.atol, seed=args.seed, min_cosine=args.min_cosine)
    console.info(f"Inputs: {report.inputs}; tolerance: max abs err <= {report.atol:g} + {report.rtol:g} * max|ort|")
    if report.layerwise:
        _table(f"{report.engine}: {len(report.layers)} intermediate tensors vs onnxruntime", report.layers, True)
        for s in report.skipped:
            console.info(f"Skipped '{s.name}' ({s.layer}): {s.reason}")
        first = report.first_divergence
        if first is None:
            console.info("Layerwise: every compared tensor is within tolerance")
        else:
            console.info(f"First divergence: layer '{first.layer}' (tensor '{first.name}', ONNX node "
                         f"'{first.onnx_node}'): max rel err {first.max_rel_err:.3g}, cosine {first.cosine:.6f}"
                         + (f" ({first.note})" if first.note else ""))
    _table(f"{report.engine} vs {report.model}: outputs", report.outputs, False)
    if args.json:
        atomic_write_text(args.json, json.dumps(report.to_dict(), indent=2) + "\n")
        console.info(f"Report written to {args.json}")
    failed = [o.name for o in report.outputs if not o.passed]
    console.info("PASSED" if not failed else f"FAILED: output(s) {failed} exceed the tolerance")
    return 0 if not failed else 1


def _table(title: str, rows, with_layer: bool) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(title))
    columns = (["#", "Layer"] if with_layer else []) + ["Tensor", "Shape", "Max abs err", "Mean abs err",
                                                        "Max rel err", "Cosine", "Argmax", "Result"]
    for col in columns:
        table.add_column(col, overflow="fold", justify="left" if col in ("Layer", "Tensor", "Result") else "right")
    for i, t in enumerate(rows):
        row = ([str(i), t.layer] if with_layer else []) + [
            t.name, "x".join(map(str, t.shape)), f"{t.max_abs_err:.3g}", f"{t.mean_abs_err:.3g}",
            f"{t.max_rel_err:.3g}", f"{t.cosine:.6f}",
            "" if t.argmax_agreement is None else f"{t.argmax_agreement:.1%}",
            ("pass" if t.passed else "FAIL") + (f" ({t.note})" if t.note else "")]
        table.add_row(*(Text(c) for c in row))   # plain text: layer names contain "[/...]"
    Console(width=200).print(table)
