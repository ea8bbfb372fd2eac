"""ConvSliceSplit: a convolution read only through channel Slices or a channel Split runs as one convolution per
slice, each computing just its output channels. YOLOv5/v8's C3/C2f blocks chunk their first 1x1 convolution's
output in two: on channel-major tensors each chunk is a strided copy of half the map (YOLOv8n at 640: 18 Slices,
1.5 ms of its ~33 ms BF16 plan on Zen 4), while two convolutions of half the output channels write their halves
dense, for the same multiply-adds. Channels no slice reads are not computed at all."""
from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node
from kiln.passes.manager import PassLog
from kiln.passes.patterns import const_value, fused_name, is_op, replace_nodes

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
        ranges = _split_ranges(reader, out.shape[1]) if reader.op_type == "Split" else \
            [_slice_range(reader, out.shape)]
        if ranges is None or None in ranges:
            return {}, f"{reader.name} does not take constant, unit-step channel ranges"
        pieces[reader.name] = list(zip(reader.outputs, ranges))
    spans = sorted(r for values in pieces.values() for _, r in values)
    if len(spans) > MAX_PIECES:
        return {}, f"{conv.name}'s output is read in {len(spans)} slices: each would read the whole input again"
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
        return {}, f"the slices of {conv.name}'s output overlap: its channels would be computed twice"
    return pieces, None


def _slice_range(node: Node, shape: tuple[int, ...]) -> Range | None:
    """The channel range [begin, end) a Slice takes of a 4-D tensor, if it slices the channel axis alone (bounds on
    another axis could not be told whole from the probe shape where that axis is dynamic)."""
    if len(node.inputs) > 1:
        starts, ends = const_value(node.inputs[1]), const_value(node.inputs[2])
        axes = const_value(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
        steps = const_value(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
        if len(node.inputs) > 3 and node.inputs[3] is not None and axes is None or \
                len(node.inputs) > 4 and node.inputs[4] is not None and steps is None:
            return None
    else:   # opset < 10: attributes
        starts, ends, axes, steps = node.attrs.get("starts"), node.attrs.get("ends"), node.attrs.get("axes"), None
    if starts is None or ends is None:
        return None
    starts, ends = np.asarray(starts).reshape(-1), np.asarray(ends).reshape(-1)
    axes = np.arange(len(starts)) if axes is None else np.asarray(axes).reshape(-1) % 4
    if steps is not None and np.any(np.asarray(steps) != 1):
        return None
    if axes.tolist() != [1] or len(starts) != 1 or len(ends) != 1:
        return None
    dim = shape[1]
    begin, stop = (min(max(v + dim if v < 0 else v, 0), dim) for v in (int(starts[0]), int(ends[0])))
    return (begin, stop) if begin < stop else None


def _split_ranges(node: Node, channels: int) -> list[Range] | None:
    """The channel ranges of a Split along axis 1: its sizes (input or attribute), or equal parts."""
    if node.attrs.get("axis", 0) % 4 != 1:
        return None
    sizes = const_value(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else \
        node.attrs.get("split")
    count = len(node.outputs)
    if sizes is None:
        if channels % count:
            return None
        sizes = [channels // count] * count
    sizes = np.asarray(sizes).reshape(-1).tolist()
    if len(sizes) != count or sum(sizes) != channels or min(sizes) <= 0:
        return None
    bounds = np.cumsum([0, *sizes]).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


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
