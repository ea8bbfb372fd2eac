"""Attribution by ONNX node: which layer of an engine (kiln's or TensorRT's) computes each ONNX node, in which
precision, and how much of that layer's time is the node's; for one engine or two side by side.

A layer's ONNX nodes come from its recorded origins (TensorRT 10's `Metadata` `[ONNX Layer: …]`, kiln's plan),
else from its name (`kiln.trt.layer_names`). A `{ForeignNode[first...last]}` range is resolved against the model's
topological order when the model is given, else against the other engine's layers (a single range the ends of
which the other engine does not name takes the other engine's nodes no other layer claims), else kept as the range.
A layer holding several nodes splits its time by the nodes' FLOPs (from the model, when given and every shape is
known; nodes the model lacks, such as Q/DQ inserted by INT8 calibration, take none), else evenly. Inserted copies (Reformat layers without ONNX nodes) are one "(reformat)" row and layers with
no ONNX node at all one "(no ONNX node)" row, so the rows' times add up to the profile's total."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.inspect.onnx_nodes import ModelNodes
from kiln.trt.layer_names import NodeRange, parse_layer_name
from kiln.trt.records import EngineInfo, LayerRecord, Profile, is_reformat

REFORMAT_ROW = "(reformat)"
NO_NODE_ROW = "(no ONNX node)"
_PASS_THROUGH_TYPES = ("NoOp", "Reformat")
OTHER_ENGINE = "the other engine's layers"


@dataclass(frozen=True)
class LayerShare:
    """One layer's part in one ONNX node."""

    layer: str
    layer_type: str | None
    precision: str | None
    share: float                                 # the node's fraction of the layer's time
    split: str                                   # how the layer's time was split: "whole" | "flops" | "even"
    time_ms: float | None                        # share x the layer's average time; None without a profile


@dataclass(frozen=True)
class Placement:
    """Where one ONNX node lives in one engine: every layer that computes part of it."""

    shares: tuple[LayerShare, ...]

    @property
    def primary(self) -> LayerShare:
        """The layer that takes most of the node's time; without times the first that computes (not a copy)."""
        computing = [s for s in self.shares if s.layer_type not in _PASS_THROUGH_TYPES] or list(self.shares)
        if any(s.time_ms for s in self.shares):
            return max(self.shares, key=lambda s: (s.time_ms or 0.0, s in computing))
        return computing[0]

    @property
    def time_ms(self) -> float | None:
        times = [s.time_ms for s in self.shares if s.time_ms is not None]
        return sum(times) if times else None


@dataclass(frozen=True)
class NodeRow:
    onnx_node: str                               # or REFORMAT_ROW / NO_NODE_ROW
    a: Placement | None
    b: Placement | None = None

    @property
    def delta_ms(self) -> float:
        """B's time minus A's (a missing side counts 0)."""
        return ((self.b.time_ms or 0.0) if self.b else 0.0) - ((self.a.time_ms or 0.0) if self.a else 0.0)

    @property
    def precision_differs(self) -> bool:
        return bool(self.a and self.b and self.a.primary.precision != self.b.primary.precision)


@dataclass(frozen=True)
class ByOnnx:
    rows: tuple[NodeRow, ...]
    engines: int                                 # 1 (inspect) or 2 (diff)
    split: str                                   # "flops (from the model)" | "even (no model)" | ...
    notes: tuple[str, ...]


@dataclass
class _Entry:
    """A timed layer and the ONNX nodes it holds, while ranges are being resolved."""

    layer: LayerRecord
    kind: str                                    # "nodes" | "reformat" | "none"
    nodes: list[str]
    ranges: list[NodeRange]


# ---- layers -> nodes -----------------------------------------------------------------------------------------------

def _times(profile: Profile | None) -> dict[str, float] | None:
    return {r.name: r.average_ms for r in profile.records} if profile else None


def _timed_layers(engine: EngineInfo, times: dict[str, float] | None, notes: list[str]) -> list[LayerRecord]:
    """The engine's layers, plus a names-only layer for each profile record the engine does not list."""
    layers = list(engine.layers)
    known = {layer.name for layer in layers}
    extra = [name for name in (times or {}) if name not in known]
    if extra:
        notes.append(f"{len(extra)} profile record(s) name no layer of the engine; attributed by their names")
        layers += [LayerRecord(name=name) for name in extra]
    return layers


