"""GeluFusion: the arithmetic exporters write for GELU becomes one Gelu op, which a MatMul then absorbs as its
activation (oneDNN's gelu_erf / gelu_tanh post-ops) instead of a pointwise layer of its own.

    erf form:   x * 0.5 * (1 + Erf(x / √2))                            ==>  Gelu(x)
    tanh form:  0.5 * x * (1 + Tanh(√(2/π) * (x + 0.044715 * x³)))     ==>  Gelu(x, approximate="tanh")

The erf form is matched by its structure. The tanh form (TensorFlow's BERT, GPT-2's gelu_new, torch's
approximate="tanh" before opset 20) comes in many arrangements: x³ as Pow(x, 3), x·x·x or 0.044715·x·x·x, the 0.5
on x or on the bracket, constants on either side. It is matched loosely, then confirmed: the scalar arithmetic from
the one tensor x under the Tanh, through it and on to its product with x is evaluated on sample points and must
equal the formula."""
from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node, Value
from kiln.passes.manager import PassLog
from kiln.passes.patterns import (fused_name, graph_order, is_op, other_input, replace_nodes, scalar_const,
                                  sole_consumer)

ARITHMETIC = ("Add", "Sub", "Mul", "Div", "Pow")   # the tanh form's scalar arithmetic around the Tanh
SAMPLES = np.linspace(-6.0, 6.0, 121)
TANH_STEPS = 4   # nodes after the Tanh: + 1, · x, · 0.5 and one spare for a split constant


def fuse_gelu(g: Graph, plog: PassLog) -> None:
    """GeluFusion: the erf and tanh forms (module docstring) become one Gelu op each."""
    for anchor in [n for n in g.nodes if is_op(n, ("Erf", "Tanh"))]:
        if anchor not in g.nodes:   # taken by an earlier match
            continue
        plog.running(anchor)
        found = _match_erf_gelu(g, anchor) if anchor.op_type == "Erf" else _match_tanh_gelu(g, anchor)
        if isinstance(found, str):
            plog.not_fused(anchor, "Gelu", found)
            continue
        nodes, x = found
        ordered = graph_order(g, nodes)
        name, origin = fused_name(ordered)
        for n in ordered[:-1]:
            plog.fusing(n, ordered[-1])
        attrs = {"approximate": "tanh"} if anchor.op_type == "Tanh" else {}
        replace_nodes(g, ordered, Node(name, "Gelu", [x], [nodes[-1].outputs[0]], attrs, "", origin))


def _number(v: Value | None) -> float | None:
    """A scalar of the tanh form's arithmetic: float, or integer (an exponent, Pow(x, 3))."""
    return scalar_const(v, "fiu")


# ---- erf form ---------------------------------------------------------------------------------------------
def _match_erf_gelu(g: Graph, erf: Node) -> tuple[list[Node], Value] | str:
    scale = erf.inputs[0].producer
    if not (is_op(scale, "Div") or is_op(scale, "Mul")) or sole_consumer(g, scale) is not erf:
        return "its input is not x/√2 computed for it alone"
    x, c = scale.inputs
    factor = scalar_const(c)
    if factor is None or not np.isclose(factor if scale.op_type == "Mul" else 1 / factor, 2 ** -0.5, rtol=1e-3):
        return "its input is not x/√2"
    add = sole_consumer(g, erf)
    if not is_op(add, "Add") or scalar_const(other_input(add, erf.outputs[0])) != 1.0:
        return "it is not followed by +1"
    nodes, consts, xs, cur = [scale, erf, add], [], 0, add
    for _ in range(2):
        mul = sole_consumer(g, cur)
        if not is_op(mul, "Mul"):
            break
        other = other_input(mul, cur.outputs[0])
        half = other.producer if other is not None else None
        if other is x:
            xs += 1
        elif scalar_const(other) is not None:
            consts.append(scalar_const(other))
        elif is_op(half, "Mul") and x in half.inputs and scalar_const(other_input(half, x)) is not None and \
                len(half.outputs[0].users) == 1 and not g.is_output(half.outputs[0]):
            xs, consts = xs + 1, consts + [scalar_const(other_input(half, x))]
            nodes.append(half)
        else:
            break
        nodes.append(mul)
        cur = mul
        if xs == 1 and consts and np.isclose(np.prod(consts), 0.5):
            return nodes, x
    return "the product with x and 0.5 is not there"


