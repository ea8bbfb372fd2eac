"""Machine-readable summaries (the `--json` outputs of inspect/lint/diff/log) built from the records of
`kiln.trt.records`."""
from __future__ import annotations

import dataclasses
from typing import Any

from kiln.trt.records import BuildLog, EngineInfo, IOTensor, LayerRecord, Profile, TensorInfo
from kiln.trt.tuning_cache import TuningCache


def tensor_json(t: TensorInfo) -> dict[str, Any]:
    """A tensor in the --json schema: name, dims, format, location (the layer's "precision" carries precision)."""
    return {"name": t.name, "dims": t.dims, "format": t.format, "location": t.location}


def io_tensor_json(t: IOTensor) -> dict[str, Any]:
    """A TensorRT 11 I/O tensor: mode, data type as written and as a precision, dims, min/opt/max per profile."""
    return {"name": t.name, "io_mode": t.io_mode, "data_type": t.data_type, "precision": t.precision,
            "dims": t.dims, "location": t.location, "shape_inference_io": t.shape_inference_io,
            "profiles": [{"min": p.min_dims, "opt": p.opt_dims, "max": p.max_dims, "format": p.format}
                         for p in t.profiles]}


def layer_json(layer: LayerRecord, times: dict[str, float]) -> dict[str, Any]:
    d = {"name": layer.name, "layer_type": layer.layer_type, "parameter_type": layer.parameter_type,
         "precision": layer.precision, "tactic_name": layer.tactic_name, "tactic_value": layer.tactic_value,
         "origin": list(layer.origin), "region": layer.region,
         "inputs": [tensor_json(t) for t in layer.inputs], "outputs": [tensor_json(t) for t in layer.outputs]}
    if layer.name in times:
        d["average_ms"] = times[layer.name]
    return d


def engine_json(engine: EngineInfo, profile: Profile | None = None) -> dict[str, Any]:
    profile = profile or engine.profile
    times = {r.name: r.average_ms for r in profile.records} if profile else {}
    out = {"format": engine.source, "verbosity": engine.verbosity, "num_layers": len(engine.layers),
           "layer_types": engine.layer_types, "precisions": engine.precisions, "bindings": list(engine.bindings),
           "layers": [layer_json(l, times) for l in engine.layers], "notes": list(engine.notes)}
    if engine.io_tensors:   # TensorRT 11's layer info only: the rest of the document is the same for 10 and 11
        out["io_tensors"] = [io_tensor_json(t) for t in engine.io_tensors]
    if engine.metadata:
        out["engine_metadata"] = engine.metadata
    if profile:
        out["total_average_ms"] = profile.total_average_ms
        out["profile_count"] = profile.count
    return out


def log_json(log: BuildLog) -> dict[str, Any]:
    return {"tool_version": log.tool_version, "options": log.options, "device": log.device,
            "pass_counts": log.pass_counts, "layer_trajectory": [list(x) for x in log.layer_trajectory],
            "tactic_choices": [dataclasses.asdict(c) for c in log.tactic_choices],
            "num_timings": len(log.timings), "memory": log.memory, "performance": log.performance,
            "engine_layers": len(log.engine.layers) if log.engine else None,
            "concatenations": concatenations_json(log), "notes": list(log.notes)}


def concatenations_json(log: BuildLog) -> dict[str, Any]:
    """What the log says of Concats: those eliminated (`Eliminating concatenation`), those kept whole with kiln's
    reason, the inputs written in place (`Retargeting`), and every copy with its reason (`Generating copy`)."""
    events = [e for e in log.events if e.pass_name == "concat removal"]
    return {"eliminated": [e.subjects[0] for e in events if e.kind == "eliminating_concat"],
            "kept": [{"layer": e.subjects[0], "reason": e.subjects[1]} for e in events
                     if e.kind == "not_eliminating_concat"],
            "retargeted": [{"tensor": e.subjects[0], "into": e.subjects[1]} for e in events if e.kind == "retargeting"],
            "copied": [{"tensor": e.subjects[0], "into": e.subjects[1], "reason": e.subjects[2]} for e in events
                       if e.kind == "generating_copy"]}


def tuning_json(cache: TuningCache) -> dict[str, Any]:
    """A TensorRT 11.1 tuning cache: the search, the best route within the accuracy budget, every iteration with
    its status, per-output accuracy loss and GPU time, and whether it is on the time/accuracy trade-off front."""
    best, front = cache.best(), {it.line for it in cache.trade_off()}
    default_knobs = len(cache.default_build_route.split()) if cache.default_build_route else None
    return {"format": "trt-tuning-cache", "tuner_version": cache.tuner_version,
            "searching_algorithm": cache.searching_algorithm, "tuning_expr": cache.tuning_expr,
            "accuracy_algorithm": cache.accuracy_algorithm, "accuracy_threshold": cache.accuracy_threshold,
            "atol": cache.atol, "rtol": cache.rtol, "default_build_route_knobs": default_knobs,
            "outputs": list(cache.outputs), "num_iterations": len(cache.iterations),
            "best": None if best is None else {"iter": best.iteration, "build_route": best.build_route,
                                               "gpu_time_ms": best.gpu_time_ms},
            "iterations": [{"iter": it.iteration, "build_route": it.build_route, "status": cache.status(it),
                            "crash": it.crashed, "error_message": it.error_message, "gpu_time_ms": it.gpu_time_ms,
                            "accuracy_loss": it.accuracy_loss, "max_accuracy_loss": it.max_accuracy_loss,
                            "best": it is best, "trade_off": it.line in front} for it in cache.iterations]}
