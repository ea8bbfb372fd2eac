"""The builder of the standard nodes that stand for one node kiln unfolds at import (onnxruntime's contrib ops,
ONNX's Attention and RotaryEmbedding): constants, nodes marked with their origin, ranks and static dims."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from kiln.errors import UnsupportedOpError

UNFOLDED_KEY = "kiln.unfolded_from"   # an unfolded node's metadata: the node it came from


class Unfolder:
    """Writes the nodes and constants standing for one unfolded node."""

    def __init__(self, node: onnx.NodeProto, ranks: dict[str, int], widths: dict[str, int],
                 shared: dict | None = None, infer=None, weights: dict[str, onnx.TensorProto] | None = None,
                 types: dict[str, tuple[int, tuple | None]] | None = None, opset: int = 1, prefix: str | None = None):
        self.src, self.ranks, self.widths, self.weights = node, ranks, widths, weights or {}
        self.types = {} if types is None else types   # element type and dims where inference knows them
        self.infer = infer   # more ranks (and types): shape inference through the nodes unfolded so far
        self.shared = {} if shared is None else shared   # values later nodes may reuse (a raw mask's bias)
        self.origin = node.name or f"{node.op_type}_{node.output[0]}"   # the node layer info names
        self.name = prefix or self.origin   # the prefix of every name made (unique where node names repeat)
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.consts: list[onnx.TensorProto] = []
        self.attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def input(self, i: int) -> str | None:
        return self.src.input[i] if i < len(self.src.input) and self.src.input[i] else None

    def output(self, i: int) -> str | None:
        return self.src.output[i] if i < len(self.src.output) and self.src.output[i] else None

    def constant(self, i: int, what: str) -> np.ndarray:
        """Input `i`'s value, which must be an initializer."""
        name = self.input(i)
        if name not in self.weights:
            self.refuse(f"its {what} '{name}' is not an initializer")
        return numpy_helper.to_array(self.weights[name])

    def refuse(self, detail: str):
        raise UnsupportedOpError(self.origin, self.src.op_type, self.src.domain, self.opset, detail)

    def const(self, tag: str, value, dtype=np.float32) -> str:
        name = f"{self.name}/{tag}"
        self.consts.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], tag: str, out: str | list[str] | None = None, **attrs) -> str:
        """One node (several outputs where `out` is a list; the first is returned), marked with the node it
        unfolds."""
        outs = out if isinstance(out, list) else [out or f"{self.name}/{tag}:0"]
        node = helper.make_node(op_type, inputs, outs, name=f"{self.name}/{tag}", **attrs)
        node.metadata_props.add(key=UNFOLDED_KEY, value=self.origin)
        self.nodes.append(node)
        return outs[0]

    def rank(self, name: str, what: str) -> int:
        if name not in self.ranks and self.infer is not None:
            self.ranks.update(self.infer())
        if name not in self.ranks:
            self.refuse(f"the rank of its {what} '{name}' is not declared in the model; add it to value_info")
        return self.ranks[name]

    def type_of(self, name: str) -> tuple[int, tuple | None] | None:
        """(ONNX element type, dims: int, dim_param or None each; None without a shape) of a value, where shape
        inference knows it."""
        if name not in self.types and self.infer is not None:
            self.ranks.update(self.infer())
        return self.types.get(name)

    def unsqueeze(self, x: str, axes: list[int], tag: str) -> str:
        return self.op("Unsqueeze", [x, self.const(f"{tag}_axes", axes, np.int64)], tag)

    def shape_part(self, x: str, start: int, end: int, tag: str) -> str:
        """x's dims start..end-1 as an int64 vector."""
        return self.op("Slice", [self.op("Shape", [x], f"{tag}_shape"), self.const(f"{tag}_start", [start], np.int64),
                                 self.const(f"{tag}_end", [end], np.int64)], tag)

    def seq_range(self, x: str, axis: int, tag: str) -> str:
        """0 .. x.shape[axis] - 1 as int64."""
        shape = self.op("Shape", [x], f"{tag}_shape")
        length = self.op("Gather", [shape, self.const(f"{tag}_axis", axis, np.int64)], f"{tag}_length", axis=0)
        return self.op("Range", [self.const(f"{tag}_start", 0, np.int64), length,
                                 self.const(f"{tag}_step", 1, np.int64)], tag)
