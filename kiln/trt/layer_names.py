"""TensorRT's layer names read back into the ONNX nodes they name (the writers are `kiln.trt.vocab`'s
`fused_layer_name`, `merged_layer_name`, `pointwise_layer_name` and `region_layer_name`): `a + b` (a vertical
fusion), `a || b` (a horizontal merge), `PWN(a, PWN(b, c))` (a pointwise program, nested), `{ForeignNode[first...
last]}` (a run of nodes one library runs; its ends may themselves be fused names), `Reformatting CopyNode for …`
(an inserted copy, no ONNX node) and `(Unnamed Layer* 7) [Shuffle]` (a layer the parser made, no ONNX node name)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.trt.vocab import is_reformat_name

_OPEN, _CLOSE = "([{", ")]}"
_UNNAMED = re.compile(r"^\(Unnamed Layer\* \d+\) \[[^\]]*\]$")
_FOREIGN_HEAD, _FOREIGN_TAIL, _RANGE = "{ForeignNode[", "]}", "..."
_PWN_HEAD = "PWN("


@dataclass(frozen=True)
class NodeRange:
    """`{ForeignNode[first...last]}`: the nodes from `first` to `last` in some order of the graph."""

    first: str
    last: str
    text: str                                    # the range as written, for display when it cannot be resolved


@dataclass(frozen=True)
class ParsedName:
    nodes: tuple[str, ...] = ()                  # ONNX node names, in the order the name lists them
    ranges: tuple[NodeRange, ...] = ()
    unnamed: tuple[str, ...] = ()                # `(Unnamed Layer* N) [Kind]` parts
    reformat: bool = False                       # an inserted copy: no ONNX node of its own


def split_top_level(text: str, separators: tuple[str, ...]) -> list[str]:
    """`text` cut at every separator outside brackets: "a + PWN(b, c)" at " + " -> ["a", "PWN(b, c)"]."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth = max(depth - 1, 0)
        elif depth == 0:
            sep = next((s for s in separators if text.startswith(s, i)), None)
            if sep is not None:
                parts.append(text[start:i])
                i = start = i + len(sep)
                continue
        i += 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_layer_name(name: str) -> ParsedName:
    """The ONNX nodes, node ranges and unnamed parts a TensorRT (or kiln) layer name lists."""
    if is_reformat_name(name):
        return ParsedName(reformat=True)
    nodes: list[str] = []
    ranges: list[NodeRange] = []
    unnamed: list[str] = []
    for part in split_top_level(name.strip(), (" + ", " || ")):
        if part.startswith(_FOREIGN_HEAD) and part.endswith(_FOREIGN_TAIL):
            ranges.append(_foreign_range(part))
        elif part.startswith(_PWN_HEAD) and part.endswith(")"):
            for inner in split_top_level(part[len(_PWN_HEAD):-1], (", ",)):
                parsed = parse_layer_name(inner)
                nodes += parsed.nodes
                ranges += parsed.ranges
                unnamed += parsed.unnamed
        elif _UNNAMED.match(part):
            unnamed.append(part)
        else:
            nodes.append(part)
    return ParsedName(tuple(nodes), tuple(ranges), tuple(unnamed))


def _foreign_range(part: str) -> NodeRange:
    """`{ForeignNode[a + b...c]}` -> the range from a (the first node of the first end) to c (the last of the last)."""
    inner = part[len(_FOREIGN_HEAD):-len(_FOREIGN_TAIL)]
    first_text, _, last_text = inner.partition(_RANGE)
    first, last = parse_layer_name(first_text), parse_layer_name(last_text or first_text)
    return NodeRange(first.nodes[0] if first.nodes else first_text.strip(),
                     last.nodes[-1] if last.nodes else last_text.strip(), part)
