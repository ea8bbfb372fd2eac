"""Express kiln layers (fused or not) as ONNX, one layer or a whole region per model, for external libraries."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kiln.ops import lookup
from kiln.ops.fused import PRODUCT_STEPS, QUANTIZED_BASE, without_steps
from kiln.tactics.base import LayerView

KILN_ONLY_ATTRS = {"activation", "padding_mode"}
POOLS = ("MaxPool", "AveragePool")
EXTERNAL_MIN_BYTES = 4096   # larger weights reach onnxruntime as external initializers: no protobuf copy
ONNX_ELEM = {np.dtype(k): v for k, v in {"float32": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "int32": 6,
                                         "int64": 7, "bool": 9, "float16": 10, "float64": 11}.items()}


def _attr(v: Any) -> Any:
    """ONNX TENSOR attributes were imported as arrays (ConstantOfShape's value): emit them as tensors again."""
    if isinstance(v, np.ndarray):
        return numpy_helper.from_array(v)
    return v.tolist() if hasattr(v, "tolist") else v


class Emitter:
    """Accumulates nodes, initializers and graph inputs of one ONNX graph."""

    def __init__(self, opset: int):
        self.opset = opset   # every node is written in this opset's form; kiln's newer ops are decomposed
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.known: set[str] = set()
        self.external: dict[str, np.ndarray] = {}
        self.weight_values: dict[str, np.ndarray] = {}   # weights by name, for forms that re-encode them
        self.counter = 0
        self.prefix = ""   # node names "<kiln layer>|<n>": profiles map onnxruntime nodes back to layers

    def fresh(self, base: str = "t") -> str:
        self.counter += 1
        return f"_{base}{self.counter}"

    def const(self, value: Any, dtype=np.float32) -> str:
        name = self.fresh("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def add_weight(self, name: str, array: np.ndarray) -> str:
        if name in self.known:
            return name
        self.known.add(name)
        array = np.ascontiguousarray(array).reshape(array.shape)
        self.weight_values[name] = array
        if array.nbytes < EXTERNAL_MIN_BYTES or array.dtype not in ONNX_ELEM:
            self.inits.append(numpy_helper.from_array(array, name))
            return name
        t = onnx.TensorProto(name=name, data_type=ONNX_ELEM[array.dtype], dims=list(array.shape),
                             data_location=onnx.TensorProto.EXTERNAL)
        entry = t.external_data.add()
        entry.key, entry.value = "location", "kiln-weights"
        self.inits.append(t)
        self.external[name] = array
        return name

    def add_input(self, name: str, shape, dtype: str) -> str:
        if name not in self.known:
            self.known.add(name)
            dims = [f"d{i}" if d < 0 else d for i, d in enumerate(shape)]   # -1: a dynamic axis
            self.inputs.append(helper.make_tensor_value_info(name, ONNX_ELEM[np.dtype(dtype)], dims))
        return name

    def add_output(self, name: str, dtype: str) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, ONNX_ELEM[np.dtype(dtype)], None))

    def node(self, op: str, inputs: list[str | None], attrs: dict[str, Any] | None = None, n_outputs: int = 1,
             domain: str = ""):
        if op == "Gelu" and not domain and self.opset < 20:
            return self.gelu(inputs[0], (attrs or {}).get("approximate", "none"))
        outs = [self.fresh() for _ in range(n_outputs)]
        clean = {k: _attr(v) for k, v in (attrs or {}).items() if k not in KILN_ONLY_ATTRS and not k.startswith("_")}
        name = f"{self.prefix}|{self.counter}" if self.prefix else None
        self.nodes.append(helper.make_node(op, [x or "" for x in inputs], outs, name=name, domain=domain or None,
                                           **clean))
        return outs[0] if n_outputs == 1 else outs

    def gelu(self, x: str, approximate: str) -> str:
        """Gelu (opset 20) for an older opset: the erf form, or the tanh form it approximates."""
        if approximate == "tanh":
            cube = self.node("Mul", [self.node("Mul", [x, x]), x])
            inner = self.node("Add", [x, self.node("Mul", [cube, self.const(0.044715)])])
            gate = self.node("Tanh", [self.node("Mul", [inner, self.const(np.sqrt(2.0 / np.pi))])])
        else:
            gate = self.node("Erf", [self.node("Div", [x, self.const(np.sqrt(2.0))])])
        return self.node("Mul", [self.node("Mul", [x, self.const(0.5)]), self.node("Add", [gate, self.const(1.0)])])

    def layer_norm(self, xs: list[str | None], attrs: dict[str, Any], rank: int) -> str:
        """LayerNormalization (opset 17), one output; for an older opset, as the ReduceMean graph it came from."""
        if self.opset >= 17:
            return self.node("LayerNormalization", xs, attrs)
        axis = attrs.get("axis", -1)
        axes = list(range(axis if axis < 0 else axis - rank, 0))
        centred = self.node("Sub", [xs[0], self.node("ReduceMean", [xs[0]], {"axes": axes})])
        var = self.node("ReduceMean", [self.node("Mul", [centred, centred])], {"axes": axes})
        std = self.node("Sqrt", [self.node("Add", [var, self.const(attrs.get("epsilon", 1e-5))])])
        y = self.node("Mul", [self.node("Div", [centred, std]), xs[1]])
        return self.node("Add", [y, xs[2]]) if len(xs) > 2 and xs[2] else y

    def rms_norm(self, xs: list[str | None], attrs: dict[str, Any], rank: int) -> str:
        """RMSNormalization (opset 23); for an older opset, as the ReduceMean graph it came from."""
        if self.opset >= 23:
            return self.node("RMSNormalization", xs[:2], attrs)
        axis = attrs.get("axis", -1)
        axes = list(range(axis if axis < 0 else axis - rank, 0))
        square = self.node("Mul", [xs[0], xs[0]])
        mean = self.node("ReduceMean", [square, self.const(np.array(axes), np.int64)]) if self.opset >= 18 else \
            self.node("ReduceMean", [square], {"axes": axes})
        rms = self.node("Sqrt", [self.node("Add", [mean, self.const(attrs.get("epsilon", 1e-5))])])
        return self.node("Mul", [self.node("Div", [xs[0], rms]), xs[1]])

    def group_norm(self, xs: list[str | None], attrs: dict[str, Any], shapes: list) -> str:
        """Group/InstanceNormalization and its fused activation. kiln's GroupNormFusion gives one scale and bias per
        channel, opset 21's form: for an older opset that is InstanceNormalization between Reshapes, then Mul, Add."""
        groups, channels = attrs.get("num_groups"), shapes[0][1]
        if groups is None or self.opset >= 21 or (self.opset >= 18 and int(np.prod(shapes[1])) == groups):
            y = self.node("GroupNormalization" if groups is not None else "InstanceNormalization", xs, attrs)
            return self.activation(y, attrs.get("activation"))
        grouped = self.node("Reshape", [xs[0], self.const([0, groups, -1], np.int64)])
        norm = self.node("InstanceNormalization", [grouped, self.const(np.ones(groups)), self.const(np.zeros(groups))],
                         {"epsilon": attrs.get("epsilon", 1e-5)})
        y = self.node("Reshape", [norm, self.node("Shape", [xs[0]])])
        per_channel = self.const([channels] + [1] * (len(shapes[0]) - 2), np.int64)
        y = self.node("Mul", [y, self.node("Reshape", [xs[1], per_channel])])
        y = self.node("Add", [y, self.node("Reshape", [xs[2], per_channel])])
        return self.activation(y, attrs.get("activation"))

    def activation(self, x: str, spec: dict | None) -> str:
        if not spec:
            return x
        attrs = dict(spec.get("attrs", {}))
        if spec["op"] == "Swish":   # opset 24: written as Sigmoid and Mul, which every runtime knows
            alpha = float(attrs.get("alpha", 1.0))
            gate = x if alpha == 1.0 else self.node("Mul", [x, self.const(alpha)])
            return self.node("Mul", [x, self.node("Sigmoid", [gate])])
        if spec["op"] == "Clip":
            lo, hi = attrs.pop("min", None), attrs.pop("max", None)
            return self.node("Clip", [x, None if lo is None else self.const(lo), None if hi is None else self.const(hi)])
        return self.node(spec["op"], [x], attrs)

    def rename_result(self, result: str | list[str], name: str | list[str]) -> None:
        """Make the value(s) `result` (just produced) carry the public name(s) `name`."""
        if isinstance(result, list):
            for r, n in zip(result, name):
                self.rename_result(r, n)
            return
        last = self.nodes[-1].output if self.nodes else []
        if result in last:
            last[list(last).index(result)] = name
        else:
            self.nodes.append(helper.make_node("Identity", [result], [name]))

    def model(self, name: str = "kiln_layer") -> onnx.ModelProto:
        """The ONNX model; large weights are external: pass `self.external` to the session with them. Weights no
        node reads (a float bias re-encoded as int32) are left out: onnxruntime rejects unused external ones."""
        used = {x for n in self.nodes for x in n.input} | {o.name for o in self.outputs}
        inits = [t for t in self.inits if t.name in used]
        self.external = {k: v for k, v in self.external.items() if k in used}
        graph = helper.make_graph(self.nodes, name, self.inputs, self.outputs, inits)
        imports = [helper.make_opsetid("", self.opset)]
        if any(n.domain == "com.microsoft" for n in self.nodes):
            imports.append(helper.make_opsetid("com.microsoft", 1))
        model = helper.make_model(graph, opset_imports=imports)
        model.ir_version = 8
        return model


