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

import logging
import os
import time
from contextlib import contextmanager

import numpy as np
import onnx
import torch

from kiln.builder.options import BuildOptions
from kiln.frontend import import_onnx, load_model
from kiln.ir import Graph, Node
from kiln.passes import DEFAULT_PIPELINE, run_passes
from kiln.plan.model import Layer, Plan
from kiln.planning.memory import plan_memory
from kiln.planning.race import choose_plan, onnxruntime_reference
from kiln.precision.policy import PrecisionDecision, decide
from kiln.tactics.autotune import Autotuner, TimingOptions, last_level_cache_bytes
from kiln.tactics.lower import Lowering, desc_of, node_view
from kiln.tactics.openvino_source import OPENVINO_REGION_TACTIC
from kiln.tactics.registry import available_sources, offers
from kiln.tactics.timing_cache import TimingCache, device_description
from kiln.trt import build_log as log_lines
from kiln.trt.vocab import layer_type
from kiln.version import __version__

log = logging.getLogger("kiln.build")


def build_plan(model: str | os.PathLike | onnx.ModelProto, options: BuildOptions = BuildOptions()) -> Plan:
    start, stages_ms = time.perf_counter(), {}

    @contextmanager
    def stage(name: str):
        begin = time.perf_counter()
        yield
        stages_ms[name] = round((time.perf_counter() - begin) * 1e3, 3)
        log.debug("Stage %s: %.3f ms", name, stages_ms[name])

    with stage("preprocess"):
        proto = preprocess(model, options)
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
        lowered = Lowering(g, sources, tuner, precisions, options.precision.constraints != "none")
        lowered.run()
    with stage("planning"):
        layers, weights = choose_plan(g, lowered, sources, tuner, options.regions, lambda: onnxruntime_reference(proto))
        cache.save()
        warm_compiled_model_cache(layers, weights, g.opset)
        inputs, outputs = tuple(desc_of(v) for v in g.inputs), tuple(desc_of(v) for v in g.outputs)
        memory = plan_memory(layers, inputs, outputs)
    log_engine_layers(layers)
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
    log.info(log_lines.engine_built(info["build_time_s"]))
    return Plan(g.name, inputs, outputs, tuple(layers), weights, memory, info, tuple(g.profiles))


def preprocess(model: str | os.PathLike | onnx.ModelProto, options: BuildOptions) -> onnx.ModelProto:
    """The model as ONNX; implicit INT8 (--int8 --calib): scales from calibration data or a cache become Q/DQ
    nodes, so the rest of the build is the explicit-quantization path."""
    from kiln.errors import ModelError

    proto = load_model(model)
    if not options.calibration:
        return proto
    from kiln.preprocess.calibration import calibrate, quantize_with_qdq

    if not options.precision.int8:
        raise ModelError("calibration data was given without --int8; add --int8 (or drop --calib)")
    if any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in proto.graph.node):
        raise ModelError("the model already has Q/DQ nodes (explicit quantization); build it without --calib")
    scales = calibrate(proto, options.calibration, options.calibration_method, options.calibration_cache)
    log.info("INT8 calibration (%s): %d activation scales from %s", options.calibration_method, len(scales),
             options.calibration)
    return quantize_with_qdq(proto, scales)


def decide_precisions(g: Graph, sources: frozenset[str], options: BuildOptions) -> dict[str, PrecisionDecision]:
    """The precision stage: every layer's requested and granted precision, from the kernels the enabled sources
    offer, before any tactic is chosen or timed."""
    def kernel_offers(node: Node, precision: str) -> bool:
        return offers(node_view(node, g.opset), sources, precision)
    return decide(g.nodes, options.precision, kernel_offers)


def autotuner(g: Graph, cache: TimingCache, options: BuildOptions) -> Autotuner | None:
    """The autotuner for this graph (None when timing is off): cold-cache timing when the weights outgrow the
    last-level cache."""
    if not options.autotune:
        return None
    weight_bytes, cache_bytes = sum(v.const.nbytes for v in g.values.values() if v.is_const), last_level_cache_bytes()
    cold = weight_bytes > cache_bytes
    log.info("Timing tactics with %s caches: %.1f MiB of weights %s the %.0f MiB last-level cache", "cold" if cold
             else "hot", weight_bytes / 2**20, "exceed" if cold else "fit in", cache_bytes / 2**20)
    return Autotuner(cache, TimingOptions(options.avg_timing, options.min_timing), cold, options.costs, options.clock)


def warm_compiled_model_cache(layers: list[Layer], weights: dict[str, np.ndarray], opset: int) -> None:
    """Compile the chosen plan's OpenVINO regions once through OpenVINO's model cache, so the engine's first load
    imports the compiled blob instead of compiling (about 0.2 s instead of 0.9 s for ResNet-50). Only the chosen
    plan's regions are written: the candidates timed during the build never touch the cache."""
    from kiln.runtime.prepare import prepare_region

    for layer in layers:
        if layer.tactic_name == OPENVINO_REGION_TACTIC:
            try:
                prepare_region(layer, weights, opset, cached=True, library="openvino")
            except Exception as exc:   # the build already ran this region; a cache it cannot write is not an error
                log.debug("OpenVINO model cache not warmed for %s: %s", layer.name, exc)


def log_engine_layers(layers: list[Layer]) -> None:
    """TensorRT's verbose "Engine Layer Information" dump, one line per layer."""
    log.debug(log_lines.ENGINE_LAYER_INFORMATION)
    for layer in layers:
        log.debug(log_lines.engine_layer(layer_type(layer), layer.name, layer.tactic_value, layer.inputs, layer.outputs))