# ---- tanh form --------------------------------------------------------------------------------------------
def _match_tanh_gelu(g: Graph, tanh: Node) -> tuple[list[Node], Value] | str:
    x = _source(tanh.inputs[0])
    if x is None or x is tanh.inputs[0]:
        return "its input is not scalar arithmetic on one tensor"
    nodes = _arithmetic_from(tanh.inputs[0], x)
    if nodes is None:
        return "its input is not computed from x and scalar constants alone"
    nodes, cur = nodes + [tanh], tanh
    for _ in range(TANH_STEPS):
        users = [u for u in cur.outputs[0].users if is_op(u, ARITHMETIC[:4])]   # others: _private says so
        if len(users) != 1:
            break
        after = users[0]
        for v in after.inputs:
            more = [] if v is cur.outputs[0] else _arithmetic_from(v, x)
            if more is None:
                return "the product with x and 0.5 is not computed from x and scalar constants alone"
            nodes += [n for n in more if n not in nodes]
        nodes.append(after)
        cur = after
        if np.allclose(_evaluate(g, nodes, x), _tanh_gelu(SAMPLES), rtol=1e-4, atol=1e-5):
            if cur.outputs[0].shape != x.shape:
                return "a constant broadcasts it to another shape"
            return (nodes, x) if _private(g, nodes) else "a value computed inside it is read outside it"
    return "the arithmetic around it is not 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))"


def _tanh_gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _source(v: Value, depth: int = 8) -> Value | None:
    """The one tensor `v` is computed from by scalar arithmetic within `depth` steps (a node with a constant that is
    not a scalar, a bias, ends the walk: its output is the source), or None where there are several or none."""
    node = v.producer
    if v.is_const:
        return None
    if depth == 0 or not is_op(node, ARITHMETIC) or any(u.is_const and _number(u) is None for u in node.inputs):
        return v
    found = {id(s): s for u in node.inputs if (s := _source(u, depth - 1)) is not None}
    return next(iter(found.values())) if len(found) == 1 else None


def _arithmetic_from(v: Value, x: Value, limit: int = 8) -> list[Node] | None:
    """The nodes computing `v` from `x` and scalar constants by ARITHMETIC alone (none where `v` is x or a scalar),
    or None where anything else feeds it."""
    if v is x or _number(v) is not None:
        return []
    node = v.producer
    if limit == 0 or not is_op(node, ARITHMETIC) or len(node.outputs) != 1:
        return None
    found: list[Node] = []
    for u in node.inputs:
        sub = _arithmetic_from(u, x, limit - 1)
        if sub is None:
            return None
        found += [n for n in sub if n not in found]
    return found + [node]


NUMPY_OPS = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power,
             "Tanh": np.tanh}   # passes compute in numpy: torch is constant folding's alone


def _evaluate(g: Graph, nodes: list[Node], x: Value) -> np.ndarray:
    """The last node's output with SAMPLES for x (float64), the nodes run in graph order."""
    values = {id(x): SAMPLES}
    for node in graph_order(g, nodes):
        args = [values[id(u)] if id(u) in values else _number(u) for u in node.inputs]
        with np.errstate(all="ignore"):
            values[id(node.outputs[0])] = NUMPY_OPS[node.op_type](*args)
    return values[id(nodes[-1].outputs[0])]


def _private(g: Graph, nodes: list[Node]) -> bool:
    """Every value the nodes compute, but the last, is read only by them and is no graph output."""
    inside = {id(n) for n in nodes}
    return all(not g.is_output(n.outputs[0]) and all(id(u) in inside for u in n.outputs[0].users)
               for n in nodes[:-1])
