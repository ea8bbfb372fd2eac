"""Models stored in float16/bfloat16 (exported for GPUs, Optimum's O4, `convert_float_to_float16`) built as TensorRT
builds a weakly typed network: the model's reduced float types are storage, not a precision request. Weights,
Casts, constants and internal types are widened to float32 before import, so every layer is FP32 unless `--fp16`/
`--bf16`/`--best` allow a reduced precision, which the precision stage then grants per layer where kiln has a
kernel (and the accuracy budget judges against the FP32 model). Inputs and outputs keep the model's types: a Cast
after each reduced input and before each reduced output. `--strongly-typed` (trtexec's `--stronglyTyped`) skips
this and computes in the model's own types, on the reference kernels where kiln has no FP16 one (float16 models
only: a bfloat16 one builds weakly typed only)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

REDUCED = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}
DTYPE_ATTRS = {"EyeLike": "dtype", "RandomNormal": "dtype", "RandomUniform": "dtype", "RandomNormalLike": "dtype",
               "RandomUniformLike": "dtype", "Bernoulli": "dtype", "Cast": "to"}
TENSOR_ATTRS = {"Constant": "value", "ConstantOfShape": "value"}


@dataclass(frozen=True)
class Widening:
    """What widening changed: the reduced types found, and how many of each thing was rewritten."""

    types: tuple[str, ...] = ()   # the model's reduced float types, e.g. ("float16",)
    weights: int = 0              # initializers and constant tensors
    casts: int = 0                # Cast / dtype attributes retargeted to float32
    inputs: int = 0               # graph inputs read through a Cast to float32
    outputs: int = 0              # graph outputs written through a Cast from float32

    @property
    def changed(self) -> bool:
        return bool(self.types)

    def summary(self) -> str:
        return (f"{self.weights} weight(s)/constant(s) and {self.casts} Cast(s) widened to float32, "
                f"{self.inputs} input(s) and {self.outputs} output(s) keep the model's type")


def widen_reduced_floats(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, Widening]:
    """A copy of `proto` computing in float32 where it stored float16/bfloat16 (`proto` itself when it has none)."""
    if not _has_reduced(proto):
        return proto, Widening()
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    if model.functions:
        from onnx import inliner

        model = inliner.inline_local_functions(model)
    counts = _Counts()
    _widen_body(model.graph, counts, keep={o.name for o in model.graph.output})
    inputs = _cast_reduced_inputs(model.graph, counts)
    outputs = _cast_reduced_outputs(model.graph, counts)
    return model, Widening(tuple(sorted(counts.types)), counts.weights, counts.casts, inputs, outputs)


class _Counts:
    def __init__(self):
        self.types: set[str] = set()
        self.weights = 0
        self.casts = 0


def bfloat16_io(proto: onnx.ModelProto) -> bool:
    """Whether a graph input or output is bfloat16 (onnxruntime's Python API takes and gives no such arrays)."""
    return any(v.type.tensor_type.elem_type == TensorProto.BFLOAT16 for v in (*proto.graph.input, *proto.graph.output))


def stores_bfloat16(proto: onnx.ModelProto) -> bool:
    """Whether the model holds bfloat16 anywhere (a scan: nothing is converted)."""
    return _has_reduced(proto, (TensorProto.BFLOAT16,))


def _has_reduced(proto: onnx.ModelProto, kinds=tuple(REDUCED)) -> bool:
    graphs = [proto.graph, *(_subgraphs(proto.graph))]
    for g in graphs:
        if any(t.data_type in kinds for t in g.initializer):
            return True
        values = [*g.input, *g.output, *g.value_info]
        if any(v.type.tensor_type.elem_type in kinds for v in values):
            return True
        if any(_node_reduced(n, kinds) for n in g.node):
            return True
    return any(_node_reduced(n, kinds) for f in proto.functions for n in f.node)


def _node_reduced(node: onnx.NodeProto, kinds=tuple(REDUCED)) -> bool:
    for a in node.attribute:
        if a.name == DTYPE_ATTRS.get(node.op_type) and a.i in kinds:
            return True
        if a.name == TENSOR_ATTRS.get(node.op_type) and a.t.data_type in kinds:
            return True
    return False


def _attribute_graphs(a: onnx.AttributeProto) -> list[onnx.GraphProto]:
    return [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)


def _subgraphs(g: onnx.GraphProto):
    for node in g.node:
        for a in node.attribute:
            for sub in _attribute_graphs(a):
                yield sub
                yield from _subgraphs(sub)


def _widened(t: TensorProto, counts: _Counts) -> TensorProto:
    counts.types.add(REDUCED[t.data_type])
    counts.weights += 1
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)