def emit_layer(e: Emitter, view: LayerView, xs: list[str | None]) -> str:
    """Append the nodes computing one layer whose inputs are the ONNX values `xs`; returns the result value."""
    a = view.attrs
    if view.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul"):
        y = e.node(view.op_type, xs[:2] if view.op_type == "MatMul" else xs[:3], a)
        if view.op_type == "MatMul" and len(xs) > 2 and xs[2]:
            y = e.node("Add", [y, xs[2]])
        if len(xs) > 3 and xs[3]:   # the fused residual, after the bias
            y = e.node("Add", [y, xs[3]])
        return e.activation(y, a.get("activation"))
    if view.op_type == "PointWise":
        return _emit_program(e, xs, a["program"])
    if view.op_type == "Shuffle":
        return _emit_steps(e, xs[0], a["steps"])
    if view.op_type == "Attention" and view.domain == "kiln":
        return _emit_attention(e, xs, a)
    if view.op_type == "RotaryEmbedding" and view.domain == "kiln":
        return _emit_rotary(e, xs, view.input_shapes[0][-1])
    if view.domain == "kiln" and view.op_type in QUANTIZED_BASE:
        return _emit_quantized(e, view, xs)
    if view.domain == "kiln" and view.op_type == "QAdd":
        return _emit_quantized_add(e, xs, a["quant"], a.get("activation"))
    if view.domain == "kiln" and view.op_type == "QLayerNorm":
        q, skip = a["quant"], a.get("skip_quant")
        x = _emit_quantized_add(e, xs[:2], skip, None) if skip else xs[0]
        norm = {k: a[k] for k in ("axis", "epsilon") if k in a}
        y = e.layer_norm([_qdq(e, "DequantizeLinear", x, q, "x")] + xs[2 if skip else 1:], norm,
                         len(view.input_shapes[0]))
        return _qdq(e, "QuantizeLinear", y, q, "y")
    if view.domain == "kiln" and view.op_type == "QConcat":   # kiln.passes.qconcat_table
        parts = [x if t is None else _emit_table(e, x, t) for x, t in zip(xs, a["in_tables"])]
        return e.node("Concat", parts, {"axis": a["axis"]})
    if view.domain == "kiln" and view.op_type == "QSoftmax":
        q = a["quant"]
        p = e.node("Softmax", [_qdq(e, "DequantizeLinear", xs[0], q, "x")], {"axis": a.get("axis", -1)})
        return _qdq(e, "QuantizeLinear", p, q, "y")
    if view.domain == "kiln" and view.op_type == "QAveragePool":   # kiln.passes.qpool
        q, pool = a["quant"], a["pool"]
        attrs = {k: v for k, v in a.items() if k not in ("pool", "quant")}
        y = e.node(pool, [_qdq(e, "DequantizeLinear", xs[0], q, "x"), *xs[1:]], attrs)
        return _qdq(e, "QuantizeLinear", y, q, "y")
    if view.domain == "kiln" and view.op_type == "QResize":   # kiln.passes.qpool
        q = a["quant"]
        y = e.node("Resize", [_qdq(e, "DequantizeLinear", xs[0], q, "x"), *xs[1:]],
                   {k: v for k, v in a.items() if k != "quant"})
        return _qdq(e, "QuantizeLinear", y, q, "y")
    if view.domain == "kiln" and view.op_type in ("DynamicQMatMul", "DynamicQConv"):
        return _emit_dynamic_quantized(e, view, xs)
    if view.op_type == "SkipLayerNormalization" and view.domain == "kiln":
        return e.layer_norm([e.node("Add", xs[:2])] + xs[2:], a, len(view.input_shapes[0]))
    if view.op_type == "LayerNormalization" and view.domain in ("", "ai.onnx") and len(view.output_dtypes) == 1:
        return e.layer_norm(xs, a, len(view.input_shapes[0]))
    if view.op_type == "RMSNormalization" and view.domain in ("", "ai.onnx"):
        return e.rms_norm(xs, a, len(view.input_shapes[0]))
    if view.op_type in ("GroupNormalization", "InstanceNormalization") and view.domain in ("", "ai.onnx"):
        return e.group_norm(xs, a, list(view.input_shapes))
    if view.op_type == "Swish" and view.domain in ("", "ai.onnx"):
        return e.activation(xs[0], {"op": "Swish", "attrs": a})
    if view.op_type in POOLS and all(d == 1 for d in a.get("dilations") or [1]):
        return e.node(view.op_type, xs, {k: v for k, v in a.items() if k != "dilations"})
    return e.node(view.op_type, xs, a, len(view.output_dtypes), view.domain if view.domain != "ai.onnx" else "")


