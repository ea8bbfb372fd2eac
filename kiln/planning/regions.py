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
import time
from dataclasses import dataclass

import torch

from kiln.errors import Error
from kiln.precision.policy import INT8_LAYERS, QDQ_OPS
from kiln.ir import Graph, Node
from kiln.tactics.base import HWC, LINEAR, LayerView
from kiln.tactics.autotune import Autotuner, TimingOptions, _example, _time_ms, robust_ms
from kiln.tactics.onnx_emit import emit_region, supports
from kiln.tactics.timing_cache import digest

log = logging.getLogger("kiln.build")

# Handing control between torch's OpenMP pool and onnxruntime's pool costs more than a copy: threads of the
# pool that just finished keep spinning while the other pool starts. Measured on 2 cores: ~2 ms per switch
# in ResNet-50 (3 switches: 54-57 ms against 47 ms for one region). Charged per switch in the cost model.
POOL_SWITCH_MS = 1.0
MIX_MARGIN = 0.05   # a mixed kiln/onnxruntime plan must beat one whole region by 5% to be taken


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


def _view(n: Node, opset: int) -> LayerView:
    return LayerView(n.op_type, n.domain, n.attrs, tuple(None if v is None else v.shape for v in n.inputs),
                     tuple(None if v is None else str(v.dtype) for v in n.inputs), {},
                     tuple(str(v.dtype) for v in n.outputs), opset,
                     tuple(() if v is None else v.dyn_dims for v in n.inputs))


def _spec(v) -> tuple[int, ...]:
    return tuple(-1 if i in v.dyn_dims else d for i, d in enumerate(v.shape))


def region_model(nodes: list[Node], g: Graph):
    opset = max(13, g.opset)
    ext_in, consts, outs = region_io(nodes, g)
    steps = [(_view(n, opset), [None if v is None else ("weight" if v.is_const else "tensor", v.name) for v in n.inputs],
              n.outputs[0].name if len(n.outputs) == 1 else [v.name for v in n.outputs]) for n in nodes]
    weights = {v.name: v.const for v in consts}
    model, external = emit_region([(v.name, _spec(v), str(v.dtype)) for v in ext_in], steps,
                                  [(v.name, str(v.dtype)) for v in outs], weights, opset)
    return model, external, ext_in, outs


def _region_runner(nodes: list[Node], g: Graph):
    """A callable running `nodes` as one onnxruntime region on example inputs, or None if it cannot."""
    from kiln.tactics.onnxruntime_source import region_kernel

    if not all(supports(_view(n, g.opset)) and (len(n.outputs) == 1 or n.domain != "kiln") for n in nodes):
        return None
    model, external, ext_in, outs = region_model(nodes, g)
    try:
        kernel = region_kernel(model, external, [v.name for v in ext_in], [v.name for v in outs])
    except Exception as exc:   # onnxruntime rejects the sub-model: that segment stays with kiln
        log.debug("Region of %s...%s not runnable by onnxruntime: %s", nodes[0].name, nodes[-1].name, exc)
        return None
    xs = [_example(v.shape, str(v.dtype), LINEAR) for v in ext_in]
    return lambda: kernel(xs)


