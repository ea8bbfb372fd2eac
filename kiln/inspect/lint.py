"""Lint an engine description (TensorRT layer info, one-line dumps, kiln engines): a list of findings, each naming a
rule, the layer (None for engine-wide), a severity, the concrete hazard and the concrete mitigation. Each rule is a
small function over the typed model (kiln.trt.records); rules never overwrite each other's findings."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

from kiln.trt.records import EngineInfo, LayerRecord, Profile, TensorInfo, is_conv, is_gemm, is_reformat, is_region
from kiln.trt.vocab import is_reformat_name


@dataclass(frozen=True)
class Finding:
    rule_id: str
    layer: str | None                            # None: engine-wide
    severity: str                                # "error" | "warning" | "info"
    hazard: str
    mitigation: str
    affected: tuple[str, ...] = ()               # the layers an engine-wide finding is about (its time at stake)


REDUCED = ("INT8", "FP16", "BF16", "FP8", "INT4")
_TYPE_WORDS = {"i8": "INT8", "int8": "INT8", "s8": "INT8", "f16": "FP16", "fp16": "FP16", "h": "FP16",
               "f32": "FP32", "fp32": "FP32", "tf32": "FP32", "bf16": "BF16", "e4m3": "FP8", "f8": "FP8"}
_TYPE_ALT = "int8|i8|s8|bf16|tf32|fp16|fp32|f16|f32|e4m3|f8"
_TYPE_GROUP = re.compile(rf"(?:^|_)({_TYPE_ALT})({_TYPE_ALT})(?=_|$)")
# cuDNN/CASK names of tensor-core kernels: HMMA/IMMA, or the MMA shape (i8816: INT8 m8n8k16, h1688, s884, ...)
_TENSOR_CORE_TACTIC = re.compile(r"hmma|imma|tensor|(?:^|_)[hsi](?:884|1688|8816|16816)", re.IGNORECASE)
_QDQ_NAME = re.compile(r"(De)?QuantizeLinear|(^|[/_.])(de)?quant(ize)?(_|\d|$)", re.IGNORECASE)
FP32_CAP = 20


def tactic_types(tactic: str | None) -> tuple[str, str] | None:
    """The first "<in><out>" type group of a kernel name: "..._i8f32_i8i32_f32_..." -> ("INT8", "FP32")."""
    m = _TYPE_GROUP.search((tactic or "").lower())
    return (_TYPE_WORDS[m.group(1)], _TYPE_WORDS[m.group(2)]) if m else None


def is_qdq(layer: LayerRecord) -> bool:
    return layer.params.get("Origin") == "QDQ" or any(_QDQ_NAME.search(p) for p in layer.fused_names)


def _side_precision(layer: LayerRecord, tensors, index: int) -> str | None:
    """The first known precision among `tensors`, else the tactic name's type group (0: input, 1: output)."""
    found = [t.precision for t in tensors if t.precision]
    if found:
        return found[0]
    types = tactic_types(layer.tactic_name)
    return types[index] if types else None


def in_precision(layer: LayerRecord) -> str | None:
    return _side_precision(layer, layer.inputs, 0)


def out_precision(layer: LayerRecord) -> str | None:
    return _side_precision(layer, layer.outputs, 1)


def majority_precision(engine: EngineInfo) -> str | None:
    """The most common precision of the compute layers (reformats, NoOps and shuffles left out)."""
    counts = Counter(p for layer in engine.layers if not _is_plumbing(layer) for p in [out_precision(layer)] if p)
    return counts.most_common(1)[0][0] if counts else None


def _is_plumbing(layer: LayerRecord) -> bool:
    return is_reformat(layer) or layer.layer_type == "NoOp" or layer.parameter_type in ("Shuffle", "Reformat") or \
        is_qdq(layer)


def engine_edges(engine: EngineInfo) -> set[str]:
    """Tensors at the engine's boundary: bindings, tensors no layer produces and tensors no layer consumes."""
    produced = {t.name for layer in engine.layers for t in layer.outputs}
    consumed = {t.name for layer in engine.layers for t in layer.inputs}
    return set(engine.bindings) | (consumed - produced) | (produced - consumed)


