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
from kiln.frontend.contrib import UNFOLDED_KEY, unfold_contrib_ops
from kiln.frontend.profiles import Profile, opt_and_probe_shapes, resolve_profiles
from kiln.frontend.shape_inference import infer_shapes
from kiln.ir import Graph, Node
from kiln.ops import lookup
from kiln.ops.dtypes import FOUR_BIT_TO_NUMPY, onnx_to_numpy, widen_four_bit
from kiln.preprocess.fold import FOLDED_KEY

log = logging.getLogger("kiln")

MIN_OPSET, UPGRADE_FROM, MAX_OPSET = 13, 7, 25


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


def check_names(proto: onnx.ModelProto) -> None:
    """Every name is text (protobuf hands back bytes for strings that are not valid UTF-8)."""
    g = proto.graph
    named = [("graph input", v.name) for v in list(g.input) + list(g.output)] + \
        [("initializer", t.name) for t in g.initializer]
    for i, node in enumerate(g.node):
        named += [(f"node #{i}", x) for x in [node.name, node.op_type, node.domain, *node.input, *node.output]]
    for where, name in named:
        if not isinstance(name, str):
            raise ModelError(f"{where}: a name is not valid UTF-8 text ({name[:40]!r}); the file is damaged")


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
                input_shapes: dict[str, tuple[int, ...]] | None = None,
                profiles: list[dict[str, tuple]] | None = None) -> Graph:
    """Build a kiln Graph from ONNX, shapes inferred at profile 0's opt point. `input_shapes` fix inputs;
    `profiles` give min/opt/max per input; dynamic inputs given neither are fixed to 1 (with a warning).
    The resolved profiles are kept in `graph.profiles`; values' `dyn_dims` mark the axes that vary."""
    proto = _normalize_opset(load_model(model))
    opset = model_opset(proto)
    check_names(proto)
    proto = unfold_contrib_ops(proto)
    check_supported(proto, opset)
    check_four_bit(proto)
    resolved = resolve_profiles(proto, input_shapes, profiles)
    opt, probe = opt_and_probe_shapes(resolved)
    g = Graph(proto.graph.name or "model", opset)
    _import_initializers(g, proto)
    _import_inputs(g, proto, opt)
    _import_nodes(g, proto)
    for out in proto.graph.output:
        if out.name not in g.values:
            raise ModelError(f"graph output '{out.name}' is not produced by any node")
        g.outputs.append(g.values[out.name])
    g.toposort()
    probed = _probe_shapes(g, probe, opt) if probe else {}
    infer_shapes(g)
    check_sizes(g)
    check_sixteen_bit_reads(g)
    _mark_dynamic_axes(g, probed)
    g.profiles = resolved if probe else []
    g.verify()
    return g


