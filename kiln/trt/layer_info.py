"""Layer information in trtexec's --exportLayerInfo schema (none / layer_names_only / detailed), as TensorRT 10
writes it (the default) or TensorRT 11 (`schema=11`: "I/O Tensors" objects instead of "Bindings", each tensor's
"Format" and "Datatype" apart, "ProfilingVerbosity" and "Engine Metadata" at the top), and its one-line text form
(--dumpLayerInfo)."""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from kiln.plan.model import Layer, Plan, TensorDesc
from kiln.errors import Error
from kiln.trt.vocab import (ACTIVATION_TYPE, PROFILING_VERBOSITY_NAMES, format_datatype, format_text_11, layer_type,
                            metadata_text, parameter_type, weight_type)
from kiln.version import __version__

VERBOSITIES = ("none", "layer_names_only", "detailed")
SCHEMAS = (10, 11)   # the TensorRT major version whose layer-info schema is written


def tensor_info(t: TensorDesc) -> dict[str, Any]:
    return {"Name": t.name, "Location": "Device", "Dimensions": list(t.shape_spec), "Format/Datatype": format_datatype(t)}


def tensor_info_11(t: TensorDesc) -> dict[str, Any]:
    """A layer's tensor as TensorRT 11 writes it: the format and the data type in fields of their own."""
    return {"Name": t.name, "Location": "Device", "Dimensions": list(t.shape_spec), "Format": format_text_11(t),
            "Datatype": weight_type(t.dtype)}


def layer_info(plan: Plan, verbosity: str = "detailed", schema: int = 10) -> dict[str, Any]:
    """The layer-info document in TensorRT `schema`'s form (10 or 11). Unlike trtexec, kiln's default verbosity is
    `detailed`."""
    if verbosity not in VERBOSITIES:
        raise Error(f"unknown profiling verbosity '{verbosity}'; use one of {', '.join(VERBOSITIES)}")
    if schema not in SCHEMAS:
        raise Error(f"unknown layer-info schema '{schema}'; use one of {', '.join(map(str, SCHEMAS))} (the TensorRT "
                    "major version whose --exportLayerInfo schema to write)")
    tensor = tensor_info if schema == 10 else tensor_info_11
    if verbosity == "none":
        layers: list = []
    elif verbosity == "layer_names_only":
        layers = [l.name for l in plan.layers]
    else:   # like TensorRT 10 with Myelin regions: names-only shows {ForeignNode[...]}, detailed lists its inner layers
        layers = [detailed_layer(plan, i, tensor) for l in plan.layers for i in (l.inner or (l,))]
    if schema == 11:
        doc = {"ProfilingVerbosity": PROFILING_VERBOSITY_NAMES[verbosity], "Layers": layers,
               "I/O Tensors": io_tensors_11(plan), "Engine Metadata": {"Producer": f"kiln {__version__}"}}
    else:
        doc = {"Layers": layers, "Bindings": [t.name for t in plan.inputs] + [t.name for t in plan.outputs]}
    if verbosity != "none":
        doc["TacticSources"] = tactic_sources(plan)
    return doc


def io_tensors_11(plan: Plan) -> list[dict[str, Any]]:
    """TensorRT 11's "I/O Tensors": each input's min/opt/max shapes per optimization profile (one profile, its
    shapes the tensor's, for a static engine); outputs carry the format of each profile."""
    profiles = plan.profiles or ({},)
    out = []
    for mode, tensors in (("Input", plan.inputs), ("Output", plan.outputs)):
        for t in tensors:
            d = {"Name": t.name, "IOMode": mode, "DataType": weight_type(t.dtype), "Dimensions": list(t.shape_spec),
                 "Location": "Device", "IsShapeInferenceIO": False, "ProfileInfo": []}
            for profile in profiles:
                bounds = profile.get(t.name)
                entry = {"Format": format_text_11(t)}
                if mode == "Input":
                    lo, opt, hi = (bounds.min, bounds.opt, bounds.max) if bounds else (t.dims, t.dims, t.dims)
                    entry = {"MinShape": list(lo), "OptShape": list(opt), "MaxShape": list(hi), **entry}
                d["ProfileInfo"].append(entry)
            out.append(d)
    return out


def tactic_sources(plan: Plan) -> dict[str, list[str]]:
    """kiln's addition: which kernel sources this machine had, which the build allowed, which layers use."""
    info = plan.build_info
    used = sorted({l.source for l in plan.layers if l.source})   # built-in Reformat copies have none
    return {"Available": list(info.get("tactic_sources_available", [])), "Enabled": list(info.get("tactic_sources", [])),
            "Used": used}


