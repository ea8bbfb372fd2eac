"""Where the build applies the accuracy budget (`--accuracy`): for BF16/FP16 layers it re-lowers with the
fewest layers kept in FP32 (kiln.planning.accuracy); for implicit INT8 (`--int8 --calib`) it re-inserts Q/DQ
without the fewest ONNX nodes, rebuilding through `lower_excluding` (kiln.planning.int8_budget). Both score the
plan on representative inputs against the FP32 model (onnxruntime, else kiln's all-FP32 plan); a BF16/FP16 plan
with INT8 layers against itself with those layers in FP32."""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import onnx
import torch

from kiln.builder.options import BuildOptions
from kiln.ir import Graph
from kiln.ops.dtypes import tensor_from_numpy
from kiln.planning.accuracy import KEPT_FP32_REASON, AccuracyBudget, BudgetReport, keep_fp32, meet_budget, \
    plan_outputs, random_input
from kiln.planning.int8_budget import Int8BudgetReport, Scored, fewest_kept_fp32, score_over_batches
from kiln.planning.race import onnxruntime_reference
from kiln.precision.policy import REDUCED_FLOATS, PrecisionDecision
from kiln.tactics.lower import Lowering

log = logging.getLogger("kiln.build")
INT8_BUDGET_BATCHES = 4   # calibration batches the INT8 budget is scored on
FLOAT_BUDGET_BATCHES = 2  # --calib batches a BF16/FP16 plan must each meet the budget on
RANDOM_BUDGET_BATCHES = 4   # random batches (each its own seed) it must meet it on without --calib
# Without --calib a fifth of the allowed error is held in reserve. The plans a dynamo-exported BERT-base got under
# cos:0.999 scored 0.99914-0.99931 on two random batches, then 0.99879-0.99950 on the benchmark's inputs (ids of
# another draw, 20 padded tokens): one output is 768 values, and its cosine moves with the input.
RANDOM_INPUT_RESERVE = 0.2


@dataclass(frozen=True)
class Lowered:
    """The model up to lowering: the ONNX it was imported from, the graph, the passes' statistics, the layers."""

    proto: onnx.ModelProto
    graph: Graph
    pass_stats: list
    lowering: Lowering
    held_logs: tuple[logging.LogRecord, ...] = ()   # a trial's log records, held back (see `holding_logs`)


@contextmanager
def holding_logs(records: list[logging.LogRecord]):
    """Hold kiln's log records in `records` instead of emitting them: INT8 budget trials would repeat every pass
    line and warning once per trial; only the chosen trial's warnings are replayed."""
    names = ["kiln"] + [n for n in logging.Logger.manager.loggerDict if n.startswith("kiln.")]
    loggers = [logging.getLogger(n) for n in names]

    def hold(record: logging.LogRecord) -> bool:
        records.append(record)
        return False
    for logger in loggers:
        logger.addFilter(hold)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(hold)


def within_accuracy_budget(g: Graph, proto: onnx.ModelProto, lowered: Lowering, options: BuildOptions,
                           budget: AccuracyBudget | None) -> tuple[Lowering, BudgetReport | None]:
    """The lowering, or one with the fewest layers kept in FP32 to meet the accuracy budget (kiln.planning.accuracy):
    `--accuracy`, by default cos:0.999 where a reduced float precision was granted; and the budget's report.
    `proto` is the FP32 model the plan is checked against (onnxruntime runs it). A plan with INT8 layers is checked
    against itself with every BF16/FP16 layer in FP32: INT8 rounding, the model's (Q/DQ) or calibration's (whose
    own budget is `within_int8_budget`), is not what BF16 costs, and kiln's INT8 kernels agree with onnxruntime
    only as well as its fused and unfused graphs agree (cosine 0.992 on a quantize_static BERT-base)."""
    if budget is None or not any(l.precision in REDUCED_FLOATS for l in lowered.layers):
        return lowered, None

    def relower(decisions: dict[str, PrecisionDecision]) -> Lowering:   # the other layers keep their kernels
        again = Lowering(g, lowered.sources, lowered.tuner, decisions, lowered.strict_precision, lowered.picked)
        again.run()
        return again
    batches = budget_batches(g, options, FLOAT_BUDGET_BATCHES, RANDOM_BUDGET_BATCHES, budget)
    int8 = any(l.precision == "INT8" for l in lowered.layers)
    check = None if int8 else onnxruntime_reference(proto)
    references = [check(b) for b in batches] if check is not None else None
    every = None
    if references is None:   # the same plan with every BF16/FP16 layer in FP32 is the reference
        every = relower(keep_fp32(lowered.precisions, [l.name for l in lowered.layers
                                                       if l.precision in REDUCED_FLOATS]))
        references = plan_outputs(g, every, batches)
        if int8:
            log.info("Accuracy budget %s: the plan's INT8 layers (the model's Q/DQ or --int8's calibration) are in "
                     "the reference too (kiln's plan with every BF16/FP16 layer in FP32): the budget measures what "
                     "BF16/FP16 adds", budget.text())
    return meet_budget(g, lowered, relower, budget, batches, references, options.precision.constraints == "obey",
                       every)


