"""Last-use analysis of a plan's layers: the one rule for when a tensor dies, shared by the memory planner and
the interpreter that frees buffers; and the best-fit placement of buffers whose lifetimes are known."""
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


def place(intervals: list[tuple[str, int, int, int]], align_bytes: int = 64) -> tuple[dict[str, int], int]:
    """(byte offset per name, total bytes) of buffers (name, first step, last step, bytes) in one arena, largest
    first, each at the lowest offset free of every buffer whose lifetime overlaps its own; sizes rounded up to
    `align_bytes`."""
    offsets: dict[str, int] = {}
    placed: list[tuple[int, int, int, int]] = []   # (start, end, offset, size)
    for name, start, end, size in sorted(intervals, key=lambda x: (-x[3], x[1])):
        size = -(-size // align_bytes) * align_bytes
        busy = sorted((o, o + s) for (a, b, o, s) in placed if not (b < start or end < a))
        offset = 0
        for lo, hi in busy:
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        offsets[name] = offset
        placed.append((start, end, offset, size))
    return offsets, max((o + s for (_, _, o, s) in placed), default=0)
