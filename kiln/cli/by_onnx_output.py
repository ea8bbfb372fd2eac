"""What `kiln diff --by onnx` and `kiln inspect --by onnx` share: their options, the model loader, the rich table
of ONNX nodes and the JSON writer."""
from __future__ import annotations

import argparse
import json


def add_by_onnx_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--by", choices=["layer", "onnx"], default="layer",
                   help="layer: by engine layer (default); onnx: per ONNX node, the layer it lives in, that layer's "
                        "precision and type, and the node's share of its time")
    p.add_argument("--model", metavar="MODEL.onnx",
                   help="(--by onnx) the ONNX model: resolves {ForeignNode[...]} ranges and splits fused layers' "
                        "time by FLOPs")


def load_model_nodes(path: str | None):
    if not path:
        return None
    from kiln.inspect.onnx_nodes import load_model_nodes as load

    return load(path)


def write_json(doc, out: str) -> None:
    text = json.dumps(doc, indent=2, default=str) + "\n"
    if out == "-":
        print(text, end="")
        return
    from kiln.cli import console
    from kiln.fileio import atomic_write_text

    atomic_write_text(out, text)
    console.info(f"wrote {out}")


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def print_by_onnx(result, title: str) -> None:
    """The per-ONNX-node table (one engine or A against B), then how times were split and the notes."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    sides = ("A", "B") if result.engines == 2 else ("",)
    table = Table(title=Text(title))
    table.add_column("ONNX node", overflow="fold")
    for side in sides:
        for col in ("layer", "type", "precision", "ms"):
            table.add_column(f"{side} {col}".strip(), overflow="fold", justify="right" if col == "ms" else "left")
    if result.engines == 2:
        table.add_column("Δ ms", justify="right")
    for row in result.rows:
        cells = [row.onnx_node]
        for p in (row.a, row.b)[:len(sides)]:
            s = p.primary if p else None
            more = f" (+{len(p.shares) - 1})" if p and len(p.shares) > 1 else ""
            cells += [s.layer + more, s.layer_type or "", s.precision or "", _ms(p.time_ms)] if s else ["", "", "", ""]
        if result.engines == 2:
            timed = any(p is not None and p.time_ms is not None for p in (row.a, row.b))
            cells.append(f"{row.delta_ms:+.4f}" if timed else "")
        table.add_row(*(Text(c) for c in cells))
    Console(width=200).print(table)
    print(f"Time inside a layer holding several ONNX nodes is split {result.split}.")
    for note in result.notes:
        print(f"Note: {note}")
