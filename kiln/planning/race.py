"""The plan race: whole candidate plans (kiln's own kernels, kiln's without Winograd, kiln's with its oneDNN
primitives wherever they apply, the whole graph as one onnxruntime or OpenVINO region, the mix the segment cost
model proposes) are checked against the original model and timed end to end through the plan interpreter; the
fastest wins, within the cost policy's margins. A build on kiln's own kernels alone races its own plans."""
from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable

import numpy as np
import onnx
import torch

from kiln.errors import Error
from kiln.ir import Graph
from kiln.plan.model import Layer
from kiln.planning.accuracy import AccuracyBudget, cosine, random_input
from kiln.planning.regions import plan_runner, apply_regions, choose_regions, unapply_regions
from kiln.precision.policy import INT8_LAYERS, QDQ_OPS, REDUCED_FLOATS
from kiln.preprocess.widen import bfloat16_io
from kiln.tactics.autotune import Autotuner, robust_ms
from kiln.tactics.clock import elapsed_ms
from kiln.tactics.lower import Lowering, lower, node_view
from kiln.tactics.onnx_emit import supports
from kiln.tactics.onnxruntime_source import REGION_TACTIC
from kiln.tactics.timing_cache import digest
from kiln.tactics.winograd import WINOGRAD_PREFIX
from kiln.trt import build_log as log_lines

log = logging.getLogger("kiln.build")

# plans of kiln's own kernels: the per-layer choices, without Winograd, oneDNN's primitives wherever they apply
OWN_PLANS = ("kiln", "kiln-direct", "kiln-onednn")
PRIMITIVES_SOURCE = "onednn"
INT8_OPS = frozenset(INT8_LAYERS + QDQ_OPS)
DYNAMIC_QUANT_OPS = ("DynamicQuantizeLinear", "DynamicQMatMul", "DynamicQConv")
MIN_QUANTIZED_COSINE = 0.95   # a quantized plan below this cosine to onnxruntime is wrong, whatever its rounding
BLOCK_MS = 600.0     # a block of timed runs lasts about this long for slow models
PLAN_ROUNDS = 4      # rounds of one block per plan
PRUNE_AFTER_ROUNDS = 2   # a plan far behind is dropped only after this many rounds: one burst must not drop it
CONFIRM_WITHIN = 0.10    # the two fastest plans closer than this after PLAN_ROUNDS are timed CONFIRM_ROUNDS more
CONFIRM_ROUNDS = 2
WARMUP_MS = 40.0     # warm-up per block: another library's idle threads spin this long after its last run
CHEAP_LAYERS = ("Reformat", "Shuffle", "Constant")
Candidates = dict[str, tuple[list[Layer], dict[str, np.ndarray]]]


