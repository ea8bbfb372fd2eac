"""The accuracy budget (`--accuracy cos:0.999`): the plan lowered with reduced precisions is checked against the
FP32 reference (onnxruntime on the original model) on representative inputs; when it misses the budget, the
fewest layers are kept in FP32 to meet it. Layers are ranked by the harm each does alone (the FP32 plan's score
with only that layer's tensors rounded to its reduced type), then the number kept is searched (doubling, then
bisecting: `fewest_that_pass`); where that needs many, each layer is re-lowered alone in FP32 and ranked by what
that buys. Last, each kept layer is tried back in reduced precision, the costliest first (`trimmed`). Each kept
layer is granted FP32 with the reason "accuracy budget" and the log says which, and by how much. No anchor
(TensorRT, onnxruntime, OpenVINO) does this automatically; Polygraphy's `debug precision` does it by hand."""
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
from kiln.precision.policy import REDUCED_FLOATS, PrecisionDecision
from kiln.runtime.interpreter import Interpreter
from kiln.runtime.prepare import TorchWeights, prepare_kernel
from kiln.ops.dtypes import is_float, to_torch_dtype
from kiln.tactics.autotune import example_input
from kiln.tactics.base import LINEAR
from kiln.tactics.lower import Lowering

log = logging.getLogger("kiln.build")
T = TypeVar("T")
Batch = dict[str, torch.Tensor]
KEPT_FP32_REASON = "accuracy budget: kept in FP32 so the plan meets it"
EXACT_RANKING_S = 90   # re-lowering each layer alone: BERT-base's 85 took 32 s (Zen 4, 2 threads)
TRIM_S = 60   # trying the kept layers back in reduced precision, one re-lowering each

METRICS = ("cos", "l0", "l1", "l2", "linf")
PRODUCTS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Attention")   # their arithmetic runs in the reduced type
RESIDUAL_INPUT = 3   # a convolution's or linear layer's fused residual (kiln.passes.conv.fuse_residual_add)
REDUCED_DTYPES = ("bfloat16", "float16")


def cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    """The cosine of two tensors' values (1 where either is all zeros)."""
    a, b = got.double().reshape(-1), want.double().reshape(-1)
    norm = float(a.norm() * b.norm())
    return 1.0 if norm == 0 else float(a @ b) / norm


@dataclass(frozen=True)
class AccuracyBudget:
    """`metric:threshold`: cos (cosine >= t), l2 (||a-b|| / ||b|| <= t), l1 (mean|a-b| / mean|b| <= t),
    linf (max|a-b| <= t), l0 (fraction of elements off by more than atol + rtol*|b| <= t); every output must pass.
    `reserve`: the fraction of the allowed error (1 - t for cos, t otherwise) held back, so that a plan checked on
    inputs that are not the user's data (random ones) still meets `t` on data that strain it more."""

    metric: str
    threshold: float
    atol: float = 1e-5
    rtol: float = 1e-3
    reserve: float = 0.0

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

    def limit(self) -> float:
        """The threshold scores are held to: the stated one, less the reserve."""
        if self.metric == "cos":
            return 1.0 - (1.0 - self.threshold) * (1.0 - self.reserve) if self.threshold < 1 else self.threshold
        return self.threshold * (1.0 - self.reserve)

    def checked_text(self) -> str:
        """The budget as it is checked: 'cos:0.9992' for cos:0.999 with a fifth in reserve."""
        return f"{self.metric}:{self.limit():.10g}"

    def words(self) -> str:
        """'cos:0.999', or 'cos:0.999 (checked as cos:0.9992)' where part of it is held in reserve."""
        checked = self.checked_text()
        return self.text() + (f" (checked as {checked})" if checked != self.text() else "")

    def score(self, got: torch.Tensor, want: torch.Tensor) -> float:
        if self.metric == "cos":
            return cosine(got, want)
        a, b = got.double().reshape(-1), want.double().reshape(-1)
        if self.metric == "l2":
            return float((a - b).norm() / max(float(b.norm()), 1e-30))
        if self.metric == "l1":
            return float((a - b).abs().mean() / max(float(b.abs().mean()), 1e-30))
        if self.metric == "linf":
            return float((a - b).abs().max()) if a.numel() else 0.0
        return float(((a - b).abs() > self.atol + self.rtol * b.abs()).double().mean()) if a.numel() else 0.0

    def met(self, score: float) -> bool:
        return score >= self.limit() if self.metric == "cos" else score <= self.limit()

    def worst(self, scores: list[float]) -> float:
        return min(scores) if self.metric == "cos" else max(scores)


