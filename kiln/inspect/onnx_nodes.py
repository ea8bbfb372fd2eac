"""The ONNX model's side of attribution by ONNX node: its node names in topological order (as kiln names them:
unnamed nodes are `(Unnamed Layer* i) [Op]`), which node produces each tensor, and each node's FLOPs estimated
from inferred shapes (2·MACs for convolutions and matrix products, one per output element for the rest, none for
shape-only ops)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import ArtifactError

# ops that only move or relabel data: they take no share of a fused layer's time when FLOPs split it
_SHAPE_ONLY = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout", "Shape", "Size",
                         "Constant", "ConstantOfShape"})
_MATMUL = frozenset({"MatMul", "MatMulInteger", "QLinearMatMul", "FusedMatMul"})
_CONV = frozenset({"Conv", "ConvInteger", "QLinearConv"})
_POOL = frozenset({"MaxPool", "AveragePool", "LpPool"})
# TensorRT's own suffixes on Q/DQ layer names: "QuantizeLinear_7_quantize_scale_node"
_TRT_SUFFIXES = ("_quantize_scale_node", "_dequantize_scale_node")


@dataclass(frozen=True)
class ModelNodes:
    order: tuple[str, ...]                       # node names, topological (the model's own order)
    op_types: dict[str, str]
    flops: dict[str, float | None]               # None where a shape needed is unknown
    producers: dict[str, str]                    # tensor name -> the node that writes it
    initializers: frozenset[str]

    def resolve(self, part: str) -> str | None:
        """A name TensorRT put in a layer name -> the model's node: the node itself, `node_of_<tensor>` or a
        tensor (the node that produces it), a Q/DQ scale node's base name; None for a weight or an unknown name."""
        if part in self.op_types:
            return part
        for suffix in _TRT_SUFFIXES:
            if part.endswith(suffix) and part[:-len(suffix)] in self.op_types:
                return part[:-len(suffix)]
        tensor = part.removeprefix("node_of_")
        return self.producers.get(tensor)


def node_name(node, index: int) -> str:
    return node.name or f"(Unnamed Layer* {index}) [{node.op_type}]"


def load_model_nodes(path: str) -> ModelNodes:
    """Read MODEL.onnx (its weights too, when external) and infer shapes for the FLOP estimates."""
    import onnx

    try:
        model = onnx.load(str(path))
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file; hint: pass the ONNX model the engines were built from") from None
    except Exception as exc:   # onnx raises DecodeError / ValueError / OSError for damaged files
        raise ArtifactError(f"{path}: not a readable ONNX model ({exc}); hint: pass the ONNX model the engines were "
                            "built from") from None
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:          # shapes stay unknown: FLOPs fall back to an even split
        pass
    return model_nodes(model, Path(path).name)


def model_nodes(model, where: str = "<model>") -> ModelNodes:
    graph = model.graph
    shapes = _shapes(graph)
    order, op_types, flops, producers = [], {}, {}, {}
    for i, node in enumerate(graph.node):
        name = node_name(node, i)
        order.append(name)
        op_types[name] = node.op_type
        flops[name] = node_flops(node, shapes)
        for out in node.output:
            if out:
                producers[out] = name
    return ModelNodes(tuple(order), op_types, flops, producers, frozenset(t.name for t in graph.initializer))


def _shapes(graph) -> dict[str, tuple[int, ...] | None]:
    """Tensor name -> static shape (symbolic dimensions read as 1), None when unknown."""
    out: dict[str, tuple[int, ...] | None] = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        t = vi.type.tensor_type
        if not t.HasField("shape"):
            out[vi.name] = None
            continue
        out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in t.shape.dim)
    for w in graph.initializer:
        out[w.name] = tuple(w.dims)
    return out


def _size(shape) -> int | None:
    return None if shape is None else math.prod(shape)


def node_flops(node, shapes: dict) -> float | None:
    """Estimated FLOPs of one node; None when a shape it needs is unknown."""
    op = node.op_type
    if op in _SHAPE_ONLY:
        return 0.0
    ins = [shapes.get(n) if n else None for n in node.input]
    out = shapes.get(node.output[0]) if node.output else None
    weight_at = 3 if op == "QLinearConv" else 1
    if op in _CONV or op == "ConvTranspose":
        w = ins[weight_at] if len(ins) > weight_at else None
        base = ins[0] if op == "ConvTranspose" else out
        return None if w is None or base is None else 2.0 * _size(base) * math.prod(w[1:])
    if op in _MATMUL or op == "Gemm":
        a = ins[0]
        if a is None or out is None or not a:
            return None
        trans_a = any(at.name == "transA" and at.i for at in node.attribute)
        k = a[0] if op == "Gemm" and trans_a else a[-1]
        return 2.0 * _size(out) * k
    if op in _POOL:
        kernel = next((list(at.ints) for at in node.attribute if at.name == "kernel_shape"), [1])
        return None if out is None else float(_size(out) * math.prod(kernel))
    if op.startswith("Global") or op.startswith("Reduce"):
        return None if not ins or ins[0] is None else float(_size(ins[0]))
    sizes = [_size(s) for s in [out] + ins[:1]]
    known = [s for s in sizes if s is not None]
    return float(max(known)) if known else None
