"""Small matching helpers shared by the fusion passes."""
from __future__ import annotations

from typing import Any

import numpy as np

from kiln.ir import Graph, Node, Value
from kiln.ops import OPS, OpKind
from kiln.trt.vocab import fused_layer_name

ONNX_DOMAINS = ("", "ai.onnx")
KILN_LAYERS = ("DynamicQConv", "DynamicQMatMul")   # kiln's own layers (domain "kiln") that ONNX ops' fusions extend

# ONNX activations a convolution or matrix product can absorb (as an epilogue)
ACTIVATION_OPS = frozenset({"Relu", "LeakyRelu", "Clip", "Sigmoid", "Tanh", "HardSigmoid", "Elu", "Selu", "Softplus",
                            "Softsign", "ThresholdedRelu", "HardSwish", "Mish", "Gelu", "Swish"})


def sole_consumer(g: Graph, node: Node) -> Node | None:
    """The only node reading `node`'s single output, if that output is not also a graph output."""
    if len(node.outputs) != 1 or g.is_output(node.outputs[0]) or len(node.outputs[0].users) != 1:
        return None
    return node.outputs[0].users[0]


def why_not_sole_consumer(g: Graph, node: Node) -> str:
    out = node.outputs[0]
    if g.is_output(out):
        return f"{node.name}'s output '{out.name}' is a network output"
    return f"{node.name}'s output '{out.name}' has {len(out.users)} consumers"


def replace_nodes(g: Graph, old: list[Node], new: Node) -> Node:
    """Swap a fused group for one node placed where the last of the group was (all inputs ready there)."""
    index = max(g.nodes.index(n) for n in old)
    before = sum(1 for n in old if g.nodes.index(n) < index)
    for n in old:
        g.remove_node(n)
    return g.add_node(new, index - before)


def other_input(node: Node, v: Value) -> Value | None:
    """The operand of a two-input `node` that is not `v` (None if `v` is neither)."""
    a, b = node.inputs[0], node.inputs[1]
    return b if a is v else a if b is v else None


def is_op(node: Node | None, ops: str | tuple[str, ...]) -> bool:
    """`node` is one of `ops`: an ONNX op, or one of kiln's own KILN_LAYERS (domain "kiln")."""
    ops = (ops,) if isinstance(ops, str) else ops
    return node is not None and node.op_type in ops and \
        node.domain in (("kiln",) if node.op_type in KILN_LAYERS else ONNX_DOMAINS)


def remove_dead(g: Graph, nodes: list[Node | None]) -> list[Node]:
    """Removes, in order, those of `nodes` still in the graph whose outputs nothing reads or returns (so a node
    read only by an earlier one goes too); returns them."""
    dead = []
    for node in dict.fromkeys(nodes):
        if node is not None and node in g.nodes and not any(v.users or g.is_output(v) for v in node.outputs):
            g.remove_node(node)
            dead.append(node)
    return dead


def is_shuffle(node: Node | None) -> bool:
    """kiln's own data-movement layer (reshape/transpose/slice steps)."""
    return node is not None and node.op_type == "Shuffle" and node.domain == "kiln"


def graph_order(g: Graph, nodes: list[Node]) -> list[Node]:
    """`nodes` (each once) in the graph's order, which computes every input first."""
    index = {id(n): i for i, n in enumerate(g.nodes)}
    return sorted({id(n): n for n in nodes}.values(), key=lambda n: index[id(n)])


def fused_name(nodes: list[Node]) -> tuple[str, tuple[str, ...]]:
    origin = tuple(o for n in nodes for o in n.origin)
    return fused_layer_name(origin), origin


def is_elementwise(node: Node) -> bool:
    if node.op_type == "PointWise" and node.domain == "kiln":
        return True
    opdef = OPS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    return opdef is not None and opdef.kind == OpKind.ELEMENTWISE and node.op_type not in ("Identity", "Dropout")


