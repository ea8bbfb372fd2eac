"""Console output in trtexec's style: `[MM/DD/YYYY-HH:MM:SS] [I] message`, plus kiln's layer table."""
from __future__ import annotations

import logging
import sys
import time

LEVEL_TAGS = {logging.DEBUG: "V", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E", logging.CRITICAL: "E"}


class TrtexecFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%m/%d/%Y-%H:%M:%S", time.localtime(record.created))
        tag = "[kiln] " if record.name.startswith("kiln") else ""
        return f"[{stamp}] [{LEVEL_TAGS.get(record.levelno, 'I')}] {tag}{record.getMessage()}"


def setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(TrtexecFormatter())
    root = logging.getLogger("kiln")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False


def info(message: str = "") -> None:
    print(f"[{time.strftime('%m/%d/%Y-%H:%M:%S')}] [I] {message}")


def error(message: str) -> None:
    print(f"[{time.strftime('%m/%d/%Y-%H:%M:%S')}] [E] {message}", file=sys.stderr)


def layer_table(plan, profile=None) -> None:
    """A readable table of the engine's layers: type, tactic, output format, shape, origin count, time."""
    from kiln.trt.vocab import format_datatype, layer_type
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    times = {t.name: t for v in ("detailed", "layer_names_only") for t in profile.summary(v)} if profile else {}
    table = Table(title=Text(f"{plan.name}: {len(plan.layers)} layers"), show_lines=False)
    for col in ("#", "Layer", "Type", "Tactic", "Output", "Format/Datatype"):
        table.add_column(col, overflow="fold")
    if times:
        table.add_column("median ms", justify="right")
        table.add_column("%", justify="right")
    for i, layer in enumerate(plan.layers):
        rows = [(str(i), layer)] + [(f"  {i}.{j}", inner) for j, inner in enumerate(layer.inner)]
        for label, item in rows:
            out = item.outputs[0] if item.outputs else None
            name = item.name if item is layer else f"└ {item.name}"
            row = [label, name, layer_type(item), item.tactic_name,
                   "x".join(map(str, out.dims)) if out else "", format_datatype(out) if out else ""]
            if times:
                t = times.get(item.name)
                row += [f"{t.median_ms:.4f}" if t else "", f"{t.percentage:.1f}" if t else ""]
            table.add_row(*(Text(c) for c in row))   # plain text: layer names contain "[/...]"
    Console(width=200).print(table)


def record_table(info, profile, title: str) -> None:
    """A table of an inspected engine description (TensorRT or kiln), with times when a profile is given."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    times = {r.name: r for r in (profile or info.profile).records} if (profile or info.profile) else {}
    table = Table(title=Text(f"{title}: {len(info.layers)} layers ({info.source}, {info.verbosity})"))
    for col in ("#", "Layer", "Type", "Precision", "Tactic", "Output"):
        table.add_column(col, overflow="fold")
    if times:
        table.add_column("avg ms", justify="right")
    for i, layer in enumerate(info.layers):
        out = layer.outputs[0] if layer.outputs else None
        row = [str(i), layer.name, layer.layer_type or "", layer.precision or "", layer.tactic_name or "",
               "x".join(map(str, out.dims)) if out and out.dims else ""]
        if times:
            t = times.get(layer.name)
            row.append(f"{t.average_ms:.4f}" if t else "")
        table.add_row(*(Text(c) for c in row))
    Console(width=200).print(table)
    info_line = ", ".join(f"{k}: {v}" for k, v in sorted(info.layer_types.items()))
    print(f"Layer types: {info_line}")
    print("Precisions: " + ", ".join(f"{k}: {v}" for k, v in sorted(info.precisions.items())))
    for t in info.io_tensors:   # TensorRT 11's "I/O Tensors"
        ranges = "; ".join(f"profile {k}: " + " .. ".join("x".join(map(str, d)) for d in (p.min_dims, p.opt_dims,
                                                                                          p.max_dims) if d is not None)
                           for k, p in enumerate(t.profiles) if p.min_dims is not None)
        dims = "x".join(map(str, t.dims)) if t.dims is not None else "?"
        print(f"{t.io_mode or 'I/O'}: {t.name} {t.precision or t.data_type or ''} {dims}" + (f" ({ranges})" if ranges else ""))
    for note in info.notes:
        print(f"Note: {note}")
