"""Activation memory planning: a best-fit arena where tensors with disjoint lifetimes share bytes."""
from __future__ import annotations

from kiln.plan.liveness import free_lists, last_uses, place
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
    offsets, total = place(intervals, ALIGN_BYTES)
    free_after = free_lists(layers, outputs | {t.name for t in graph_inputs})
    return MemoryPlan(total, sum(x[3] for x in intervals), offsets, tuple(tuple(f) for f in free_after))