def activation_spec(g: Graph, node: Node) -> dict[str, Any] | None:
    """The activation a conv/gemm could absorb: {"op", "attrs"}; None if `node` is not a foldable activation."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ACTIVATION_OPS:
        return None
    attrs = {k: v for k, v in node.attrs.items()}
    if node.op_type == "Clip":
        for i, key in ((1, "min"), (2, "max")):
            v = node.inputs[i] if len(node.inputs) > i else None
            if v is None:
                continue
            if not v.is_const:
                return None
            attrs[key] = float(np.asarray(v.const).reshape(-1)[0])
    return {"op": node.op_type, "attrs": attrs}


def scalar_const(v: Value | None, kinds: str = "f") -> float | None:
    """A one-element constant's value, where its dtype kind is among `kinds` ("f" float, "i"/"u" integer)."""
    if v is None or not v.is_const or v.const.size != 1 or v.const.dtype.kind not in kinds:
        return None
    return float(v.const.reshape(-1)[0])


def batchnorm_factors(bn: Node) -> tuple[np.ndarray, np.ndarray] | None:
    """(k, shift) per channel, in float64, with an inference BatchNormalization(y) = y * k + shift: k = scale /
    sqrt(var + epsilon), shift = B - mean * k; None where a parameter is computed at run time."""
    params = [v.const if v is not None and v.is_const else None for v in bn.inputs[1:5]]
    if any(p is None for p in params):
        return None
    scale, bias, mean, var = (p.astype(np.float64).reshape(-1) for p in params)
    k = scale / np.sqrt(var + bn.attrs.get("epsilon", 1e-5))
    return k, bias - mean * k


def const_value(v: Value | None) -> np.ndarray | None:
    return None if v is None or not v.is_const else v.const


def slice_range(node: Node, axis: int, rank: int, dim: int) -> tuple[int, int] | None:
    """[begin, end) a Slice takes of axis `axis` (of `dim` elements, in a rank-`rank` tensor), clamped to it, where
    it slices that axis alone with step 1 and constant bounds (its inputs, or opset < 10's attributes); None for
    anything else or an empty range."""
    if len(node.inputs) > 1:
        parts = node.inputs[1:5]
        if any(v is not None and not v.is_const for v in parts):
            return None
        starts, ends, axes, steps = [const_value(v) for v in parts] + [None] * (4 - len(parts))
    else:
        starts, ends, axes, steps = node.attrs.get("starts"), node.attrs.get("ends"), node.attrs.get("axes"), None
    if starts is None or ends is None:
        return None
    starts, ends = np.asarray(starts).reshape(-1), np.asarray(ends).reshape(-1)
    axes = np.arange(len(starts)) if axes is None else np.asarray(axes).reshape(-1) % rank
    if axes.tolist() != [axis] or len(ends) != 1 or (steps is not None and np.any(np.asarray(steps) != 1)):
        return None
    begin, end = (min(max(v + dim if v < 0 else v, 0), dim) for v in (int(starts[0]), int(ends[0])))
    return (begin, end) if begin < end else None


def split_ranges(node: Node, axis: int, rank: int, dim: int) -> list[tuple[int, int]] | None:
    """The [begin, end) ranges a Split along `axis` (of `dim` elements, in a rank-`rank` tensor) gives its outputs:
    its constant sizes (input or attribute), or equal parts; None where it splits another axis, its sizes are
    computed, or they do not add up."""
    if node.attrs.get("axis", 0) % rank != axis:
        return None
    given = len(node.inputs) > 1 and node.inputs[1] is not None
    sizes = const_value(node.inputs[1]) if given else node.attrs.get("split")
    if given and sizes is None:
        return None   # sizes computed at run time
    count = len(node.outputs)
    if sizes is None:
        if dim % count:
            return None
        sizes = [dim // count] * count
    sizes = np.asarray(sizes).reshape(-1).tolist()
    if len(sizes) != count or sum(sizes) != dim or min(sizes) <= 0:
        return None
    bounds = np.cumsum([0, *sizes]).tolist()
    return list(zip(bounds[:-1], bounds[1:]))
