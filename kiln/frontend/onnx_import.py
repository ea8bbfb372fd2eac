"""ONNX import: a ModelProto (or file) becomes a kiln Graph with every value's shape and dtype known."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from kiln.errors import ModelError, UnsupportedOpError
from kiln.frontend.shape_inference import infer_shapes
from kiln.ir import Graph, Node
from kiln.ops import lookup
from kiln.ops.dtypes import onnx_to_numpy

log = logging.getLogger("kiln")

MIN_OPSET, UPGRADE_FROM, MAX_OPSET = 13, 7, 23


def load_model(model: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """Read and structurally check an ONNX model; errors name the file and what is wrong."""
    if isinstance(model, onnx.ModelProto):
        return model
    path = Path(model)
    if not path.is_file():
        raise ModelError(f"{path}: no such ONNX file")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError and others
        raise ModelError(f"{path}: not a valid ONNX model ({type(exc).__name__}: {exc})") from None
    _load_external_data(proto, path.parent)
    return proto


def _load_external_data(proto: onnx.ModelProto, base: Path) -> None:
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    root = base.resolve()
    for tensor in _get_all_tensors(proto):
        if not uses_external_data(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        target = (root / location).resolve()
        if os.path.isabs(location) or (root not in target.parents and target != root):
            raise ModelError(f"initializer '{tensor.name}': external data path '{location}' escapes the model's "
                             f"folder {root}; refusing to read it")
        if not target.is_file():
            raise ModelError(f"initializer '{tensor.name}': external data file '{location}' is missing (looked in {root})")
    try:
        onnx.load_external_data_for_model(proto, str(root))
    except Exception as exc:
        raise ModelError(f"cannot load external data from {root}: {exc}") from None


def model_opset(proto: onnx.ModelProto) -> int:
    for imp in proto.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    raise ModelError("model imports no default-domain (ai.onnx) opset")


def _normalize_opset(proto: onnx.ModelProto) -> onnx.ModelProto:
    opset = model_opset(proto)
    if opset > MAX_OPSET:
        raise ModelError(f"model opset {opset} is newer than kiln supports ({MIN_OPSET}-{MAX_OPSET}); "
                         f"re-export with opset_version<={MAX_OPSET}")
    if opset < MIN_OPSET:
        if opset < UPGRADE_FROM:
            raise ModelError(f"model opset {opset} is too old (kiln supports {MIN_OPSET}-{MAX_OPSET}, upgrades from "
                             f"{UPGRADE_FROM}); re-export with a newer opset")
        from onnx import version_converter

        try:
            proto = version_converter.convert_version(proto, MIN_OPSET)
        except Exception as exc:
            raise ModelError(f"cannot upgrade opset {opset} to {MIN_OPSET}: {exc}") from None
        log.info("Upgraded model from opset %d to %d", opset, MIN_OPSET)
    if proto.functions:
        from onnx import inliner

        proto = inliner.inline_local_functions(proto)
    return proto


def attr_value(attr: onnx.AttributeProto) -> Any:
    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, list):
        return [v.decode() if isinstance(v, bytes) else v for v in value]
    return value


def check_supported(proto: onnx.ModelProto, opset: int) -> None:
    """Fail on the first node kiln cannot build, naming node, op type, domain and opset."""
    for i, node in enumerate(proto.graph.node):
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            continue
        if lookup(node.op_type, node.domain) is None:
            name = node.name or f"(Unnamed Layer* {i}) [{node.op_type}]"
            dom_opset = next((imp.version for imp in proto.opset_import if imp.domain == node.domain), opset)
            raise UnsupportedOpError(name, node.op_type, node.domain, dom_opset)


def import_onnx(model: str | os.PathLike | onnx.ModelProto,
                input_shapes: dict[str, tuple[int, ...]] | None = None) -> Graph:
    """Build a kiln Graph from ONNX. Dynamic input dims take `input_shapes` or default to 1 (with a warning)."""
    proto = _normalize_opset(load_model(model))
    opset = model_opset(proto)
    check_supported(proto, opset)
    g = Graph(proto.graph.name or "model", opset)
    _import_initializers(g, proto)
    _import_inputs(g, proto, input_shapes or {})
    _import_nodes(g, proto)
    for out in proto.graph.output:
        if out.name not in g.values:
            raise ModelError(f"graph output '{out.name}' is not produced by any node")
        g.outputs.append(g.values[out.name])
    g.toposort()
    infer_shapes(g)
    g.verify()
    return g


def _import_initializers(g: Graph, proto: onnx.ModelProto) -> None:
    for init in proto.graph.initializer:
        try:
            arr = numpy_helper.to_array(init)
        except Exception as exc:
            raise ModelError(f"initializer '{init.name}' cannot be read: {exc}") from None
        onnx_to_numpy(init.data_type, f"initializer '{init.name}'")
        g.add_const(init.name, arr)


def _import_inputs(g: Graph, proto: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> None:
    known = {i.name for i in proto.graph.initializer}
    unknown = set(shapes) - {i.name for i in proto.graph.input}
    if unknown:
        raise ModelError(f"shape given for unknown input(s) {sorted(unknown)}; "
                         f"model inputs are {[i.name for i in proto.graph.input if i.name not in known]}")
    for inp in proto.graph.input:
        if inp.name in known:
            continue
        ttype = inp.type.tensor_type
        dtype = onnx_to_numpy(ttype.elem_type, f"input '{inp.name}'")
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in ttype.shape.dim]
        if inp.name in shapes:
            given = tuple(int(d) for d in shapes[inp.name])
            if len(given) != len(dims) or any(d not in (-1, s) for d, s in zip(dims, given)):
                raise ModelError(f"input '{inp.name}': shape {list(given)} does not match the model's {dims}")
            dims = list(given)
        elif -1 in dims:
            fixed = [1 if d == -1 else d for d in dims]
            log.warning("Dynamic dimensions required for input: %s, but no shapes were provided. "
                        "Automatically overriding shape to: %s", inp.name, "x".join(map(str, fixed)))
            dims = fixed
        if any(d <= 0 for d in dims):
            raise ModelError(f"input '{inp.name}': dimension sizes must be positive, got {dims}")
        v = g.value(inp.name)
        v.shape, v.dtype = tuple(dims), dtype
        g.inputs.append(v)


def _import_nodes(g: Graph, proto: onnx.ModelProto) -> None:
    used_names: set[str] = set()
    produced: set[str] = {v.name for v in g.inputs} | {n for n, v in g.values.items() if v.is_const}
    for i, pnode in enumerate(proto.graph.node):
        name = pnode.name or f"(Unnamed Layer* {i}) [{pnode.op_type}]"
        if name in used_names:
            name = f"{name}_{i}"
        used_names.add(name)
        attrs = {a.name: attr_value(a) for a in pnode.attribute}
        for out in pnode.output:
            if out and out in produced:
                raise ModelError(f"node '{name}' ({pnode.op_type}) writes '{out}', which is already defined; "
                                 "ONNX values must have exactly one producer")
            produced.add(out)
        if pnode.op_type == "Constant":
            g.add_const(pnode.output[0], _constant_value(name, attrs))
            continue
        inputs = [g.value(x) if x else None for x in pnode.input]
        outputs = [g.value(x) for x in pnode.output if x]
        g.add_node(Node(name, pnode.op_type, inputs, outputs, attrs, pnode.domain, (name,)))


def _constant_value(name: str, attrs: dict[str, Any]) -> np.ndarray:
    if "value" in attrs:
        return np.asarray(attrs["value"])
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    raise ModelError(f"Constant node '{name}' has no supported value attribute ({sorted(attrs)})")
