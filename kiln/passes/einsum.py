"""EinsumToMatMul: a two-operand Einsum that is a (batched) matrix product becomes Transpose/Reshape → MatMul →
Reshape/Transpose, so the matrix-product kernels, their precisions and the attention fusion apply to it.

    Einsum("bhqd,bhkd->bhqk")(q, k)  ==>  MatMul(q, Transpose(k, [0, 1, 3, 2]))
    Einsum("bsd,hd->bsh")(x, W)      ==>  MatMul(x, Wᵀ)        (Wᵀ folded by ConstantFolding, which runs next)

Letters are classed by where they appear: batch (both operands and the output: MatMul's broadcast axes, kept
apart), m (first operand and output), n (second operand and output), k (both operands, summed: merged into one
axis). The first operand becomes [batch…, m…, K], the second [batch…, 1…, K, N], so MatMul's output is
[batch…, m…, N]; N is split back into its letters and the axes are put in the output's order. Identity steps are not
written. Declined, with the reason logged: one operand or more than two, a repeated letter (a diagonal), a letter
summed within one operand, a reshape that would infer two dynamic axes, non-float operands."""
from __future__ import annotations

import math
import string

import numpy as np

from kiln.ir import Graph, Node, Value
from kiln.passes.manager import PassLog
from kiln.passes.patterns import sole_consumer
from kiln.passes.shuffle import reshape_target

ONNX = ("", "ai.onnx")


def lower_einsum(g: Graph, plog: PassLog) -> None:
    """EinsumToMatMul (see the module docstring)."""
    for node in [n for n in g.nodes if n.op_type == "Einsum" and n.domain in ONNX]:
        plog.running(node)
        plan = _plan(node)
        lowered = _lowering(g, node, *plan) if not isinstance(plan, str) else plan
        if isinstance(lowered, str):
            plog.not_fused(node, "MatMul", lowered)
            continue
        bias_add = _bias_add(g, node, lowered)
        index = g.nodes.index(node)
        g.remove_node(node)
        if bias_add is not None:
            lowered = _bias_before_split(g, *bias_add, lowered)
        for offset, new in enumerate(lowered):
            g.add_node(new, index + offset)
        plog.lowering(node, " -> ".join(n.op_type for n in lowered))