def detailed_layer(plan: Plan, layer: Layer, tensor=tensor_info) -> dict[str, Any]:
    runner, kind = layer_type(layer), parameter_type(layer)
    d: dict[str, Any] = {"Name": layer.name, "LayerType": runner,
                         "Inputs": [tensor(t) for t in layer.inputs],
                         "Outputs": [tensor(t) for t in layer.outputs]}
    if runner != "NoOp":
        d["ParameterType"] = kind
        d.update(PARAMETERS.get(kind, _generic)(plan, layer))
        d["TacticName"] = layer.tactic_name
    d["TacticValue"] = f"0x{layer.tactic_value:016x}"
    for attr, key in QUANTIZATION_KEYS.items():   # kiln's addition: the scales an INT8 layer runs with
        if attr in layer.attrs:
            d[key] = quantization(layer.attrs[attr])
    if layer.requested_precision:   # kiln's addition: TensorRT never says why it fell back
        d["RequestedPrecision"] = layer.requested_precision
        d["GrantedPrecision"] = layer.precision
        if layer.precision_reason:
            d["PrecisionReason"] = layer.precision_reason
    d["StreamId"] = 0
    d["Metadata"] = metadata_text(layer.origin)
    return d


QUANTIZATION_KEYS = {"quant": "Quantization", "skip_quant": "SkipQuantization"}   # QLayerNorm's fused skip QAdd


def quantization(quant: dict[str, Any]) -> dict[str, Any]:
    """An INT8 layer's quantization as its parameters name them (x_scale, w_scale, y_zero_point, ...; dtypes as
    strings); a per-channel array as its count and range, which is what a reader compares between engines."""
    out: dict[str, Any] = {}
    for key, value in quant.items():
        array = np.asarray(value)
        if array.size > 1:
            out[key] = {"Count": int(array.size), "Min": float(array.min()), "Max": float(array.max())}
        else:
            out[key] = array.reshape(()).item() if array.dtype.kind in "biuf" else value
    return out


def _weight_info(plan: Plan, layer: Layer, index: int) -> dict[str, Any]:
    if index >= len(layer.args) or layer.args[index].kind != "weight":
        return {"Type": "Float", "Count": 0}
    w = plan.weights[layer.args[index].name]
    return {"Type": weight_type(w.dtype), "Count": int(w.size)}


def _padding_mode(attrs: dict) -> str:
    mode = attrs.get("padding_mode")
    if mode in ("SAME_UPPER", "SAME_LOWER"):
        return f"k{mode}"
    return "kEXPLICIT_ROUND_UP" if attrs.get("ceil_mode") else "kEXPLICIT_ROUND_DOWN"


def _activation(attrs: dict) -> str:
    spec = attrs.get("activation")
    return ACTIVATION_TYPE.get(spec["op"], "GENERIC") if spec else "NONE"


# (weights, bias) argument indices of the convolutions whose operands are not Conv's (x, W, B)
CONV_OPERANDS = {"QLinearConv": (3, 8), "ConvInteger": (1, None)}