def _emit_steps(e: Emitter, y: str, steps: list[dict]) -> str:
    for step in steps:
        if "transpose" in step:
            y = e.node("Transpose", [y], {"perm": step["transpose"]})
        elif "reshape" in step:
            y = e.node("Reshape", [y, e.const(step["reshape"], np.int64)])
        else:
            axis, start, end = step["slice"]
            y = e.node("Slice", [y, e.const([start], np.int64), e.const([end], np.int64), e.const([axis], np.int64)])
    return y


def _qdq(e: Emitter, op: str, x: str, q: dict, prefix: str, dtype: str | None = None) -> str:
    """`op` (QuantizeLinear or DequantizeLinear) of `x` at quant `q`'s `prefix`_scale and `prefix`_zero_point, the
    zero point of type `dtype` (default: q's `prefix`_dtype)."""
    zero_point = e.const(q[f"{prefix}_zero_point"], np.dtype(dtype or q[f"{prefix}_dtype"]))
    return e.node(op, [x, e.const(q[f"{prefix}_scale"]), zero_point])


def _emit_quantized_add(e: Emitter, xs: list[str | None], q: dict, activation: dict | None) -> str:
    """kiln's QAdd: both INT8 inputs dequantized, added, the activation, quantized at the output scale."""
    parts = [_qdq(e, "DequantizeLinear", x, q, k) for x, k in zip(xs, "ab")]
    return _qdq(e, "QuantizeLinear", e.activation(e.node("Add", parts), activation), q, "y")


