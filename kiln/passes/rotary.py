"""RotaryFusion: the half-split rotary position embedding (HF's LLaMA, Mistral, Qwen2, GPT-NeoX `rotate_half`)
becomes one layer instead of seven (two Slices, Neg, Concat, two Muls, Add), applied to Q and K of every decoder
layer:

    Add(Mul(x, cos), Mul(Concat(Neg(x[..., D/2:]), x[..., :D/2], axis=-1), sin))  ==>  kiln.RotaryEmbedding(x, cos, sin)

The halves may come from two Slices or one Split (onnxruntime's GatherSliceToSplitFusion writes that); Add and Mul
take their operands in either order. cos and sin are any tensors D wide along the last axis that broadcast to x,
read as they are (not ONNX's RotaryEmbedding, whose caches are half as wide: nothing here proves that the two
halves of cos are equal). The result must have x's shape. Anything else, or a value inside read outside, is left
with the reason."""
from __future__ import annotations

from kiln.ir import Graph, Node, Value, same_extent, same_shape
from kiln.passes.manager import PassLog
from kiln.passes.patterns import fused_name, graph_order, is_op, other_input, replace_nodes, slice_range, \
    sole_consumer, split_ranges


def fuse_rotary(g: Graph, plog: PassLog) -> None:
    """RotaryFusion (module docstring)."""
    for concat in [n for n in g.nodes if is_op(n, "Concat") and len(n.inputs) == 2]:
        plog.running(concat)
        found = _match(g, concat)
        if isinstance(found, str):
            if found:
                plog.not_fused(concat, "RotaryEmbedding", found)
            continue
        nodes, x, cos, sin = found
        ordered = graph_order(g, nodes)
        name, origin = fused_name(ordered)
        for n in ordered[:-1]:
            plog.fusing(n, ordered[-1])
        replace_nodes(g, ordered, Node(name, "RotaryEmbedding", [x, cos, sin], [ordered[-1].outputs[0]], {}, "kiln",
                                       origin))


def _match(g: Graph, concat: Node) -> tuple[list[Node], Value, Value, Value] | str:
    """(nodes, x, cos, sin), or why not; "" where the Concat is not a rotate_half at all (nothing to say)."""
    neg, first = concat.inputs[0].producer, concat.inputs[1]
    if not is_op(neg, "Neg"):
        return ""
    halves = _halves(neg.inputs[0], first)
    if halves is None:
        return ""
    x, movers = halves
    rank = len(x.shape) if x.shape is not None else 0
    if rank == 0 or concat.attrs.get("axis", 0) % rank != rank - 1:
        return ""
    mul_sin = sole_consumer(g, concat)
    if not is_op(mul_sin, "Mul") or sole_consumer(g, neg) is not concat:
        return "rotate_half(x) is not multiplied by sin alone"
    sin = other_input(mul_sin, concat.outputs[0])
    add = sole_consumer(g, mul_sin)
    if not is_op(add, "Add"):
        return "rotate_half(x) * sin is not added to x * cos"
    mul_cos = other_input(add, mul_sin.outputs[0]).producer
    if not is_op(mul_cos, "Mul") or x not in mul_cos.inputs or sole_consumer(g, mul_cos) is not add:
        return "rotate_half(x) * sin is not added to x * cos computed for it alone"
    cos = other_input(mul_cos, x)
    if any(g.is_output(v) or any(u is not concat and u is not neg for u in v.users) for m in movers for v in m.outputs):
        return "a half of x is read outside it"
    if not all(_fits(t, x) for t in (cos, sin)) or not same_shape(add.outputs[0], x):
        return "cos and sin do not broadcast to x, D wide"
    return movers + [neg, concat, mul_sin, mul_cos, add], x, cos, sin


def _halves(second: Value, first: Value) -> tuple[Value, list[Node]] | None:
    """(x, the nodes taking its halves) where `first` and `second` are x[..., :D/2] and x[..., D/2:] (D even and
    static), by two Slices or one Split."""
    a, b = first.producer, second.producer
    if is_op(a, "Split") and a is b and len(a.outputs) == 2 and a.outputs[0] is first and a.outputs[1] is second:
        x = a.inputs[0]
        if not _last_axis(a.attrs.get("axis", 0), x):
            return None
        d, last = x.shape[-1], len(x.shape) - 1
        return (x, [a]) if split_ranges(a, last, last + 1, d) == [(0, d // 2), (d // 2, d)] else None
    if not (is_op(a, "Slice") and is_op(b, "Slice")) or a.inputs[0] is not b.inputs[0]:
        return None
    x = a.inputs[0]
    if x.shape is None or x.shape[-1] % 2 or (len(x.shape) - 1) in x.dyn_dims:
        return None
    d, last = x.shape[-1], len(x.shape) - 1
    if slice_range(a, last, last + 1, d) == (0, d // 2) and slice_range(b, last, last + 1, d) == (d // 2, d):
        return x, [a, b]
    return None


def _last_axis(axis: int, x: Value) -> bool:
    return x.shape is not None and len(x.shape) > 0 and axis % len(x.shape) == len(x.shape) - 1 and \
        (len(x.shape) - 1) not in x.dyn_dims and x.shape[-1] % 2 == 0


def _fits(t: Value | None, x: Value) -> bool:
    """`t` is D wide along its last axis and broadcasts to x's shape without enlarging it, at every input shape (an
    axis of 1 that is static, or one extent with x's)."""
    if t is None or t.shape is None or x.shape is None or len(t.shape) > len(x.shape) or not t.shape:
        return False
    skip = len(x.shape) - len(t.shape)
    return all((t.shape[i] == 1 and i not in t.dyn_dims) or same_extent(t, i, x, skip + i)
               for i in range(len(t.shape))) and same_extent(t, len(t.shape) - 1, x, len(x.shape) - 1)
