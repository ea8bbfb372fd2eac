"""Shuffle fusions: Reshape/Flatten/Squeeze/Unsqueeze/Transpose become Shuffle layers; chains merge; no-ops go."""
from __future__ import annotations

from kiln.ir import Graph, Node, Value, format_shape, same_extent
from kiln.passes.manager import PassLog
from kiln.passes.patterns import fused_name, replace_nodes, sole_consumer, why_not_sole_consumer

SHUFFLE_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose")


def _as_shuffle(node: Node) -> Node | None:
    """A data-movement op as a Shuffle with explicit steps; None when its target cannot be written down."""
    if node.op_type == "Transpose":
        perm = node.attrs.get("perm") or list(reversed(range(len(node.inputs[0].shape))))
        target = _unit_axes_target(perm, node.inputs[0], node.outputs[0])
        steps = [{"transpose": list(perm)} if target is None else {"reshape": target}]
    else:
        if node.op_type in ("Squeeze", "Unsqueeze", "Flatten") and node.outputs[0].dyn_dims:
            target = _axes_target(node)   # exact from the op's axes (or None: kept), never guessed from sizes
        else:
            target = _constant_target(node) or reshape_target(node.inputs[0], node.outputs[0])
        if target is None:
            return None
        steps = [{"reshape": target}]
    return Node(node.name, "Shuffle", [node.inputs[0]], list(node.outputs), {"steps": steps}, "kiln", node.origin)


def _axes_target(node: Node) -> list[int] | None:
    """The reshape target of a Squeeze, Unsqueeze or Flatten with dynamic axes, from the axes it names: each output
    axis copies the input axis it comes from where that is the same index (0), a static one is written, at most one
    other is inferred (-1). None where that is not enough (a dynamic axis that moves, besides one) or the axes are
    not constants: the ONNX op stays and runs as written. Sizes equal at every profile bound (a square image
    profile's H and W) cannot mislead it."""
    src, out = node.inputs[0], node.outputs[0]
    sources = _output_sources(node, len(src.shape))
    if sources is None or len(sources) != len(out.shape):
        return None
    target = [out.shape[i] if i not in out.dyn_dims else 0 if source == i else -1 for i, source in enumerate(sources)]
    return target if target.count(-1) <= 1 and 0 not in out.shape else None


def _output_sources(node: Node, rank: int) -> list[int | None] | None:
    """Per output axis, the input axis it is (None: a new or merged axis); None where the axes are not known."""
    if node.op_type == "Flatten":
        axis = node.attrs.get("axis", 1) % max(rank, 1) if rank else 0
        return [0 if axis == 1 else None, rank - 1 if axis == rank - 1 else None]
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
        axes = node.inputs[1].const.reshape(-1).tolist() if node.inputs[1].is_const else None
    if axes is None:
        return None
    if node.op_type == "Squeeze":
        gone = {int(a) % rank for a in axes}
        return [i for i in range(rank) if i not in gone]
    out_rank = rank + len(axes)
    added = {int(a) % out_rank for a in axes}
    kept = iter(range(rank))
    return [None if i in added else next(kept) for i in range(out_rank)]


def _constant_target(node: Node) -> list[int] | None:
    """A Reshape's own constant target where the output has dynamic axes: exact, where one derived from the shapes
    can only guess which input axis a dynamic output axis copies. None where the shapes say it all (static), or an
    explicit zero-size axis (allowzero) would read as a copy."""
    if node.op_type != "Reshape" or not node.outputs[0].dyn_dims or len(node.inputs) < 2 or \
            node.inputs[1] is None or not node.inputs[1].is_const:
        return None
    target = [int(d) for d in node.inputs[1].const.reshape(-1)]
    return None if node.attrs.get("allowzero", 0) and 0 in target else target


def _unit_axes_target(perm: list[int], src: Value, out: Value) -> list[int] | None:
    """The reshape target of a permutation that keeps every axis but static size-1 ones in order, so the data's
    layout does not change ([1, S, D] -> [S, 1, D]: nn.MultiheadAttention's batch-first transposes at batch 1),
    written from the permutation: a dynamic axis that stays in place is copied (0), at most one that moves is
    inferred (-1). None where the permutation moves data or that is not enough."""
    if src.shape is None or len(perm) != len(src.shape) or 0 in out.shape:
        return None
    kept = [axis for axis in perm if src.shape[axis] != 1 or axis in src.dyn_dims]
    if kept != sorted(kept):
        return None
    target = [0 if axis in src.dyn_dims and axis == i else -1 if axis in src.dyn_dims else out.shape[i]
              for i, axis in enumerate(perm)]
    return target if target.count(-1) <= 1 else None


