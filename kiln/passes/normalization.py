"""LayerNormFusion: the decomposed LayerNorm that exporters emit becomes one LayerNormalization layer.

    m = ReduceMean(x, axes=A)  d = Sub(x, m)  v = ReduceMean(Pow(d, 2) | Mul(d, d), axes=A)
    y = Div(d, Sqrt(Add(v, eps)))  [y = Mul(y, gamma)]  [y = Add(y, beta)]
==> LayerNormalization(x, gamma, beta, axis=first of A, epsilon=eps), A being the trailing axes.
TensorFlow's form (tf.nn.batch_normalization, as tf2onnx exports Keras LayerNormalization) too:
    a = [gamma *] 1 / Sqrt(Add(v, eps))   y = Add(Mul(x, a), Sub(beta, Mul(m, a)))

RMSNormFusion: T5's and LLaMA's RMSNorm (no mean subtracted) becomes one RMSNormalization layer (ONNX opset 23).

    v = ReduceMean(Pow(x, 2) | Mul(x, x), axes=A)  s = Sqrt(Add(v, eps))
    y = Div(x, s) | Mul(x, Reciprocal(s)) | Mul(x, Div(1, s))  [y = Mul(y, gamma)]
==> RMSNormalization(x, gamma, axis=first of A, epsilon=eps).

GroupNormFusion: torch's GroupNorm export, InstanceNormalization between two Reshapes, becomes GroupNormalization.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from kiln.ir import Graph, Node, Value, same_extent, same_shape, shape_at_points
from kiln.passes.manager import PassLog
from kiln.passes.patterns import fused_name, is_shuffle, other_input, replace_nodes, scalar_const, sole_consumer


@dataclass(frozen=True)
class NearMiss:
    """A pattern that almost matched: the node it starts from (the log's first name) and the unmet condition."""

    first: Node
    reason: str


def _matches(g: Graph, plog: PassLog, ops: tuple[str, ...], match) -> Iterator[tuple[Node, tuple]]:
    """(node, what `match` found) for each ONNX node of `ops` still in the graph that `match` accepts; near
    misses are logged with their reason. The caller may rewrite the graph between items."""
    for node in [n for n in g.nodes if n.op_type in ops and n.domain in ("", "ai.onnx")]:
        if node not in g.nodes or (found := match(g, node)) is None:
            continue
        plog.running(node)
        if isinstance(found, NearMiss):
            plog.not_fused(found.first, node, found.reason)
            continue
        yield node, found


def _producer(v: Value | None, op: str) -> Node | None:
    return v.producer if v is not None and v.producer is not None and v.producer.op_type == op else None


def _reduce_axes(node: Node, rank: int) -> list[int] | None:
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None and node.inputs[1].is_const:
        axes = node.inputs[1].const.reshape(-1).tolist()
    if axes is None or not node.attrs.get("keepdims", 1):
        return None
    return sorted(a % rank for a in axes)


def _scalar(v: Value | None) -> float | None:
    return scalar_const(v, "fiub")


def _match(g: Graph, div: Node) -> tuple[list[Node], Value, list[int], float] | NearMiss | None:
    """(nodes, x, axes, eps) for a LayerNorm ending at `div`, or why it almost matched."""
    sub, sqrt = _producer(div.inputs[0], "Sub"), _producer(div.inputs[1], "Sqrt")
    if sub is None or sqrt is None:
        return None
    add_eps = _producer(sqrt.inputs[0], "Add")
    mean = _producer(sub.inputs[1], "ReduceMean")
    if add_eps is None or mean is None or mean.inputs[0] is not sub.inputs[0]:
        return None
    var = _producer(add_eps.inputs[0], "ReduceMean")
    eps = _scalar(add_eps.inputs[1])
    if var is None:
        return None
    square = var.inputs[0].producer
    d = sub.outputs[0]
    is_square = square is not None and ((square.op_type == "Pow" and square.inputs[0] is d and
                                         _scalar(square.inputs[1]) == 2.0) or
                                        (square.op_type == "Mul" and square.inputs[0] is d and square.inputs[1] is d))
    if not is_square:
        return None
    x = sub.inputs[0]
    rank = len(x.shape)
    axes, axes_var = _reduce_axes(mean, rank), _reduce_axes(var, rank)
    if eps is None:
        return NearMiss(sub, "epsilon is not a constant scalar")
    if axes is None or axes != axes_var or axes != list(range(rank - len(axes), rank)):
        return NearMiss(sub, f"reductions are not over the same trailing axes ({axes} vs {axes_var})")
    nodes = [mean, sub, square, var, add_eps, sqrt, div]
    inner = [mean, square, var, add_eps, sqrt]
    if any(sole_consumer(g, n) is None for n in inner) or {id(u) for u in d.users} != {id(square), id(div)} \
            or g.is_output(d):   # Mul(d, d) lists its node twice among d's users
        return NearMiss(sub, "an intermediate value is also used outside the pattern")
    return nodes, x, axes, eps


def _affine(g: Graph, node: Node, op: str, width: int) -> tuple[Node, Value] | None:
    """A following Mul/Add by a constant of the normalized width (gamma / beta)."""
    nxt = sole_consumer(g, node)
    if nxt is None or nxt.op_type != op:
        return None
    other = nxt.inputs[1] if nxt.inputs[0] is node.outputs[0] else nxt.inputs[0]
    if not other.is_const or other.const.size != width:
        return None
    return nxt, other


def _reciprocal_sqrt(v: Value) -> tuple[Node, Node] | None:
    """(the Sqrt, the Reciprocal or Div(1, ·)) where `v` is 1 / √s."""
    recip = v.producer
    if recip is None or not (recip.op_type == "Reciprocal" or (recip.op_type == "Div" and
                                                               _scalar(recip.inputs[0]) == 1.0)):
        return None
    sqrt = _producer(recip.inputs[-1], "Sqrt")
    return (sqrt, recip) if sqrt is not None else None


def _match_tf(g: Graph, add: Node):
    """(nodes, x, axes, eps, gamma, beta) for TensorFlow's batch_normalization form of a LayerNorm (tf2onnx's
    export of Keras LayerNormalization) ending at `add`: a = γ / √(var + ε), y = x·a + (β − mean·a)."""
    found = [(xa, shift) for xa, shift in ((_producer(add.inputs[0], "Mul"), _producer(add.inputs[1], "Sub")),
                                          (_producer(add.inputs[1], "Mul"), _producer(add.inputs[0], "Sub")))
             if xa is not None and shift is not None]
    if not found:
        return None
    xa, shift = found[0]
    ma, beta = _producer(shift.inputs[1], "Mul"), shift.inputs[0]
    if ma is None or not beta.is_const:
        return None
    pairs = [(x, a) for x, a in (xa.inputs, xa.inputs[::-1]) if a in ma.inputs and x is not a]
    if not pairs:
        return None
    x, a = pairs[0]
    mean = _producer(ma.inputs[1] if ma.inputs[0] is a else ma.inputs[0], "ReduceMean")
    scale = _producer(a, "Mul")
    gamma = next((v for v in scale.inputs if v.is_const), None) if scale is not None else None
    inv = other_input(scale, gamma) if gamma is not None else a
    rs = _reciprocal_sqrt(inv) if inv is not None else None
    if mean is None or mean.inputs[0] is not x or rs is None:
        return None
    add_eps = _producer(rs[0].inputs[0], "Add")
    var = _producer(add_eps.inputs[0], "ReduceMean") if add_eps is not None else None
    square = var.inputs[0].producer if var is not None else None
    d = _producer(square.inputs[0], "Sub") if square is not None else None
    if d is None or d.inputs != [x, mean.outputs[0]] or not (
            (square.op_type == "Mul" and square.inputs[1] is square.inputs[0]) or
            (square.op_type == "Pow" and _scalar(square.inputs[1]) == 2.0)):
        return None
    rank, eps = len(x.shape), _scalar(add_eps.inputs[1])
    axes = _reduce_axes(mean, rank)
    if eps is None or axes is None or axes != _reduce_axes(var, rank) or axes != list(range(rank - len(axes), rank)):
        return NearMiss(mean, "epsilon is not a constant scalar or the reductions are not over the same trailing axes")
    width = int(np.prod([x.shape[i] for i in axes]))
    if any(v is not None and v.const.size not in (1, width) for v in (gamma, beta)):
        return NearMiss(mean, "the scale or shift is not one value per normalized element")
    sqrt, recip = rs
    single = [square, var, add_eps, sqrt, xa, ma, shift] + ([recip] if gamma is not None else [])
    shared = [mean.outputs[0], a, d.outputs[0]]
    if any(sole_consumer(g, n) is None for n in single) or {id(u) for u in d.outputs[0].users} != {id(square)} or \
            len(mean.outputs[0].users) != 2 or len(a.users) != 2 or any(g.is_output(v) for v in shared):
        return NearMiss(mean, "an intermediate value is also used outside the pattern")
    nodes = [mean, d, square, var, add_eps, sqrt, recip, *([scale] if gamma is not None else []), xa, ma, shift, add]
    return nodes, x, axes, eps, gamma, beta


def fuse_layer_norm(g: Graph, plog: PassLog) -> None:
    """LayerNormFusion: the torch/ONNX decomposition (module docstring) and TensorFlow's batch_normalization form."""
    for add, (nodes, x, axes, eps, gamma, beta) in _matches(g, plog, ("Add",), _match_tf):
        _replace_layer_norm(g, plog, nodes, x, axes, eps, gamma, beta, add)
    for div, (nodes, x, axes, eps) in _matches(g, plog, ("Div",), _match):
        width = int(np.prod([x.shape[a] for a in axes]))
        shape = tuple(x.shape[a] for a in axes)
        last, gamma, beta = div, None, None
        if (m := _affine(g, last, "Mul", width)) is not None:
            last, gamma = m
            nodes.append(last)
        if (a := _affine(g, last, "Add", width)) is not None:
            last, beta = a
            nodes.append(last)
        _replace_layer_norm(g, plog, nodes, x, axes, eps, gamma, beta, last)


def _per_element(v: Value | None, shape: tuple[int, ...], default: float) -> np.ndarray:
    """A scale or shift (absent, a scalar or one value per element) as an array of the normalized `shape`."""
    if v is None:
        return np.full(shape, default)
    return v.const.reshape(shape) if v.const.size == int(np.prod(shape)) else np.broadcast_to(v.const.reshape(()), shape)


def _replace_layer_norm(g: Graph, plog: PassLog, nodes: list[Node], x: Value, axes: list[int], eps: float,
                        gamma: Value | None, beta: Value | None, last: Node) -> None:
    shape = tuple(x.shape[a] for a in axes)
    name, origin = fused_name(nodes)
    dtype = x.dtype
    gamma_v = g.add_const(f"{name}.scale", _per_element(gamma, shape, 1.0).astype(dtype))
    beta_v = g.add_const(f"{name}.bias", _per_element(beta, shape, 0.0).astype(dtype))
    plog.fusing(nodes[0], last)
    replace_nodes(g, nodes, Node(name, "LayerNormalization", [x, gamma_v, beta_v], list(last.outputs),
                                 {"axis": axes[0], "epsilon": eps}, "", origin))


def _rms_denominator(y: Node) -> tuple[Value, Node, list[Node]] | None:
    """(x, the Sqrt node, the nodes between it and `y`) where `y` is x / s, x * Reciprocal(s) or x * Div(1, s)."""
    if y.op_type == "Div" and (sqrt := _producer(y.inputs[1], "Sqrt")) is not None:
        return y.inputs[0], sqrt, []
    if y.op_type != "Mul":
        return None
    for x, r in (y.inputs, reversed(y.inputs)):
        if (rs := _reciprocal_sqrt(r)) is not None:
            return x, rs[0], [rs[1]]
    return None


def _match_rms(g: Graph, y: Node) -> tuple[list[Node], Value, list[int], float] | NearMiss | None:
    """(nodes, x, axes, eps) for an RMSNorm ending at `y`, or why it almost matched."""
    found = _rms_denominator(y)
    if found is None:
        return None
    x, sqrt, between = found
    add_eps = _producer(sqrt.inputs[0], "Add")
    mean = _producer(add_eps.inputs[0], "ReduceMean") if add_eps is not None else None
    square = mean.inputs[0].producer if mean is not None else None
    if square is None or not ((square.op_type == "Pow" and square.inputs[0] is x and _scalar(square.inputs[1]) == 2.0)
                              or (square.op_type == "Mul" and square.inputs[0] is x and square.inputs[1] is x)):
        return None
    rank = len(x.shape) if x.shape is not None else 0
    axes, eps = _reduce_axes(mean, rank) if rank else None, _scalar(add_eps.inputs[1])
    if eps is None:
        return NearMiss(square, "epsilon is not a constant scalar")
    if axes is None or axes != list(range(rank - len(axes), rank)):
        return NearMiss(square, f"the mean of squares is not over trailing axes ({axes})")
    inner = [square, mean, add_eps, sqrt, *between]
    if any(sole_consumer(g, n) is None for n in inner):
        return NearMiss(square, "an intermediate value is also used outside the pattern")
    return inner + [y], x, axes, eps


def fuse_rms_norm(g: Graph, plog: PassLog) -> None:
    for y, (nodes, x, axes, eps) in _matches(g, plog, ("Div", "Mul"), _match_rms):
        shape = tuple(x.shape[a] for a in axes)
        last, gamma = y, None
        if (m := _affine(g, last, "Mul", int(np.prod(shape)))) is not None:
            last, gamma = m
            nodes.append(last)
        name, origin = fused_name(nodes)
        gamma_v = g.add_const(f"{name}.scale", _per_element(gamma, shape, 1.0).astype(x.dtype))
        plog.fusing(nodes[0], last)
        replace_nodes(g, nodes, Node(name, "RMSNormalization", [x, gamma_v], list(last.outputs),
                                     {"axis": axes[0], "epsilon": eps}, "", origin))


def _per_channel(v: Value | None, rank: int, channels: int) -> np.ndarray | None:
    """A constant broadcasting over [N, C, spatial...] with one value per channel (or one for all), as [C]."""
    if v is None or not v.is_const or v.const.ndim > rank:
        return None
    shape = (1,) * (rank - v.const.ndim) + v.const.shape
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(v.const.reshape(-1).astype(np.float32), (channels,))


def _is_reshape(node: Node | None) -> bool:
    return is_shuffle(node) and len(node.attrs["steps"]) == 1 and "reshape" in node.attrs["steps"][0]


def _match_group(g: Graph, inn: Node) -> tuple[list[Node], Value, int, np.ndarray, np.ndarray] | NearMiss | None:
    """(nodes, x, groups, scale [C], bias [C]) where `inn` normalizes x reshaped to [N, G, -1] and the result is
    reshaped back to x's shape, or why the rest does not match where that frame is there."""
    split, merge = inn.inputs[0].producer, sole_consumer(g, inn)
    if not (_is_reshape(split) and _is_reshape(merge)) or len(inn.inputs) != 3:
        return None
    x, grouped = split.inputs[0], inn.inputs[0]
    if x.shape is None or len(x.shape) < 3 or grouped.shape is None or len(grouped.shape) != 3:
        return None
    channels, groups = x.shape[1], grouped.shape[1]
    if merge.outputs[0].shape != x.shape or grouped.shape[0] != x.shape[0] or channels % groups:
        return None
    if set(x.dyn_dims) - {0} or set(grouped.dyn_dims) - {0}:
        return NearMiss(split, "a dynamic axis other than the batch")
    if not same_shape(merge.outputs[0], x) or not same_extent(grouped, 0, x, 0):
        shapes = ", ".join(shape_at_points(v) for v in (x, grouped, merge.outputs[0]))
        return NearMiss(split, f"the grouped batch may differ from the input's at other input shapes ({shapes}; "
                               "probe sizes in brackets)")
    scale, bias = (v.const.reshape(-1).astype(np.float32) if v is not None and v.is_const and v.const.size == groups
                   else None for v in inn.inputs[1:3])
    if scale is None or bias is None:
        return NearMiss(split, f"{inn.name}'s scale and bias are not constants with one value per group")
    if sole_consumer(g, split) is not inn:
        return NearMiss(split, f"{split.name}'s output is also used outside the pattern")
    per_channel = channels // groups
    return [split, inn, merge], x, groups, np.repeat(scale, per_channel), np.repeat(bias, per_channel)


def fuse_group_norm(g: Graph, plog: PassLog) -> None:
    """GroupNormFusion: torch's GroupNorm export (both exporters) becomes one GroupNormalization layer.

        r = Reshape(x, [N, G, -1])  n = InstanceNormalization(r, s, b)  y = Reshape(n, shape of x)
        [y = Mul(y, gamma)]  [y = Add(y, beta)]      (gamma, beta: one value per channel)
    ==> GroupNormalization(x, scale, bias, num_groups=G) with opset 21's per-channel scale and bias, the
        InstanceNormalization's per-group ones folded in."""
    for inn, (nodes, x, groups, scale, bias) in _matches(g, plog, ("InstanceNormalization",), _match_group):
        channels, rank = x.shape[1], len(x.shape)
        for op in ("Mul", "Add"):
            nxt = sole_consumer(g, nodes[-1])
            if nxt is None or nxt.op_type != op or nxt.domain not in ("", "ai.onnx") or len(nxt.inputs) != 2:
                continue
            other = nxt.inputs[1] if nxt.inputs[0] is nodes[-1].outputs[0] else nxt.inputs[0]
            if (const := _per_channel(other, rank, channels)) is None:
                continue
            scale, bias = (scale * const, bias * const) if op == "Mul" else (scale, bias + const)
            nodes.append(nxt)
        name, origin = fused_name(nodes)
        dtype = x.dtype if x.dtype is not None else np.float32
        scale_v = g.add_const(f"{name}.scale", np.ascontiguousarray(scale, dtype=dtype))
        bias_v = g.add_const(f"{name}.bias", np.ascontiguousarray(bias, dtype=dtype))
        plog.fusing(nodes[0], nodes[-1])
        replace_nodes(g, nodes, Node(name, "GroupNormalization", [x, scale_v, bias_v], list(nodes[-1].outputs),
                                     {"num_groups": groups, "epsilon": inn.attrs.get("epsilon", 1e-5)}, "", origin))