def feeds_output(engine: EngineInfo, tensor: str, edges: set[str]) -> bool:
    """The tensor is an engine output, directly or through NoOp/Shuffle layers (a reshape after the last layer)."""
    if tensor in edges:
        return True
    users = [layer for layer in engine.layers if any(t.name == tensor for t in layer.inputs)]
    return bool(users) and all((u.layer_type == "NoOp" or u.parameter_type == "Shuffle") and
                               all(t.name in edges for t in u.outputs) for u in users)


def _int8_evidence(layer: LayerRecord) -> str | None:
    weights = layer.params.get("Weights")
    if isinstance(weights, dict) and weights.get("Type") == "Int8":
        return f"INT8 weights ({weights.get('Count', '?')})"
    if in_precision(layer) == "INT8":
        return "INT8 input"
    tactic = (layer.tactic_name or "").lower()
    if "imma" in tactic or re.search(r"(^|_)(i8|int8)", tactic):
        return f"INT8 tactic {layer.tactic_name}"
    return None


def rule_int8_float_output(engine: EngineInfo, profile: Profile | None) -> Iterable[Finding]:
    edges = engine_edges(engine)
    for layer in engine.layers:
        if not (is_conv(layer) or is_gemm(layer)) or not layer.outputs:
            continue
        evidence, out = _int8_evidence(layer), out_precision(layer)
        if not evidence or out not in ("FP32", "FP16") or in_precision(layer) in ("FP32", "FP16", "BF16"):
            continue   # float in and out around INT8 weights: dynamic (or weight-only) quantization, by design
        tensor = layer.outputs[0].name
        how = "its output format" if layer.outputs[0].precision else f"its tactic's type group ({layer.tactic_name})"
        note = f"{tensor} is an engine output (directly or through a reshape), so a float output may be intended" \
            if feeds_output(engine, tensor, edges) else f"consumers of {tensor} must re-quantize it"
        yield Finding("INT8_FLOAT_OUTPUT", layer.name, "warning",
                      f"{layer.name} computes in INT8 ({evidence}) but {how} says it writes {out} to {tensor}: "
                      f"no output scale, so it dequantizes to {out}; {note}",
                      f"add a QuantizeLinear/DequantizeLinear pair after {layer.name}'s output ({tensor}) so the builder "
                      f"can emit INT8 (or accept the float output)")


def rule_conv_no_tensor_cores(engine: EngineInfo, profile: Profile | None) -> Iterable[Finding]:
    engine_reduced = majority_precision(engine) in REDUCED
    for layer in engine.layers:
        tactic = (layer.tactic_name or "").lower()
        if not is_conv(layer) or not tactic:
            continue
        simt = "simt" in tactic or ("cudnn" in tactic and not _TENSOR_CORE_TACTIC.search(tactic))
        if simt and (engine_reduced or in_precision(layer) in REDUCED):
            yield Finding("CONV_NO_TENSOR_CORES", layer.name, "warning",
                          f"{layer.name} runs the non-tensor-core (SIMT/cuDNN) tactic {layer.tactic_name} in a "
                          f"mostly-{majority_precision(engine)} engine",
                          "make its channels tensor-core friendly (multiples of 8 for FP16, 32 for INT8), keep its "
                          "input and output in the reduced precision (Q/DQ on both sides for INT8), or check that "
                          "the tactic sources include cuBLAS/cuDNN/edge-mask kernels (--tacticSources)")


def _alignment(t: TensorInfo, fallback: str | None) -> tuple[str, int] | None:
    prec = t.precision or fallback
    if prec == "FP16" or prec == "BF16":
        return prec, 8
    if prec == "INT8":
        return prec, 4 if t.format and t.format.startswith("Four wide") else 32
    return None