def _entry(layer: LayerRecord, model: ModelNodes | None, unknown: list[str]) -> _Entry:
    if layer.origin:
        return _Entry(layer, "nodes", _dedupe(_resolve(p, model, unknown) or p for p in layer.origin), [])
    parsed = parse_layer_name(layer.name)
    if parsed.reformat or is_reformat(layer):
        return _Entry(layer, "reformat", [], [])
    nodes = [n for n in (_resolve(p, model, unknown) for p in parsed.nodes) if n]
    if model is not None:
        nodes += [p for p in parsed.unnamed if p in model.op_types]   # kiln names unnamed ONNX nodes this way
    kind = "nodes" if nodes or parsed.ranges else "none"
    return _Entry(layer, kind, _dedupe(nodes), list(parsed.ranges))


def _resolve(part: str, model: ModelNodes | None, unknown: list[str]) -> str | None:
    """A name part -> the model's node (None for a weight); the part itself without a model or when unknown."""
    if model is None:
        return part
    node = model.resolve(part)
    if node is None and part not in model.initializers:
        unknown.append(part)
        return part
    return node


def _dedupe(items) -> list[str]:
    return list(dict.fromkeys(items))


def _order(entries: list[_Entry]) -> list[str]:
    """The ONNX nodes an engine names, in layer order."""
    return _dedupe(n for e in entries for n in e.nodes)


def _resolve_ranges(entries: list[_Entry], orders: list[tuple[list[str], str]], notes: list[str]) -> None:
    """Replace each `{ForeignNode[first...last]}` by the nodes between its ends in the first of `orders` (node
    order, what it is) that names both ends, less the nodes other layers of the engine hold; see the module
    docstring for the fallbacks."""
    claimed = set(_order(entries))
    pending = [(e, r) for e in entries for r in e.ranges]
    other = next((order for order, what in orders if what == OTHER_ENGINE), None)
    for entry, rng in pending:
        found = next(((o, what) for o, what in orders if rng.first in o and rng.last in o), None)
        if found:
            order, what = found
            i, j = order.index(rng.first), order.index(rng.last)
            entry.nodes += [n for n in order[min(i, j):max(i, j) + 1] if n not in claimed]
            notes.append(f"{rng.text}: resolved against {what}")
        elif other and len(pending) == 1:
            entry.nodes += [n for n in other if n not in claimed]
            notes.append(f"{rng.text}: its ends are not named elsewhere; it takes the {len(entry.nodes)} nodes of "
                         "the other engine that no other layer holds")
        else:
            entry.nodes.append(rng.text)
            notes.append(f"{rng.text}: kept as the range (its ends are not found; give --model to resolve it)")
        entry.nodes = _dedupe(entry.nodes)
        entry.ranges = []


# ---- time shares ---------------------------------------------------------------------------------------------------

def _weights(nodes: list[str], model: ModelNodes | None) -> tuple[list[float], str]:
    if len(nodes) == 1:
        return [1.0], "whole"
    # nodes the model does not have (Q/DQ that --int8 calibration inserted) take no share; unknown shapes: even
    flops = [model.flops.get(n, 0.0) for n in nodes] if model is not None else [None]
    if all(f is not None for f in flops) and sum(flops) > 0:
        total = sum(flops)
        return [f / total for f in flops], "flops"
    return [1.0 / len(nodes)] * len(nodes), "even"


def _attribute(entries: list[_Entry], times: dict[str, float] | None,
               model: ModelNodes | None) -> dict[str, Placement]:
    shares: dict[str, list[LayerShare]] = {}
    for e in entries:
        layer = e.layer
        time = times.get(layer.name) if times is not None else None
        kind_type = layer.layer_type or layer.parameter_type
        if e.kind == "nodes":
            weights, split = _weights(e.nodes, model)
            pairs = list(zip(e.nodes, weights))
        else:
            pairs, split = [(REFORMAT_ROW if e.kind == "reformat" else NO_NODE_ROW, 1.0)], "whole"
        for node, w in pairs:
            shares.setdefault(node, []).append(LayerShare(layer.name, kind_type, layer.precision, w, split,
                                                          None if time is None else w * time))
    return {node: Placement(tuple(s)) for node, s in shares.items()}


