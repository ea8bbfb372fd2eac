"""The accuracy budget for implicit INT8 (`--int8 --calib DATA --accuracy cos:0.999`): keeping an ONNX node in FP32
means calibrating without quantizing it (no Q/DQ on its inputs, float weights). The scales are computed once; each
trial re-inserts Q/DQ for every quantizable node except an exclusion set and lowers the result (the builder supplies
that as `Trial`). A node's sensitivity is the score with only it excluded; nodes are ranked by it and the number
excluded is searched (doubling, then bisecting), as the BF16 search in kiln.planning.accuracy does for layers.
Scores are taken over the first calibration batches against the FP32 model's outputs on them."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from kiln.errors import ModelError
from kiln.planning.accuracy import AccuracyBudget, fewest_that_pass

log = logging.getLogger("kiln.build")
Outcome = TypeVar("Outcome")


@dataclass(frozen=True)
class Int8BudgetReport:
    """What the INT8 budget did, by ONNX node: the nodes calibration quantizes, those kept in FP32 (most
    sensitive first) and the plan layers they became, the scores with none and with those kept, and each
    quantized node's sensitivity (the score with it alone kept in FP32)."""

    budget: str
    score_before: float
    score_after: float
    quantized_nodes: tuple[str, ...]
    kept_fp32_nodes: tuple[str, ...]
    kept_fp32_layers: tuple[str, ...]
    sensitivity: dict[str, float]

    def to_dict(self) -> dict:
        return {"budget": self.budget, "precision": "INT8", "score_before": self.score_before,
                "score_after": self.score_after, "quantized_nodes": list(self.quantized_nodes),
                "kept_fp32_nodes": list(self.kept_fp32_nodes), "kept_fp32_layers": list(self.kept_fp32_layers),
                "sensitivity": dict(self.sensitivity)}


@dataclass(frozen=True)
class Scored(Generic[Outcome]):
    """One trial: the nodes kept in FP32, the plan's score, and what the builder made (graph, lowering, ...)."""

    excluded: frozenset[str]
    score: float
    outcome: Outcome


Trial = Callable[[frozenset[str]], Scored]   # exclusion set -> the rebuilt, scored plan


def fewest_kept_fp32(quantized: list[str], trial: Trial, budget: AccuracyBudget, first: Scored,
                     give_up_quietly: bool = False) -> tuple[Scored, tuple[str, ...], dict[str, float]]:
    """The trial with the fewest quantized nodes kept in FP32 that meets `budget` (`first` is the trial with none
    kept), the nodes kept (most sensitive first) and every node's sensitivity. When even keeping all of them
    misses it: an error, or with `give_up_quietly` (other reduced layers may still be kept) the all-FP32 trial."""
    if not quantized or budget.met(first.score):
        log.info("Accuracy budget %s met by INT8 calibration: %s %.8g with %d quantized nodes", budget.text(),
                 budget.metric, first.score, len(quantized))
        return first, (), {}
    every = trial(frozenset(quantized))   # first, so that an impossible budget fails before the search
    if not budget.met(every.score):
        if not give_up_quietly:
            raise ModelError(f"the accuracy budget {budget.text()} cannot be met even with every layer in FP32 "
                             f"({budget.metric} {every.score:.6g} against the FP32 reference): relax it")
        return every, tuple(quantized), {}
    sensitivity = {name: trial(frozenset({name})).score for name in quantized}
    ranked = sorted(quantized, key=sensitivity.get, reverse=budget.metric == "cos")   # best score first
    def attempt(k: int) -> tuple[bool, Scored]:
        scored = every if k == len(ranked) else trial(frozenset(ranked[:k]))
        return budget.met(scored.score), scored
    high, best = fewest_that_pass(len(ranked), attempt)   # every node kept meets it: found above
    kept = tuple(ranked[:high])
    log.info("Accuracy budget %s: %d of %d INT8-calibrated nodes kept in FP32 (%s %.8g -> %.8g): %s",
             budget.text(), len(kept), len(quantized), budget.metric, first.score, best.score, ", ".join(kept))
    return best, kept, sensitivity


def score_over_batches(budget: AccuracyBudget, got: list[list[torch.Tensor]],
                       want: list[list[torch.Tensor]]) -> float:
    """The worst output's score, each output's values over all batches taken together."""
    def joined(per_batch: list[list[torch.Tensor]], k: int) -> torch.Tensor:
        return torch.cat([outs[k].reshape(-1).double() for outs in per_batch])
    return budget.worst([budget.score(joined(got, k), joined(want, k)) for k in range(len(want[0]))])
