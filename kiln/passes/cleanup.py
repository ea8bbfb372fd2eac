"""Clean-up passes: dead-layer removal, Identity/Dropout removal, constant folding, common subexpressions."""
from __future__ import annotations

import struct

import numpy as np
import torch

from kiln.frontend.shape_inference import evaluate_node
from kiln.ir import Graph
from kiln.passes.manager import PassLog

PASSTHROUGH_OPS = ("Identity", "Dropout")
INT8_TYPES = (np.dtype(np.int8), np.dtype(np.uint8))
FOLD_MAX_ELEMENTS = 1 << 24   # never materialize constants larger than 64 MiB of float32


def remove_dead_layers(g: Graph, plog: PassLog) -> None:
    """Drop nodes none of whose outputs reach a graph output."""
    live = {id(v) for v in g.outputs}
    keep = []
    for node in reversed(g.nodes):
        if any(id(v) in live for v in node.outputs):
            keep.append(node)
            live.update(id(v) for v in node.inputs if v is not None)
        else:
            plog.removing(node)
    for node in [n for n in g.nodes if n not in keep]:
        g.remove_node(node)


def remove_identities(g: Graph, plog: PassLog) -> None:
    """Identity and inference-mode Dropout forward their input; Cast to the same dtype too."""
    for node in list(g.nodes):
        same_cast = node.op_type == "Cast" and node.inputs[0].dtype == node.outputs[0].dtype
        if node.op_type not in PASSTHROUGH_OPS and not same_cast:
            continue
        if node.op_type == "Dropout" and len(node.outputs) > 1 and node.outputs[1].users:
            plog.note(f"keeping {node.name}: its mask output is used")
            continue
        src, out = node.inputs[0], node.outputs[0]
        plog.running(node)
        if g.is_output(out) and (g.is_output(src) or src in g.inputs):
            plog.note(f"keeping {node.name}: it copies one graph binding to another")
            continue
        g.remove_node(node)
        if g.is_output(out):
            _rename_into(g, src, out)   # keep the public output name
        else:
            g.replace_all_uses(out, src)
        plog.removing(node)


def _rename_into(g: Graph, src, out) -> None:
    """Make `src`'s producer write `out` (a graph output) and point `src`'s other users at `out`."""
    producer = src.producer
    if producer is None:   # a constant feeding an output through Identity
        out.const, out.shape, out.dtype = src.const, src.shape, src.dtype
        return
    producer.outputs = [out if v is src else v for v in producer.outputs]
    out.producer, src.producer = producer, None
    for user in list(src.users):
        for i, v in enumerate(user.inputs):
            if v is src:
                g.set_input(user, i, out)


def fold_constants(g: Graph, plog: PassLog) -> None:
    """Evaluate nodes whose inputs are all constant (and Shape/Size of static tensors) at build time."""
    for node in list(g.nodes):
        is_shape = node.op_type in ("Shape", "Size")
        if is_shape and _reads_dynamic_axes(node):
            continue
        through = node.op_type == "QuantizeLinear" and _kept_int8_constant(node.inputs[0]) and \
            all(v is None or v.is_const for v in node.inputs[1:])
        if not is_shape and not through and not all(v is None or v.is_const for v in node.inputs):
            continue
        if node.op_type == "DequantizeLinear" and node.inputs[0].dtype in INT8_TYPES:
            continue   # INT8 weights stay INT8: QuantizeDoubleInputNodes reads them with their scales
        if any(v.shape is not None and np.prod(v.shape) > FOLD_MAX_ELEMENTS for v in node.outputs):
            plog.note(f"not folding {node.name}: output too large")
            continue
        if any(g.is_output(v) for v in node.outputs):
            continue
        plog.running(node)
        fold_node(g, node)
        plog.removing(node)


def _kept_int8_constant(v) -> bool:
    """`v` is DequantizeLinear(INT8 constant), which folding keeps for the Q/DQ fusions. A QuantizeLinear reading it
    is still a constant: quantize_static writes Q(DQ(w)) where an exporter's Identity shared one weight (torch's
    deduplicated parameters), treating the copy as an activation."""
    dq = v.producer if v is not None else None
    return dq is not None and dq.op_type == "DequantizeLinear" and dq.inputs[0].dtype in INT8_TYPES and \
        all(i is None or i.is_const for i in dq.inputs)


