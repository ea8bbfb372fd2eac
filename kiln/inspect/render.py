"""Render an engine description (kiln.trt.records.EngineInfo) as a Graphviz DOT graph, and DOT as SVG.

One node per layer, coloured by precision (a legend node lists the colours); fused names stacked one part per
line; the layer type (and, with a profile, the average time) on the last line; Reformat/NoOp layers drawn small
and dashed, pure Q/DQ layers in their own colour; layers of a region grouped in a `cluster_` subgraph labelled with
the region name; edges from producer to consumer by tensor name, graph inputs and outputs as small ellipses.
Names-only engines carry no tensors: their layers are drawn as a chain in engine order, which the graph label says.
"""
from __future__ import annotations

import re
import shutil
import subprocess

from kiln.errors import Error
from kiln.inspect.lint import is_qdq
from kiln.trt.records import EngineInfo, LayerRecord, Profile

PRECISION_COLOURS = {"FP32": "#9ecae1", "FP16": "#a1d99b", "BF16": "#74c476", "INT8": "#fdae6b", "FP8": "#fc9272",
                     "unknown": "#e0e0e0"}
QDQ_COLOUR = "#bcbddc"
REFORMAT_COLOUR = "#f7f7f7"
MAX_PART = 48          # characters per name part before truncation
MAX_PARTS = 8          # name parts per node before "… (+N more)"
_DOT_SPECIAL = re.compile(r'([\\"{}<>|])')
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
NL = "\\n"            # a line break inside a DOT label
NOT_FOUND = "Graphviz 'dot' not found; install graphviz (make does: apt-get install graphviz)"


def dot_escape(text: str) -> str:
    """Text for a double-quoted DOT string: control characters become spaces; quotes, backslashes, braces,
    angle brackets and bars are backslash-escaped (Graphviz prints the character itself)."""
    return _DOT_SPECIAL.sub(r"\\\1", _CONTROL.sub(" ", text))


def truncate(text: str, limit: int = MAX_PART) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def precision_colour(layer: LayerRecord) -> str:
    return PRECISION_COLOURS.get(layer.precision or "unknown", PRECISION_COLOURS["unknown"])


def is_plumbing(layer: LayerRecord) -> bool:
    """Reformat and NoOp layers: drawn small and dashed."""
    return layer.is_reformat or layer.layer_type == "NoOp" or layer.parameter_type == "Reformat"


def is_pure_qdq(layer: LayerRecord) -> bool:
    """A Q/DQ layer on its own (Origin "QDQ", or every fused part a Quantize/Dequantize name) - not a conv that
    absorbed its Q/DQ pair."""
    if layer.params.get("Origin") == "QDQ":
        return True
    return is_qdq(layer) and all(is_qdq(LayerRecord(p)) for p in layer.fused_names)


def node_label(layer: LayerRecord, avg_ms: float | None) -> str:
    """Fused name parts one per line (escaped, truncated), then "type precision [avg ms]"."""
    parts = layer.fused_names or (layer.name,)
    lines = [dot_escape(truncate(p)) for p in parts[:MAX_PARTS]]
    if len(parts) > MAX_PARTS:
        lines.append(f"… (+{len(parts) - MAX_PARTS} more)")
    kind = layer.layer_type or layer.parameter_type or "?"
    detail = f"{kind} · {layer.precision or 'unknown'}"
    if avg_ms is not None:
        detail += f" · {avg_ms:.3f} ms"
    lines.append(dot_escape(detail))
    return NL.join(lines)


def node_attrs(layer: LayerRecord, avg_ms: float | None) -> str:
    label = node_label(layer, avg_ms)
    if is_pure_qdq(layer):
        return f'label="{label}", shape=cds, style="filled,dashed", fillcolor="{QDQ_COLOUR}", fontsize=9'
    if is_plumbing(layer):
        return (f'label="{label}", shape=cds, style="filled,dashed", fillcolor="{REFORMAT_COLOUR}", '
                f'color="{precision_colour(layer)}", penwidth=2, fontsize=8, height=0.3')
    return f'label="{label}", shape=box, style="rounded,filled", fillcolor="{precision_colour(layer)}"'


def legend() -> list[str]:
    rows = "".join(f'<TR><TD BGCOLOR="{c}">{p}</TD></TR>' for p, c in PRECISION_COLOURS.items())
    rows += f'<TR><TD BGCOLOR="{QDQ_COLOUR}">Q/DQ</TD></TR><TR><TD BGCOLOR="{REFORMAT_COLOUR}">Reformat/NoOp' \
            '</TD></TR>'
    return [f'  legend [shape=plaintext, label=<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0">'
            f'<TR><TD><B>precision</B></TD></TR>{rows}</TABLE>>];']


