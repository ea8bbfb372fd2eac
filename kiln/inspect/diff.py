"""Diff two engine descriptions (kiln or TensorRT): match their layers (by ONNX origin sets, then exact name, then
layer type + output shapes), list what changed per matched pair (precision, format, tactic, type), which fused groups
differ, and explain the time difference with the few layers that account for most of it. A names-only dump against a
detailed dump of the same engine is recognised as a verbosity difference (a Myelin region vs its sub-layers)."""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from kiln.trt.records import EngineInfo, LayerRecord, Profile, is_region

_MYELIN_TYPES = ("kgen", "gemm", "fusion", "myelin")


@dataclass(frozen=True)
class Change:
    layer_a: str
    layer_b: str
    kind: str                                    # "precision" | "format" | "tactic" | "type"
    a: str | None
    b: str | None


@dataclass(frozen=True)
class FusedGroup:
    """Layers of A and of B that share ONNX origins but group them differently."""
    layers_a: tuple[str, ...]
    layers_b: tuple[str, ...]
    origins: tuple[str, ...]


@dataclass(frozen=True)
class EngineDiff:
    pairs: tuple[tuple[str, str, str], ...]      # (layer_a, layer_b, how: "origin" | "name" | "type+shape")
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    changes: tuple[Change, ...]
    fused_groups_differ: tuple[FusedGroup, ...]
    layer_count_a: int
    layer_count_b: int
    total_ms_a: float | None
    total_ms_b: float | None
    verbosity_only: bool                         # the layer lists differ only in how a region is listed
    explanation: tuple[str, ...]


def _shape_key(layer: LayerRecord):
    kind = layer.layer_type or layer.parameter_type
    return (kind, tuple(t.dims for t in layer.outputs)) if kind and layer.outputs else None


_KEYS = (("origin", lambda l: frozenset(l.origin) or None), ("name", lambda l: l.name), ("type+shape", _shape_key))


def _compatible(la: LayerRecord, lb: LayerRecord) -> bool:
    """Layers known to come from disjoint ONNX nodes are not the same layer, whatever their type and shape."""
    return not (la.origin and lb.origin) or bool(set(la.origin) & set(lb.origin))


def match_layers(a: EngineInfo, b: EngineInfo) -> list[tuple[int, int, str]]:
    """Index pairs (i in a, j in b, how), one-to-one, each key tried in order over the still-unmatched layers; a
    type+shape match needs origins that overlap (or are unknown on one side)."""
    used_a, used_b, pairs = set(), set(), []
    for how, key in _KEYS:
        free_b: dict = defaultdict(list)
        for j, layer in enumerate(b.layers):
            k = key(layer)
            if j not in used_b and k is not None:
                free_b[k].append(j)
        for i, layer in enumerate(a.layers):
            k = key(layer)
            fits = [j for j in free_b.get(k, ()) if how != "type+shape" or _compatible(layer, b.layers[j])]
            if i in used_a or k is None or not fits:
                continue
            j = fits[0]
            free_b[k].remove(j)
            used_a.add(i)
            used_b.add(j)
            pairs.append((i, j, how))
    return sorted(pairs)


def _format(layer: LayerRecord) -> tuple[str, ...] | None:
    formats = tuple(t.format for t in layer.outputs)
    return formats if formats and all(formats) else None


def _tactic(layer: LayerRecord) -> str | None:
    return layer.tactic_name or layer.tactic_value


def pair_changes(la: LayerRecord, lb: LayerRecord, compare_tactics: bool) -> list[Change]:
    out = []
    if la.layer_type and lb.layer_type and la.layer_type != lb.layer_type:
        out.append(Change(la.name, lb.name, "type", la.layer_type, lb.layer_type))
    if la.precision and lb.precision and la.precision != lb.precision:
        out.append(Change(la.name, lb.name, "precision", la.precision, lb.precision))
    elif _format(la) and _format(lb) and _format(la) != _format(lb):
        out.append(Change(la.name, lb.name, "format", " | ".join(_format(la)), " | ".join(_format(lb))))
    if compare_tactics and _tactic(la) and _tactic(lb) and _tactic(la) != _tactic(lb):
        out.append(Change(la.name, lb.name, "tactic", _tactic(la), _tactic(lb)))
    return out