def choose_plan(g: Graph, first: Lowering, sources: frozenset[str], tuner: Autotuner | None, regions: bool,
                make_reference: Callable = lambda: None,
                budget: AccuracyBudget | None = None) -> tuple[list[Layer], dict[str, np.ndarray]]:
    """The plan to build from `first` (the graph lowered onto per-layer tactics): where timing is on, whole
    candidate plans are built (kiln's own alternatives; regions where an external library is enabled) and the
    fastest is kept. Where a reduced float precision was granted, only an OpenVINO region at bf16 can join
    (onnxruntime's run FP32), judged by the accuracy `budget`. Returns (layers, weights)."""
    if tuner is None or not regions:
        return first.layers, first.weights
    reduced = sorted({d.granted for d in first.precisions.values() if d.granted in REDUCED_FLOATS})
    proposals: dict[str, list] = {"kiln": []}
    candidates: Candidates = {"kiln": (first.layers, first.weights)}
    if region_candidates(sources, first, reduced):
        proposals, candidates = reduced_proposals(g, first) if reduced else propose_plans(g, sources, tuner, first)
    if budget is not None or not reduced:   # reduced precision is checked by its budget, none with --accuracy off
        for name, plan in own_alternatives(g, sources, tuner, first).items():
            proposals[name], candidates[name] = [], plan
    if len(proposals) == 1:
        return first.layers, first.weights
    for name, proposal in proposals.items():
        if proposal and name not in candidates:
            apply_regions(g, proposal, "openvino" if name == "openvino" else "onnxruntime",
                          "bf16" if reduced else "f32")
            try:
                layers, weights = lower(g, sources, tuner, first.precisions, first.strict_precision)
                candidates[name] = (allow_spinning(layers), weights)
            except Exception as exc:   # the library rejects the graph: that plan is simply not a candidate
                log.debug("%s plan unavailable: %s", name, exc)
            unapply_regions(g)
    times = measure_plans(candidates, first.descs, g, tuner, make_reference(), budget if reduced else None)
    best = pick_fastest(times, tuner)
    if proposals[best]:
        apply_regions(g, proposals[best], "openvino" if best == "openvino" else "onnxruntime",
                      "bf16" if reduced else "f32")
        regions = f"{len(proposals[best])} onnxruntime region(s)"
        log.debug(log_lines.after_layers("region formation", len(g.nodes), regions))
    return candidates[best]


def region_candidates(sources: frozenset[str], first: Lowering, reduced: list[str]) -> bool:
    """Whether onnxruntime or OpenVINO regions may join the race: a library is enabled, and where a reduced float
    precision was granted, it is BF16 alone, OpenVINO can run it, and no precision constraint asks for kiln's."""
    if not {"onnxruntime", "openvino"} & sources:
        return False
    if reduced and (reduced != ["BF16"] or first.strict_precision or "openvino" not in sources):
        log.info("No onnxruntime/OpenVINO region candidates: %s was granted to layers a region would run in FP32"
                 "%s", "/".join(reduced), " (precision constraints ask for kiln's BF16 kernels)"
                 if first.strict_precision else "")
        return False
    return True


def own_alternatives(g: Graph, sources: frozenset[str], tuner: Autotuner, first: Lowering) -> Candidates:
    """kiln's plan with its oneDNN primitives wherever one runs a layer, where that differs from `first`: per-layer
    timing runs each kernel alone, with hot caches and its own Python call, while inside the plan consecutive
    primitives run as one C call (kiln.runtime.chains) and other kernels meet colder caches. On quantize_static
    ResNet-50 (Zen 4, 2 threads) the per-layer choices took kiln's C kernels for 12 convolutions, profiled in the
    plan up to 0.06 ms slower than OpenVINO's same layer, where the primitives were within 0.01."""
    if PRIMITIVES_SOURCE not in sources:
        return {}
    layers, weights = lower(g, sources, tuner, first.precisions, first.strict_precision, PRIMITIVES_SOURCE)
    if plan_signature(layers) == plan_signature(first.layers):
        return {}
    return {"kiln-onednn": (layers, weights)}


def propose_plans(g: Graph, sources: frozenset[str], tuner: Autotuner, first: Lowering):
    """(region proposals per plan name, the candidates already lowered): kiln's own plan (`first`), the segment
    cost model's mix, one whole-graph region per enabled library, and kiln's plan without Winograd."""
    whole = all(supports(node_view(n, g.opset, with_consts=False)) for n in g.nodes)
    proposals: dict[str, list] = {"kiln": []}
    if "onnxruntime" in sources:
        runs = choose_regions(g, first.node_layers, first.layers, first.descs, first.weights, first.formats, tuner)
        if whole:
            proposals["onnxruntime"] = [list(g.nodes)]
        if runs and runs != [list(g.nodes)]:
            proposals["mixed"] = runs
    if "openvino" in sources and whole:
        proposals["openvino"] = [list(g.nodes)]
    candidates: Candidates = {"kiln": (first.layers, first.weights)}
    if any(l.tactic_name.startswith(WINOGRAD_PREFIX) for l in first.layers):
        # per-layer timing runs each kernel with hot caches, which flatters Winograd's larger transformed weights:
        # the same plan without it is timed end to end too, and the faster one stays
        proposals["kiln-direct"] = []
        candidates["kiln-direct"] = lower(g, sources - {"kiln"}, tuner, first.precisions, first.strict_precision)
    return proposals, candidates