def parse_equation(equation: str, ranks: list[int]) -> tuple[list[str], str] | str:
    """The operands' and the output's letters, with each "..." spelled out as letters of its own (aligned from the
    right, as broadcasting aligns them); the implicit output (no "->") is ONNX's: "..." first, then the letters
    that occur once, in alphabetical order. A string says why the equation cannot be read."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        return f"the equation names {len(terms)} operands, the node has {len(ranks)}"
    spare = [c for c in string.ascii_letters if c not in equation]
    ellipsis_rank = max([r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t] or [0])
    if ellipsis_rank > len(spare) or ellipsis_rank < 0:
        return "the ellipsis does not fit the operands' ranks"
    dots = "".join(spare[:ellipsis_rank])
    spelled = []
    for term, rank in zip(terms, ranks):
        own = rank - len(term.replace("...", ""))
        term = term.replace("...", dots[ellipsis_rank - own:] if own else "")
        if len(term) != rank:
            return f"'{term}' does not match an operand of rank {rank}"
        spelled.append(term)
    if arrow:
        out = rhs.replace("...", dots)
    else:
        letters = "".join(spelled)
        out = dots + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in dots))
    return spelled, out


def _plan(node: Node):
    """(a, b, out letters, batch, m, k, n letters) or the reason the node stays an Einsum."""
    if len(node.inputs) != 2 or any(v is None or v.shape is None for v in node.inputs):
        count = len(node.inputs)
        return f"it has {count} operand{'s' * (count != 1)}; only a product of two is a MatMul"
    a, b = node.inputs
    if any(v.dtype is None or np.dtype(v.dtype).kind != "f" for v in (a, b)):
        return "its operands are not floating point"
    parsed = parse_equation(str(node.attrs.get("equation", "")), [len(a.shape), len(b.shape)])
    if isinstance(parsed, str):
        return parsed
    (ta, tb), out = parsed
    if any(len(set(t)) != len(t) for t in (ta, tb, out)):
        return "a letter repeats within one term (a diagonal)"
    if set(ta) - set(tb) - set(out) or set(tb) - set(ta) - set(out):
        return "a letter is summed within one operand alone"
    batch = [c for c in out if c in ta and c in tb]
    m = [c for c in out if c in ta and c not in tb]
    n = [c for c in out if c in tb and c not in ta]
    k = [c for c in ta if c not in out]
    for c in k + batch:
        sa, sb = a.shape[ta.index(c)], b.shape[tb.index(c)]
        if c in k and sa != sb:
            return f"the summed axis '{c}' differs in size between the operands ({sa} and {sb})"
        if c in k and (ta.index(c) in a.dyn_dims) != (tb.index(c) in b.dyn_dims):
            return f"the summed axis '{c}' is dynamic in one operand only"
        if c in batch and sa != sb and 1 not in (sa, sb):
            return f"the axis '{c}' does not broadcast ({sa} and {sb})"
    swapped = [c for c in tb if c in k]   # Kᵀ·Q written for (Q·Kᵀ)ᵀ: the operands swap where that moves less data
    if _transposes(tb, ta, out, batch, n, swapped, m) < _transposes(ta, tb, out, batch, m, k, n):
        return b, a, tb, ta, out, batch, n, swapped, m
    return a, b, ta, tb, out, batch, m, k, n


def _transposes(ta: str, tb: str, out: str, batch, m, k, n) -> int:
    return sum(list(t) != [c for c in order if c in t] for t, order in
               ((ta, batch + m + k), (tb, batch + k + n), (out, batch + m + n)))


def _lowering(g: Graph, node: Node, a: Value, b: Value, ta: str, tb: str, out: str, batch, m, k, n):
    """The nodes replacing `node` (the last writes its output), or why a reshape cannot be written."""
    name, steps = node.name, []
    a2 = _transpose(g, a, ta, batch + m + k, f"{name} [Transpose A]", steps)
    rows = [_axis(a, ta, c) for c in m] or [UNIT]   # MatMul needs a row axis: [batch…, 1, K]
    a2 = _reshape(g, a2, [_axis(a, ta, c) for c in batch] + rows + [_merged(a, ta, k)], f"{name} [Reshape A]", steps)
    b2 = _transpose(g, b, tb, batch + k + n, f"{name} [Transpose B]", steps)
    ones = [UNIT] * (len(rows) - 1 if batch else 0)   # A's leading m axes are MatMul batch axes too
    b_dims = [_axis(b, tb, c) for c in batch] + ones + [_merged(b, tb, k), _merged(b, tb, n)]
    b2 = None if a2 is None else _reshape(g, b2, b_dims, f"{name} [Reshape B]", steps)
    if a2 is None or b2 is None:
        return "merging an operand's axes would need two inferred (-1) dynamic axes in one reshape"
    sizes = {c: _size(a, ta, b, tb, c) for c in out}
    product = _value(g, f"{node.outputs[0].name}_matmul", [sizes[c] for c in batch] + rows + [_merged(b, tb, n)],
                     node.outputs[0].dtype)
    steps.append(Node(name, "MatMul", [a2, b2], [product], {}, "", node.origin))
    order = batch + m + n
    split = _reshape(g, product, [sizes[c] for c in order], f"{name} [Reshape]", steps)
    if split is None:
        return "splitting the product's columns would need two inferred (-1) dynamic axes"
    _transpose(g, split, "".join(order), list(out), f"{name} [Transpose]", steps)
    target = node.outputs[0]
    steps[-1].outputs = [target]
    return steps


def _bias_add(g: Graph, node: Node, lowered: list[Node]) -> tuple[Node, Value] | None:
    """(the Add, its bias) for a constant bias Add after a product whose columns are split into several axes (a Keras dense layer,
    "abc,cde->abde" + b[d, e]); moved before the split, MatMulAddFusion takes it."""
    split = lowered[-1]
    add = sole_consumer(g, node)
    if split.op_type != "Reshape" or split.inputs[0] is not lowered[-2].outputs[0] or add is None or \
            add.op_type != "Add" or add.domain not in ONNX:
        return None
    bias = next((v for v in add.inputs if v is not node.outputs[0]), None)
    out = node.outputs[0]
    n_axes = len(out.shape) - (len(split.inputs[0].shape) - 1)
    trailing = tuple(out.shape[len(out.shape) - n_axes:])
    if bias is None or not bias.is_const or len(bias.shape) > len(out.shape) or \
            tuple(bias.shape[len(bias.shape) - n_axes:]) != trailing or any(d != 1 for d in bias.shape[:-n_axes]):
        return None
    return add, bias


def _bias_before_split(g: Graph, add: Node, bias: Value, lowered: list[Node]) -> list[Node]:
    """`lowered` with the bias added to the product, flat, before the split; the split writes the Add's output."""
    split = lowered[-1]
    product = split.inputs[0]
    flat = g.add_const(g.fresh_name(f"{bias.name}_flat"), bias.const.reshape(-1))
    summed = _value(g, f"{product.name}_biased", [_dim(product, i) for i in range(len(product.shape))], product.dtype)
    g.remove_node(add)
    lowered[-1] = Node(split.name, "Reshape", [summed, split.inputs[1]], list(add.outputs), {}, "", ())
    return lowered[:-1] + [Node(add.name, "Add", [product, flat], [summed], dict(add.attrs), "", add.origin),
                           lowered[-1]]