def fold_node(g: Graph, node) -> None:
    """Evaluate `node` on its constant inputs and replace it by the constants it computes; an input that is a
    kept DequantizeLinear of an INT8 constant is evaluated on the way."""
    known = {id(v): torch.from_numpy(np.array(v.const)) for v in node.inputs if v is not None and v.is_const}
    for v in node.inputs:
        if v is not None and not v.is_const and _kept_int8_constant(v):
            consts = {id(i): torch.from_numpy(np.array(i.const)) for i in v.producer.inputs if i is not None}
            known[id(v)] = evaluate_node(v.producer, consts)[0]
    outs = evaluate_node(node, known)
    g.remove_node(node)
    for v, t in zip(node.outputs, outs):
        v.const = np.ascontiguousarray(t.numpy()).reshape(tuple(t.shape))   # ascontiguousarray makes 0-d 1-d


def _reads_dynamic_axes(node) -> bool:
    """Shape/Size whose result depends on an axis that varies with the input shapes cannot be folded."""
    x = node.inputs[0]
    if not x.dyn_dims:
        return False
    if node.op_type == "Size":
        return True
    rank = len(x.shape)
    start, end = node.attrs.get("start", 0), node.attrs.get("end", rank)
    start, end = (max(0, min(rank, a + rank if a < 0 else a)) for a in (start, end))
    return any(start <= i < end for i in x.dyn_dims)


NOT_MERGED_OPS = ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                  "Bernoulli",   # each draws its own values
                  "QuantizeLinear", "DequantizeLinear")   # HorizontalMergeQNodes merges these where Q/DQ fusions expect
COMPARED_CONSTANT_BYTES = 1 << 16   # constants up to this size are compared by value, larger ones by identity


def merge_common_subexpressions(g: Graph, plog: PassLog) -> None:
    """Nodes that compute the same op with the same attributes on the same inputs (small constants compared by
    value) become one, its outputs read by both sets of users: an exporter's per-layer copies of one computation
    (each attention block turning the same boolean mask into the same additive mask; Shape of one input read per
    layer) run once. onnxruntime's CommonSubexpressionElimination; random ops, Q/DQ, graph outputs and nodes of
    several outputs (but Split) are left alone.
    The merged nodes' ONNX names are in no layer, as folded ones are."""
    seen: dict[tuple, object] = {}
    for node in list(g.nodes):   # in topological order: a node's inputs are merged before it is keyed
        key = _expression_key(node)
        if key is None:
            continue
        kept = seen.setdefault(key, node)
        if kept is node or any(g.is_output(v) for v in node.outputs):
            continue
        plog.note(f"{node.name} computes what {kept.name} does: merged into it")
        for old, new in zip(node.outputs, kept.outputs):
            g.replace_all_uses(old, new)
        g.remove_node(node)
        plog.removing(node)


def _expression_key(node) -> tuple | None:
    """What the node computes, hashable; None where it cannot be merged (random, or an attribute it cannot key)."""
    if node.op_type in NOT_MERGED_OPS or (len(node.outputs) > 1 and node.op_type != "Split"):
        return None   # the IR drops unnamed optional outputs: which ones a node has is not in its outputs
    try:
        attrs = tuple(sorted((name, _frozen(value)) for name, value in node.attrs.items()))
        hash(attrs)
    except TypeError:
        return None
    return (node.domain, node.op_type, len(node.outputs), attrs, tuple(_input_key(v) for v in node.inputs))


def _input_key(v) -> tuple | None:
    if v is None:
        return None
    if v.is_const and v.const.nbytes <= COMPARED_CONSTANT_BYTES:
        return ("const", _frozen(v.const))
    return ("value", id(v))


def _frozen(value):
    """An attribute value as a hashable key (arrays by type, shape and bytes); TypeError where it has no key."""
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (float, np.floating)):
        return ("float", struct.pack("<d", float(value)))   # -0.0 apart from 0.0
    if value is None or isinstance(value, (bool, int, str, bytes, np.generic)):
        return value
    raise TypeError(f"no key for {type(value).__name__}")
