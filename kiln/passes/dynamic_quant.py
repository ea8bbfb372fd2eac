"""Dynamic quantization (onnxruntime's quantize_dynamic, the usual INT8 recipe for transformers):
DynamicQuantizeLinear(x) -> MatMulInteger(x_u8, W_int8, x_zp[, W_zp]) -> Cast(FLOAT) -> Mul(x_scale * W_scale)
becomes one DynamicQMatMul layer: FP32 in, the activation quantized to u8 from its own range on every call, an
INT8 product, FP32 out (onnxruntime's DynamicQuantizeMatMul fusion). MatMulAddFusion then takes the bias, and
MatMulHorizontalMerge merges the Q, K and V products, which then quantize their shared input once. Left as they
were, the five ops ran one by one, the product on the reference kernel: 10x onnxruntime on BERT-base.
The same chain around a ConvInteger (quantize_dynamic on a CNN), with its bias Add, becomes one DynamicQConv."""
from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node, Value
from kiln.passes.manager import PassLog
from kiln.passes.patterns import const_value, is_op, remove_dead, replace_nodes, sole_consumer, why_not_sole_consumer
from kiln.trt.vocab import fused_layer_name

FLOAT = 1   # TensorProto.FLOAT, Cast's "to"
PRODUCTS = {"MatMulInteger": "DynamicQMatMul", "ConvInteger": "DynamicQConv"}


def fuse_dynamic_quantized_matmul(g: Graph, plog: PassLog) -> None:
    """DynamicQuantizeMatMulFusion: the dynamic-quantization chain around each MatMulInteger, as one layer."""
    _fuse_chains(g, plog, "MatMulInteger")


def fuse_dynamic_quantized_conv(g: Graph, plog: PassLog) -> None:
    """DynamicQuantizeConvFusion: the chain around each ConvInteger, with the bias Add quantize_dynamic writes
    after it, as one DynamicQConv layer (BatchNormalization and the activation fold in later, as into a Conv)."""
    _fuse_chains(g, plog, "ConvInteger")


def _fuse_chains(g: Graph, plog: PassLog, op: str) -> None:
    for product in [n for n in g.nodes if is_op(n, op)]:
        plog.running(product)
        found = _match(g, product)
        if isinstance(found, str):
            plog.not_fused(product.inputs[0].producer or product.inputs[0].name, product, found)
            continue
        dql, nodes, scales, w_scale, w_zp = found
        w, conv = product.inputs[1], op == "ConvInteger"
        channels = len(w_scale)
        quant = {"x_dtype": "uint8", "w_axis": 0 if conv else 1, "w_scale": w_scale.astype(float).tolist(),
                 "w_zero_point": w_zp.astype(int).tolist()}
        inputs, attrs = [dql.inputs[0], w], {"quant": quant}
        if conv:
            attrs = {**product.attrs, "quant": quant}
            bias_add, bias = _conv_bias(g, nodes[-1], channels, w.const.ndim)
            if isinstance(bias, str):
                plog.not_fused(product, bias_add, bias)
            elif bias_add is not None:
                nodes.append(bias_add)
                inputs.append(g.add_const(f"{product.name}.bias", bias))
        for node in nodes[1:]:
            plog.fusing(nodes[0], node)
        plog.fusing(dql, product)
        origin = tuple(o for node in nodes for o in node.origin)
        layer = replace_nodes(g, nodes, Node(fused_layer_name(origin), PRODUCTS[op], inputs,
                                             [nodes[-1].outputs[0]], attrs, "kiln", origin))
        for absorbed in remove_dead(g, [scales, dql]):   # the last product reading them stands for them
            layer.origin += tuple(o for o in absorbed.origin if o not in layer.origin)
        layer.name = fused_layer_name(layer.origin)