@dataclass(frozen=True)
class BudgetReport:
    """What the budget did: scores before and after, the layers kept in FP32 (most sensitive first) and per reduced
    layer the score with only it reduced (the rest FP32) and, where measured, with only it in FP32 (the rest
    reduced), for build info and `kiln debug precision`."""

    budget: str
    score_before: float
    score_after: float
    reduced_layers: tuple[str, ...]
    kept_fp32: tuple[str, ...]
    score_alone_reduced: dict[str, float]
    score_alone_fp32: dict[str, float]
    origins: dict[str, tuple[str, ...]] = field(default_factory=dict)   # reduced layer -> its ONNX nodes
    granted: dict[str, str] = field(default_factory=dict)   # reduced layer -> its precision in kiln's plan
    checked_as: str = ""   # the budget less its reserve (random inputs), as scores were held to it

    def to_dict(self) -> dict:
        return {"budget": self.budget, "checked_as": self.checked_as,
                "score_before": self.score_before, "score_after": self.score_after,
                "reduced_layers": list(self.reduced_layers), "kept_fp32": list(self.kept_fp32),
                "score_alone_reduced": dict(self.score_alone_reduced),
                "score_alone_fp32": dict(self.score_alone_fp32),
                "origins": {k: list(v) for k, v in self.origins.items()}, "granted": dict(self.granted)}


Relower = Callable[[dict[str, PrecisionDecision]], Lowering]


