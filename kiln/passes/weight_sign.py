"""UnsignedWeightRecentering: unsigned INT8 weights whose values, less their zero point, all fit a signed byte
become signed weights with zero point 0, the same numbers:

    DQ(W_uint8, scale, zp_uint8) ─► product weight   ==>  DQ(W - zp as int8, scale, 0 as int8)
    ConvInteger / MatMulInteger(x, W_uint8, ., zp)   ==>  (x, W - zp as int8, ., 0 as int8)

onnxruntime's quantize_static with u8 weights (`weight_type=QuantType.QUInt8`, symmetric: zero point 128) and
QOperator models quantized that way then run on the kernels for signed weights: oneDNN's INT8 primitives take s8
weights only, and u8 ones fell to kiln's C kernels or torch's reference (a u8-weight MobileNetV2 ran 1.37 ms against
0.20 ms with s8 weights, Zen 4). A zero point other than 128 with the full u8 range does not fit and is left as
it is, as are block-quantized weights and constants read by anything but a product's weight input (through
movement ops), which keep the type the fusions around them expect."""
from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node
from kiln.passes.manager import PassLog
from kiln.passes.patterns import is_op
from kiln.passes.qdq_constants import weight_uses

INTEGER_PRODUCTS = {"ConvInteger": (1, 3), "MatMulInteger": (1, 3)}   # op -> (weight input, its zero point)


def recenter_unsigned_weights(g: Graph, plog: PassLog) -> None:
    """UnsignedWeightRecentering (the module's docstring)."""
    for node in list(g.nodes):
        if is_op(node, "DequantizeLinear") and "block_size" not in node.attrs and weight_uses(node):
            weight, zero_point = 0, 2
            axis = node.attrs.get("axis", 1)
        elif is_op(node, tuple(INTEGER_PRODUCTS)):
            weight, zero_point = INTEGER_PRODUCTS[node.op_type]
            axis = 0 if node.op_type == "ConvInteger" else -1   # per output channel: W's rows, B's columns
        else:
            continue
        _recenter(g, node, weight, zero_point, axis, plog)


def _recenter(g: Graph, node: Node, weight: int, zero_point: int, axis: int, plog: PassLog) -> None:
    w = node.inputs[weight] if len(node.inputs) > weight else None
    if w is None or not w.is_const or w.dtype != np.uint8:
        return
    zp = node.inputs[zero_point] if len(node.inputs) > zero_point else None
    if zp is not None and not zp.is_const:
        return
    zp_values = np.zeros((), np.uint8) if zp is None else zp.const
    offsets = _broadcast(zp_values, w.const.shape, axis)
    if offsets is None:
        return   # zero points that do not match the weights' axis: the op's own checks say what is wrong
    centred = w.const.astype(np.int16) - offsets
    plog.running(node)
    if centred.min() < -128 or centred.max() > 127:
        plog.note(f"not recentering {node.name}: its u8 weights less their zero point span "
                  f"{centred.min()}..{centred.max()}, more than a signed byte")
        return
    g.set_input(node, weight, g.add_const(f"{w.name}_s8", centred.astype(np.int8)))
    signed_zero = g.add_const(f"{w.name}_s8_zero_point", np.zeros(zp_values.shape, np.int8))
    if zp is None:
        node.inputs.extend([None] * (zero_point + 1 - len(node.inputs)))
    g.set_input(node, zero_point, signed_zero)
    plog.lowering(node, "signed INT8 weights (zero point 0)")


def _broadcast(zp: np.ndarray, shape: tuple[int, ...], axis: int) -> np.ndarray | None:
    """A per-tensor or per-axis zero point shaped to broadcast against weights of `shape`; None where its count is
    not the axis' extent."""
    if zp.size == 1:
        return zp.astype(np.int16).reshape(())
    if not shape or zp.size != shape[axis % len(shape)]:
        return None
    view = [1] * len(shape)
    view[axis % len(shape)] = zp.size
    return zp.astype(np.int16).reshape(view)