Dim = tuple[int, bool, "int | None"]   # size at the opt point, dynamic, size at the probe point (None: not known)
UNIT: Dim = (1, False, 1)


def _axis(v: Value, term: str, c: str) -> Dim:
    return _dim(v, term.index(c))


def _dim(v: Value, i: int) -> Dim:
    if i not in v.dyn_dims:
        return v.shape[i], False, v.shape[i]
    return v.shape[i], True, None if v.probe_shape is None else v.probe_shape[i]


def _merged(v: Value, term: str, letters: list[str]) -> Dim:
    axes = [_axis(v, term, c) for c in letters]
    probes = [p for _, _, p in axes]
    return math.prod(s for s, _, _ in axes), any(d for _, d, _ in axes), \
        None if None in probes else math.prod(probes)


def _size(a: Value, ta: str, b: Value, tb: str, c: str) -> Dim:
    sides = [_axis(v, t, c) for v, t in ((a, ta), (b, tb)) if c in t]
    probes = [p for _, _, p in sides]
    return max(s for s, _, _ in sides), any(d for _, d, _ in sides), None if None in probes else max(probes)


def _value(g: Graph, base: str, dims: list[Dim], dtype) -> Value:
    v = g.value(g.fresh_name(base))
    v.shape = tuple(int(s) for s, _, _ in dims)
    v.dyn_dims = tuple(i for i, (_, d, _) in enumerate(dims) if d)
    probes = [p for _, _, p in dims]
    v.probe_shape = None if None in probes else tuple(int(p) for p in probes)
    v.dtype = dtype
    return v


def _transpose(g: Graph, v: Value, term: str, order: list[str], name: str, steps: list[Node]) -> Value:
    perm = [term.index(c) for c in order]
    if perm == sorted(perm):
        return v
    out = _value(g, f"{v.name}_t", [_axis(v, term, term[p]) for p in perm], v.dtype)
    steps.append(Node(name, "Transpose", [v], [out], {"perm": perm}, "", ()))
    return out


def _reshape(g: Graph, v: Value, dims: list[Dim], name: str, steps: list[Node]) -> Value | None:
    if [s for s, _, _ in dims] == list(v.shape) and [i for i, (_, d, _) in enumerate(dims) if d] == list(v.dyn_dims):
        return v
    out = _value(g, f"{v.name}_r", dims, v.dtype)
    target = reshape_target(v, out)
    if target is None:
        return None
    shape = g.add_const(g.fresh_name(f"{out.name}_shape"), np.array(target, dtype=np.int64))
    steps.append(Node(name, "Reshape", [v, shape], [out], {}, "", ()))
    return out