def _round_trip(e: Emitter, x: str, q: dict, prefix: str) -> str:
    """QuantizeLinear then DequantizeLinear at one scale: the INT8 rounding a model writes between two float steps."""
    return _qdq(e, "DequantizeLinear", _qdq(e, "QuantizeLinear", x, q, prefix), q, prefix)


def _without_activation(view: LayerView) -> LayerView:
    return dataclasses.replace(view, attrs={k: v for k, v in view.attrs.items() if k != "activation"})


def _emit_quantized(e: Emitter, view: LayerView, xs: list[str | None]) -> str:
    """An INT8 layer as the Q/DQ graph it came from: DQ(x) -> op(DQ(W)) -> [Q] (onnxruntime fuses it again); a
    product of two activations with its operands' and result's steps (kiln.passes.qmatmul_steps) around it; an
    output table (kiln.passes.qproduct_table) as a Gather of its bytes."""
    steps = [view.attrs.get(key) or [] for key in PRODUCT_STEPS]
    table = view.attrs.get("out_table")
    view = dataclasses.replace(view, attrs={k: v for k, v in without_steps(view.attrs).items() if k != "out_table"})
    operands = [_emit_steps(e, x, s) for x, s in zip(xs[:2], steps)]
    y = _emit_steps(e, _emit_quantized_product(e, view, operands + list(xs[2:])), steps[2])
    return y if table is None else _emit_table(e, y, table)