def reshape_target(src, out) -> list[int] | None:
    """The Reshape target (ONNX semantics: 0 copies the input's axis, -1 is inferred) reaching `out`'s shape
    for every input shape: static axes literally, dynamic axes copied from the same input axis where that axis
    has the same size at the opt and probe points, at most one other dynamic axis as -1. None if that is not
    enough (e.g. two merged dynamic axes)."""
    target = list(out.shape)
    if 0 in target:
        return None   # a zero-size axis would read as "copy"
    rest = []
    for i in out.dyn_dims:
        if i < len(src.shape) and same_extent(src, i, out, i):
            target[i] = 0
        else:
            rest.append(i)
    if len(rest) > 1:
        return None
    for i in rest:
        target[i] = -1
    return target


def simplify(steps: list[dict]) -> list[dict]:
    """The same data movement in fewer steps: identity transposes dropped, adjacent reshapes and transposes merged."""
    out: list[dict] = []
    for step in steps:
        if "transpose" in step and step["transpose"] == sorted(step["transpose"]):
            continue
        if out and "reshape" in step and "reshape" in out[-1]:
            merged = _merge_reshapes(out[-1]["reshape"], step["reshape"])
            if merged is not None:
                out[-1] = {"reshape": merged}
                continue
        if out and "transpose" in step and "transpose" in out[-1]:
            first = out[-1]["transpose"]
            out[-1] = {"transpose": [first[i] for i in step["transpose"]]}
            if out[-1]["transpose"] == sorted(out[-1]["transpose"]):
                out.pop()
            continue
        out.append(step)
    return out


def _merge_reshapes(first: list[int], second: list[int]) -> list[int] | None:
    """One reshape doing both: the second's copied axes (0) come from the first's target."""
    merged = []
    for i, d in enumerate(second):
        if d != 0:
            merged.append(d)
        elif i < len(first) and first[i] >= 0:
            merged.append(first[i])
        else:
            return None
    return merged if merged.count(-1) <= 1 else None


def fuse_shuffles(g: Graph, plog: PassLog) -> None:
    """ShuffleShuffleFusion: consecutive shuffles whose middle tensor has one reader become one Shuffle."""
    for node in [n for n in g.nodes if n.op_type in SHUFFLE_OPS and n.domain in ("", "ai.onnx")]:
        shuffle = _as_shuffle(node)
        if shuffle is None:
            out = node.outputs[0]
            plog.note(f"keeping {node.name} as {node.op_type}: its output shape "
                      f"{format_shape(out.shape, out.dyn_dims)} cannot be written as one reshape target")
            continue
        replace_nodes(g, [node], shuffle)
    changed, seen = True, set()
    while changed:
        changed = False
        for first in [n for n in g.nodes if n.op_type == "Shuffle"]:
            second = sole_consumer(g, first)
            if second is None:
                for user in (u for u in first.outputs[0].users if u.op_type == "Shuffle" and (first, u) not in seen):
                    seen.add((first, user))
                    plog.not_fused(first, user, why_not_sole_consumer(g, first))
                continue
            if second.op_type != "Shuffle":
                continue
            plog.running(first)
            plog.fusing(first, second)
            name, origin = fused_name([first, second])
            steps = simplify(first.attrs["steps"] + second.attrs["steps"])
            replace_nodes(g, [first, second], Node(name, "Shuffle", [first.inputs[0]], list(second.outputs),
                                                   {"steps": steps}, "kiln", origin))
            changed = True
            break


def erase_noop_shuffles(g: Graph, plog: PassLog) -> None:
    """ShuffleErasure: a Shuffle that keeps the shape and moves no data is removed."""
    for node in [n for n in g.nodes if n.op_type == "Shuffle"]:
        src, out = node.inputs[0], node.outputs[0]
        steps = simplify(node.attrs["steps"])
        if any("transpose" in s for s in steps) or src.shape != out.shape or src.dyn_dims != out.dyn_dims:
            continue
        if g.is_output(out) or src.is_const:
            continue
        plog.running(node)
        g.remove_node(node)
        g.replace_all_uses(out, src)
        plog.removing(node)
