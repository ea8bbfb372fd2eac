"""Group lint findings by cause: one record per cause with the layers it touches, the findings that follow from it
(a Q/DQ reformat that re-quantizes an INT8 layer's float output is that layer's problem, not a second one), and
the time at stake with a profile (the affected layers' summed average time), ranked so the costliest cause is
first."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kiln.inspect.lint import Finding, engine_edges, feeds_output, majority_precision
from kiln.trt.records import EngineInfo, LayerRecord, Profile

SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}
ROOT_OF_REQUANTIZE = "INT8_FLOAT_OUTPUT"
_FOLLOWS_ROOT = ("REFORMAT_CHANGES_TYPE", "QDQ_UNFUSED")   # symptoms on the layer that consumes a root's output


@dataclass(frozen=True)
class Cause:
    cause_id: str                      # the rule of the root finding
    severity: str                      # the most severe of its findings
    summary: str                       # one sentence: what, in how many layers
    example: str                       # the first finding's hazard, concrete
    mitigation: str
    layers: tuple[str, ...]            # affected layers, in engine order
    rule_ids: tuple[str, ...]          # the rules whose findings it gathers, root first
    num_findings: int
    time_ms: float | None              # the affected layers' summed average time (None: no profile or no layers)
    time_percent: float | None         # of the profile's total average time


def _titles(engine: EngineInfo) -> dict[str, Callable[[int], str]]:
    majority = majority_precision(engine) or "reduced-precision"
    return {
        "INT8_FLOAT_OUTPUT": lambda n: f"{n} INT8 layers write a float output: no Q/DQ follows them, so there is "
                                       "no output scale",
        "CONV_NO_TENSOR_CORES": lambda n: f"{n} convolutions run a non-tensor-core (SIMT/cuDNN) tactic in a "
                                          f"mostly-{majority} engine",
        "CHANNELS_NOT_ALIGNED": lambda n: f"{n} convolution/GEMM layers have channel counts their precision's "
                                          "vector width does not divide",
        "REFORMAT_CHANGES_TYPE": lambda n: f"{n} reformats change a tensor's data type",
        "QDQ_UNFUSED": lambda n: f"{n} Q/DQ layers run as kernels of their own",
        "FP32_IN_REDUCED_ENGINE": lambda n: f"{n} layers run in FP32 in a mostly-{majority} engine",
    }


_GROUP_FIXES = {
    "INT8_FLOAT_OUTPUT": "add a QuantizeLinear/DequantizeLinear pair after each listed INT8 layer's output (for a "
                         "residual Add, on its skip-connection input too) so the builder keeps the tensor in INT8 "
                         "and drops the reformats that quantize it again; or accept the float outputs",
    "CONV_NO_TENSOR_CORES": "make the channels tensor-core friendly (multiples of 8 for FP16, 32 for INT8), keep "
                            "inputs and outputs in the reduced precision (Q/DQ on both sides for INT8), or check "
                            "--tacticSources",
    "CHANNELS_NOT_ALIGNED": "pad the channel counts to the multiple (zero-padded weights) or accept the padding cost",
    "QDQ_UNFUSED": "move each QuantizeLinear/DequantizeLinear so it directly feeds or follows a Conv/Gemm input or "
                   "weight, or remove the pair",
}


def _producers(engine: EngineInfo) -> dict[str, LayerRecord]:
    return {t.name: layer for layer in engine.layers for t in layer.outputs}


def _cause_keys(engine: EngineInfo, findings: list[Finding]) -> list[tuple[str, ...]]:
    """Each finding's cause: a Q/DQ reformat right after an INT8 layer with a float output joins that layer's
    cause, a QDQ_UNFUSED joins the type change found on the same layer, an INT8 layer's float engine output (often
    intended) is a cause apart from float outputs inside the engine, anything else is (rule, severity)."""
    by_name = {layer.name: layer for layer in engine.layers}
    producers, edges = _producers(engine), engine_edges(engine)
    roots = {f.layer for f in findings if f.rule_id == ROOT_OF_REQUANTIZE and f.layer}
    at_output = {name for name in roots if name in by_name and by_name[name].outputs and
                 feeds_output(engine, by_name[name].outputs[0].name, edges)}
    own = {f.layer: (f.rule_id, f.severity) for f in findings if f.rule_id == "REFORMAT_CHANGES_TYPE" and f.layer}
    keys = []
    for f in findings:
        layer = by_name.get(f.layer) if f.layer else None
        producer = producers.get(layer.inputs[0].name) if layer and layer.inputs else None
        if f.rule_id in _FOLLOWS_ROOT and producer is not None and producer.name in roots:
            keys.append((ROOT_OF_REQUANTIZE,))
        elif f.rule_id == ROOT_OF_REQUANTIZE:
            keys.append((ROOT_OF_REQUANTIZE, "engine output") if f.layer in at_output else (ROOT_OF_REQUANTIZE,))
        elif f.rule_id == "QDQ_UNFUSED" and f.layer in own:
            keys.append(own[f.layer])
        else:
            keys.append((f.rule_id, f.severity))
    return keys


def _summary(engine: EngineInfo, members: list[Finding], titles) -> str:
    root = members[0]
    root_layers = [f.layer for f in members if f.rule_id == root.rule_id and f.layer]
    if len(root_layers) < 2 or root.rule_id not in titles:
        text = root.hazard
    else:
        text = titles[root.rule_id](len(root_layers))
    followers = [f for f in members if f.rule_id != root.rule_id]
    if followers and root.rule_id == ROOT_OF_REQUANTIZE:
        reformats = sorted({f.layer for f in followers if f.layer})
        text += f"; {len(reformats)} Q/DQ reformats after them quantize those outputs again"
    elif followers:
        rules = sorted({f.rule_id for f in followers})
        text += f"; also reported by {', '.join(rules)}"
    return text


def _affected(engine: EngineInfo, members: list[Finding]) -> tuple[str, ...]:
    names = {f.layer for f in members if f.layer} | {n for f in members for n in f.affected}
    order = {layer.name: i for i, layer in enumerate(engine.layers)}
    return tuple(sorted(names, key=lambda n: (order.get(n, len(order)), n)))


def _time_at_stake(layers: tuple[str, ...], profile: Profile | None) -> tuple[float | None, float | None]:
    if not profile or not profile.records or not layers:
        return None, None
    times = {r.name: r.average_ms for r in profile.records}
    spent = sum(times.get(name, 0.0) for name in layers)
    total = sum(times.values())
    return spent, (100.0 * spent / total if total > 0 else None)


def group_by_cause(engine: EngineInfo, findings: list[Finding], profile: Profile | None = None) -> list[Cause]:
    """One Cause per root problem, the costliest first with a profile (time at stake, then severity), else the
    most severe first, then the one touching the most layers."""
    profile = profile or engine.profile
    groups: dict[tuple[str, ...], list[Finding]] = {}
    for key, finding in zip(_cause_keys(engine, findings), findings):
        groups.setdefault(key, []).append(finding)
    titles = _titles(engine)
    causes = []
    for key, members in groups.items():
        members.sort(key=lambda f: f.rule_id != key[0])          # the root rule's findings first, order kept
        layers = _affected(engine, members)
        time_ms, percent = _time_at_stake(layers, profile)
        root = members[0]
        fix = _GROUP_FIXES.get(root.rule_id, root.mitigation) if len(members) > 1 else root.mitigation
        causes.append(Cause(
            cause_id=root.rule_id, severity=min((f.severity for f in members), key=SEVERITY_RANK.get),
            summary=_summary(engine, members, titles), example=root.hazard, mitigation=fix, layers=layers,
            rule_ids=tuple(dict.fromkeys(f.rule_id for f in members)), num_findings=len(members),
            time_ms=time_ms, time_percent=percent))
    causes.sort(key=lambda c: (-(c.time_ms or 0.0), SEVERITY_RANK.get(c.severity, 3), -len(c.layers)))
    return causes