def meet_budget(g: Graph, lowered: Lowering, relower: Relower, budget: AccuracyBudget, batches: list[Batch],
                references: list[list[torch.Tensor]], obey: bool,
                every: Lowering | None = None) -> tuple[Lowering, BudgetReport]:
    """`lowered`, or the same graph re-lowered with the fewest reduced-precision layers kept in FP32 so that
    `budget` holds on every one of `batches` against its FP32 `references` outputs; and what was done. Layers are
    ranked on the first batch. `every`: the graph re-lowered with every reduced layer in FP32, where the caller has
    it (lowered here when needed)."""
    reduced = [l.name for l in lowered.layers if l.precision in REDUCED_FLOATS]
    score = evaluate(g, lowered, budget, batches, references)
    if not reduced or budget.met(score):
        log.info("Accuracy budget %s met: %s %.8g with %d reduced-precision layers", budget.words(), budget.metric,
                 score, len(reduced))
        return lowered, BudgetReport(budget.text(), score, score, tuple(reduced), (), {}, {},
                                     *_described(lowered, reduced), checked_as=budget.checked_text())
    if obey:
        raise ModelError(f"the plan misses the accuracy budget {budget.words()} ({budget.metric} {score:.6g}) and "
                         "--precision-constraints obey forbids keeping layers in FP32; relax the budget or the "
                         "constraints")
    every = every or relower(keep_fp32(lowered.precisions, reduced))
    alone = reduced_alone(g, lowered, every, batches[0], budget, references[0])
    ranked = sorted(alone, key=alone.get, reverse=budget.metric != "cos")   # most harmful first: worst score
    ranked += [n for n in reduced if n not in alone]
    found, fp32_alone = fewest_kept(g, lowered, relower, budget, batches, references, ranked), {}
    if found is None:
        every_score = evaluate(g, every, budget, batches, references)
        raise ModelError(f"the accuracy budget {budget.words()} cannot be met even with every layer in FP32 "
                         f"({budget.metric} {every_score:.6g} against the FP32 reference): relax it")
    if found[0] > max(2, len(reduced) // 8):
        # Reduced precision's harm is not additive (errors cancel or compound downstream), so the layers that hurt
        # most alone may not be the ones whose return to FP32 helps most. Re-lowering with each layer alone in FP32
        # measures that, at a re-lowering per layer.
        log.info("Accuracy budget %s: %s of %d layers needed when ranked by harm alone; measuring each layer "
                 "re-lowered alone in FP32", budget.words(), found[0], len(reduced))
        fp32_alone = fp32_alone_scores(g, lowered, relower, budget, batches, references, ranked)
        by_gain = sorted(fp32_alone, key=fp32_alone.get, reverse=budget.metric == "cos")   # best score first
        again = fewest_kept(g, lowered, relower, budget, batches, references,
                            by_gain + [n for n in ranked if n not in fp32_alone])
        if again is not None and again[0] < found[0]:
            found = again
    kept, best = trimmed(g, lowered, relower, budget, batches, references, list(found[2]), found[1])
    log.info("Accuracy budget %s: %d of %d reduced-precision layers kept in FP32 (%s %.8g -> %.8g): %s",
             budget.words(), len(kept), len(reduced), budget.metric, score, best[1], ", ".join(kept))
    return best[0], BudgetReport(budget.text(), score, best[1], tuple(reduced), tuple(kept), alone, fp32_alone,
                                 *_described(best[0], reduced), checked_as=budget.checked_text())


def trimmed(g: Graph, lowered: Lowering, relower: Relower, budget: AccuracyBudget, batches: list[Batch],
            references: list[list[torch.Tensor]], kept: list[str],
            best: tuple[Lowering, float]) -> tuple[list[str], tuple[Lowering, float]]:
    """The search's kept layers less each one the budget holds without, the costliest first (its tactic's timed
    cost in `lowered`; among equal costs the least sensitive first), until TRIM_S have passed. The search keeps a
    prefix of one ranking, and a layer taken on the way may not be needed beside the later ones (a dynamo-exported
    BERT-base with dynamic axes once kept 8 layers, 6 ms slower than its static export, which kept 6)."""
    deadline = time.monotonic() + TRIM_S
    returned = []
    for name in sorted(reversed(kept), key=lambda n: -lowered.timed_ms.get(n, 0.0)):
        if len(kept) == 1:   # without it the plan is the one that missed
            break
        if time.monotonic() > deadline:
            log.info("Accuracy budget: trying kept layers back in reduced precision stopped after %d s", TRIM_S)
            break
        fewer = [n for n in kept if n != name]
        trial = relower(keep_fp32(lowered.precisions, fewer))
        trial_score = evaluate(g, trial, budget, batches, references)
        log.debug("Accuracy budget: %s back in reduced precision: %s %.8g (%s)", name, budget.metric, trial_score,
                  "holds" if budget.met(trial_score) else "misses")
        if budget.met(trial_score):
            kept, best = fewer, (trial, trial_score)
            returned.append(name)
    if returned:
        log.info("Accuracy budget %s: the budget holds with %d of the search's layers back in reduced precision "
                 "(costliest first): %s", budget.words(), len(returned), ", ".join(returned))
    return kept, best


def _described(lowered: Lowering, names: list[str]) -> tuple[dict, dict]:
    """(ONNX nodes, granted precision) of each named layer of kiln's plan: `kiln debug precision` answers from
    them even where the whole-plan race then picks an external library's region."""
    layers = {l.name: l for l in lowered.layers}
    return ({n: tuple(layers[n].origin) for n in names if n in layers},
            {n: layers[n].precision for n in names if n in layers})


def fewest_kept(g: Graph, lowered: Lowering, relower: Relower, budget: AccuracyBudget, batches: list[Batch],
                references: list[list[torch.Tensor]], ranked: list[str]):
    """(k, (plan, score), the k layers) for the fewest of `ranked` (most sensitive first) kept in FP32 to meet
    `budget`; None when not even all of them do."""
    def attempt(k: int):
        trial = relower(keep_fp32(lowered.precisions, ranked[:k]))
        trial_score = evaluate(g, trial, budget, batches, references)
        return budget.met(trial_score), (trial, trial_score)
    found = fewest_that_pass(len(ranked), attempt)
    return None if found is None else (found[0], found[1], ranked[:found[0]])


def fp32_alone_scores(g: Graph, lowered: Lowering, relower: Relower, budget: AccuracyBudget, batches: list[Batch],
                      references: list[list[torch.Tensor]], ranked: list[str]) -> dict[str, float]:
    """Per layer, most harmful first, the plan's score re-lowered with that layer alone in FP32, until
    EXACT_RANKING_S have passed (the rest are left out: a large model could take minutes)."""
    scores: dict[str, float] = {}
    deadline = time.monotonic() + EXACT_RANKING_S
    for name in ranked:
        if time.monotonic() > deadline:
            log.info("Accuracy budget: %d of %d layers measured re-lowered within %d s", len(scores), len(ranked),
                     EXACT_RANKING_S)
            break
        scores[name] = evaluate(g, relower(keep_fp32(lowered.precisions, [name])), budget, batches, references)
    return scores


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


def evaluate(g: Graph, lowered: Lowering, budget: AccuracyBudget, batches: list[Batch],
             references: list[list[torch.Tensor]]) -> float:
    """The plan's worst score over the graph's outputs and the batches (each batch must meet the budget)."""
    scores = [budget.score(got, want) for outs, wants in zip(plan_outputs(g, lowered, batches), references)
              for got, want in zip(outs, wants)]
    return budget.worst(scores)


def plan_outputs(g: Graph, lowered: Lowering, batches: list[Batch]) -> list[list[torch.Tensor]]:
    """The plan's outputs on each batch; kernels are prepared once."""
    weights = TorchWeights(lowered.weights)
    kernels = [prepare_kernel(l, weights, lowered.weights, g.opset) for l in lowered.layers]
    names = [v.name for v in g.outputs]
    outputs = []
    for inputs in batches:
        with torch.inference_mode():
            env = Interpreter(lowered.layers, kernels, set(inputs) | set(names)).run(dict(inputs))
        outputs.append([env[n] for n in names])
    return outputs


def reduced_alone(g: Graph, lowered: Lowering, every: Lowering, inputs: Batch, budget: AccuracyBudget,
                  reference: list[torch.Tensor]) -> dict[str, float]:
    """Per reduced layer, the score of the all-FP32 plan with only that layer in its reduced precision, emulated:
    its float inputs and weights rounded to bf16 (or fp16) around its FP32 kernel, and the outputs the reduced
    plan stores in that type. This is the harm the layer does alone, the rounding of the tensor it writes included
    (BERT's first Q/K/V projection, whose bf16 output sharpens the first attention's error, is by far the worst).
    `every` is the same graph lowered with those layers in FP32; one run per layer."""
    reduced = {l.name: l for l in lowered.layers if l.precision in REDUCED_FLOATS}
    weights, opset = TorchWeights(every.weights), g.opset
    kernels = [prepare_kernel(l, weights, every.weights, opset) for l in every.layers]
    keep = set(inputs) | {v.name for v in g.outputs}
    scores = {}
    for i, layer in enumerate(every.layers):
        if layer.name not in reduced:
            continue
        emulated = _rounded_around(layer, reduced[layer.name], weights, every.weights, opset)
        with torch.inference_mode():
            env = Interpreter(every.layers, kernels[:i] + [emulated] + kernels[i + 1:], keep).run(dict(inputs))
        scores[layer.name] = budget.worst([budget.score(env[v.name], want) for v, want in zip(g.outputs, reference)])
    return scores


def _rounded_around(layer, as_reduced, weights: TorchWeights, np_weights: dict, opset: int):
    """`layer`'s FP32 kernel with values rounded as `as_reduced` (the same layer in the reduced plan) rounds them:
    its weights, the outputs it stores in a reduced type, and a product's float inputs (its arithmetic is in that
    type; other kernels compute in FP32, and the rounding of what they read is its writer's harm). A convolution's
    or linear layer's fused residual (input 3) is added in FP32 as stored, so it is not rounded here either."""
    dtype = torch.bfloat16 if as_reduced.precision == "BF16" else torch.float16

    def rounded(t):
        return t.to(dtype).float() if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t
    product = layer.op_type in PRODUCTS
    writes = [t.dtype in REDUCED_DTYPES for t in as_reduced.outputs]
    own = {a.name: rounded(weights[a.name]) for a in layer.args if a.kind == "weight"}
    kernel = prepare_kernel(layer, _Overlay(weights, own), np_weights, opset)

    def emulated(xs):
        exact = RESIDUAL_INPUT if layer.op_type in ("Conv", "MatMul", "Gemm") else None
        read = [rounded(x) if i != exact else x for i, x in enumerate(xs)] if product else xs
        return [rounded(y) if low else y for y, low in zip(kernel(read), writes)]
    return emulated


class _Overlay(dict):
    """`base` with some weights replaced."""

    def __init__(self, base: dict, replaced: dict):
        super().__init__(replaced)
        self.base = base

    def __missing__(self, name: str):
        return self.base[name]


def random_input(v, seed: int = 0) -> torch.Tensor:
    """Random values for a graph input, drawn from `seed`: normal floats; integer indices into a constant table
    (token ids into an embedding: Gather's indices) drawn from the table's range; other integers (masks,
    positions) ones."""
    generator = torch.Generator().manual_seed(seed)
    if is_float(v.dtype):
        return torch.randn(v.shape, generator=generator).to(to_torch_dtype(np.dtype(v.dtype)))
    if np.dtype(v.dtype).kind != "i":
        return example_input(v.shape, str(v.dtype), LINEAR)
    tables = [u.inputs[0].const.shape[u.attrs.get("axis", 0)] for u in v.users
              if u.op_type == "Gather" and len(u.inputs) > 1 and u.inputs[1] is v and u.inputs[0].is_const]
    if tables:
        return torch.randint(0, min(tables), v.shape, generator=generator).to(to_torch_dtype(np.dtype(v.dtype)))
    return torch.ones(v.shape, dtype=to_torch_dtype(np.dtype(v.dtype)))
