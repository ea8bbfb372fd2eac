"""The build as named stages, in the order data flows through them:

    preprocess  ONNX -> ONNX      load the model; --int8 --calib writes calibrated Q/DQ (kiln.preprocess)
    import      ONNX -> IR        shapes, profiles, constants (kiln.frontend)
    passes      IR -> IR          fusions and clean-ups, each logged (kiln.passes)
    precision   IR -> decisions   requested vs granted precision per layer; `obey` fails here, before any timing
    lowering    IR -> layers      a tactic per layer for its granted precision, timed; Reformats (kiln.tactics)
    planning    layers -> plan    regions and the whole-plan race, the memory plan (kiln.planning)

Each stage is one call below with its own options (`BuildOptions` groups them); the log says how long each took
and `build_info["stages_ms"]` records it."""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from contextlib import contextmanager

import numpy as np
import onnx
import torch

from kiln.builder.budget import Lowered, held_in_reserve, holding_logs, kept_in_fp32, within_accuracy_budget, \
    within_int8_budget
from kiln.builder.options import BuildOptions
from kiln.builder.progress import ProgressReporter
from kiln.frontend import import_onnx, load_model
from kiln.ir import Graph, Node
from kiln.passes import DEFAULT_PIPELINE, run_passes
from kiln.plan.model import Layer, Plan
from kiln.planning.memory import plan_memory
from kiln.planning.accuracy import AccuracyBudget, BudgetReport
from kiln.planning.int8_budget import Int8BudgetReport
from kiln.planning.race import choose_plan, onnxruntime_reference
from kiln.precision.policy import QDQ_OPS, PrecisionDecision, decide, output_tail
from kiln.preprocess.calibration import quantize_with_qdq, sum_ranks
from kiln.runtime.elision import concat_decisions, elision_log_lines
from kiln.runtime.prepare import TorchWeights, prepare_kernel
from kiln.tactics.autotune import Autotuner, TimingOptions, last_level_cache_bytes
from kiln.tactics.base import Kernel
from kiln.tactics.lower import Lowering, desc_of, node_view
from kiln.tactics.openvino_source import OPENVINO_REGION_TACTIC
from kiln.tactics.registry import available_sources, offers
from kiln.tactics.storage import log_storage
from kiln.tactics.timing_cache import TimingCache, device_description
from kiln.trt import build_log as log_lines
from kiln.trt.vocab import layer_type
from kiln.version import __version__

log = logging.getLogger("kiln.build")
DEFAULT_BUDGET = "cos:0.999"   # where --bf16/--best granted a reduced precision and --accuracy was not given


