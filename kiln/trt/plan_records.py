"""kiln's own engines as the inspector's records, made from the plan: each tensor's precision comes from its dtype,
origins and regions from the plan's layers, not read back from `Format/Datatype` prose or `Metadata`; the TensorRT
vocabulary a record carries for display (LayerType, ParameterType, tactic, parameters, Format/Datatype text) is the
detailed layer info's, taken without a JSON round trip. The records equal those the engine's detailed layer-info
export reads as."""
from __future__ import annotations

import json
from typing import Any

from kiln.plan.model import Layer, Plan, TensorDesc
from kiln.trt.layer_info import detailed_layer, tactic_sources, tensor_info
from kiln.trt.vocab import dtype_precision
from kiln.trt.readers import LAYER_FIELDS, tactic_sources_note
from kiln.trt.records import EngineInfo, LayerRecord, TensorInfo


def engine_info_from_plan(plan: Plan) -> EngineInfo:
    """The plan's layers as records, a region's inner layers (as detailed layer info lists them) tagged with it."""
    layers = tuple(layer_record(plan, inner, outer.name if outer.inner else None)
                   for outer in plan.layers for inner in (outer.inner or (outer,)))
    bindings = tuple(t.name for t in plan.inputs + plan.outputs)
    notes = (tactic_sources_note(tactic_sources(plan)),)
    return EngineInfo("kiln-engine", "detailed", layers, bindings, notes=notes)


def layer_record(plan: Plan, layer: Layer, region: str | None = None) -> LayerRecord:
    info = detailed_layer(plan, layer)
    return LayerRecord(name=layer.name, layer_type=info["LayerType"], parameter_type=info.get("ParameterType"),
                       inputs=tuple(tensor_record(t) for t in layer.inputs),
                       outputs=tuple(tensor_record(t) for t in layer.outputs),
                       params={k: json_value(v) for k, v in info.items() if k not in LAYER_FIELDS},
                       tactic_name=info.get("TacticName"), tactic_value=info["TacticValue"],
                       origin=tuple(layer.origin), region=region)


def tensor_record(t: TensorDesc) -> TensorInfo:
    """The precision is the dtype's; `format` and `location` keep the layer-info text, for display."""
    info = tensor_info(t)
    dims = json_value(info["Dimensions"])
    return TensorInfo(t.name, tuple(dims) if all(isinstance(d, int) for d in dims) else None,
                      info["Format/Datatype"], info["Location"], dtype_precision(t.dtype))


def json_value(v: Any) -> Any:
    """A layer-info value as its JSON export reads back: tuples and arrays as lists, numpy scalars as Python
    numbers, dictionary keys as strings."""
    if isinstance(v, dict):
        return {k if isinstance(k, str) else json.dumps(k): json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    if hasattr(v, "tolist"):
        return json_value(v.tolist())
    return v