def _emit_table(e: Emitter, x: str, table: dict) -> str:
    """An INT8 tensor's bytes mapped through a 256-entry table as a Gather of the table's bytes."""
    index = e.node("Cast", [x], {"to": onnx.TensorProto.INT32})   # an s8 byte < 0 reads from the end: its raw byte
    entries = np.array(table["bytes"], np.uint8).view(table["dtype"])
    return e.node("Gather", [e.const(entries, table["dtype"]), index])


def _emit_quantized_product(e: Emitter, view: LayerView, xs: list[str | None]) -> str:
    q = view.attrs["quant"]
    x = _qdq(e, "DequantizeLinear", xs[0], q, "x")
    w_scale, w_zp = np.array(q["w_scale"], np.float32), np.array(q["w_zero_point"])
    w_type = np.dtype(view.input_dtypes[1]) if view.input_dtypes[1] else np.dtype(np.int8)
    scalar = w_scale.size == 1
    w = e.node("DequantizeLinear", [xs[1], e.const(w_scale[0] if scalar else w_scale),
                                    e.const(w_zp[0] if scalar else w_zp, w_type)], {} if scalar else {"axis": q["w_axis"]})
    base = dataclasses.replace(view, op_type=QUANTIZED_BASE[view.op_type], domain="",
                               attrs={k: v for k, v in view.attrs.items() if k != "quant"})
    rest = list(xs[2:])
    if rest and rest[0] and "mid_scale" not in q:
        rest[0] = _quantized_bias(e, rest[0], np.float32(q["x_scale"]) * w_scale)
    if len(rest) > 1 and rest[1] and "r_scale" in q:   # the fused INT8 residual: summed dequantized
        rest[1] = _qdq(e, "DequantizeLinear", rest[1], q, "r", view.input_dtypes[3] or q["y_dtype"])
        if "sum_input_scale" in q:   # the convolution's own Q -> DQ before the sum, as the model had it
            return _emit_quantized_sum(e, base, [x, w] + rest, q)
    if "mid_scale" in q:
        y = _emit_rounded_before_bias(e, base, [x, w] + rest, q)
    else:
        y = emit_layer(e, base, [x, w] + rest)
    return _qdq(e, "QuantizeLinear", y, q, "y") if "y_scale" in q else y


def _emit_dynamic_quantized(e: Emitter, view: LayerView, xs: list[str | None]) -> str:
    """A DynamicQMatMul or DynamicQConv as quantize_dynamic wrote it (onnxruntime fuses the product's again into
    DynamicQuantizeMatMul): DynamicQuantizeLinear -> MatMulInteger or ConvInteger -> Cast -> Mul(x_scale * W_scale)
    [-> Add(bias)] [-> Add(residual)] [-> activation]."""
    q, conv = view.attrs["quant"], view.op_type == "DynamicQConv"
    x_u8, x_scale, x_zp = e.node("DynamicQuantizeLinear", [xs[0]], n_outputs=3)
    w_type = np.dtype(view.input_dtypes[1]) if view.input_dtypes[1] else np.dtype(np.int8)
    w_zp = np.array(q["w_zero_point"])
    w_zp = e.const(w_zp if np.any(w_zp != w_zp[0]) else w_zp[0], w_type)
    channel = (-1,) + (1,) * (len(view.input_shapes[0]) - 2) if conv else (-1,)   # the output's channel axis
    if conv:
        attrs = {k: v for k, v in view.attrs.items() if k != "quant"}
        y = e.node("ConvInteger", [x_u8, xs[1], x_zp, w_zp], attrs)
    else:
        y = e.node("MatMulInteger", [x_u8, xs[1], x_zp, w_zp])
    w_scale = e.const(np.array(q["w_scale"], np.float32).reshape(channel))
    y = e.node("Mul", [e.node("Cast", [y], {"to": onnx.TensorProto.FLOAT}), e.node("Mul", [x_scale, w_scale])])
    if len(xs) > 2 and xs[2]:
        y = e.node("Add", [y, e.node("Reshape", [xs[2], e.const(list(channel), np.int64)]) if conv else xs[2]])
    if len(xs) > 3 and xs[3]:
        y = e.node("Add", [y, xs[3]])
    return e.activation(y, view.attrs.get("activation"))