def reduced_proposals(g: Graph, first: Lowering):
    """A BF16 build's candidates: kiln's plan (its BF16 and FP32 kernels), and the whole graph as one OpenVINO
    region at bf16 where OpenVINO can run every node."""
    proposals: dict[str, list] = {"kiln": []}
    if all(supports(node_view(n, g.opset, with_consts=False)) for n in g.nodes):
        proposals["openvino"] = [list(g.nodes)]
    return proposals, {"kiln": (first.layers, first.weights)}


def pick_fastest(times: dict[str, float], tuner: Autotuner) -> str:
    """The fastest plan, where a mix must beat one onnxruntime region and an external library's region must beat
    kiln's own plan by the cost policy's margins."""
    costs = tuner.costs
    best = min(times, key=times.get)
    if best == "mixed" and "onnxruntime" in times and times[best] > times["onnxruntime"] * (1 - costs.plan_margin):
        best = "onnxruntime"   # torch and onnxruntime handing over cores: a mix must win clearly to be trusted
    own = min((k for k in OWN_PLANS if k in times), key=times.get, default=None)
    if best not in OWN_PLANS and own is not None and times[best] > times[own] * (1 - costs.own_plan_margin):
        log.debug("The %s plan (%.4g ms) is within %d%% of kiln's own (%.4g ms): keeping kiln's own", best,
                  times[best], round(costs.own_plan_margin * 100), times[own])
        best = own
    log.debug("Whole-plan latency: %s -> %s", ", ".join(f"{k} {v:.4g} ms" for k, v in times.items()), best)
    return best


def allow_spinning(layers: list[Layer]) -> list[Layer]:
    """onnxruntime may spin its threads between operators only when no torch kernel shares the cores."""
    import dataclasses

    alone = all(l.tactic_name == REGION_TACTIC or l.op_type in CHEAP_LAYERS for l in layers)
    regions = sum(1 for l in layers if l.tactic_name == REGION_TACTIC)
    if not (alone and regions == 1):
        return layers
    return [dataclasses.replace(l, attrs={**l.attrs, "spinning": True}) if l.tactic_name == REGION_TACTIC else l
            for l in layers]


