"""`kiln debug precision`: which ONNX nodes must stay in higher precision for a reduced-precision build to meet an
accuracy budget (Polygraphy's `debug precision`, answered with ONNX node names, TensorRT#4616). The build's own
accuracy budget does the search (kiln.planning.accuracy); this maps its layers back to the model's nodes."""
from __future__ import annotations

import os
from dataclasses import dataclass

import onnx

from kiln.errors import ModelError


@dataclass(frozen=True)
class NodeVerdict:
    """One layer the search looked at: its ONNX nodes, whether it must stay FP32, the model's score with only it
    reduced (the rest FP32: the harm it does alone) and with only it in FP32 (the rest reduced: what keeping it
    buys), each None where the search did not measure it, and the precision it was granted."""

    layer: str
    onnx_nodes: tuple[str, ...]
    keep_fp32: bool
    score_alone_reduced: float | None
    score_alone_fp32: float | None
    granted: str


@dataclass(frozen=True)
class PrecisionReport:
    budget: str
    score_all_reduced: float
    score_final: float
    verdicts: tuple[NodeVerdict, ...]
    checked_as: str = ""   # the budget as scores were held to it (less its reserve on random inputs)

    @property
    def keep_fp32_nodes(self) -> tuple[str, ...]:
        return tuple(n for v in self.verdicts if v.keep_fp32 for n in v.onnx_nodes)

    def to_dict(self) -> dict:
        return {"kind": "kiln-debug-precision", "version": 1, "budget": self.budget,
                "checked_as": self.checked_as or self.budget,
                "score_all_reduced": self.score_all_reduced, "score_final": self.score_final,
                "keep_fp32_onnx_nodes": list(self.keep_fp32_nodes),
                "layers": [{"layer": v.layer, "onnx_nodes": list(v.onnx_nodes), "keep_fp32": v.keep_fp32,
                            "score_alone_reduced": v.score_alone_reduced, "score_alone_fp32": v.score_alone_fp32,
                            "granted": v.granted} for v in self.verdicts]}


DEFAULT_INT8_BUDGET = "cos:0.999"   # a build applies none to INT8 unless asked; the search needs one
NOT_CALIBRATED = ("kiln debug precision --int8 needs calibration data (--calib DATA.npz): without it INT8 comes "
                  "only from the model's own Q/DQ nodes, which fix each layer's precision, so there is nothing to "
                  "choose (to keep a quantized node in FP32, remove the Q/DQ pair on its input)")


def debug_precision(model: str | os.PathLike | onnx.ModelProto, **build_options) -> PrecisionReport:
    """Build `model` with the given reduced precision (bf16=True, best=True, layer_precisions=..., or int8=True
    with calibration=DATA) and accuracy budget (default cos:0.999) and report, per reduced-precision layer (per
    calibrated ONNX node for INT8), its ONNX nodes and whether they must stay in FP32."""
    import kiln

    if build_options.get("accuracy") == "off":
        raise ModelError("kiln debug precision needs an accuracy budget; drop --accuracy off")
    calibrated = bool(build_options.get("calibration"))

    def allowed(flag: str) -> bool:
        return bool(build_options.get(flag) or getattr(build_options.get("precision"), flag, False))
    floats = any(allowed(flag) for flag in ("bf16", "fp16", "best"))   # with --int8 --bf16 the BF16 layers are searched
    if allowed("int8") and not calibrated and not floats:
        raise ModelError(NOT_CALIBRATED)
    if calibrated and not build_options.get("accuracy"):
        build_options["accuracy"] = DEFAULT_INT8_BUDGET
    engine = kiln.build(model, **build_options)
    report = engine.plan.build_info.get("accuracy_budget")
    if calibrated and report is not None:
        return _int8_report(engine.plan.layers, report if report.get("precision") == "INT8" else report["int8"])
    if report is None:
        raise ModelError("no layer was granted a reduced precision, so there is nothing to search: ask for one "
                         "(--bf16, --best, --layer-precisions) on a CPU with the kernels for it (see the build log "
                         "for each layer's reason)")
    # kiln's plan as the budget left it (the engine may run an external region that won the whole-plan race)
    kept = set(report["kept_fp32"])
    ranked = report["kept_fp32"] + sorted(set(report["reduced_layers"]) - kept,
                                          key=lambda n: report["reduced_layers"].index(n))
    verdicts = tuple(NodeVerdict(name, tuple(report["origins"].get(name, ())), name in kept,
                                 report["score_alone_reduced"].get(name), report["score_alone_fp32"].get(name),
                                 report["granted"].get(name, ""))
                     for name in ranked)
    return PrecisionReport(report["budget"], report["score_before"], report["score_after"], verdicts,
                           report.get("checked_as", ""))


def _int8_report(layers, report: dict) -> PrecisionReport:
    """One verdict per calibrated ONNX node (kept ones first, most sensitive first; the rest in graph order),
    with the plan layer that computes it and that layer's granted precision."""
    holder = {}
    for layer in layers:
        for inner in (*layer.inner, layer):   # a region's inner layer names the node more closely
            for name in inner.origin:
                holder.setdefault(name, inner)
    kept = report["kept_fp32_nodes"]
    ranked = kept + [n for n in report["quantized_nodes"] if n not in kept]
    verdicts = tuple(NodeVerdict(holder[n].name if n in holder else "", (n,), n in kept, None,
                                 report["sensitivity"].get(n), holder[n].precision if n in holder else "")
                     for n in ranked)
    return PrecisionReport(report["budget"], report["score_before"], report["score_after"], verdicts)