def rule_channels_not_aligned(engine: EngineInfo, profile: Profile | None) -> Iterable[Finding]:
    for layer in engine.layers:
        conv, gemm = is_conv(layer), is_gemm(layer)
        if not (conv or gemm):
            continue
        bad = []
        for side, tensors, fallback in (("input", layer.inputs[:1], in_precision(layer)),
                                        ("output", layer.outputs[:1], out_precision(layer))):
            for t in tensors:
                align = _alignment(t, fallback)
                if not t.dims or len(t.dims) < 2 or align is None:
                    continue
                c = t.dims[1] if conv else t.dims[-1]
                if c > 0 and c % align[1]:
                    bad.append(f"{side} {t.name} has {c} channels ({align[0]} wants a multiple of {align[1]})")
        if bad:
            yield Finding("CHANNELS_NOT_ALIGNED", layer.name, "info", f"{layer.name}: " + "; ".join(bad),
                          "pad the channel count to the multiple (zero-padded weights) or accept the padding cost; "
                          "TensorRT pads internally and may pick slower kernels")


def rule_reformat_changes_type(engine: EngineInfo, profile: Profile | None) -> Iterable[Finding]:
    edges = engine_edges(engine)
    for layer in engine.layers:
        if not (is_reformat(layer) or layer.parameter_type == "Slice") or not layer.inputs or not layer.outputs:
            continue
        a, b = layer.inputs[0].precision, layer.outputs[0].precision
        if not a or not b or a == b:
            continue
        at_edge = layer.inputs[0].name in edges or layer.outputs[0].name in edges
        yield Finding("REFORMAT_CHANGES_TYPE", layer.name, "info" if at_edge else "warning",
                      f"{layer.name} converts {layer.inputs[0].name} from {a} to {b}"
                      + (" at an engine input/output" if at_edge else " between two layers"),
                      f"give both sides one precision: a Q/DQ pair at {layer.inputs[0].name} for INT8, or "
                      f"--inputIOFormats/--outputIOFormats (or layer precision constraints) to keep {a} or {b} "
                      "throughout")


def rule_qdq_unfused(engine: EngineInfo, profile: Profile | None) -> Iterable[Finding]:
    for layer in engine.layers:
        if is_conv(layer) or is_gemm(layer) or is_region(layer):
            continue
        if layer.params.get("Origin") == "QDQ" or (is_qdq(layer) and all(_QDQ_NAME.search(p) or "Reformat" in p
                                                                            for p in layer.fused_names)):
            yield Finding("QDQ_UNFUSED", layer.name, "warning",
                          f"{layer.name} ({layer.layer_type or 'unknown type'}) is a Q/DQ left as its own kernel: "
                          "the builder (TensorRT or kiln) could not fold it into a neighbouring compute layer",
                          f"move the QuantizeLinear/DequantizeLinear around {layer.name} so it directly feeds / "
                          "follows a Conv/Gemm input or weight (Q/DQ on inputs and weights, not after "
                          "non-quantizable ops), or remove the pair")


def _profile_times(engine: EngineInfo, profile: Profile) -> list[tuple[str, float, bool]]:
    by_name = {layer.name: layer for layer in engine.layers}
    out = []
    for r in profile.records:
        layer = by_name.get(r.name)
        reformat = is_reformat(layer) if layer else is_reformat_name(r.name)
        out.append((r.name, r.average_ms, reformat))
    return out


def rule_reformat_time_share(engine: EngineInfo, profile: Profile | None) -> Iterable[Finding]:
    if not profile or not profile.records:
        return
    times = _profile_times(engine, profile)
    total = sum(t for _, t, _ in times)
    reformats = sorted(((n, t) for n, t, r in times if r), key=lambda x: -x[1])
    spent = sum(t for _, t in reformats)
    if total <= 0 or spent / total <= 0.05:
        return
    top = ", ".join(f"{n} ({t:.3f} ms)" for n, t in reformats[:3])
    yield Finding("REFORMAT_TIME_SHARE", None, "warning",
                  f"{len(reformats)} reformat layers take {spent:.3f} of {total:.3f} ms ({100 * spent / total:.1f}%); "
                  f"top: {top}",
                  "keep neighbouring layers in one precision/format: add Q/DQ so INT8 regions are contiguous, set "
                  "--inputIOFormats/--outputIOFormats to the engine's internal format, or align channels",
                  tuple(n for n, _ in reformats))


