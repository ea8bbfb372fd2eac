"""Region planning: hand whole segments of the graph to onnxruntime where that beats kiln's own kernels.

A segment is the run of nodes between two points where exactly one tensor is live (block boundaries in
CNNs). Each segment costs kiln's per-layer times (from the autotuner) or its time as one onnxruntime
sub-model; a small dynamic program picks the cheapest mix, counting layout copies where sources switch.
Adjacent onnxruntime segments merge into one `{ForeignNode[first...last]}` layer (TVM's external-library
trade-off: a region cannot fuse with its neighbours, so it must win on its own).
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

import torch

from kiln.ir import Graph, Node
from kiln.tactics.autotune import Autotuner, TimingOptions, example_input, time_rounds_ms
from kiln.tactics.base import HWC, LINEAR
from kiln.tactics.lower import node_view
from kiln.tactics.onnx_emit import emit_region, supports
from kiln.tactics.timing_cache import digest
from kiln.trt.vocab import region_layer_name

log = logging.getLogger("kiln.build")

SEGMENT_BLOCK_MS = 600.0   # segment timing: runs per measurement are capped at about a quarter of this



@dataclass(frozen=True)
class Segment:
    start: int
    end: int                 # exclusive
    kiln_ms: float
    region_ms: float | None  # None: onnxruntime cannot run every node of it
    boundary: str | None     # the single tensor live after the segment


def segments(g: Graph) -> list[tuple[int, int, str | None]]:
    """Cut the node order wherever exactly one activation is live."""
    last_use: dict[str, int] = {}
    for i, n in enumerate(g.nodes):
        for v in n.inputs:
            if v is not None and not v.is_const:
                last_use[v.name] = i
    for v in g.outputs:
        last_use[v.name] = len(g.nodes)
    cuts, live, start = [], {}, 0
    for i, n in enumerate(g.nodes):
        for v in n.outputs:
            if last_use.get(v.name, -1) > i:
                live[v.name] = v
        live = {k: v for k, v in live.items() if last_use.get(k, -1) > i}
        if len(live) == 1 and i + 1 < len(g.nodes):
            cuts.append((start, i + 1, next(iter(live))))
            start = i + 1
    cuts.append((start, len(g.nodes), None))
    return cuts


def region_io(nodes: list[Node], g: Graph):
    inside = {id(v) for n in nodes for v in n.outputs}
    ext_in, consts, outs = [], [], []
    for n in nodes:
        for v in n.inputs:
            if v is None or id(v) in inside:
                continue
            target = consts if v.is_const else ext_in
            if all(v is not x for x in target):
                target.append(v)
    later = {id(v) for n in g.nodes if n not in nodes for v in n.inputs if v is not None}
    for n in nodes:
        for v in n.outputs:
            if id(v) in later or g.is_output(v):
                outs.append(v)
    return ext_in, consts, outs


def _spec(v) -> tuple[int, ...]:
    return tuple(-1 if i in v.dyn_dims else d for i, d in enumerate(v.shape))


def region_model(nodes: list[Node], g: Graph):
    opset = max(13, g.opset)
    ext_in, consts, outs = region_io(nodes, g)
    steps = [(node_view(n, opset, with_consts=False),
              [None if v is None else ("weight" if v.is_const else "tensor", v.name) for v in n.inputs],
              n.outputs[0].name if len(n.outputs) == 1 else [v.name for v in n.outputs]) for n in nodes]
    weights = {v.name: v.const for v in consts}
    model, external = emit_region([(v.name, _spec(v), str(v.dtype)) for v in ext_in], steps,
                                  [(v.name, str(v.dtype)) for v in outs], weights, opset)
    return model, external, ext_in, outs


def _region_runner(nodes: list[Node], g: Graph):
    """A callable running `nodes` as one onnxruntime region on example inputs, or None if it cannot."""
    from kiln.tactics.onnxruntime_source import region_kernel

    if not all(supports(node_view(n, g.opset, with_consts=False)) and (len(n.outputs) == 1 or n.domain != "kiln")
               for n in nodes):
        return None
    model, external, ext_in, outs = region_model(nodes, g)
    try:
        kernel = region_kernel(model, external, [v.name for v in ext_in], [v.name for v in outs])
    except Exception as exc:   # onnxruntime rejects the sub-model: that segment stays with kiln
        log.debug("Region of %s...%s not runnable by onnxruntime: %s", nodes[0].name, nodes[-1].name, exc)
        return None
    xs = [example_input(v.shape, str(v.dtype), LINEAR) for v in ext_in]
    return lambda: kernel(xs)


def plan_runner(layers: list, descs: dict, weights_np: dict, opset: int, env0: dict | None = None,
                 keep: set[str] | None = None):
    """A callable running a run of planned layers on example inputs through the plan interpreter; it returns the
    final environment. With `keep` (the graph's outputs) it runs as an execution context does: each tensor is
    released after its last reader and in-place kernels take a dying residual's buffer. Without it every tensor
    stays (segment timing reads the boundary tensors)."""
    from kiln.runtime.interpreter import Interpreter
    from kiln.runtime.prepare import TorchWeights, prepare_kernel

    weights = TorchWeights(weights_np)
    produced = {t.name for layer in layers for t in layer.outputs}
    external = dict.fromkeys(a.name for layer in layers for a in layer.args
                             if a.kind == "tensor" and a.name not in produced)
    if env0 is None:
        env0 = {n: example_input(descs[n].dims, descs[n].dtype, descs[n].format) for n in external}
    kernels = [prepare_kernel(layer, weights, weights_np, opset) for layer in layers]
    interpreter = Interpreter(layers, kernels, None if keep is None else set(keep) | set(env0))
    return lambda: interpreter.run(dict(env0))


def measure_segment(nodes: list[Node], layers: list, g: Graph, descs: dict, weights: dict,
                    tuner: Autotuner) -> tuple[float, float | None]:
    """(kiln ms, onnxruntime region ms) for one segment, timed interleaved so drift hits both alike."""
    key = digest({"segment": [(n.op_type, n.attrs, [None if v is None else (v.shape, str(v.dtype), v.is_const)
                                                    for v in n.inputs]) for n in nodes],
                  "kiln": [(l.tactic_name, [(t.dims, t.format) for t in l.inputs]) for l in layers]})
    what = f"segment {nodes[0].name}...{nodes[-1].name}"
    kiln_ms = tuner.cache.get(key, "kiln.segment", what)
    region_ms = tuner.cache.get(key, "onnxruntime.region", what)
    if kiln_ms is not None and region_ms is not None:
        return kiln_ms, (None if region_ms < 0 else region_ms)
    runners = [plan_runner(layers, descs, weights, g.opset), _region_runner(nodes, g)]
    samples: list[list[float]] = [[], []]
    with torch.inference_mode():
        for _ in range(tuner.options.min_timing):
            for i, run in enumerate(runners):
                if run is not None:
                    runs = tuner.options.avg_timing
                    if samples[i]:   # long segments: fewer runs per measurement (about SEGMENT_BLOCK_MS / 4 each)
                        runs = max(2, min(runs, int(SEGMENT_BLOCK_MS / 4 / max(statistics.median(samples[i]), 1e-3))))
                    samples[i] += time_rounds_ms(run, TimingOptions(runs, 1), tuner.clock)
    kiln_ms = statistics.median(samples[0])
    region_ms = statistics.median(samples[1]) if samples[1] else None
    tuner.cache.put(key, "kiln.segment", kiln_ms)
    tuner.cache.put(key, "onnxruntime.region", -1.0 if region_ms is None else region_ms)
    return kiln_ms, region_ms


def choose_regions(g: Graph, node_layers: dict[str, tuple[int, int]], layers: list, descs: dict, weights: dict,
                   formats: dict[str, str], tuner: Autotuner) -> list[list[Node]]:
    """The runs of nodes that onnxruntime should run, each as one region."""
    segs = []
    for start, end, boundary in segments(g):
        nodes = g.nodes[start:end]
        first, last = node_layers[nodes[0].name][0], node_layers[nodes[-1].name][1]
        kiln_ms, region_ms = measure_segment(nodes, layers[first:last], g, descs, weights, tuner)
        segs.append(Segment(start, end, kiln_ms, region_ms, boundary))
    picks, best = _dynamic_program(g, segs, formats, tuner)
    if all(s.region_ms is not None for s in segs) and "K" in picks:
        whole = sum(s.region_ms for s in segs)
        if best > whole * (1 - tuner.costs.mix_margin):   # mixing must clearly win: one region is predictable parity
            log.debug("Mixed plan %.4g ms is within %d%% of one onnxruntime region (%.4g ms): taking one region",
                      best, int(tuner.costs.mix_margin * 100), whole)
            picks = ["O"] * len(segs)
    for seg, pick in zip(segs, picks):
        log.debug("Segment %s...%s: kiln %.4g ms, onnxruntime region %s -> %s", g.nodes[seg.start].name,
                  g.nodes[seg.end - 1].name, seg.kiln_ms, "n/a" if seg.region_ms is None else f"{seg.region_ms:.4g} ms",
                  "onnxruntime" if pick == "O" else "kiln")
    runs, current = [], []
    for seg, pick in zip(segs, picks):
        if pick == "O":
            current += g.nodes[seg.start:seg.end]
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def _dynamic_program(g: Graph, segs: list[Segment], formats: dict[str, str], tuner: Autotuner):
    """Cheapest source per segment; state = which source ran the previous segment."""
    inf = float("inf")
    cost = {"K": 0.0, "O": 0.0}
    back: list[dict[str, str]] = []
    prev_boundary = None
    for seg in segs:
        switch = _switch_ms(g, prev_boundary, formats, tuner)
        k = seg.kiln_ms + min(cost["K"], cost["O"] + switch)
        o = inf if seg.region_ms is None else seg.region_ms + min(cost["O"], cost["K"] + switch)
        back.append({"K": "K" if cost["K"] <= cost["O"] + switch else "O",
                     "O": "O" if cost["O"] <= cost["K"] + switch else "K"})
        cost = {"K": k, "O": o}
        prev_boundary = seg.boundary
    state = "K" if cost["K"] <= cost["O"] else "O"
    best = cost[state]
    picks = []
    for b in reversed(back):
        picks.append(state)
        state = b[state]
    picks.reverse()
    return picks, best


def unapply_regions(g: Graph) -> None:
    """Undo apply_regions: put each region's nodes back in its place."""
    for region in [n for n in g.nodes if n.op_type == "Region" and n.domain == "kiln"]:
        index = g.nodes.index(region)
        g.remove_node(region)
        for k, n in enumerate(region.attrs["nodes"]):
            g.add_node(n, index + k)


def _switch_ms(g: Graph, boundary: str | None, formats: dict[str, str], tuner: Autotuner) -> float:
    """Cost of changing source at a boundary: the pool hand-over, plus a layout copy for channel-major tensors."""
    if boundary is None or boundary not in g.values:
        return tuner.costs.pool_switch_ms
    v = g.values[boundary]
    if v.shape is None or len(v.shape) != 4 or formats.get(boundary) != HWC:
        return tuner.costs.pool_switch_ms
    return tuner.costs.pool_switch_ms + tuner.reformat_ms(v.shape, str(v.dtype), LINEAR)


def apply_regions(g: Graph, runs: list[list[Node]], library: str = "onnxruntime", precision: str = "f32") -> None:
    """Replace each run of nodes by one Region node (domain "kiln") holding them, run by `library` (OpenVINO at
    `precision`: f32, or bf16 in a --bf16 build)."""
    for nodes in runs:
        ext_in, consts, outs = region_io(nodes, g)
        name = region_layer_name(nodes[0].name, nodes[-1].name)
        origin = tuple(o for n in nodes for o in n.origin)
        attrs = {"nodes": list(nodes), "library": library, **({"precision": precision} if precision != "f32" else {})}
        region = Node(name, "Region", [*ext_in, *consts], list(outs), attrs, "kiln", origin)
        index = g.nodes.index(nodes[0])
        for n in nodes:
            g.remove_node(n)
        g.add_node(region, index)
