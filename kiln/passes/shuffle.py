"""Shuffle fusions: Reshape/Flatten/Squeeze/Unsqueeze/Transpose become Shuffle layers; chains merge; no-ops go."""
from __future__ import annotations

from kiln.ir import Graph, Node
from kiln.passes.manager import PassLog
from kiln.passes.patterns import fused_name, replace_nodes, sole_consumer, why_not_sole_consumer

SHUFFLE_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose")


def _as_shuffle(node: Node) -> Node:
    """A data-movement op as a Shuffle with explicit steps (static shapes make every reshape concrete)."""
    if node.op_type == "Transpose":
        perm = node.attrs.get("perm") or list(reversed(range(len(node.inputs[0].shape))))
        steps = [{"transpose": list(perm)}]
    else:
        steps = [{"reshape": list(node.outputs[0].shape)}]
    return Node(node.name, "Shuffle", [node.inputs[0]], list(node.outputs), {"steps": steps}, "kiln", node.origin)


def _simplify(steps: list[dict]) -> list[dict]:
    out: list[dict] = []
    for step in steps:
        if "transpose" in step and step["transpose"] == sorted(step["transpose"]):
            continue
        if out and "reshape" in step and "reshape" in out[-1]:
            out[-1] = step
            continue
        if out and "transpose" in step and "transpose" in out[-1]:
            first = out[-1]["transpose"]
            out[-1] = {"transpose": [first[i] for i in step["transpose"]]}
            if out[-1]["transpose"] == sorted(out[-1]["transpose"]):
                out.pop()
            continue
        out.append(step)
    return out


def fuse_shuffles(g: Graph, plog: PassLog) -> None:
    """ShuffleShuffleFusion: consecutive shuffles whose middle tensor has one reader become one Shuffle."""
    for node in [n for n in g.nodes if n.op_type in SHUFFLE_OPS and n.domain in ("", "ai.onnx")]:
        replace_nodes(g, [node], _as_shuffle(node))
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
            steps = _simplify(first.attrs["steps"] + second.attrs["steps"])
            replace_nodes(g, [first, second], Node(name, "Shuffle", [first.inputs[0]], list(second.outputs),
                                                   {"steps": steps}, "kiln", origin))
            changed = True
            break


def erase_noop_shuffles(g: Graph, plog: PassLog) -> None:
    """ShuffleErasure: a Shuffle that keeps the shape and moves no data is removed."""
    for node in [n for n in g.nodes if n.op_type == "Shuffle"]:
        src, out = node.inputs[0], node.outputs[0]
        steps = _simplify(node.attrs["steps"])
        if any("transpose" in s for s in steps) or src.shape != out.shape:
            continue
        if g.is_output(out) or src.is_const:
            continue
        plog.running(node)
        g.remove_node(node)
        g.replace_all_uses(out, src)
        plog.removing(node)