def rule_fp32_in_reduced_engine(engine: EngineInfo, profile: Profile | None) -> Iterable[Finding]:
    majority = majority_precision(engine)
    if majority not in REDUCED:
        return
    fp32 = [layer for layer in engine.layers if not _is_plumbing(layer)
            and {t.precision for t in layer.inputs + layer.outputs if t.precision} == {"FP32"}]
    for layer in fp32[:FP32_CAP]:
        yield Finding("FP32_IN_REDUCED_ENGINE", layer.name, "warning",
                      f"{layer.name} ({layer.layer_type}) runs in FP32 in a mostly-{majority} engine",
                      f"allow {majority} for it (Q/DQ around it for INT8, or drop the FP32 precision constraint / "
                      "--precisionConstraints), or check that it has a reduced-precision implementation")
    if len(fp32) > FP32_CAP:
        yield Finding("FP32_IN_REDUCED_ENGINE", None, "warning",
                      f"{len(fp32) - FP32_CAP} more FP32 layers ({len(fp32)} in all) in a mostly-{majority} engine",
                      "see the per-layer findings above; the same fix applies",
                      tuple(layer.name for layer in fp32[FP32_CAP:]))


def rule_qdq_splits_region(engine: EngineInfo, profile: Profile | None) -> Iterable[Finding]:
    regions, separated, between, splitters = 0, 0, [], []
    for layer in engine.layers:
        if is_region(layer):
            regions += 1
            separated += bool(between)
            splitters += between
            between = []
        elif regions and (is_qdq(layer) or (is_reformat(layer) and _touches_quantized(layer))):
            between.append(layer.name)
    if regions >= 2 and separated:
        yield Finding("QDQ_SPLITS_REGION", None, "warning",
                      f"{regions} Myelin/ForeignNode regions, {separated} boundaries between them are Q/DQ reformats: "
                      "the quantized graph is split into many regions",
                      "place Q/DQ only where TensorRT's Myelin fuses them (inputs of MatMul/Gemm), remove Q/DQ "
                      "around non-quantizable ops (Softmax, LayerNorm, Add) or quantize the whole block",
                      tuple(splitters))


def _touches_quantized(layer: LayerRecord) -> bool:
    return any(t.precision in ("INT8", "FP8", "INT4") for t in layer.inputs + layer.outputs)


def rule_tiny_layers(engine: EngineInfo, profile: Profile | None) -> Iterable[Finding]:
    if not profile or not profile.records:
        return
    tiny = [r for r in profile.records if r.average_ms < 0.01]
    n = len(profile.records)
    if len(tiny) >= 20 and len(tiny) >= 0.3 * n:
        yield Finding("TINY_LAYERS", None, "warning",
                      f"{len(tiny)} of {n} layers ({100 * len(tiny) / n:.0f}%) average under 0.01 ms: the engine is "
                      "launch-bound",
                      "use CUDA graphs (trtexec --useCudaGraph), a larger batch, or a graph with fewer, fused layers")


def rule_names_only_input(engine: EngineInfo, profile: Profile | None) -> Iterable[Finding]:
    if engine.verbosity == "layer_names_only":
        yield Finding("NAMES_ONLY_INPUT", None, "info",
                      "this description lists layer names only: checks of formats, precisions and tactics "
                      "(INT8_FLOAT_OUTPUT, CONV_NO_TENSOR_CORES, CHANNELS_NOT_ALIGNED, REFORMAT_CHANGES_TYPE, "
                      "FP32_IN_REDUCED_ENGINE) cannot run",
                      "rebuild or re-export with --profilingVerbosity=detailed (trtexec); kiln engines give detailed "
                      "layer info by default")


RULES: tuple[Callable[[EngineInfo, Profile | None], Iterable[Finding]], ...] = (
    rule_names_only_input, rule_int8_float_output, rule_conv_no_tensor_cores, rule_channels_not_aligned,
    rule_reformat_changes_type, rule_qdq_unfused, rule_reformat_time_share, rule_fp32_in_reduced_engine,
    rule_qdq_splits_region, rule_tiny_layers)


def lint(engine: EngineInfo, profile: Profile | None = None) -> list[Finding]:
    """Every finding of every rule, in rule order then layer order."""
    profile = profile or engine.profile
    return [f for rule in RULES for f in rule(engine, profile)]
