"""Shape and dtype inference by running each op's reference implementation on meta tensors.

Values computable at build time (initializers, shape arithmetic) are evaluated for real, so host inputs
(Reshape's shape, Slice's starts, ...) are always known; anything else only gets its shape and dtype.
"""
from __future__ import annotations

import numpy as np
import torch

from kiln.errors import ModelError
from kiln.ir import Graph, Node
from kiln.ops import lookup
from kiln.ops.dtypes import to_numpy_dtype
from kiln.ops.nn import check_window_attrs, resolve_auto_pad
from kiln.ops.registry import host_value

SHAPE_OPS = ("Shape", "Size")


def normalize_attrs(node: Node) -> None:
    """Make implicit attributes explicit: kernel_shape, strides, dilations, and pads from auto_pad."""
    if node.op_type not in ("Conv", "ConvInteger", "MaxPool", "AveragePool"):
        return
    x = node.inputs[0]
    if node.op_type in ("Conv", "ConvInteger"):
        kernel = list(node.attrs.get("kernel_shape") or node.inputs[1].shape[2:])
    else:
        kernel = list(node.attrs["kernel_shape"])
    k = len(kernel)
    strides = list(node.attrs.get("strides") or [1] * k)
    dilations = list(node.attrs.get("dilations") or [1] * k)
    auto_pad = node.attrs.get("auto_pad", "NOTSET")
    node.attrs.update(kernel_shape=kernel, strides=strides, dilations=dilations,
                      pads=resolve_auto_pad(auto_pad, x.shape[2:], kernel, strides, dilations, node.attrs.get("pads")))
    if auto_pad not in ("NOTSET", ""):
        node.attrs["padding_mode"] = auto_pad   # remembered for layer info (TensorRT's kSAME_UPPER, ...)
    node.attrs["auto_pad"] = "NOTSET"


def infer_shapes(g: Graph) -> None:
    known: dict[int, torch.Tensor] = {id(v): torch.from_numpy(np.array(v.const)) for v in g.values.values() if v.is_const}
    for node in g.nodes:
        for v in node.inputs:
            if v is not None and v.shape is None and id(v) not in known:
                raise ModelError(f"node '{node.name}' ({node.op_type}) reads '{v.name}', which has no known shape")
        bad = check_window_attrs(node.op_type, node.attrs)
        if bad:
            raise ModelError(f"node '{node.name}' ({node.op_type}): {bad}")
        try:
            normalize_attrs(node)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ModelError(f"node '{node.name}' ({node.op_type}) has malformed attributes or inputs: "
                             f"{type(exc).__name__}: {exc}") from None
        outs = evaluate_node(node, known)
        if len(outs) < len(node.outputs):
            raise ModelError(f"node '{node.name}' ({node.op_type}) declares {len(node.outputs)} outputs, "
                             f"kiln computes {len(outs)}")
        for v, t in zip(node.outputs, outs):
            v.shape, v.dtype = tuple(int(d) for d in t.shape), np.dtype(to_numpy_dtype(t.dtype))
            if t.device.type != "meta":
                known[id(v)] = t


def evaluate_node(node: Node, known: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """Run the reference op on real tensors when every input is known, else on meta tensors."""
    opdef = lookup(node.op_type, node.domain)
    all_known = all(v is None or id(v) in known for v in node.inputs)
    args = []
    for i, v in enumerate(node.inputs):
        if v is None:
            args.append(None)
        elif i in opdef.host_inputs:
            if id(v) not in known:
                raise ModelError(f"node '{node.name}' ({node.op_type}): input {i} ('{v.name}') is computed at run "
                                 "time, but kiln needs it constant at build time (fix the input shapes with --shapes)")
            args.append(host_value(known[id(v)]))
        elif all_known:
            args.append(known[id(v)])
        elif id(v) in known and known[id(v)].dim() == 0:
            args.append(known[id(v)].to("meta"))
        else:
            args.append(torch.empty(v.shape, dtype=_torch_dtype(v), device="meta"))
    try:
        with torch.no_grad():
            return [t for t in opdef.impl(node.attrs, args)]
    except ModelError:
        raise
    except Exception as exc:
        shapes = [None if v is None else list(v.shape) for v in node.inputs]
        raise ModelError(f"node '{node.name}' ({node.op_type}) cannot be evaluated with input shapes {shapes}: "
                         f"{type(exc).__name__}: {exc}") from None


def _torch_dtype(v) -> torch.dtype:
    from kiln.ops.dtypes import to_torch_dtype

    return to_torch_dtype(v.dtype)
