"""The accuracy budget (`--accuracy cos:0.999`): the plan lowered with reduced precisions is checked against the
FP32 reference (onnxruntime on the original model) on representative inputs; when it misses the budget, the
fewest layers are kept in FP32 to meet it. Layers are ranked by sensitivity (the plan's score with that one
layer's kernel replaced by torch's FP32 reference kernel), then the number kept is searched (doubling, then
bisecting: `fewest_that_pass`); each kept layer is
granted FP32 with the reason "accuracy budget" and the log says which, and by how much. No anchor (TensorRT,
onnxruntime, OpenVINO) does this automatically; Polygraphy's `debug precision` does it by hand."""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from kiln.errors import ModelError
from kiln.ir import Graph
from kiln.planning.regions import plan_runner
from kiln.precision.policy import REDUCED_FLOATS, PrecisionDecision
from kiln.runtime.interpreter import Interpreter
from kiln.runtime.prepare import TorchWeights, prepare_kernel
from kiln.ops.dtypes import to_torch_dtype
from kiln.tactics.autotune import example_input
from kiln.tactics.base import LINEAR
from kiln.tactics.lower import Lowering
from kiln.tactics.reference import ReferenceTactic

log = logging.getLogger("kiln.build")
T = TypeVar("T")
KEPT_FP32_REASON = "accuracy budget: kept in FP32 so the plan meets it"
EXACT_RANKING_S = 90   # re-lowering each layer alone: BERT-base's 85 took 32 s (Zen 4, 2 threads)

METRICS = ("cos", "l0", "l1", "l2", "linf")


@dataclass(frozen=True)
class AccuracyBudget:
    """`metric:threshold`: cos (cosine >= t), l2 (||a-b|| / ||b|| <= t), l1 (mean|a-b| / mean|b| <= t),
    linf (max|a-b| <= t), l0 (fraction of elements off by more than atol + rtol*|b| <= t); every output must pass."""

    metric: str
    threshold: float
    atol: float = 1e-5
    rtol: float = 1e-3

    @classmethod
    def parse(cls, spec: str, atol: float = 1e-5, rtol: float = 1e-3) -> "AccuracyBudget":
        metric, sep, value = spec.partition(":")
        try:
            threshold = float(value)
        except ValueError:
            threshold = math.nan
        if not sep or metric not in METRICS or not math.isfinite(threshold) or threshold < 0:
            raise ModelError(f"bad accuracy budget '{spec}': expected METRIC:THRESHOLD with METRIC one of "
                             f"{', '.join(METRICS)} and a non-negative number, e.g. cos:0.999")
        return cls(metric, threshold, atol, rtol)

    def text(self) -> str:
        return f"{self.metric}:{self.threshold:.10g}"

    def score(self, got: torch.Tensor, want: torch.Tensor) -> float:
        a, b = got.double().reshape(-1), want.double().reshape(-1)
        if self.metric == "cos":
            norm = float(a.norm() * b.norm())
            return 1.0 if norm == 0 else float(a @ b) / norm
        if self.metric == "l2":
            return float((a - b).norm() / max(float(b.norm()), 1e-30))
        if self.metric == "l1":
            return float((a - b).abs().mean() / max(float(b.abs().mean()), 1e-30))
        if self.metric == "linf":
            return float((a - b).abs().max()) if a.numel() else 0.0
        return float(((a - b).abs() > self.atol + self.rtol * b.abs()).double().mean()) if a.numel() else 0.0

    def met(self, score: float) -> bool:
        return score >= self.threshold if self.metric == "cos" else score <= self.threshold

    def worst(self, scores: list[float]) -> float:
        return min(scores) if self.metric == "cos" else max(scores)


@dataclass(frozen=True)
class BudgetReport:
    """What the budget did: scores before and after, the layers kept in FP32 (most sensitive first) and each
    reduced layer's score with it alone in FP32 (its sensitivity), for build info and `kiln debug precision`."""

    budget: str
    score_before: float
    score_after: float
    reduced_layers: tuple[str, ...]
    kept_fp32: tuple[str, ...]
    sensitivity: dict[str, float]
    origins: dict[str, tuple[str, ...]] = field(default_factory=dict)   # reduced layer -> its ONNX nodes
    granted: dict[str, str] = field(default_factory=dict)   # reduced layer -> its precision in kiln's plan

    def to_dict(self) -> dict:
        return {"budget": self.budget, "score_before": self.score_before, "score_after": self.score_after,
                "reduced_layers": list(self.reduced_layers), "kept_fp32": list(self.kept_fp32),
                "sensitivity": dict(self.sensitivity), "origins": {k: list(v) for k, v in self.origins.items()},
                "granted": dict(self.granted)}


