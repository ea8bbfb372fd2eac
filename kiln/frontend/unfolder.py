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

    def __init__(self, node: onnx.NodeProto, *, ranks: dict[str, int], types: dict[str, tuple[int, tuple | None]],
                 infer, weights: dict[str, onnx.TensorProto], shared: dict, opset: int, prefix: str):
        self.src, self.ranks, self.weights = node, ranks, weights
        self.types = types   # element type and dims where inference knows them
        self.infer = infer   # more ranks (and types): shape inference through the nodes unfolded so far
        self.shared = shared   # values later nodes may reuse (a raw mask's bias)
        self.origin = node.name or f"{node.op_type}_{node.output[0]}"   # the node layer info names
        self.name = prefix   # the prefix of every name made (unique where node names repeat)
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.consts: list[onnx.TensorProto] = []
        self.attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def input(self, i: int) -> str | None:
        return self.src.input[i] if i < len(self.src.input) and self.src.input[i] else None

    def output(self, i: int) -> str | None:
        return self.src.output[i] if i < len(self.src.output) and self.src.output[i] else None

    def weight_width(self, i: int) -> int | None:
        """The last dim of input `i` where it is an initializer."""
        found = self.weights.get(self.input(i))
        return int(found.dims[-1]) if found is not None and found.dims else None

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

    def split_heads(self, x: str, part: str, heads: int, head_size: int = -1, keys_transposed: bool = False) -> str:
        """[B,S,N*h] as heads: [B,N,S,h], or [B,N,h,S] for keys multiplied as they are (`keys_transposed`)."""
        split = self.op("Reshape", [x, self.const(f"{part}_heads", [0, 0, heads, head_size], np.int64)],
                        f"{part}_heads")
        if keys_transposed:
            return self.op("Transpose", [split], f"{part}_bnhs", perm=[0, 2, 3, 1])
        return self.op("Transpose", [split], f"{part}_bnsh", perm=[0, 2, 1, 3])

    def merge_heads(self, context: str, out: str | None) -> str:
        """[B,N,S,h] heads back as [B,S,N*h], written to `out`."""
        merged = self.op("Transpose", [context], "context_bsnh", perm=[0, 2, 1, 3])
        return self.op("Reshape", [merged, self.const("merge", [0, 0, -1], np.int64)], "merge", out)

    def inverse_sqrt(self, x: str, tag: str) -> str:
        """1 / sqrt(x) (a head size computed at build time: attention's default scale)."""
        return self.op("Reciprocal", [self.op("Sqrt", [x], f"{tag}_sqrt")], f"{tag}_value")

    def seq_range(self, x: str, axis: int, tag: str) -> str:
        """0 .. x.shape[axis] - 1 as int64."""
        shape = self.op("Shape", [x], f"{tag}_shape")
        length = self.op("Gather", [shape, self.const(f"{tag}_axis", axis, np.int64)], f"{tag}_length", axis=0)
        return self.op("Range", [self.const(f"{tag}_start", 0, np.int64), length,
                                 self.const(f"{tag}_step", 1, np.int64)], tag)
