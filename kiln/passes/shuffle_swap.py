"""ShuffleMatMulSwap: data movement that keeps a linear product's rows whole crosses the product, to merge with a
Shuffle on the other side or to let an Add or activation join the product.

A MatMul with a constant [K, N] weight maps each row of K values to N values, so a Shuffle whose steps keep the last
axis whole and last (reshapes of the leading axes, transposes of them) commutes with it: only the row width in its
reshape targets changes. nn.MultiheadAttention is the model: its batch-first export transposes [B, S, D] to
[S, B, D] before in_proj and back after out_proj, so the residual Add sits behind a Shuffle, and at batch 1 the
transposes are reshapes. Moved across, they join the Attention layer's steps (read and written as strided views).
A transpose moves up only: below a product it would make the steps after it copy where they were views."""
from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node
from kiln.passes.manager import PassLog
from kiln.passes.patterns import activation_spec, fused_name, is_op, is_shuffle, replace_nodes, sole_consumer
from kiln.passes.shuffle import simplify


def move_shuffles_across_products(g: Graph, plog: PassLog) -> None:
    """ShuffleMatMulSwap. Up: MatMul(x, W) -> Shuffle -> Add or activation  ==>  Shuffle(x) -> MatMul -> Add, merged
    into a Shuffle producing x where there is one. Down: reshape -> MatMul -> Shuffle  ==>  MatMul -> one Shuffle."""
    for mm in [n for n in g.nodes if is_op(n, "MatMul")]:
        below = sole_consumer(g, mm)
        if not is_shuffle(below):
            continue
        reader, above = sole_consumer(g, below), mm.inputs[0].producer
        if reader is not None and (is_op(reader, "Add") or activation_spec(g, reader) is not None):
            _lift(g, plog, mm, below)
        elif is_shuffle(above) and sole_consumer(g, above) is mm:
            _sink(g, plog, mm, above, below)


def _lift(g: Graph, plog: PassLog, mm: Node, shuffle: Node) -> None:
    plog.running(mm)
    x, out = mm.inputs[0], shuffle.outputs[0]
    reason = _product_blocker(mm)
    steps = None if reason else row_steps(shuffle.attrs["steps"], mm.outputs[0].shape, x.shape[-1])
    if steps is None:
        plog.not_fused(mm, shuffle, reason or f"{shuffle.name} does not keep the product's rows whole")
        return
    plog.moving(shuffle, mm)
    above = x.producer if is_shuffle(x.producer) and sole_consumer(g, x.producer) is mm else None
    if above is not None:
        plog.fusing(above, shuffle)
        name, origin = fused_name([above, shuffle])
        g.remove_node(above)
        source, steps = above.inputs[0], above.attrs["steps"] + steps
    else:
        name, origin, source = shuffle.name, shuffle.origin, x
        x = g.value(g.fresh_name(f"{x.name}_rows"))
        x.dtype = source.dtype
    x.shape, x.dyn_dims = out.shape[:-1] + mm.inputs[0].shape[-1:], out.dyn_dims
    x.probe_shape = None if out.probe_shape is None else out.probe_shape[:-1] + x.shape[-1:]
    g.add_node(Node(name, "Shuffle", [source], [x], {"steps": simplify(steps)}, "kiln", origin), g.nodes.index(mm))
    replace_nodes(g, [mm, shuffle], Node(mm.name, mm.op_type, [x] + mm.inputs[1:], list(shuffle.outputs),
                                         dict(mm.attrs), mm.domain, mm.origin))


def _sink(g: Graph, plog: PassLog, mm: Node, above: Node, below: Node) -> None:
    x, product = above.inputs[0], mm.outputs[0]
    if _product_blocker(mm) or x.shape is None or not x.shape or len(x.shape) - 1 in x.dyn_dims:
        return
    steps = row_steps(above.attrs["steps"], x.shape, product.shape[-1])
    if steps is None or any("transpose" in step for step in steps):   # kept above: the product reads it contiguous,
        return                                                         # the Shuffles below read views of that
    plog.running(mm)
    plog.moving(above, mm)
    plog.fusing(above, below)
    g.remove_node(above)
    g.set_input(mm, 0, x)
    product.shape, product.dyn_dims = x.shape[:-1] + product.shape[-1:], x.dyn_dims
    product.probe_shape = None if x.probe_shape is None else x.probe_shape[:-1] + product.shape[-1:]
    name, origin = fused_name([above, below])
    replace_nodes(g, [below], Node(name, "Shuffle", [product], list(below.outputs),
                                   {"steps": simplify(steps + below.attrs["steps"])}, "kiln", origin))


def _product_blocker(mm: Node) -> str | None:
    """Why rows cannot cross this product: a weight that is not a constant matrix, a bias that is not a constant
    row, a third operand (a residual)."""
    w = mm.inputs[1]
    if not w.is_const or w.const.ndim != 2 or len(mm.inputs) > 3 or mm.inputs[0].shape is None or \
            len(mm.inputs[0].shape) < 2:
        return "the product is not rows times a constant matrix"
    bias = mm.inputs[2] if len(mm.inputs) > 2 else None
    if bias is not None and not (bias.is_const and bias.const.ndim == 1 and bias.const.size == w.shape[1]):
        return "the product's bias is not a constant row"   # one of higher rank could change the result's rank
    return None


def row_steps(steps: list[dict], shape: tuple[int, ...], width: int) -> list[dict] | None:
    """`steps`, which act on a tensor of `shape`, rewritten for rows `width` wide; None unless every step keeps the
    last axis whole and last (a transpose of the leading axes, a reshape of them)."""
    shape, old, out = tuple(shape), shape[-1], []
    for step in simplify(steps):
        if "transpose" in step and step["transpose"][-1] == len(shape) - 1:
            shape = tuple(shape[p] for p in step["transpose"])
            out.append(step)
            continue
        target = list(step.get("reshape", ()))
        if not target or any(d == 0 and i >= len(shape) - 1 for i, d in enumerate(target[:-1])) or \
                (target[-1] == 0 and len(target) != len(shape)):
            return None
        shape = _resolved(target, shape)
        if shape[-1] != old:
            return None
        out.append({"reshape": target[:-1] + [width if target[-1] == old else target[-1]]})
    return out


def _resolved(target: list[int], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a reshape to `target` gives (ONNX's 0 copies the input's axis, -1 is inferred)."""
    dims = [shape[i] if d == 0 else d for i, d in enumerate(target)]
    if -1 in dims:
        known = int(np.prod([d for d in dims if d != -1]))
        dims[dims.index(-1)] = int(np.prod(shape)) // known if known else 0
    return tuple(dims)