Relower = Callable[[dict[str, PrecisionDecision]], Lowering]


def meet_budget(g: Graph, lowered: Lowering, relower: Relower, budget: AccuracyBudget, inputs: dict,
                reference: list[torch.Tensor], obey: bool) -> tuple[Lowering, BudgetReport]:
    """`lowered`, or the same graph re-lowered with the fewest reduced-precision layers kept in FP32 so that
    `budget` holds on `inputs` against the FP32 `reference` outputs; and what was done."""
    reduced = [l.name for l in lowered.layers if l.precision in REDUCED_FLOATS]
    score = evaluate(g, lowered, budget, inputs, reference)
    if not reduced or budget.met(score):
        log.info("Accuracy budget %s met: %s %.8g with %d reduced-precision layers", budget.text(), budget.metric,
                 score, len(reduced))
        return lowered, BudgetReport(budget.text(), score, score, tuple(reduced), (), {}, *_described(lowered, reduced))
    if obey:
        raise ModelError(f"the plan misses the accuracy budget {budget.text()} ({budget.metric} {score:.6g}) and "
                         "--precision-constraints obey forbids keeping layers in FP32; relax the budget or the "
                         "constraints")
    reverted = sensitivity(g, lowered, inputs, budget, reference)   # most sensitive first: best score reverted
    found = fewest_kept(g, lowered, relower, budget, inputs, reference, reduced, reverted)
    if found is not None and found[0] > max(2, len(reduced) // 8):
        # Swapping one kernel keeps the bf16 tensors around it, so a layer whose cost is the rounding of the tensor
        # it writes (BERT's first Q/K/V projection) looks harmless and the search keeps most layers instead.
        # Re-lowering with each layer alone in FP32 measures that too, at a re-lowering per layer.
        log.info("Accuracy budget %s: %d of %d layers needed by single-kernel sensitivity; measuring each layer "
                 "re-lowered alone in FP32", budget.text(), found[0], len(reduced))
        exact = dict(reverted)
        deadline = time.monotonic() + EXACT_RANKING_S
        for done, name in enumerate(reduced):   # plan order; past the deadline the rest keep their single-kernel score
            if time.monotonic() > deadline:
                log.info("Accuracy budget: %d of %d layers measured re-lowered within %d s", done, len(reduced),
                         EXACT_RANKING_S)
                break
            exact[name] = evaluate(g, relower(keep_fp32(lowered.precisions, [name])), budget, inputs, reference)
        again = fewest_kept(g, lowered, relower, budget, inputs, reference, reduced, exact)
        if again is not None and again[0] < found[0]:
            found, reverted = again, exact
    if found is None:
        every_score = evaluate(g, relower(keep_fp32(lowered.precisions, reduced)), budget, inputs, reference)
        raise ModelError(f"the accuracy budget {budget.text()} cannot be met even with every layer in FP32 "
                         f"({budget.metric} {every_score:.6g} against the FP32 reference): relax it")
    _, best, kept = found
    log.info("Accuracy budget %s: %d of %d reduced-precision layers kept in FP32 (%s %.8g -> %.8g): %s",
             budget.text(), len(kept), len(reduced), budget.metric, score, best[1], ", ".join(kept))
    return best[0], BudgetReport(budget.text(), score, best[1], tuple(reduced), tuple(kept), reverted,
                                 *_described(best[0], reduced))


def _described(lowered: Lowering, names: list[str]) -> tuple[dict, dict]:
    """(ONNX nodes, granted precision) of each named layer of kiln's plan: `kiln debug precision` answers from
    them even where the whole-plan race then picks an external library's region."""
    layers = {l.name: l for l in lowered.layers}
    return ({n: tuple(layers[n].origin) for n in names if n in layers},
            {n: layers[n].precision for n in names if n in layers})


def fewest_kept(g: Graph, lowered: Lowering, relower: Relower, budget: AccuracyBudget, inputs: dict,
                reference: list[torch.Tensor], reduced: list[str], reverted: dict[str, float]):
    """(k, (plan, score), the k layers) for the fewest of `reduced`, most sensitive first by `reverted` (each
    layer's score with it reverted to FP32), kept in FP32 to meet `budget`; None when not even all of them do."""
    ranked = sorted(reduced, key=reverted.get, reverse=budget.metric == "cos")

    def attempt(k: int):
        trial = relower(keep_fp32(lowered.precisions, ranked[:k]))
        trial_score = evaluate(g, trial, budget, inputs, reference)
        return budget.met(trial_score), (trial, trial_score)
    found = fewest_that_pass(len(ranked), attempt)
    return None if found is None else (found[0], found[1], ranked[:found[0]])


def fewest_that_pass(count: int, attempt: Callable[[int], tuple[bool, T]]) -> tuple[int, T] | None:
    """The smallest k in 1..count whose `attempt(k)` passes, with what it made: k doubles from 1 until one passes,
    then the range since the last failure is bisected. Scores near a budget are not monotonic in k (re-lowering
    moves bf16 storage around the kept layers): a bisection from the middle once kept 40 of BERT-base's 61 BF16
    layers in FP32 where keeping its most sensitive one had met cos:0.999. None when not even `count` passes."""
    tried: dict[int, tuple[bool, T]] = {}

    def run(k: int) -> tuple[bool, T]:
        if k not in tried:
            tried[k] = attempt(k)
        return tried[k]
    last_failed, k = 0, min(1, count)
    while k < count and not run(k)[0]:
        last_failed, k = k, min(2 * k, count)
    if not run(k)[0]:
        return None
    low, high = last_failed + 1, k
    while low < high:
        middle = (low + high) // 2
        if run(middle)[0]:
            high = middle
        else:
            low = middle + 1
    return high, run(high)[1]


def keep_fp32(decisions: dict[str, PrecisionDecision], names: list[str]) -> dict[str, PrecisionDecision]:
    out = dict(decisions)
    for name in names:
        out[name] = PrecisionDecision(out[name].requested, "FP32", KEPT_FP32_REASON)
    return out


def evaluate(g: Graph, lowered: Lowering, budget: AccuracyBudget, inputs: dict,
             reference: list[torch.Tensor]) -> float:
    """The plan's worst score over the graph's outputs."""
    run = plan_runner(lowered.layers, {}, lowered.weights, g.opset, inputs, keep={v.name for v in g.outputs})
    with torch.inference_mode():
        env = run()
    return budget.worst([budget.score(env[v.name], want) for v, want in zip(g.outputs, reference)])


def sensitivity(g: Graph, lowered: Lowering, inputs: dict, budget: AccuracyBudget,
                reference: list[torch.Tensor]) -> dict[str, float]:
    """Per reduced layer, the plan's score with that one layer run by torch's FP32 reference kernel instead (every
    other kernel as planned): what keeping it in FP32 alone would buy. Kernels are prepared once; one run each."""
    weights, opset = TorchWeights(lowered.weights), g.opset
    kernels = [prepare_kernel(l, weights, lowered.weights, opset) for l in lowered.layers]
    keep = set(inputs) | {v.name for v in g.outputs}
    scores = {}
    for i, layer in enumerate(lowered.layers):
        if layer.precision not in REDUCED_FLOATS:
            continue
        fp32 = prepare_kernel(_as_reference(layer), weights, lowered.weights, opset)
        swapped = kernels[:i] + [fp32] + kernels[i + 1:]
        with torch.inference_mode():
            env = Interpreter(lowered.layers, swapped, keep).run(dict(inputs))
        scores[layer.name] = budget.worst([budget.score(env[v.name], want) for v, want in zip(g.outputs, reference)])
    return scores


def _as_reference(layer):
    import dataclasses

    return dataclasses.replace(layer, tactic_name=ReferenceTactic.name, source=ReferenceTactic.source)


def random_input(v) -> torch.Tensor:
    """Random values for a graph input: normal floats; integer indices into a constant table (token ids into an
    embedding: Gather's indices) drawn from the table's range; other integers (masks, positions) ones."""
    if np.dtype(v.dtype).kind != "i":
        return example_input(v.shape, str(v.dtype), LINEAR)
    tables = [u.inputs[0].const.shape[u.attrs.get("axis", 0)] for u in v.users
              if u.op_type == "Gather" and len(u.inputs) > 1 and u.inputs[1] is v and u.inputs[0].is_const]
    generator = torch.Generator().manual_seed(0)
    if tables:
        return torch.randint(0, min(tables), v.shape, generator=generator).to(to_torch_dtype(np.dtype(v.dtype)))
    return torch.ones(v.shape, dtype=to_torch_dtype(np.dtype(v.dtype)))
