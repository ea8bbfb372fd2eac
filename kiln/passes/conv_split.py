"""ConvSliceSplit: a convolution read only through channel Slices or a channel Split runs as one convolution per
slice, each computing just its output channels. YOLOv5/v8's C3/C2f blocks chunk their first 1x1 convolution's
output in two: on channel-major tensors each chunk is a strided copy of half the map (YOLOv8n at 640: 18 Slices,
1.5 ms of its ~33 ms BF16 plan on Zen 4), while two convolutions of half the output channels write their halves
dense, for the same multiply-adds. Channels no slice reads are not computed at all."""
from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node
from kiln.passes.manager import PassLog
from kiln.passes.patterns import fused_name, is_op, replace_nodes, slice_range, split_ranges

Range = tuple[int, int]
MAX_PIECES = 4   # each piece reads the whole input again and is one more call: C2f/C3 chunk in two


def split_sliced_convs(g: Graph, plog: PassLog) -> None:
    for conv in [n for n in g.nodes if is_op(n, "Conv")]:
        out = conv.outputs[0]
        readers = list(dict.fromkeys(out.users))
        if not readers or not all(is_op(r, ("Slice", "Split")) for r in readers):
            continue
        plog.running(conv)
        pieces, reason = _pieces(g, conv, readers)
        if reason is not None:
            plog.not_fused(conv, readers[0], reason)
            continue
        for reader in readers:
            plog.fusing(conv, reader)
            made = [_conv_for(g, conv, reader, value, channels, index if len(reader.outputs) > 1 else None)
                    for index, (value, channels) in enumerate(pieces[reader.name])]
            at = replace_nodes(g, [reader], made[0])
            for offset, node in enumerate(made[1:], 1):
                g.add_node(node, g.nodes.index(at) + offset)
        g.remove_node(conv)


def _pieces(g: Graph, conv: Node, readers: list[Node]) -> tuple[dict, str | None]:
    """Per reader, its (output value, channel range) pairs, or why the convolution cannot be split."""
    shape, out = conv.inputs[0].shape, conv.outputs[0]
    if g.is_output(out):
        return {}, f"{conv.name}'s output '{out.name}' is a network output"
    if shape is None or len(shape) != 4 or out.shape is None or len(out.shape) != 4:
        return {}, f"{conv.name} is not a 2-D convolution of known shape"
    if conv.attrs.get("group", 1) != 1 or len(conv.inputs) > 3 or not conv.inputs[1].is_const or \
            (len(conv.inputs) > 2 and conv.inputs[2] is not None and not conv.inputs[2].is_const):
        return {}, f"{conv.name} is grouped, adds a residual or has computed weights"
    pieces = {}
    for reader in readers:
        if reader.inputs[0] is not out or any(v is out for v in reader.inputs[1:]):
            return {}, f"{reader.name} reads {conv.name}'s output other than as the data it slices"
        channels = out.shape[1]   # a Slice of the channel axis alone: bounds on a dynamic axis would be unknown
        ranges = split_ranges(reader, 1, 4, channels) if reader.op_type == "Split" else \
            [slice_range(reader, 1, 4, channels)]
        if ranges is None or None in ranges:
            return {}, f"{reader.name} does not take constant, unit-step channel ranges"
        pieces[reader.name] = list(zip(reader.outputs, ranges))
    spans = sorted(r for values in pieces.values() for _, r in values)
    if len(spans) > MAX_PIECES:
        return {}, f"{conv.name}'s output is read in {len(spans)} slices: each would read the whole input again"
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return {}, f"the slices of {conv.name}'s output overlap: its channels would be computed twice"
    return pieces, None


def _conv_for(g: Graph, conv: Node, reader: Node, value, channels: Range, index: int | None) -> Node:
    """The convolution computing `channels` of `conv`'s output into `value` (a Slice's output, a Split's)."""
    name, origin = fused_name([conv, reader])
    name = name if index is None else f"{name} [{index}]"
    begin, end = channels
    w = g.add_const(f"{name}.weight", np.ascontiguousarray(conv.inputs[1].const[begin:end]))
    inputs = [conv.inputs[0], w]
    if len(conv.inputs) > 2 and conv.inputs[2] is not None:
        inputs.append(g.add_const(f"{name}.bias", np.ascontiguousarray(conv.inputs[2].const[begin:end])))
    return Node(name, "Conv", inputs, [value], dict(conv.attrs), conv.domain, origin)
