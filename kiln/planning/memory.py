"""Activation memory planning: a best-fit arena where tensors with disjoint lifetimes share bytes."""
from __future__ import annotations

from kiln.plan.liveness import free_lists, last_uses
from kiln.plan.model import Layer, MemoryPlan, TensorDesc

ALIGN_BYTES = 64


def plan_memory(layers: list[Layer], graph_inputs: tuple[TensorDesc, ...], graph_outputs: tuple[TensorDesc, ...]) -> MemoryPlan:
    outputs = {t.name for t in graph_outputs}
    last = last_uses(layers, outputs)
    intervals = []
    for i, layer in enumerate(layers):
        for t in layer.outputs:
            size = -(-t.size_bytes // ALIGN_BYTES) * ALIGN_BYTES
            intervals.append((t.name, i, last[t.name], size))
    offsets: dict[str, int] = {}
    placed: list[tuple[int, int, int, int]] = []   # (start, end, offset, size)
    for name, start, end, size in sorted(intervals, key=lambda x: (-x[3], x[1])):
        busy = sorted((o, o + s) for (a, b, o, s) in placed if not (b < start or end < a))
        offset = 0
        for lo, hi in busy:
            if offset + size <= lo:
                break
            offset = max(offset, hi)
        offsets[name] = offset
        placed.append((start, end, offset, size))
    total = max((o + s for (_, _, o, s) in placed), default=0)
    free_after = free_lists(layers, outputs | {t.name for t in graph_inputs})
    return MemoryPlan(total, sum(x[3] for x in intervals), offsets, tuple(tuple(f) for f in free_after))