def _emit_quantized_sum(e: Emitter, base: LayerView, xs: list[str | None], q: dict) -> str:
    """A convolution with a fused INT8 residual as quantize_static wrote it: Conv -> Q -> DQ, + DQ(residual),
    activation, Q. onnxruntime fuses that into QLinearConv and QLinearAdd; summed in FP32 instead, it ran the
    convolution in FP32 between layout transposes (ResNet-50: 16 such layers, 36 Transposes)."""
    y = _round_trip(e, emit_layer(e, _without_activation(base), xs[:3]), q, "sum_input")
    y = e.activation(e.node("Add", [y, xs[3]]), base.attrs.get("activation"))
    return _qdq(e, "QuantizeLinear", y, q, "y")


def _emit_rounded_before_bias(e: Emitter, base: LayerView, xs: list[str | None], q: dict) -> str:
    """A product rounded to INT8 before its bias, as quantize_static writes a MatMul and its bias Add: product ->
    Q -> DQ at the mid scale, + the FP32 bias (per output channel), + residual, activation (the caller adds the
    output's Q). onnxruntime fuses the product into QLinearMatMul/QLinearConv again."""
    y = _round_trip(e, emit_layer(e, _without_activation(base), xs[:2]), q, "mid")
    bias, residual = (list(xs[2:]) + [None, None])[:2]
    if bias:
        channel = [-1] + [1] * (len(base.input_shapes[0]) - 2) if base.op_type == "Conv" else [-1]
        y = e.node("Add", [y, e.node("Reshape", [bias, e.const(channel, np.int64)])])
    if residual:
        y = e.node("Add", [y, residual])
    return e.activation(y, base.attrs.get("activation"))


def _quantized_bias(e: Emitter, name: str, scale: np.ndarray) -> str:
    """A float bias as onnxruntime's quantize_static writes it: int32 at x_scale * w_scale (zero point 0) through
    a DequantizeLinear. Its QDQ fusions (QLinearConv, QGemm) need that form; given a float bias onnxruntime ran
    ResNet-50's convolutions in FP32 (a 24.6 ms region against 12.8 ms for the quantize_static file). A bias that
    came from such a DequantizeLinear (folded at import) gets its integers back exactly."""
    bias = e.weight_values.get(name)
    if bias is None or bias.dtype != np.float32 or bias.ndim != 1 or scale.size not in (1, bias.size) or \
            not np.all(scale > 0):
        return name
    scale = scale.astype(np.float32).reshape(-1)
    ints = np.round(bias / scale)
    if np.abs(ints).max(initial=0) >= 2 ** 31 - 1:
        return name
    per_channel = scale.size > 1
    return e.node("DequantizeLinear", [e.add_weight(f"{name}_int32", ints.astype(np.int32)),
                                       e.const(scale if per_channel else scale[0]),
                                       e.const(np.zeros(scale.size) if per_channel else 0, np.int32)],
                  {"axis": 0} if per_channel else {})