def build_plan(model: str | os.PathLike | onnx.ModelProto, options: BuildOptions = BuildOptions()) -> Plan:
    start, stages_ms, progress = time.perf_counter(), {}, ProgressReporter(options.progress)

    @contextmanager
    def stage(name: str):
        begin = time.perf_counter()
        progress.begin(name)
        yield
        progress.end()
        stages_ms[name] = round((time.perf_counter() - begin) * 1e3, 3)
        log.debug("Stage %s: %.3f ms", name, stages_ms[name])

    with stage("preprocess"):
        float_proto, scales = preprocess(model, options)
        ranks = None if scales is None else sum_ranks(float_proto, scales)   # once: the budget's trials reuse them
        proto = float_proto if scales is None else quantize_with_qdq(float_proto, scales, ranks=ranks)
    with stage("import"):
        g = import_onnx(proto, options.input_shapes, list(options.profiles))
    with stage("passes"):
        stats = run_passes(g, DEFAULT_PIPELINE, options.disabled_passes, options.verify_each)
    sources = options.tactic_sources if options.tactic_sources is not None else available_sources()
    with stage("precision"):
        precisions = decide_precisions(g, sources, options)
    cache = TimingCache(device_description(torch.get_num_threads()), options.timing_cache, options.deterministic)
    with stage("lowering"):
        tuner = autotuner(g, cache, options)
        if tuner is not None:
            tuner.on_timing = progress.timing
        lowered = Lowering(g, sources, tuner, precisions, options.precision.constraints != "none")
        lowered.on_node = progress.node
        lowered.run()
        stated = None if options.accuracy == "off" else \
            AccuracyBudget.parse(options.accuracy or DEFAULT_BUDGET, options.atol, options.rtol)
        budget = stated and held_in_reserve(stated, options)
        int8_report = None
        if scales is not None and budget is not None and options.accuracy is not None:   # explicit for INT8
            def lower_excluding(excluded: frozenset[str]) -> Lowered:
                with holding_logs(held := []):
                    trial = lower_model(quantize_with_qdq(float_proto, scales, exclude=excluded, ranks=ranks),
                                        options, sources, tuner, excluded)
                return dataclasses.replace(trial, held_logs=tuple(held))
            chosen, int8_report = within_int8_budget(float_proto, scales, Lowered(proto, g, stats, lowered),
                                                     lower_excluding, options, budget)
            proto, g, stats, lowered = chosen.proto, chosen.graph, chosen.pass_stats, chosen.lowering
        lowered, budget_report = within_accuracy_budget(g, float_proto, lowered, options, budget)
    with stage("planning"):
        layers, weights = choose_plan(g, lowered, sources, tuner, options.regions, lambda: onnxruntime_reference(proto),
                                      budget)
        cache.save()
        layers = finish_openvino_regions(layers, weights, g.opset)
        log_storage(layers, {name for name, v in g.values.items() if v.dtype == np.float32})
        inputs, outputs = tuple(desc_of(v) for v in g.inputs), tuple(desc_of(v) for v in g.outputs)
        memory = plan_memory(layers, inputs, outputs)
    log_engine_layers(layers)
    log_concat_elisions(layers, weights, g.opset, {t.name for t in (*inputs, *outputs)})
    log.debug(log_lines.total_activation_memory(memory.total_bytes, memory.unshared_bytes))
    log.debug(log_lines.total_weights_memory(sum(w.nbytes for w in weights.values())))
    info = {
        "kiln_version": __version__, "torch_version": torch.__version__, "opset": g.opset,
        "build_time_s": round(time.perf_counter() - start, 6), "device": "cpu",
        "tactic_sources_available": sorted(available_sources()), "tactic_sources": sorted(sources),
        "timing_cache": {"hits": cache.hits, "misses": cache.misses}, "device_description": cache.device,
        "passes": [{"name": s.name, "matches": s.matches, "rejections": s.rejections,
                    "layers_before": s.layers_before, "layers_after": s.layers_after} for s in stats],
        "stages_ms": stages_ms,
    }
    if budget_report is not None or int8_report is not None:
        info["accuracy_budget"] = accuracy_budget_info(budget_report, int8_report)
    log.info(log_lines.engine_built(info["build_time_s"]))
    progress.finish()
    return Plan(g.name, inputs, outputs, tuple(layers), weights, memory, info, tuple(g.profiles))


def preprocess(model: str | os.PathLike | onnx.ModelProto,
               options: BuildOptions) -> tuple[onnx.ModelProto, dict[str, float] | None]:
    """The model as ONNX and, for implicit INT8 (--int8 --calib), its activation scales from calibration data or a
    cache; the caller writes them as Q/DQ nodes, so the rest of the build is the explicit-quantization path."""
    from kiln.errors import ModelError

    proto = load_model(model)
    proto = _strongly_typed(proto) if options.precision.strongly_typed else _weakly_typed(proto)
    if not options.calibration:
        return proto, None
    from kiln.preprocess.calibration import calibrate
    from kiln.preprocess.fold import fold_batch_norms
    from kiln.preprocess.widen import bfloat16_io

    allowed = options.precision
    if not allowed.int8:
        if allowed.bf16 or allowed.fp16 or allowed.best:   # the accuracy budget's representative inputs
            log.info("--calib %s: inputs the accuracy budget is checked on (INT8 calibration needs --int8)",
                     options.calibration)
            return proto, None
        raise ModelError("calibration data was given without --int8 (or --bf16/--fp16/--best, whose accuracy "
                         "budget it feeds); add one of them, or drop --calib")
    if any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in proto.graph.node):
        raise ModelError("the model already has Q/DQ nodes (explicit quantization); build it without --calib")
    if bfloat16_io(proto):
        raise ModelError("--int8 --calib: calibration runs the model in onnxruntime, which takes no bfloat16 inputs "
                         "from Python; calibrate the model's float32 export")
    proto = fold_batch_norms(proto)   # calibrated and quantized as folded, as TensorRT calibrates after fusions
    scales = calibrate(proto, options.calibration, options.calibration_method, options.calibration_cache)
    log.info("INT8 calibration (%s): %d activation scales from %s", options.calibration_method, len(scales),
             options.calibration)
    return proto, scales