def fused_groups(a: EngineInfo, b: EngineInfo) -> list[FusedGroup]:
    """Connected groups of layers sharing ONNX origins whose origin sets differ between A and B."""
    nodes = [("a", i, l) for i, l in enumerate(a.layers) if l.origin] + \
            [("b", j, l) for j, l in enumerate(b.layers) if l.origin]
    parent = list(range(len(nodes)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first: dict[str, int] = {}
    for n, (_, _, layer) in enumerate(nodes):
        for o in layer.origin:
            parent[find(n)] = find(first.setdefault(o, n))
    groups: dict[int, list] = defaultdict(list)
    for n, node in enumerate(nodes):
        groups[find(n)].append(node)
    out = []
    for members in groups.values():
        sa = Counter(frozenset(l.origin) for s, _, l in members if s == "a")
        sb = Counter(frozenset(l.origin) for s, _, l in members if s == "b")
        if sa and sb and sa != sb:
            origins = sorted({o for _, _, l in members for o in l.origin})
            out.append(FusedGroup(tuple(l.name for s, _, l in members if s == "a"),
                                  tuple(l.name for s, _, l in members if s == "b"), tuple(origins)))
    return out


def _myelin_like(layer: LayerRecord) -> bool:
    return bool(layer.region) or "_myl" in layer.name or (layer.layer_type or "").lower() in _MYELIN_TYPES


def _fits(regions: list[LayerRecord], extras: list[LayerRecord]) -> bool:
    """The extra layers are the regions' sub-layers: Myelin-like, or their data flow starts at the regions' inputs
    and ends at the regions' outputs."""
    if not extras:
        return False
    if all(_myelin_like(x) for x in extras):
        return True
    produced = {t.name for x in extras for t in x.outputs}
    external = {t.name for x in extras for t in x.inputs} - produced
    r_in = {t.name for r in regions for t in r.inputs}
    r_out = {t.name for r in regions for t in r.outputs}
    return bool(r_in or r_out) and external <= r_in and r_out <= produced


def verbosity_split(a: EngineInfo, b: EngineInfo, only_a: list[LayerRecord], only_b: list[LayerRecord]):
    """(coarse side "A"/"B", its unmatched regions, the other side's extra layers) when the only layer-list
    difference is a region listed as one layer vs as its sub-layers; else None."""
    for side, coarse, rest_c, rest_f in (("A", a, only_a, only_b), ("B", b, only_b, only_a)):
        regions = [l for l in rest_c if is_region(l)]
        if not regions or len(regions) != len(rest_c):
            continue
        if _fits(regions, rest_f):
            return side, regions, rest_f
    return None


def _times(profile: Profile | None) -> dict[str, float] | None:
    return {r.name: r.average_ms for r in profile.records} if profile else None


def _items(a, b, idx_pairs, changes, only_a, only_b, split, ta, tb) -> list[tuple[float, str]]:
    """(time delta B - A, description) for each pair, region-vs-sub-layers group and unmatched layer."""
    items, grouped = [], set()
    if split:
        side, regions, extras = split
        coarse_t, fine_t = (ta, tb) if side == "A" else (tb, ta)
        tc, tf = sum(coarse_t.get(r.name, 0.0) for r in regions), sum(fine_t.get(x.name, 0.0) for x in extras)
        delta = tf - tc if side == "A" else tc - tf
        items.append((delta, f"{', '.join(r.name for r in regions)} vs its {len(extras)} sub-layers"))
        grouped = {id(l) for l in regions + extras}
    by_pair = defaultdict(list)
    for c in changes:
        by_pair[(c.layer_a, c.layer_b)].append(f"{c.kind} {c.a} -> {c.b}")
    for i, j, _ in idx_pairs:
        la, lb = a.layers[i], b.layers[j]
        what = "; ".join(by_pair[(la.name, lb.name)]) or "no recorded change"
        x, y = ta.get(la.name, 0.0), tb.get(lb.name, 0.0)
        items.append((y - x, f"{lb.name}: {x:.3f} -> {y:.3f} ms ({what})"))
    items += [(-ta.get(l.name, 0.0), f"{l.name} only in A ({ta.get(l.name, 0.0):.3f} ms)")
              for l in only_a if id(l) not in grouped]
    items += [(tb.get(l.name, 0.0), f"{l.name} only in B ({tb.get(l.name, 0.0):.3f} ms)")
              for l in only_b if id(l) not in grouped]
    return items


def _ranking(items: list[tuple[float, str]]) -> list[str]:
    """The few items that make up most (80%) of the absolute time change, largest first, at most 5."""
    ranked = sorted((it for it in items if it[0]), key=lambda it: -abs(it[0]))
    total, acc, out = sum(abs(d) for d, _ in ranked), 0.0, []
    for d, text in ranked[:5]:
        out.append(f"{'+' if d > 0 else '-'}{abs(d):.3f} ms: {text}")
        acc += abs(d)
        if acc >= 0.8 * total:
            break
    return out


def _explain(a, b, d_pairs, only_a, only_b, changes, groups, split, ta, tb, idx_pairs) -> list[str]:
    hows = Counter(how for _, _, how in d_pairs)
    lines = [f"A has {len(a.layers)} layers ({a.source}, {a.verbosity}); B has {len(b.layers)} ({b.source}, "
             f"{b.verbosity}).",
             f"{len(d_pairs)} matched ({', '.join(f'{n} by {h}' for h, n in hows.items()) or 'none'}); "
             f"{len(only_a)} only in A, {len(only_b)} only in B."]
    if split:
        side, regions, extras = split
        fine = "B" if side == "A" else "A"
        lines.append(f"The difference is the verbosity, not the engine: {side} lists the Myelin region "
                     f"{regions[0].name}{' (and %d more)' % (len(regions) - 1) if len(regions) > 1 else ''} as one "
                     f"layer, {fine} lists its {len(extras)} sub-layers.")
    elif a.verbosity != b.verbosity:
        lines.append("One side lists layer names only: precisions, formats and tactics cannot be compared.")
    kinds = Counter(c.kind for c in changes)
    if not (kinds or groups or only_a or only_b):
        lines.append("No layer differences found.")
    if kinds:
        lines.append("Changed: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ".")
    if groups:
        lines.append(f"{len(groups)} fused group(s) differ, e.g. A {list(groups[0].layers_a)} vs B "
                     f"{list(groups[0].layers_b)}.")
    if ta is not None and tb is not None:
        sa, sb = sum(ta.values()), sum(tb.values())
        lines.append(f"Total {sa:.3f} ms (A) vs {sb:.3f} ms (B): {sb - sa:+.3f} ms. Most of it:")
        lines += _ranking(_items(a, b, idx_pairs, changes, only_a, only_b, split, ta, tb))
    elif changes:
        lines += [f"{c.layer_b}: {c.kind} {c.a} -> {c.b}" for c in changes[:3]]
    return lines


def diff(a: EngineInfo, b: EngineInfo, profile_a: Profile | None = None,
         profile_b: Profile | None = None) -> EngineDiff:
    idx_pairs = match_layers(a, b)
    ia, ib = {i for i, _, _ in idx_pairs}, {j for _, j, _ in idx_pairs}
    only_a = [l for i, l in enumerate(a.layers) if i not in ia]
    only_b = [l for j, l in enumerate(b.layers) if j not in ib]
    detailed = "layer_names_only" not in (a.verbosity, b.verbosity)
    changes = [c for i, j, _ in idx_pairs for c in pair_changes(a.layers[i], b.layers[j], detailed)]
    groups = fused_groups(a, b)
    split = verbosity_split(a, b, only_a, only_b)
    ta, tb = _times(profile_a or a.profile), _times(profile_b or b.profile)
    d_pairs = [(a.layers[i].name, b.layers[j].name, how) for i, j, how in idx_pairs]
    explanation = _explain(a, b, d_pairs, only_a, only_b, changes, groups, split, ta, tb, idx_pairs)
    return EngineDiff(tuple(d_pairs), tuple(l.name for l in only_a), tuple(l.name for l in only_b), tuple(changes),
                      tuple(groups), len(a.layers), len(b.layers), sum(ta.values()) if ta is not None else None,
                      sum(tb.values()) if tb is not None else None, split is not None, tuple(explanation))
