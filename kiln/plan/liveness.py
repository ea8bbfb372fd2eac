"""Last-use analysis of a plan's layers: the one rule for when a tensor dies, shared by the memory planner and
the interpreter that frees buffers."""
from __future__ import annotations

from kiln.plan.model import Layer


def last_uses(layers: list[Layer] | tuple[Layer, ...], keep: set[str]) -> dict[str, int]:
    """Index of the last layer reading each tensor; tensors in `keep` live to the end."""
    last: dict[str, int] = {}
    for i, layer in enumerate(layers):
        for a in layer.args:
            if a.kind == "tensor":
                last[a.name] = i
        for t in layer.outputs:
            last.setdefault(t.name, i)
    end = len(layers)
    for name in keep:
        last[name] = end
    return last


def free_lists(layers: list[Layer] | tuple[Layer, ...], keep: set[str]) -> list[list[str]]:
    """Per layer, the tensors whose last reader it is (tensors in `keep` are never freed)."""
    frees: list[list[str]] = [[] for _ in layers]
    for name, idx in last_uses(layers, keep).items():
        if idx < len(layers):
            frees[idx].append(name)
    return frees