def _emit_attention(e: Emitter, xs: list[str | None], a: dict) -> str:
    """kiln's Attention as the plain ONNX ops it stands for (what an external library can run)."""
    q, kt, v = (_emit_steps(e, x, a.get(key, [])) for x, key in zip(xs, ("q_steps", "k_steps", "v_steps")))
    scores = e.node("Mul", [e.node("MatMul", [q, kt]), e.const(a["scale"])])
    if len(xs) > 3 and xs[3]:
        scores = e.node("Add", [scores, xs[3]])
    probs = e.node("Softmax", [scores], {"axis": -1})
    if a.get("nan_to_zero"):
        probs = e.node("Where", [e.node("IsNaN", [probs]), e.const(0.0), probs])
    out = e.node("MatMul", [probs, v])
    return _emit_steps(e, out, a.get("out_steps", []))


def _emit_rotary(e: Emitter, xs: list[str | None], d: int) -> str:
    """x * cos + Concat(-x[..., d/2:], x[..., :d/2]) * sin, as HF's rotate_half exports it."""
    x, cos, sin = xs
    last = e.const([-1], np.int64)
    first = e.node("Slice", [x, e.const([0], np.int64), e.const([d // 2], np.int64), last])
    second = e.node("Slice", [x, e.const([d // 2], np.int64), e.const([d], np.int64), last])
    rotated = e.node("Concat", [e.node("Neg", [second]), first], {"axis": -1})
    return e.node("Add", [e.node("Mul", [x, cos]), e.node("Mul", [rotated, sin])])


KILN_EMITTABLE = ("PointWise", "Shuffle", "Attention", "SkipLayerNormalization", "RotaryEmbedding", "QAdd", "QSoftmax",
                  "QLayerNorm", "QConcat", "QAveragePool", "QResize", "DynamicQMatMul", "DynamicQConv",
                  *QUANTIZED_BASE)


def emit(view: LayerView, opset: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One layer as a model: activations are inputs "x<i>", weights initializers "w<i>", one output."""
    e = Emitter(opset)
    xs: list[str | None] = []
    for i in range(len(view.input_shapes)):
        shape = view.input_spec(i)
        if shape is None:
            xs.append(None)
        elif i in view.const_inputs:
            xs.append(e.add_weight(f"w{i}", view.const_inputs[i].numpy()))
        else:
            xs.append(e.add_input(f"x{i}", shape, view.input_dtypes[i]))
    y = emit_layer(e, view, xs)
    e.rename_result(y, "y")
    e.add_output("y", view.output_dtypes[0])
    return e.model(), e.external


def _emit_program(e: Emitter, xs: list[str | None], steps: list[dict]) -> str:
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
        if step["op"] == "Swish":
            temps.append(e.activation(args[0], {"op": "Swish", "attrs": step.get("attrs", {})}))
            continue
        temps.append(e.node(step["op"], args, step.get("attrs", {})))
    return temps[-1]


def supports(view: LayerView) -> bool:
    """Whether onnxruntime and OpenVINO can be handed this layer: ONNX ops of their domains, no bfloat16 tensor
    (a bfloat16 model's boundary Casts: kiln feeds them numpy arrays, which have no bfloat16 of their own)."""
    if "bfloat16" in (*view.input_dtypes, *view.output_dtypes):
        return False
    if view.op_type == "AveragePool" and view.opset < 19 and any(d != 1 for d in view.attrs.get("dilations") or [1]):
        return False
    return view.domain in ("", "ai.onnx", "com.microsoft") or (view.domain == "kiln" and view.op_type in KILN_EMITTABLE)


def emit_region(inputs: list[tuple[str, tuple[int, ...], str]], steps: list[tuple[LayerView, list, str]],
                outputs: list[tuple[str, str]], weights: dict[str, np.ndarray],
                opset: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Several layers as one model. Each step: (view, args as ("tensor"|"weight", name) or None, output name(s))."""
    e = Emitter(opset)
    for name, shape, dtype in inputs:
        e.add_input(name, shape, dtype)
    for step in steps:
        view, args, out = step[:3]
        e.prefix = step[3] if len(step) > 3 else ""
        xs = [None if a is None else (e.add_weight(a[1], weights[a[1]]) if a[0] == "weight" else a[1]) for a in args]
        e.rename_result(emit_layer(e, view, xs), out)
    for name, dtype in outputs:
        e.add_output(name, dtype)
    return e.model("kiln_region"), e.external