def _entries(engine: EngineInfo, profile: Profile | None, model: ModelNodes | None,
             notes: list[str]) -> tuple[list[_Entry], dict[str, float] | None]:
    times = _times(profile or engine.profile)
    unknown: list[str] = []
    entries = [_entry(layer, model, unknown) for layer in _timed_layers(engine, times, notes)]
    if unknown:
        unknown = _dedupe(unknown)
        notes.append(f"{len(unknown)} name(s) are no node of the model, kept as written (Q/DQ that INT8 calibration "
                     f"inserted, or another model's nodes), e.g. {', '.join(unknown[:3])}")
    return entries, times


def _split_text(model: ModelNodes | None) -> str:
    return ("by FLOPs estimated from the model (evenly where a shape is unknown)" if model is not None
            else "evenly (no model given; kiln and TensorRT record no per-node FLOPs)")


def by_onnx(a: EngineInfo, profile_a: Profile | None = None, b: EngineInfo | None = None,
            profile_b: Profile | None = None, model: ModelNodes | None = None) -> ByOnnx:
    """Per ONNX node: its layer, precision, type and time in A (and B), sorted by |time difference| (one engine:
    by time), then nodes whose precision differs, then engine order."""
    notes_a: list[str] = []
    notes_b: list[str] = []
    entries_a, times_a = _entries(a, profile_a, model, notes_a)
    entries_b, times_b = _entries(b, profile_b, model, notes_b) if b is not None else ([], None)
    order_a, order_b = _order(entries_a), _order(entries_b)
    by_model = [(list(model.order), "the model's topological order")] if model is not None else []
    _resolve_ranges(entries_a, by_model + ([(order_b, OTHER_ENGINE)] if order_b else []), notes_a)
    _resolve_ranges(entries_b, by_model + ([(order_a, OTHER_ENGINE)] if order_a else []), notes_b)
    place_a, place_b = _attribute(entries_a, times_a, model), _attribute(entries_b, times_b, model)
    names = _dedupe(list(place_a) + list(place_b))
    rows = [NodeRow(n, place_a.get(n), place_b.get(n) if b is not None else None) for n in names]
    rank = {n: i for i, n in enumerate(names)}
    rows.sort(key=lambda r: (-abs(r.delta_ms), not r.precision_differs, rank[r.onnx_node]))
    notes = [f"A: {n}" for n in _dedupe(notes_a)] + [f"B: {n}" for n in _dedupe(notes_b)] if b is not None \
        else _dedupe(notes_a)
    absent = [n for n in model.order if n not in place_a and n not in place_b] if model is not None else []
    if absent:
        notes.append(f"{len(absent)} node(s) of the model are in no layer (removed or folded by the build): "
                     + ", ".join(absent[:5]) + (", ..." if len(absent) > 5 else ""))
    return ByOnnx(tuple(rows), 2 if b is not None else 1, _split_text(model), tuple(notes))


# ---- JSON ----------------------------------------------------------------------------------------------------------

def side_json(p: Placement | None) -> dict[str, Any]:
    """One engine's side of a row: {} when the node is not in that engine."""
    if p is None:
        return {}
    primary = p.primary
    return {"layer": primary.layer, "precision": primary.precision, "time_ms": p.time_ms,
            "layer_type": primary.layer_type, "share": primary.share, "split": primary.split,
            "layers": [{"layer": s.layer, "layer_type": s.layer_type, "precision": s.precision, "share": s.share,
                        "split": s.split, "time_ms": s.time_ms} for s in p.shares]}


def to_json(result: ByOnnx) -> dict[str, Any]:
    """`{"nodes": [{"onnx_node", "a": {...}, "b": {...}}], "split", "notes"}`; one engine: "a" only."""
    nodes = []
    for r in result.rows:
        row: dict[str, Any] = {"onnx_node": r.onnx_node, "a": side_json(r.a)}
        if result.engines == 2:
            row["b"] = side_json(r.b)
            row["delta_ms"] = r.delta_ms
        nodes.append(row)
    return {"nodes": nodes, "split": result.split, "notes": list(result.notes)}