def _times(profile: Profile | None) -> dict[str, float]:
    return {r.name: r.average_ms for r in profile.records} if profile else {}


def _layer_nodes(engine: EngineInfo, times: dict[str, float]) -> list[str]:
    """Node statements, layers of one region inside a `subgraph cluster_N` (consecutive or not)."""
    lines, clusters = [], {}
    for i, layer in enumerate(engine.layers):
        stmt = f"L{i} [{node_attrs(layer, times.get(layer.name))}];"
        if layer.region:
            clusters.setdefault(layer.region, []).append(stmt)
        else:
            lines.append("  " + stmt)
    for n, (region, stmts) in enumerate(clusters.items()):
        lines.append(f"  subgraph cluster_{n} {{")
        lines.append(f'    label="{dot_escape(truncate(region, 80))}"; style="rounded,dashed"; color="#636363";')
        lines.extend("    " + s for s in stmts)
        lines.append("  }")
    return lines


def _tensor_edges(engine: EngineInfo) -> list[str]:
    """Producer -> consumer edges by tensor name; unproduced inputs and graph outputs as ellipse nodes."""
    producer = {t.name: f"L{i}" for i, layer in enumerate(engine.layers) for t in layer.outputs}
    consumed = {t.name for layer in engine.layers for t in layer.inputs}
    outputs = [b for b in engine.bindings if b in producer] if engine.bindings else \
        [t for t in producer if t not in consumed]
    ends, lines = {}, []

    def end(tensor: str, role: str) -> str:
        if (tensor, role) not in ends:
            ends[tensor, role] = node = f"T{len(ends)}"
            bold = ", penwidth=2" if tensor in engine.bindings else ""
            lines.append(f'  {node} [label="{dot_escape(truncate(tensor))}", shape=ellipse, fontsize=9, '
                         f'height=0.3{bold}];')
        return ends[tensor, role]

    edges: dict[str, None] = {}                  # ordered set: a tensor read twice by one layer is one edge
    for i, layer in enumerate(engine.layers):
        for t in layer.inputs:
            edges[f"  {producer.get(t.name) or end(t.name, 'in')} -> L{i};"] = None
    for tensor in outputs:
        edges[f"  {producer[tensor]} -> {end(tensor, 'out')};"] = None
    return lines + list(edges)


def _chain_edges(engine: EngineInfo) -> list[str]:
    return [f"  L{i} -> L{i + 1};" for i in range(len(engine.layers) - 1)]


def has_tensors(engine: EngineInfo) -> bool:
    return any(layer.inputs or layer.outputs for layer in engine.layers)


def to_dot(engine: EngineInfo, profile: Profile | None = None) -> str:
    """The engine as a Graphviz DOT digraph (see the module docstring)."""
    times = _times(profile or engine.profile)
    title = [f"{engine.source} ({engine.verbosity}), {len(engine.layers)} layers"]
    if not has_tensors(engine):
        title.append("no tensor information (layer names only): layers drawn as a chain in engine order")
    lines = ["digraph engine {", "  rankdir=TB;", '  node [fontname="Helvetica", fontsize=10];',
             '  edge [color="#555555", arrowsize=0.6];', f'  label="{NL.join(dot_escape(t) for t in title)}";',
             "  labelloc=t;"]
    lines += legend()
    lines += _layer_nodes(engine, times)
    lines += _tensor_edges(engine) if has_tensors(engine) else _chain_edges(engine)
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_svg(dot_text: str, timeout: float = 60) -> str:
    """Run `dot -Tsvg` on DOT text; kiln.errors.Error when Graphviz is missing, fails or times out."""
    exe = shutil.which("dot")
    if exe is None:
        raise Error(NOT_FOUND)
    try:
        done = subprocess.run([exe, "-Tsvg"], input=dot_text.encode("utf-8"), capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Error(f"Graphviz 'dot' took more than {timeout:g} s; draw a smaller engine or write .dot instead") \
            from None
    except OSError as exc:
        raise Error(f"cannot run Graphviz 'dot' ({exc}); {NOT_FOUND}") from None
    if done.returncode != 0:
        detail = done.stderr.decode("utf-8", "replace").strip().splitlines()
        raise Error(f"Graphviz 'dot' failed (exit {done.returncode}): {detail[-1] if detail else 'no message'}")
    return done.stdout.decode("utf-8", "replace")