def within_int8_budget(float_proto: onnx.ModelProto, scales: dict[str, float], first: Lowered,
                       lower_excluding: Callable[[frozenset[str]], Lowered], options: BuildOptions,
                       budget: AccuracyBudget) -> tuple[Lowered, Int8BudgetReport]:
    """`first` (every calibrated node quantized), or the model rebuilt with the fewest ONNX nodes left
    unquantized so that the plan meets `budget` on the first calibration batches; and the search's report.
    The scales are reused: only Q/DQ insertion and lowering are redone per trial."""
    from kiln.preprocess.calibration import quantizable_nodes

    quantized = quantizable_nodes(float_proto, scales)
    batches = budget_batches(first.graph, options, INT8_BUDGET_BATCHES)
    check = onnxruntime_reference(float_proto)
    if check is not None:
        reference = [check(b) for b in batches]
    else:   # no onnxruntime: kiln's plan of the unquantized model is the reference
        every = lower_excluding(frozenset(quantized))
        reference = plan_outputs(every.graph, every.lowering, batches)

    tried: dict[frozenset[str], Scored] = {}

    def trial(excluded: frozenset[str]) -> Scored:
        if excluded not in tried:
            built = first if not excluded else lower_excluding(excluded)
            tried[excluded] = Scored(excluded, score_over_batches(
                budget, plan_outputs(built.graph, built.lowering, batches), reference), built)
        return tried[excluded]
    start = trial(frozenset())
    if options.precision.constraints == "obey" and quantized and not budget.met(start.score):
        raise_obey(budget, start.score)
    floats_left = any(l.precision in REDUCED_FLOATS for l in first.lowering.layers)
    best, kept, sensitivity = fewest_kept_fp32(quantized, trial, budget, start, give_up_quietly=floats_left)
    for record in best.outcome.held_logs:   # the chosen plan's warnings (the first build's were emitted already)
        if record.levelno >= logging.WARNING:
            logging.getLogger(record.name).handle(record)
    layers = tuple(l.name for l in best.outcome.lowering.layers if set(l.origin) & set(kept))
    return best.outcome, Int8BudgetReport(budget.text(), start.score, best.score, tuple(quantized), kept, layers,
                                          sensitivity)


def raise_obey(budget: AccuracyBudget, score: float) -> None:
    from kiln.errors import ModelError

    raise ModelError(f"the plan misses the accuracy budget {budget.text()} ({budget.metric} {score:.6g}) and "
                     "--precision-constraints obey forbids keeping layers in FP32; relax the budget or the "
                     "constraints")


def kept_in_fp32(decisions: dict[str, PrecisionDecision], g: Graph,
                 excluded: frozenset[str]) -> dict[str, PrecisionDecision]:
    """The decisions with every FP32 layer that stands for an excluded ONNX node saying the budget kept it."""
    out = dict(decisions)
    for node in g.nodes:
        d = out.get(node.name)
        if d is not None and d.granted == "FP32" and set(node.origin) & excluded:
            out[node.name] = PrecisionDecision(d.requested, "FP32", KEPT_FP32_REASON)
    return out


def representative_data(options: BuildOptions) -> bool:
    """Whether --calib gives data the accuracy budget can be checked on (else it is checked on random inputs)."""
    data = str(options.calibration or "")
    return data.endswith(".npz") or (bool(data) and os.path.isdir(data))


def held_in_reserve(budget: AccuracyBudget, options: BuildOptions) -> AccuracyBudget:
    """`budget` as the build checks it: with RANDOM_INPUT_RESERVE of its error held back where the inputs it is
    checked on are random."""
    return budget if representative_data(options) else dataclasses.replace(budget, reserve=RANDOM_INPUT_RESERVE)


def budget_batches(g: Graph, options: BuildOptions, count: int, random_count: int | None = None,
                   budget: AccuracyBudget | None = None) -> list[dict[str, torch.Tensor]]:
    """Representative inputs for the accuracy budget: the first `count` batches of --calib data (.npz or a folder),
    else `random_count` (default `count`) batches of random values, each from its own seed, with a warning (real
    data judges accuracy better) that says how `budget` is checked on them."""
    if representative_data(options):
        from kiln.preprocess.calibration import load_calibration_data

        ranks = {v.name: len(v.shape) for v in g.inputs if v.shape is not None}
        static = {v.name: v.shape[0] for v in g.inputs if v.shape and isinstance(v.shape[0], int)}
        batches = load_calibration_data(str(options.calibration), [v.name for v in g.inputs], ranks, static)[:count]
        return [{name: tensor_from_numpy(np.ascontiguousarray(array)) for name, array in batch.items()}
                for batch in batches]
    held = f" as {budget.checked_text()}, {budget.reserve:.0%} of its error in reserve" \
        if budget is not None and budget.reserve else ""
    log.warning("Accuracy budget checked on random inputs%s: give representative data with --calib DATA.npz", held)
    return [{v.name: random_input(v, seed) for v in g.inputs} for seed in range(random_count or count)]