def _conv_geometry(plan: Plan, layer: Layer, weights: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(kernel, pads, strides, dilations), ONNX's defaults filled in where the model left them out (kiln's import
    fills them for Conv and ConvInteger; QLinearConv keeps the model's attributes)."""
    a, w = layer.attrs, layer.args[weights]
    if a.get("kernel_shape"):
        kernel = list(a["kernel_shape"])
    elif w.kind == "weight":
        kernel = list(plan.weights[w.name].shape[2:])
    else:   # weights computed at run time: their tensor's spatial dims
        kernel = list(next(d.dims[2:] for d in layer.inputs if d.name == w.name))
    n = len(kernel)
    return (kernel, list(a.get("pads") or [0] * (2 * n)), list(a.get("strides") or [1] * n),
            list(a.get("dilations") or [1] * n))


def _conv(plan: Plan, layer: Layer) -> dict[str, Any]:
    a = layer.attrs
    weights, bias = CONV_OPERANDS.get(layer.op_type, (1, 2))
    kernel, pads, strides, dilations = _conv_geometry(plan, layer, weights)
    n = len(kernel)
    has_bias = bias is not None and len(layer.args) > bias and layer.args[bias].kind == "weight"
    has_res = layer.op_type in ("Conv", "QConv", "DynamicQConv") and len(layer.args) > 3 and layer.args[3].kind == "tensor"
    act = _activation(a)
    d = {"Kernel": kernel, "PaddingMode": _padding_mode(a), "PrePadding": pads[:n], "PostPadding": pads[n:],
         "Stride": strides, "Dilation": dilations,
         "OutMaps": int(layer.outputs[0].dims[1]), "Groups": int(a.get("group", 1)),
         "Weights": _weight_info(plan, layer, weights),
         "Bias": _weight_info(plan, layer, bias) if has_bias else {"Type": "Float", "Count": 0},
         "HasBias": int(has_bias), "HasReLU": int(act == "RELU"), "HasSparseWeights": 0, "HasDynamicFilter": 0,
         "HasDynamicBias": 0, "HasResidual": int(has_res), "ConvXAsActInputIdx": -1, "BiasAsActInputIdx": -1,
         "ResAsActInputIdx": -1, "Activation": act}
    return _with_output_table(a, d)


def _pooling(plan: Plan, layer: Layer) -> dict[str, Any]:
    a = layer.attrs
    op = a.get("pool", layer.op_type)   # kiln's INT8 QAveragePool: the pool it runs
    if "Global" in op or op == "ReduceMean":   # GlobalAveragePool, GlobalMaxPool, QLinearGlobalAveragePool
        window = list(layer.inputs[0].dims[2:])
        pads, strides = [0] * (2 * len(window)), [1] * len(window)
    else:
        window, pads = list(a["kernel_shape"]), list(a["pads"])
        strides = list(a.get("strides") or [1] * len(window))
    n = len(window)
    return {"PoolingType": "MAX" if "Max" in op else "AVERAGE", "WindowSize": window, "PaddingMode": _padding_mode(a),
            "PrePadding": pads[:n], "PostPadding": pads[n:], "Stride": strides, "BlendFactor": 0,
            "AverageCountExcludesPadding": int(not a.get("count_include_pad", 0))}


def _shuffle_steps(layer: Layer) -> list[dict[str, Any]]:
    """A fused Shuffle's steps; for a single ONNX node (Transpose, Reshape, Flatten, ...) the one it takes: its
    permutation, or its output's dims (-1 on axes that vary with the input shapes)."""
    if "steps" in layer.attrs:
        return layer.attrs["steps"]
    if layer.op_type == "Transpose":
        rank = len(layer.inputs[0].dims) if layer.inputs else 0
        return [{"transpose": list(layer.attrs.get("perm") or range(rank - 1, -1, -1))}]
    return [{"reshape": list(layer.outputs[0].shape_spec)}]


def _shuffle(plan: Plan, layer: Layer) -> dict[str, Any]:
    steps = _shuffle_steps(layer)
    rank_in, rank_out = len(layer.inputs[0].dims) if layer.inputs else 0, len(layer.outputs[0].dims)
    first, reshape, second = list(range(rank_in)), None, list(range(rank_out))
    rest = list(steps)
    if rest and "transpose" in rest[0]:
        first = rest.pop(0)["transpose"]
    if rest and "reshape" in rest[0]:
        reshape = rest.pop(0)["reshape"]
    if rest and "transpose" in rest[0]:
        second = rest.pop(0)["transpose"]
    d = {"FirstTranspose": first, "Reshape": list(reshape) if reshape is not None else "nbDims=-1",
         "SecondTranspose": second, "ZeroIsPlaceholder": 1}   # kiln's targets read 0 as "copy this axis"
    if rest:   # chains TensorRT's three-step shuffle cannot express: kiln lists every step
        d["Steps"] = steps
    return d


def _matmul(plan: Plan, layer: Layer) -> dict[str, Any]:
    a = layer.attrs
    has_bias = len(layer.args) > 2 and layer.args[2].kind != "none"
    d = {"MatrixOpA": "kTRANSPOSE" if a.get("transA") else "kNONE",
         "MatrixOpB": "kTRANSPOSE" if a.get("transB") else "kNONE",
         "Weights": _weight_info(plan, layer, 1), "HasBias": int(has_bias),
         "Bias": _weight_info(plan, layer, 2) if has_bias else {"Type": "Float", "Count": 0},
         "Alpha": a.get("alpha", 1.0), "Beta": a.get("beta", 1.0), "Activation": _activation(a)}
    steps = {key: a[attr] for attr, key in STEPS_KEYS.items() if a.get(attr)}
    if steps:   # kiln's addition: an INT8 product's head split and merge (kiln.passes.qmatmul_steps)
        d["Steps"] = steps
    return _with_output_table(a, d)


def _with_output_table(attrs: dict, d: dict[str, Any]) -> dict[str, Any]:
    """`d` and, where an INT8 product took a pointwise chain (kiln.passes.qproduct_table), kiln's `OutputTable`: the
    bytes each requantized output byte maps to."""
    table = attrs.get("out_table")
    if table:
        d["OutputTable"] = _table_info(table)
    return d


def _table_info(table: dict) -> dict[str, Any]:
    """A 256-entry byte table (kiln.passes.qproduct_table, qconcat_table) as layer info shows it."""
    return {"Type": weight_type(table["dtype"]), "Count": len(table["bytes"]), "Values": table["bytes"]}


STEPS_KEYS = {"a_steps": "A", "b_steps": "B", "out_steps": "Output"}   # kiln.ops.fused.PRODUCT_STEPS, as shown


def _pointwise(plan: Plan, layer: Layer) -> dict[str, Any]:
    steps = layer.attrs["program"]
    n_inputs = sum(1 for a in layer.args if a.kind != "none")
    literals: list[str] = []
    ops = []
    for k, step in enumerate(steps):
        args = []
        for a in step["args"]:
            if a is None:
                continue
            if isinstance(a, dict):
                literals.append(repr(a["const"]))
                args.append(f"literal{len(literals) - 1}")
            else:
                args.append(("arg" if a[0] == "x" else "var") + a[1:])
        attrs = "".join(f", {k}={v}" for k, v in step.get("attrs", {}).items())
        ops.append(f"const auto var{k} = pwgen::i{step['op']}({', '.join(args)}{attrs});")
    return {"ParameterSubType": "PointWiseExpression", "NbInputArgs": n_inputs,
            "InputArgs": [f"arg{i}" for i in range(n_inputs)], "NbOutputVars": 1, "OutputVars": [f"var{len(steps) - 1}"],
            "NbParams": 0, "Params": [], "NbLiterals": len(literals), "Literals": literals,
            "NbOperations": len(ops), "Operations": ops}


def _softmax(plan: Plan, layer: Layer) -> dict[str, Any]:
    rank = len(layer.outputs[0].dims)
    axis = layer.attrs.get("axis", -1) % max(rank, 1)
    return {"Axes": 1 << axis, "HasLog": int(layer.op_type == "LogSoftmax")}


def _concatenation(plan: Plan, layer: Layer) -> dict[str, Any]:
    """TensorRT's Axis; for a QConcat (kiln.passes.qconcat_table) kiln's `InputTables`: per input with one, the
    bytes each of its bytes maps to as it is copied."""
    rank = len(layer.outputs[0].dims)
    d: dict[str, Any] = {"Axis": layer.attrs.get("axis", 0) % max(rank, 1)}
    tables = layer.attrs.get("in_tables") or []
    if any(tables):
        d["InputTables"] = [{"Input": i, **_table_info(t)} for i, t in enumerate(tables) if t]
    return d


def _reformat(plan: Plan, layer: Layer) -> dict[str, Any]:
    if layer.op_type in ("QuantizeLinear", "DequantizeLinear"):   # an unfused Q/DQ, as trtexec reports it
        return {"Origin": "QDQ"}
    return {"Origin": layer.attrs.get("origin", "REFORMAT")}


def _generic(plan: Plan, layer: Layer) -> dict[str, Any]:
    """Layers TensorRT has no published key set for: kiln names the ONNX op and its attributes."""
    attrs = {k: v for k, v in layer.attrs.items() if not k.startswith("_") and k not in QUANTIZATION_KEYS}
    return {"Operation": layer.op_type, "Attributes": attrs}


PARAMETERS = {"Convolution": _conv, "Pooling": _pooling, "Shuffle": _shuffle, "MatrixMultiply": _matmul,
              "PointWise": _pointwise, "SoftMax": _softmax, "Reformat": _reformat, "Concatenation": _concatenation}


def dumps(info: dict[str, Any]) -> str:
    return json.dumps(info, indent=2, default=_json_default) + "\n"


def _json_default(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def oneline(info: dict[str, Any]) -> str:
    """trtexec's --dumpLayerInfo text: "Layers:" then one `Name: ..., LayerType: ...` line per layer."""
    lines = ["Layers:"]
    for layer in info["Layers"]:
        if isinstance(layer, str):
            lines.append(layer)
            continue
        parts = []
        for k, v in layer.items():
            if k in ("Inputs", "Outputs"):
                items = ", ".join("{ " + ", ".join(f"{kk}: {_plain(vv)}" for kk, vv in t.items()) + " }" for t in v)
                parts.append(f"{k}: [ {items}]" if v else f"{k}: []")
            else:
                parts.append(f"{k}: {_plain(v)}")
        lines.append(", ".join(parts))
    lines.append("")
    lines.append("Bindings:")
    lines.extend(info["Bindings"] if "Bindings" in info else [t["Name"] for t in info.get("I/O Tensors", [])])
    return "\n".join(lines)


def _plain(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
        return "[" + ",".join(str(x) for x in v) + "]"
    return json.dumps(v, default=_json_default)