def _widen_body(g: onnx.GraphProto, counts: _Counts, keep: frozenset[str] | set[str] = frozenset()) -> None:
    """Initializers, node attributes and value types of `g` and its subgraphs, in place (inputs/outputs of the
    main graph are handled by the caller, and a Cast writing one of them, `keep`, stays; a subgraph's are internal
    and widened here)."""
    for i, t in enumerate(g.initializer):
        if t.data_type in REDUCED:
            g.initializer[i].CopyFrom(_widened(t, counts))
    for node in g.node:
        for a in node.attribute:
            if a.name == DTYPE_ATTRS.get(node.op_type) and a.i in REDUCED and not set(node.output) & keep:
                counts.types.add(REDUCED[a.i])
                counts.casts += 1
                a.i = TensorProto.FLOAT
            elif a.name == TENSOR_ATTRS.get(node.op_type) and a.t.data_type in REDUCED:
                a.t.CopyFrom(_widened(a.t, counts))
            else:
                for sub in _attribute_graphs(a):
                    _widen_sub(sub, counts)
    for v in g.value_info:
        _widen_type(v, counts)


def _widen_sub(g: onnx.GraphProto, counts: _Counts) -> None:
    _widen_body(g, counts)
    for v in [*g.input, *g.output]:
        _widen_type(v, counts)


def _widen_type(v: onnx.ValueInfoProto, counts: _Counts) -> None:
    tensor = v.type.tensor_type
    if tensor.elem_type in REDUCED:
        counts.types.add(REDUCED[tensor.elem_type])
        tensor.elem_type = TensorProto.FLOAT


def _cast_reduced_inputs(g: onnx.GraphProto, counts: _Counts) -> int:
    """Each float16/bfloat16 graph input read by a node other than a Cast is read through a Cast to float32 (its
    consumers renamed)."""
    names = {i.name for i in g.initializer}
    reduced = [v for v in g.input if v.type.tensor_type.elem_type in REDUCED and v.name not in names]
    count = 0
    for v in reduced:
        if all(n.op_type == "Cast" for n in g.node if v.name in n.input) and not _read_in_subgraph(g, v.name):
            continue
        counts.types.add(REDUCED[v.type.tensor_type.elem_type])
        wide = _fresh(g, f"{v.name}_fp32")
        _rename_uses(g, v.name, wide)
        g.node.insert(0, helper.make_node("Cast", [v.name], [wide], name=f"{v.name} to FP32", to=TensorProto.FLOAT))
        count += 1
    return count


def _cast_reduced_outputs(g: onnx.GraphProto, counts: _Counts) -> int:
    """Each float16/bfloat16 graph output a node other than a Cast to its type produces is written through a Cast
    from float32."""
    producers = {o: n for n in g.node for o in n.output}
    inputs = {v.name for v in g.input}
    count = 0
    for out in g.output:
        elem, node = out.type.tensor_type.elem_type, producers.get(out.name)
        if elem not in REDUCED or node is None or out.name in inputs or \
                (node.op_type == "Cast" and any(a.name == "to" and a.i == elem for a in node.attribute)):
            continue
        counts.types.add(REDUCED[elem])
        wide = _fresh(g, f"{out.name}_fp32")
        _rename_uses(g, out.name, wide, outputs_too=True)
        g.node.append(helper.make_node("Cast", [wide], [out.name], name=f"{out.name} to {REDUCED[elem]}", to=elem))
        count += 1
    return count


def _fresh(g: onnx.GraphProto, base: str) -> str:
    taken = {v.name for v in [*g.input, *g.output, *g.value_info]} | {t.name for t in g.initializer} | \
        {o for n in g.node for o in n.output}
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    return name


def _read_in_subgraph(g: onnx.GraphProto, name: str) -> bool:
    """Whether a node inside one of `g`'s subgraphs (If/Loop/Scan bodies, which read outer values by name) reads
    `name`."""
    for node in g.node:
        for a in node.attribute:
            for sub in _attribute_graphs(a):
                if any(name in n.input for n in sub.node) or _read_in_subgraph(sub, name):
                    return True
    return False


def _rename_uses(g: onnx.GraphProto, old: str, new: str, outputs_too: bool = False) -> None:
    """Rename `old` to `new` where nodes read it (and, with outputs_too, where a node writes it); subgraphs read
    outer values by name, so they are renamed too."""
    for node in g.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        if outputs_too:
            for i, name in enumerate(node.output):
                if name == old:
                    node.output[i] = new
        for a in node.attribute:
            for sub in _attribute_graphs(a):
                _rename_uses(sub, old, new)
    for v in g.value_info:
        if v.name == old:
            v.name = new
