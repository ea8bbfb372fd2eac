"""Express one kiln layer (fused or not) as a small ONNX model, so an external library can run it."""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kiln.ops import lookup
from kiln.ops.dtypes import NUMPY_TO_TORCH  # noqa: F401  (dtype table lives there)
from kiln.tactics.base import LayerView

KILN_ONLY_ATTRS = {"activation", "padding_mode"}
POOLS = ("MaxPool", "AveragePool")
ONNX_ELEM = {np.dtype(k): v for k, v in {"float32": 1, "uint8": 2, "int8": 3, "int16": 5, "int32": 6, "int64": 7,
                                         "bool": 9, "float16": 10, "float64": 11}.items()}


class _Emitter:
    def __init__(self, view: LayerView):
        self.view = view
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.counter = 0

    def fresh(self, base: str = "t") -> str:
        self.counter += 1
        return f"{base}{self.counter}"

    def const(self, value: Any, dtype=np.float32) -> str:
        name = self.fresh("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def layer_inputs(self) -> list[str | None]:
        names: list[str | None] = []
        for i, shape in enumerate(self.view.input_shapes):
            if shape is None:
                names.append(None)
            elif i in self.view.const_inputs:
                arr = self.view.const_inputs[i].numpy()
                name = f"w{i}"
                self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr).reshape(arr.shape), name))
                names.append(name)
            else:
                name = f"x{i}"
                dtype = np.dtype(self.view.input_dtypes[i])
                self.inputs.append(helper.make_tensor_value_info(name, ONNX_ELEM[dtype], list(shape)))
                names.append(name)
        return names

    def node(self, op: str, inputs: list[str | None], attrs: dict[str, Any] | None = None) -> str:
        out = self.fresh()
        clean = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in (attrs or {}).items()
                 if k not in KILN_ONLY_ATTRS and not k.startswith("_")}
        self.nodes.append(helper.make_node(op, [x or "" for x in inputs], [out], **clean))
        return out

    def activation(self, x: str, spec: dict | None) -> str:
        if not spec:
            return x
        attrs = dict(spec.get("attrs", {}))
        if spec["op"] == "Clip":
            lo, hi = attrs.pop("min", None), attrs.pop("max", None)
            return self.node("Clip", [x, None if lo is None else self.const(lo), None if hi is None else self.const(hi)])
        return self.node(spec["op"], [x], attrs)


def emit(view: LayerView, opset: int) -> onnx.ModelProto:
    e = _Emitter(view)
    xs = e.layer_inputs()
    a = view.attrs
    if view.op_type == "Conv":
        y = e.node("Conv", xs[:3], a)
        if len(xs) > 3 and xs[3]:
            y = e.node("Add", [y, xs[3]])
        y = e.activation(y, a.get("activation"))
    elif view.op_type in ("Gemm", "MatMul"):
        y = e.node(view.op_type, xs[:3] if view.op_type == "Gemm" else xs[:2], a)
        if view.op_type == "MatMul" and len(xs) > 2 and xs[2]:
            y = e.node("Add", [y, xs[2]])
        y = e.activation(y, a.get("activation"))
    elif view.op_type == "PointWise":
        y = _emit_program(e, xs, a["program"])
    elif view.op_type == "Shuffle":
        y = xs[0]
        for step in a["steps"]:
            y = e.node("Transpose", [y], {"perm": step["transpose"]}) if "transpose" in step else \
                e.node("Reshape", [y, e.const(step["reshape"], np.int64)])
    elif view.op_type in POOLS and all(d == 1 for d in a.get("dilations") or [1]):
        y = e.node(view.op_type, xs, {k: v for k, v in a.items() if k != "dilations"})
    else:
        y = e.node(view.op_type, xs, a)
    out_type = ONNX_ELEM[np.dtype(view.output_dtypes[0])]
    graph = helper.make_graph(e.nodes, "kiln_layer", e.inputs, [helper.make_tensor_value_info(y, out_type, None)],
                              e.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _emit_program(e: _Emitter, xs: list[str | None], steps: list[dict]) -> str:
    temps: list[str] = []
    for step in steps:
        host = lookup(step["op"]).host_inputs
        args = []
        for i, arg in enumerate(step["args"]):
            if arg is None:
                args.append(None)
            elif isinstance(arg, dict):
                dtype = np.int64 if i in host and step["op"] not in ("Clip",) else np.float32
                args.append(e.const(arg["const"], dtype))
            elif arg[0] == "x":
                args.append(xs[int(arg[1:])])
            else:
                args.append(temps[int(arg[1:])])
        temps.append(e.node(step["op"], args, step.get("attrs", {})))
    return temps[-1]


def supports(view: LayerView) -> bool:
    if view.op_type == "AveragePool" and view.opset < 19 and any(d != 1 for d in view.attrs.get("dilations") or [1]):
        return False
    return view.domain in ("", "ai.onnx") or (view.domain == "kiln" and view.op_type in ("PointWise", "Shuffle"))