def _probe_shapes(g: Graph, probe: dict[str, tuple[int, ...]], opt: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
    """Infer every value's shape at the probe point, then restore the graph for inference at opt."""
    saved = [dict(n.attrs) for n in g.nodes]
    for v in g.inputs:
        v.shape = probe.get(v.name, v.shape)
    try:
        infer_shapes(g)
    except ModelError as exc:
        raise ModelError(f"at input shapes {probe} (a profile bound): {exc}") from None
    check_sizes(g, f" at input shapes {probe}")
    shapes = {name: v.shape for name, v in g.values.items() if not v.is_const}
    for n, attrs in zip(g.nodes, saved):
        n.attrs = attrs
    for v in g.inputs:
        v.shape = opt[v.name]
    return shapes


MAX_TENSOR_BYTES = 16 << 30   # one activation larger than this is a mistake in the shapes, not a workload


def check_sizes(g: Graph, where: str = "") -> None:
    """Refuse absurd activations (e.g. a 100000x100000 image) at build time, naming the tensor and its producer,
    instead of failing to allocate at run time."""
    for node in g.nodes:
        for v in node.outputs:
            if v.shape is None or v.dtype is None:
                continue
            size = int(np.prod(v.shape, dtype=np.float64)) * np.dtype(v.dtype).itemsize
            if size > MAX_TENSOR_BYTES:
                raise ModelError(f"node '{node.name}' ({node.op_type}) would produce '{v.name}' of shape "
                                 f"{list(v.shape)}{where}: {size / 2**30:.1f} GiB, more than kiln allows for one "
                                 f"tensor ({MAX_TENSOR_BYTES >> 30} GiB); check the input shapes")


def _mark_dynamic_axes(g: Graph, probed: dict[str, tuple]) -> None:
    for name, shape in probed.items():
        v = g.values[name]
        if v.shape is None or shape is None:
            continue
        if len(shape) != len(v.shape):
            v.dyn_dims = tuple(range(len(v.shape)))
        else:
            v.dyn_dims = tuple(i for i, (a, b) in enumerate(zip(shape, v.shape)) if a != b)
            v.probe_shape = tuple(shape)


def _import_initializers(g: Graph, proto: onnx.ModelProto) -> None:
    for init in proto.graph.initializer:
        try:
            arr = numpy_helper.to_array(init)
        except Exception as exc:
            raise ModelError(f"initializer '{init.name}' cannot be read: {exc}") from None
        if init.data_type not in FOUR_BIT_TO_NUMPY:
            onnx_to_numpy(init.data_type, f"initializer '{init.name}'")
        g.add_const(init.name, widen_four_bit(arr))


def check_four_bit(proto: onnx.ModelProto) -> None:
    """INT4/UINT4 initializers and Constant nodes are read widened to int8/uint8, which is exact only where
    DequantizeLinear reads them (its data and zero point): a QuantizeLinear to 4 bits would saturate at 8 bits."""
    four_bit = {t.name: ("initializer", t.data_type) for t in proto.graph.initializer
                if t.data_type in FOUR_BIT_TO_NUMPY}
    four_bit.update({n.output[0]: ("constant", a.t.data_type) for n in proto.graph.node if n.op_type == "Constant"
                     for a in n.attribute if a.name == "value" and a.t.data_type in FOUR_BIT_TO_NUMPY})
    for i, node in enumerate(proto.graph.node if four_bit else ()):
        for j, x in enumerate(node.input):
            if x in four_bit and not (node.op_type == "DequantizeLinear" and j in (0, 2)):
                what, kind = four_bit[x][0], onnx.TensorProto.DataType.Name(four_bit[x][1])
                raise ModelError(f"{what} '{x}' is {kind}, read as input {j} of node "
                                 f"'{node.name or f'(Unnamed Layer* {i}) [{node.op_type}]'}' ({node.op_type}): kiln "
                                 "reads 4-bit values only as DequantizeLinear's data or zero point (weight-only "
                                 "quantization)")


# uint16 is read as 16-bit Q/DQ data (onnxruntime's QUInt16 activations) and moved; torch has no CPU arithmetic,
# comparison or pooling kernels for it, so any other reader is refused at import, not at run time
UINT16_READERS = {"DequantizeLinear": (0, 2), "QuantizeLinear": (2,)}
UINT16_MOVERS = ("Reshape", "Transpose", "Concat", "Slice", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Split",
                 "Expand", "Shape", "Cast")


def check_sixteen_bit_reads(g: Graph) -> None:
    """Fail on the first node reading a uint16 tensor other than as Q/DQ data or by moving it, naming it."""
    for node in g.nodes:
        for i, x in enumerate(node.inputs):
            if x is None or x.dtype is None or np.dtype(x.dtype) != np.uint16 or node.op_type in UINT16_MOVERS or \
                    i in UINT16_READERS.get(node.op_type, ()):
                continue
            raise ModelError(f"node '{node.name}' ({node.op_type}) reads the uint16 tensor '{x.name}' as input {i}: "
                             "kiln reads uint16 only as Q/DQ data (16-bit quantization) and moves it "
                             f"({', '.join(UINT16_MOVERS)})")


def _import_inputs(g: Graph, proto: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> None:
    known = {i.name for i in proto.graph.initializer}
    for inp in proto.graph.input:
        if inp.name in known:
            continue
        dtype = onnx_to_numpy(inp.type.tensor_type.elem_type, f"input '{inp.name}'")
        v = g.value(inp.name)
        v.shape, v.dtype = tuple(shapes[inp.name]), dtype
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
        _check_arity(pnode, name, g.opset)
        inputs = [g.value(x) if x else None for x in pnode.input]
        outputs = [g.value(x) for x in pnode.output if x]
        if pnode.op_type == "Split" and len(inputs) < 2 and "split" not in attrs:
            attrs.setdefault("num_outputs", len(outputs))   # before opset 18: as many equal parts as outputs
        unfolded_from = [p.value for p in pnode.metadata_props if p.key == UNFOLDED_KEY]
        origin = tuple(unfolded_from) or (name, *(p.value for p in pnode.metadata_props if p.key == FOLDED_KEY))
        node_name = name if unfolded_from else " + ".join(origin)
        g.add_node(Node(node_name, pnode.op_type, inputs, outputs, attrs, pnode.domain, origin))


def _check_arity(pnode: onnx.NodeProto, name: str, opset: int) -> None:
    """Input/output counts the ONNX schema allows (a malformed node fails here, not deep inside an op)."""
    if pnode.domain not in ("", "ai.onnx"):
        return
    try:
        schema = onnx.defs.get_schema(pnode.op_type, opset, "")
    except Exception:
        return
    n_in, n_out = len(pnode.input), len([o for o in pnode.output if o])
    if not schema.min_input <= n_in <= schema.max_input or not schema.min_output <= n_out <= schema.max_output:
        raise ModelError(f"node '{name}' ({pnode.op_type}) has {n_in} input(s) and {n_out} output(s); opset {opset} "
                         f"allows {schema.min_input}-{schema.max_input} inputs and {schema.min_output}-"
                         f"{schema.max_output} outputs")
    if any(not x for x in pnode.input[:schema.min_input]):
        raise ModelError(f"node '{name}' ({pnode.op_type}) leaves a required input empty")


def _constant_value(name: str, attrs: dict[str, Any]) -> np.ndarray:
    if "value" in attrs:
        return widen_four_bit(np.asarray(attrs["value"]))   # as 4-bit initializers are
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    raise ModelError(f"Constant node '{name}' has no supported value attribute ({sorted(attrs)})")