def _match(g: Graph, product: Node) -> tuple[Node, list[Node], Node, np.ndarray, np.ndarray] | str:
    """(the DynamicQuantizeLinear, [MatMulInteger or ConvInteger, Cast, Mul], the Mul(x_scale, W_scale), W_scale
    and W_zp one per output channel), or why the chain is not one."""
    dql, conv = product.inputs[0].producer, product.op_type == "ConvInteger"
    if not is_op(dql, "DynamicQuantizeLinear") or dql.outputs[0] is not product.inputs[0]:
        return "its input is not quantized by a DynamicQuantizeLinear"
    if len(product.inputs) < 3 or product.inputs[2] is not dql.outputs[2]:
        return "its input zero point is not the DynamicQuantizeLinear's"
    w = product.inputs[1]
    if not w.is_const or (w.const.ndim < 3 if conv else w.const.ndim != 2) or \
            np.dtype(w.dtype) not in (np.dtype(np.int8), np.dtype(np.uint8)):
        return f"its second input is not a constant INT8 {'filter' if conv else '2-D matrix'}"
    channels, rank = (w.shape[0], w.const.ndim) if conv else (w.shape[1], 1)
    zp_input = product.inputs[3] if len(product.inputs) > 3 else None
    w_zp = np.zeros(1, np.int64) if zp_input is None else const_value(zp_input)
    if w_zp is None or np.size(w_zp) not in (1, channels):
        return f"its weight zero point is not a constant per tensor or per {'output channel' if conv else 'column'}"
    cast = sole_consumer(g, product)
    if cast is None:
        return why_not_sole_consumer(g, product)
    if not is_op(cast, "Cast") or cast.attrs.get("to") != FLOAT:
        return f"{cast.name} is not a Cast to FLOAT"
    mul = sole_consumer(g, cast)
    if mul is None:
        return why_not_sole_consumer(g, cast)
    scales = None if not is_op(mul, "Mul") else next((v for v in mul.inputs if v is not cast.outputs[0]), None)
    w_scale = _weight_scale(scales, dql)
    per_channel = None if w_scale is None else _per_channel(w_scale, channels, rank)
    if per_channel is None:
        return f"{cast.name} is not scaled by Mul(x_scale, constant weight scale) alone"
    return dql, [product, cast, mul], scales.producer, per_channel, np.broadcast_to(np.reshape(w_zp, -1), (channels,))


def _per_channel(values: np.ndarray, channels: int, rank: int) -> np.ndarray | None:
    """`values` as one per channel, where they broadcast along the output's channel axis (`rank` - 1 axes from the
    end: the last for a product, 1 for an N-D convolution's [N, C, ...]) or are one scalar; else None."""
    if values.size == 1:
        return np.repeat(values.reshape(-1), channels)
    axis = values.ndim - (rank - 1 if rank > 1 else 1)
    if values.size != channels or axis < 0 or values.shape[axis] != channels:
        return None
    return values.reshape(-1)


def _conv_bias(g: Graph, mul: Node, channels: int, rank: int) -> tuple[Node | None, np.ndarray | str | None]:
    """(the Add, its bias) where quantize_dynamic's Add of a constant per-channel FP32 bias follows a ConvInteger's
    scaling; (the Add, why not) for another constant Add; (None, None) without one."""
    add = sole_consumer(g, mul)
    if not is_op(add, "Add") or sum(v is mul.outputs[0] for v in add.inputs) != 1:
        return None, None
    other = const_value(next(v for v in add.inputs if v is not mul.outputs[0]))
    if other is None:
        return None, None
    bias = None if other.dtype != np.float32 or other.ndim > rank else _per_channel(other, channels, rank)
    if bias is None:
        return add, f"{add.name} adds a constant that is not one FP32 value per output channel"
    return add, bias


def _weight_scale(scales: Value | None, dql: Node) -> np.ndarray | None:
    """W_scale when `scales` is Mul(x_scale, W_scale) with the DynamicQuantizeLinear's x_scale."""
    product = scales.producer if scales is not None else None
    if not is_op(product, "Mul") or dql.outputs[1] not in product.inputs:
        return None
    other = product.inputs[1] if product.inputs[0] is dql.outputs[1] else product.inputs[0]
    w_scale = const_value(other)
    return w_scale if w_scale is not None and w_scale.dtype == np.float32 else None