def _weakly_typed(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its float16/bfloat16 storage widened to float32 (kiln.preprocess.widen), logged once."""
    from kiln.preprocess.widen import widen_reduced_floats

    proto, widening = widen_reduced_floats(proto)
    if widening.changed:
        log.info("The model stores %s: built weakly typed, as TensorRT does (%s); --fp16/--bf16 allow reduced "
                 "precision per layer%s", "/".join(widening.types), widening.summary(),
                 "" if "bfloat16" in widening.types else ", --strongly-typed computes in the model's types")
    return proto


def _strongly_typed(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` as it is, unless it computes in bfloat16: kiln's kernels take bfloat16 tensors between layers, not
    as weights and constants in the model's own types, so such a model builds weakly typed only."""
    from kiln.errors import ModelError
    from kiln.preprocess.widen import stores_bfloat16

    if stores_bfloat16(proto):
        raise ModelError("the model stores bfloat16: kiln builds it weakly typed only (drop --strongly-typed; add "
                         "--bf16 to run its layers in BF16 where kiln has the kernels)")
    return proto


def lower_model(proto: onnx.ModelProto, options: BuildOptions, sources: frozenset[str], tuner: Autotuner | None,
                excluded: frozenset[str] = frozenset()) -> Lowered:
    """Import, passes, precision and lowering of one INT8 budget trial; the layers standing for the `excluded`
    ONNX nodes (left unquantized) say the budget kept them in FP32."""
    g = import_onnx(proto, options.input_shapes, list(options.profiles))
    stats = run_passes(g, DEFAULT_PIPELINE, options.disabled_passes, options.verify_each)
    precisions = kept_in_fp32(decide_precisions(g, sources, options), g, excluded)
    lowering = Lowering(g, sources, tuner, precisions, options.precision.constraints != "none")
    lowering.run()
    return Lowered(proto, g, stats, lowering)


def accuracy_budget_info(floats: BudgetReport | None, int8: Int8BudgetReport | None) -> dict:
    """build_info["accuracy_budget"]: the BF16/FP16 search's report, the INT8 one's under "int8" when both ran."""
    if floats is None:
        return int8.to_dict()
    return floats.to_dict() | ({"int8": int8.to_dict()} if int8 is not None else {})


def decide_precisions(g: Graph, sources: frozenset[str], options: BuildOptions) -> dict[str, PrecisionDecision]:
    """The precision stage: every layer's requested and granted precision, from the kernels the enabled sources
    offer, before any tactic is chosen or timed."""
    def kernel_offers(node: Node, precision: str) -> bool:
        return offers(node_view(node, g.opset), sources, precision)
    return decide(g.nodes, options.precision, kernel_offers, tail=output_tail(g))


def autotuner(g: Graph, cache: TimingCache, options: BuildOptions) -> Autotuner | None:
    """The autotuner for this graph (None when timing is off): cold-cache timing when the weights fill more than
    half the last-level cache. Activations, the other cores' work and the cache's own replacement share it: a
    quantize_static ResNet-50 (24.4 MiB of weights, 32 MiB cache, Zen 4) ran its 3x3 512-channel layers at
    0.40-0.66 ms in the plan, 0.25-0.29 timed alone with hot caches, 0.40-0.54 timed cold."""
    if not options.autotune:
        return None
    weight_bytes, cache_bytes = sum(v.const.nbytes for v in g.values.values() if v.is_const), last_level_cache_bytes()
    cold = weight_bytes > cache_bytes // 2
    log.info("Timing tactics with %s caches: %.1f MiB of weights %s half the %.0f MiB last-level cache",
             "cold" if cold else "hot", weight_bytes / 2**20, "exceed" if cold else "fit in", cache_bytes / 2**20)
    return Autotuner(cache, TimingOptions(options.avg_timing, options.min_timing), cold, options.costs, options.clock)


def finish_openvino_regions(layers: list[Layer], weights: dict[str, np.ndarray], opset: int) -> list[Layer]:
    """Compile the chosen plan's OpenVINO regions once through OpenVINO's model cache, so the engine's first load
    imports the compiled blob instead of compiling (about 0.2 s instead of 0.9 s for ResNet-50; the candidates timed
    during the build never touch the cache); a region compiled at bf16, or holding INT8 layers, records what each
    inner layer ran in, from OpenVINO's execution graph, as its granted precision."""
    from kiln.runtime.prepare import prepare_region

    finished = []
    for layer in layers:
        if layer.tactic_name == OPENVINO_REGION_TACTIC:
            try:
                kernel = prepare_region(layer, weights, opset, cached=True, library="openvino")
                if layer.attrs.get("precision") == "bf16" or any(i.requested_precision == "INT8" for i in layer.inner):
                    names = frozenset(i.name for i in layer.inner)
                    layer = with_runtime_precisions(layer, kernel.runtime_precisions(names))
                    log_region_grants(layer)
            except Exception as exc:   # the build already ran this region; a cache it cannot write is not an error
                log.debug("OpenVINO model cache not warmed for %s: %s", layer.name, exc)
        finished.append(layer)
    return finished


def log_region_grants(region: Layer) -> None:
    """The policy's "requested, granted" line for each inner layer the region ran in another precision."""
    for inner in region.inner:
        if inner.precision != inner.requested_precision and inner.precision_reason:
            log.info("Layer %s: requested %s, granted %s: %s", inner.name, inner.requested_precision,
                     inner.precision, inner.precision_reason)


def with_runtime_precisions(region: Layer, ran: dict[str, frozenset[str]]) -> Layer:
    """The region with each inner layer granted the lowest precision OpenVINO ran its ops in (FP32 where unknown).
    Quantize and dequantize layers keep theirs: OpenVINO's FakeQuantize reports its FP32 input, not the INT8 it
    writes. OpenVINO's u8/i8 counts as INT8 only for a layer that asked for INT8: elsewhere it is a mask's boolean
    type (a BERT's attention-mask And and Where read "INT8" in a --bf16 build)."""
    order = ("INT8", "FP16", "BF16", "FP32")

    def one(inner: Layer) -> Layer:
        if inner.op_type in QDQ_OPS:
            return inner
        counted = ran.get(inner.name, frozenset()) - (set() if inner.requested_precision == "INT8" else {"INT8"})
        got = min(counted or {"FP32"}, key=order.index)
        why = "" if got == inner.requested_precision else f"the OpenVINO region ran it in {got}"
        return dataclasses.replace(inner, precision=got, precision_reason=why)
    return dataclasses.replace(region, inner=tuple(one(i) for i in region.inner))


def log_engine_layers(layers: list[Layer]) -> None:
    """TensorRT's verbose "Engine Layer Information" dump, one line per layer."""
    log.debug(log_lines.ENGINE_LAYER_INFORMATION)
    for layer in layers:
        log.debug(log_lines.engine_layer(layer_type(layer), layer.name, layer.tactic_value, layer.inputs,
                                         layer.outputs))


def log_concat_elisions(layers: list[Layer], weights: dict[str, np.ndarray], opset: int, keep: set[str]) -> None:
    """The verbose log's account of the Concat inputs the engine writes in place and why the rest are copied
    (kiln.runtime.elision), decided on the kernels a loaded engine prepares, as its execution contexts decide it.
    Only producers of Concat inputs are prepared, and only in verbose builds."""
    if not log.isEnabledFor(logging.DEBUG) or not any(layer.op_type == "Concat" for layer in layers):
        return
    torch_weights = TorchWeights(weights)

    @functools.cache
    def kernel_of(i: int) -> Kernel | None:   # regions write their outputs whole: no kernel needed to say so
        if layers[i].inner:
            return None
        try:
            return prepare_kernel(layers[i], torch_weights, weights, opset, cached=True)
        except Exception as exc:   # a log line never fails a build; loading the engine will say what is wrong
            log.debug("Cannot prepare %s to see whether it writes into a Concat: %s", layers[i].name, exc)
            return None
    for line in elision_log_lines(layers, concat_decisions(layers, kernel_of, keep)):
        log.debug(line)
