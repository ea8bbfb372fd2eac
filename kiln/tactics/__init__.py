"""Tactics: kernel implementations per layer, a registry, and the choice among them."""
from __future__ import annotations

from kiln.tactics.base import ANY, HWC, LINEAR, Kernel, LayerView, Tactic, tactic_value
from kiln.tactics.onednn_conv import OneDnnConvTactic
from kiln.tactics.reference import ReferenceTactic

# Candidates per op type, in preference order; "*" applies to every op. The autotuner (next step) times them.
REGISTRY: dict[str, list[Tactic]] = {
    "Conv": [OneDnnConvTactic()],
    "*": [ReferenceTactic()],
}
TACTICS_BY_NAME: dict[str, Tactic] = {t.name: t for ts in REGISTRY.values() for t in ts}


def candidates(layer: LayerView, sources: frozenset[str] | None = None) -> list[Tactic]:
    found = [t for t in REGISTRY.get(layer.op_type, []) + REGISTRY["*"] if t.supports(layer)]
    if sources is not None:
        found = [t for t in found if t.source in sources] or found[-1:]
    return found


def choose(layer: LayerView, sources: frozenset[str] | None = None) -> Tactic:
    return candidates(layer, sources)[0]


__all__ = ["ANY", "HWC", "LINEAR", "Kernel", "LayerView", "Tactic", "TACTICS_BY_NAME", "candidates", "choose",
           "tactic_value"]