def _kiln_runner(layers: list, descs: dict, weights_np: dict, opset: int, env0: dict | None = None,
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
        env0 = {n: _example(descs[n].dims, descs[n].dtype, descs[n].format) for n in external}
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
    runners = [_kiln_runner(layers, descs, weights, g.opset), _region_runner(nodes, g)]
    samples: list[list[float]] = [[], []]
    with torch.inference_mode():
        for _ in range(tuner.options.min_timing):
            for i, run in enumerate(runners):
                if run is not None:
                    runs = tuner.options.avg_timing
                    if samples[i]:   # long segments: fewer runs per measurement (about BLOCK_MS / 4 each)
                        runs = max(2, min(runs, int(BLOCK_MS / 4 / max(statistics.median(samples[i]), 1e-3))))
                    samples[i] += _time_ms(run, TimingOptions(runs, 1))
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
        if best > whole * (1 - MIX_MARGIN):   # mixing must clearly win: one region is predictable parity
            log.debug("Mixed plan %.4g ms is within %d%% of one onnxruntime region (%.4g ms): taking one region",
                      best, int(MIX_MARGIN * 100), whole)
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


INT8_OPS = frozenset(INT8_LAYERS + QDQ_OPS)
BLOCK_MS = 600.0     # whole-plan timing: a block of runs lasts about this long for slow models
PLAN_ROUNDS = 4      # whole-plan timing: rounds of one block per plan
PRUNE_RATIO = 1.15   # a plan this much slower than the best after one round is not timed further
WARMUP_MS = 40.0     # warm-up per block: another library's idle threads spin this long after its last run


def plan_signature(layers: list) -> str:
    return digest([(l.name, l.tactic_name, [(t.dims, t.format) for t in l.inputs]) for l in layers])


def measure_plans(candidates: dict[str, tuple[list, dict]], descs: dict, g: Graph, tuner: Autotuner,
                  reference_fn=None) -> dict[str, float]:
    """Whole-plan latency of each candidate, timed in blocks (the deciding measurement). Each candidate's outputs
    on the timing input are checked first: against the original model in onnxruntime when available, else
    against kiln's own kernels (the first candidate)."""
    times, runners = {}, {}
    inputs = {v.name: _example(v.shape, str(v.dtype), LINEAR) for v in g.inputs}
    reference = _reference_outputs(reference_fn, inputs)
    for name, (layers, weights) in candidates.items():
        key = plan_signature(layers)
        cached = tuner.cache.get(key, "plan", f"the {name} plan")
        if cached is not None:
            times[name] = cached
            continue
        try:
            run = _kiln_runner(layers, descs, weights, g.opset, inputs, keep={v.name for v in g.outputs})
            with torch.inference_mode():
                outputs = [run()[v.name] for v in g.outputs]
        except Exception as exc:   # a library refused the plan: it is simply not a candidate
            log.warning("The %s plan cannot run (%s: %s); leaving it out", name, type(exc).__name__, exc)
            continue
        if reference is None:
            reference = outputs   # no onnxruntime reference: the first candidate (kiln's own kernels) is the judge
        elif not _agree(outputs, reference, quantized=any(n.op_type in INT8_OPS for n in g.nodes)):
            log.warning("The %s plan's outputs differ from %s on the timing input; leaving it out", name,
                        "the original model in onnxruntime" if reference_fn else "kiln's kernels")
            continue
        runners[name] = (key, run, [])
    if not runners and not times and candidates:
        raise Error("no plan reproduces the original model's outputs (checked against onnxruntime on a random "
                    "input); rebuild with --builder-optimization-level 0 and compare with `kiln run`, then report it")
    # blocks, each after its own warm-up runs (at least WARMUP_MS): a library's idle threads keep spinning for a
    # while after it returns, which would bill the next candidate if runs alternated one by one. After the first
    # round a plan far behind the best is out; blocks of slow models are capped near BLOCK_MS. A plan's time is
    # its fastest round's median (autotune.robust_ms): noise here only adds time, in bursts that can cover a
    # whole block (one ResNet-50 build timed kiln's plan at 38.6 ms against 34-35 in every other one).
    with torch.inference_mode():
        for round_index in range(max(PLAN_ROUNDS, tuner.options.min_timing)):
            for name in _block_order(list(runners), round_index):
                _, run, rounds = runners[name]
                warmup = [_once_ms(run)]   # warm-up, and the first estimate of this plan's latency
                while sum(warmup) < WARMUP_MS and len(warmup) < 50:
                    warmup.append(_once_ms(run))
                estimate_ms = statistics.median(rounds[0]) if rounds else min(warmup)
                runs = max(3, min(max(5, tuner.options.avg_timing), int(BLOCK_MS / max(estimate_ms, 1e-3))))
                rounds.append([_once_ms(run) for _ in range(runs)])
            if round_index == 0 and len(runners) > 1:
                best = min(statistics.median(r[2][0]) for r in runners.values())
                for name in [n for n, r in runners.items() if statistics.median(r[2][0]) > PRUNE_RATIO * best]:
                    key, _, rounds = runners.pop(name)
                    times[name] = statistics.median(rounds[0])
                    tuner.cache.put(key, "plan", times[name])
                    log.debug("The %s plan (%.4g ms) is out after the first round", name, times[name])
    for name, (key, _, rounds) in runners.items():
        times[name] = robust_ms([statistics.median(r) for r in rounds])
        tuner.cache.put(key, "plan", times[name])
    return times


def _block_order(names: list[str], round_index: int) -> list[str]:
    """One round's block order, reversed every other round. The block after another library's keeps paying for
    that library's idle threads and data in cache (measured: ~4 % on ResNet-50 right after OpenVINO); in a fixed
    order the first plan would follow the last one in every round. Reversing makes each round boundary a plan
    following itself."""
    return names if round_index % 2 == 0 else names[::-1]


def _once_ms(run) -> float:
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3


def _reference_outputs(reference_fn, inputs: dict) -> list | None:
    if reference_fn is None:
        return None
    try:
        return reference_fn(inputs)
    except Exception as exc:
        log.debug("onnxruntime reference run failed (%s); plans are checked against kiln's kernels", exc)
        return None


def _agree(got: list, want: list, rel: float = 1e-3, quantized: bool = False) -> bool:
    """FP32 plans: max error within `rel` of the largest value. Quantized models: INT8 kernels round
    differently (one step moves a value by a whole scale), so float outputs need cosine >= 0.999 instead."""
    for a, b in zip(got, want):
        a, b = a.double() if a.is_floating_point() else a, b.double() if b.is_floating_point() else b
        if a.shape != b.shape:
            return False
        if a.is_floating_point() and quantized:
            norm = float(a.norm() * b.norm())
            if norm > 0 and float((a * b).sum()) / norm < 0.999:
                return False
        elif a.is_floating_point():
            scale = max(float(b.abs().max()) if b.numel() else 0.0, 1e-6)
            if float((a - b).abs().max()) > rel * scale:
                return False
        elif not torch.equal(a, b):
            return False
    return True


def _switch_ms(g: Graph, boundary: str | None, formats: dict[str, str], tuner: Autotuner) -> float:
    """Cost of changing source at a boundary: the pool hand-over, plus a layout copy for channel-major tensors."""
    if boundary is None or boundary not in g.values:
        return POOL_SWITCH_MS
    v = g.values[boundary]
    if v.shape is None or len(v.shape) != 4 or formats.get(boundary) != HWC:
        return POOL_SWITCH_MS
    return POOL_SWITCH_MS + tuner.reformat_ms(v.shape, str(v.dtype), LINEAR)


def apply_regions(g: Graph, runs: list[list[Node]], library: str = "onnxruntime") -> None:
    """Replace each run of nodes by one Region node (domain "kiln") holding them, run by `library`."""
    for nodes in runs:
        ext_in, consts, outs = region_io(nodes, g)
        name = f"{{ForeignNode[{nodes[0].name}...{nodes[-1].name}]}}"
        origin = tuple(o for n in nodes for o in n.origin)
        region = Node(name, "Region", [*ext_in, *consts], list(outs), {"nodes": list(nodes), "library": library},
                      "kiln", origin)
        index = g.nodes.index(nodes[0])
        for n in nodes:
            g.remove_node(n)
        g.add_node(region, index)