def onnxruntime_reference(proto: onnx.ModelProto):
    """A function running the ORIGINAL model in onnxruntime (the ground truth plans are checked against), or None."""
    from kiln.optional import require

    if bfloat16_io(proto):
        log.debug("No onnxruntime reference for plan checks: its Python API takes no bfloat16 arrays")
        return None
    try:
        ort = require("onnxruntime", "checking plans against the ONNX model")
        serialized = proto.SerializeToString()
        sess = ort.InferenceSession(serialized, providers=["CPUExecutionProvider"])
    except Exception as exc:   # not installed, too large to serialize, or a model it rejects: no reference
        log.debug("No onnxruntime reference for plan checks: %s", str(exc).splitlines()[0] if str(exc) else exc)
        return None

    def run(inputs: dict[str, torch.Tensor], session=sess) -> list[torch.Tensor]:
        feeds = {name: t.contiguous().numpy() for name, t in inputs.items()}
        return [torch.from_numpy(np.asarray(y)) for y in session.run(None, feeds)]

    def literal(inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The model with onnxruntime's graph optimizations off: Q/DQ nodes run as written, nothing fused."""
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return run(inputs, ort.InferenceSession(serialized, options, providers=["CPUExecutionProvider"]))
    run.literal = literal
    return run


def plan_signature(layers: list) -> str:
    return digest([(l.name, l.tactic_name, [(t.dims, t.format) for t in l.inputs]) for l in layers])


def measure_plans(candidates: Candidates, descs: dict, g: Graph, tuner: Autotuner,
                  reference_fn=None, budget: AccuracyBudget | None = None) -> dict[str, float]:
    """Whole-plan latency of each candidate, timed in blocks (the deciding measurement). Each candidate's outputs
    on the timing input are checked first: against the original model in onnxruntime when available, else
    against kiln's own kernels (the first candidate); reduced-precision plans against the accuracy `budget`."""
    times: dict[str, float] = {}
    runners = checked_runners(candidates, g, tuner, reference_fn, times, budget)
    if not runners and not times and candidates:
        raise Error("no plan reproduces the original model's outputs (checked against onnxruntime on a random "
                    "input); rebuild with --builder-optimization-level 0 and compare with `kiln run`, then report it")
    time_blocks(runners, tuner, times)
    return times


def checked_runners(candidates: Candidates, g: Graph, tuner: Autotuner, reference_fn, times: dict[str, float],
                    budget: AccuracyBudget | None = None):
    """{plan name: (cache key, runner, rounds)} for the candidates that run and agree with the reference; cached
    plan times go straight into `times`."""
    inputs = {v.name: random_input(v) for v in g.inputs}   # token ids within their embedding, masks as ones
    reference = _reference_outputs(reference_fn, inputs)
    cosine_bar = _cosine_bar(g, reference_fn, inputs, reference)
    judge = "the original model in onnxruntime" if reference_fn else "kiln's kernels"
    runners = {}
    for name, (layers, weights) in candidates.items():
        key = plan_signature(layers)
        cached = tuner.cache.get(key, "plan", f"the {name} plan")
        if cached is not None:
            times[name] = cached
            continue
        try:
            run = plan_runner(layers, {}, weights, g.opset, inputs, keep={v.name for v in g.outputs})
            with torch.inference_mode():
                outputs = [run()[v.name] for v in g.outputs]
        except Exception as exc:   # a library refused the plan: it is simply not a candidate
            log.warning("The %s plan cannot run (%s: %s); leaving it out", name, type(exc).__name__, exc)
            continue
        if reference is None:
            reference = outputs   # no onnxruntime reference: the first candidate (kiln's own kernels) is the judge
        elif budget is not None:
            score = budget.worst([budget.score(a, b) for a, b in zip(outputs, reference)])
            if not budget.met(score):
                log.warning("The %s plan misses the accuracy budget %s on the timing input (%s %.6g against %s); "
                            "leaving it out", name, budget.words(), budget.metric, score, judge)
                continue
        elif not _agree(outputs, reference, min_cosine=cosine_bar()):
            log.warning("The %s plan's outputs differ from %s on the timing input; leaving it out", name, judge)
            continue
        runners[name] = (key, run, [])
    return runners


def time_blocks(runners: dict, tuner: Autotuner, times: dict[str, float]) -> None:
    """Blocks, each after its own warm-up runs (at least WARMUP_MS): a library's idle threads keep spinning for a
    while after it returns, which would bill the next candidate if runs alternated one by one. After
    PRUNE_AFTER_ROUNDS rounds a plan far behind the best (the cost policy's prune ratio) is out; a close call
    between the two fastest gets more rounds; blocks of slow models are capped near BLOCK_MS. A plan's time is its
    fastest round's median (autotune.robust_ms): noise here only adds time, in bursts that can cover a whole block
    (one ResNet-50 build timed kiln's plan at 38.6 ms against 34-35 in every other one)."""
    with torch.inference_mode():
        for round_index in range(max(PLAN_ROUNDS, tuner.options.min_timing)):
            time_round(runners, _block_order(list(runners), round_index), round_index, tuner)
            if round_index == PRUNE_AFTER_ROUNDS - 1 and len(runners) > 1:
                prune_slow_plans(runners, tuner, times)
        confirm_close_call(runners, tuner, round_index + 1)
    for name, (key, _, rounds) in runners.items():
        times[name] = robust_ms([statistics.median(r) for r in rounds])
        tuner.cache.put(key, "plan", times[name])


def time_round(runners: dict, names: list[str], round_index: int, tuner: Autotuner) -> None:
    """One block of timed runs for each plan in `names`, in that order, each after its warm-up runs."""
    clock = tuner.clock
    for name in names:
        if getattr(tuner, "on_timing", None) is not None:
            tuner.on_timing(f"the {name} plan, round {round_index + 1}")
        _, run, rounds = runners[name]
        warmup = [elapsed_ms(clock, run)]   # warm-up, and the first estimate of this plan's latency
        while sum(warmup) < WARMUP_MS and len(warmup) < 50:
            warmup.append(elapsed_ms(clock, run))
        estimate_ms = statistics.median(rounds[0]) if rounds else min(warmup)
        runs = max(3, min(max(5, tuner.options.avg_timing), int(BLOCK_MS / max(estimate_ms, 1e-3))))
        rounds.append([elapsed_ms(clock, run) for _ in range(runs)])


def confirm_close_call(runners: dict, tuner: Autotuner, next_round: int) -> None:
    """When the two fastest plans are within CONFIRM_WITHIN of each other, both are timed CONFIRM_ROUNDS more
    rounds, alternating: the host's load drifts over tens of seconds, and one YOLOv8n build kept kiln's plan
    (35.7 ms in the benchmark) over the OpenVINO region (28.5 ms) on four rounds."""
    if len(runners) < 2:
        return
    so_far = {name: robust_ms([statistics.median(r) for r in rounds]) for name, (_, _, rounds) in runners.items()}
    first, second = sorted(so_far, key=so_far.get)[:2]
    if so_far[second] > so_far[first] * (1 + CONFIRM_WITHIN):
        return
    log.debug("The %s and %s plans are within %d%% (%.4g, %.4g ms): timing both %d more rounds", first, second,
              round(CONFIRM_WITHIN * 100), so_far[first], so_far[second], CONFIRM_ROUNDS)
    for extra in range(CONFIRM_ROUNDS):
        names = [second, first] if extra % 2 == 0 else [first, second]
        time_round(runners, names, next_round + extra, tuner)


def prune_slow_plans(runners: dict, tuner: Autotuner, times: dict[str, float]) -> None:
    """Drop the plans whose fastest round so far is more than the prune ratio behind the best plan's; their time
    so far goes into `times` and the cache. Judged on the fastest of two rounds, not the first alone: one burst of
    noise over a plan's first block would drop it (the likely cause of one ResNet-50 INT8 build keeping kiln's own
    plan, which then ran 1.26x OpenVINO's region)."""
    so_far = {name: robust_ms([statistics.median(r) for r in rounds]) for name, (_, _, rounds) in runners.items()}
    best = min(so_far.values())
    for name in [n for n, ms in so_far.items() if ms > tuner.costs.prune_ratio * best]:
        key, _, _ = runners.pop(name)
        times[name] = so_far[name]
        tuner.cache.put(key, "plan", times[name])
        log.debug("The %s plan (%.4g ms) is out after %d rounds", name, times[name], PRUNE_AFTER_ROUNDS)


def _block_order(names: list[str], round_index: int) -> list[str]:
    """One round's block order, reversed every other round. The block after another library's keeps paying for
    that library's idle threads and data in cache (measured: ~4 % on ResNet-50 right after OpenVINO); in a fixed
    order the first plan would follow the last one in every round. Reversing makes each round boundary a plan
    following itself."""
    return names if round_index % 2 == 0 else names[::-1]


def _reference_outputs(reference_fn, inputs: dict) -> list | None:
    if reference_fn is None:
        return None
    try:
        return reference_fn(inputs)
    except Exception as exc:
        log.debug("onnxruntime reference run failed (%s); plans are checked against kiln's kernels", exc)
        return None


def quantized_agreement(g: Graph) -> float | None:
    """The cosine a plan of a quantized model must reach against the reference; None for FP32 models. Dynamic
    quantization rounds each product's input afresh from its range, so an FP32 ulp upstream moves u8 steps in
    every later layer: onnxruntime agrees with itself, with and without its graph optimizations, to cosine 0.9989
    on a quantize_dynamic BERT-base, and kiln's plan to 0.9988."""
    if any(n.op_type in DYNAMIC_QUANT_OPS for n in g.nodes):
        return 0.99
    return 0.999 if any(n.op_type in INT8_OPS for n in g.nodes) else None


def _cosine_bar(g: Graph, reference_fn, inputs: dict, reference: list | None):
    """The cosine bar plans of `g` must reach against `reference` (None for FP32 models), as a function computing it
    on its first call: lowering it runs the model unfused in onnxruntime, which no cached or budget-checked plan
    needs."""
    found = []

    def bar() -> float | None:
        if not found:
            min_cosine = quantized_agreement(g)
            if min_cosine is not None and reference is not None:
                min_cosine = _rounding_floor(reference_fn, inputs, reference, min_cosine)
            found.append(min_cosine)
        return found[0]
    return bar


def _rounding_floor(reference_fn, inputs: dict, reference: list, min_cosine: float) -> float:
    """A quantized model's cosine bar, lowered to what two correct runs of it reach: onnxruntime with and without
    its fusions round INT8 differently (a quantize_static BERT-base calibrated on 4 inputs: 0.993), and a plan may
    round as either does. The bar is then twice their distance from 1, never below MIN_QUANTIZED_COSINE."""
    literal = getattr(reference_fn, "literal", None)
    if literal is None:
        return min_cosine
    try:
        cosines = [cosine(a, b) for a, b in zip(literal(inputs), reference)
                   if a.is_floating_point() and a.shape == b.shape and float(a.norm() * b.norm()) > 0]
    except Exception as exc:
        log.debug("onnxruntime without optimizations failed (%s); the cosine bar stays %s", exc, min_cosine)
        return min_cosine
    worst = min(cosines, default=1.0)
    if not math.isfinite(worst):
        return min_cosine
    floor = max(MIN_QUANTIZED_COSINE, 1.0 - 2.0 * (1.0 - worst))
    if floor < min_cosine:
        (log.warning if floor < 0.99 else log.info)(
            "onnxruntime with and without its graph optimizations agree to cosine %.5f on this quantized model: "
            "plans must reach %.5f against it (not %s)", worst, floor, min_cosine)
    return min(min_cosine, floor)


def _agree(got: list, want: list, rel: float = 1e-3, min_cosine: float | None = None) -> bool:
    """FP32 plans: max error within `rel` of the largest value. Quantized models (`min_cosine` given): INT8 kernels
    round differently (one step moves a value by a whole scale), so float outputs need that cosine instead. An
    output stored in bfloat16 may also differ by one of its rounding steps per element (up to 2^-7 of it): two
    plans a millionth apart in FP32 round to neighbouring bfloat16 values."""
    for a, b in zip(got, want):
        bf16 = a.dtype == torch.bfloat16
        a, b = a.double() if a.is_floating_point() else a, b.double() if b.is_floating_point() else b
        if a.shape != b.shape:
            return False
        if a.is_floating_point() and min_cosine is not None:
            if float(a.norm() * b.norm()) > 0 and cosine(a, b) < min_cosine:
                return False
        elif a.is_floating_point():
            scale = max(float(b.abs().max()) if b.numel() else 0.0, 1e-6)
            if bool(((a - b).abs() > rel * scale + (2.0 ** -7 * b.abs() if bf16 else 0.0)).any()):
                return False
        elif not torch.equal(a, b):
            return False
    return True
