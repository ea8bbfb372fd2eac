"""Dynamic quantization (onnxruntime's quantize_dynamic, the usual INT8 recipe for transformers):
DynamicQuantizeLinear(x) -> MatMulInteger(x_u8, W_int8, x_zp[, W_zp]) -> Cast(FLOAT) -> Mul(x_scale * W_scale)
becomes one DynamicQMatMul layer: FP32 in, the activation quantized to u8 from its own range on every call, an
INT8 product, FP32 out (onnxruntime's DynamicQuantizeMatMul fusion). MatMulAddFusion then takes the bias, and
MatMulHorizontalMerge merges the Q, K and V products, which then quantize their shared input once. Left as they
were, the five ops ran one by one, the product on the reference kernel: 10x onnxruntime on BERT-base."""
from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node, Value
from kiln.passes.manager import PassLog
from kiln.passes.patterns import replace_nodes, sole_consumer, why_not_sole_consumer
from kiln.trt.vocab import fused_layer_name

ONNX = ("", "ai.onnx")
FLOAT = 1   # TensorProto.FLOAT, Cast's "to"


def _is(node: Node | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in ONNX


def fuse_dynamic_quantized_matmul(g: Graph, plog: PassLog) -> None:
    """DynamicQuantizeMatMulFusion: the dynamic-quantization chain around each MatMulInteger, as one layer."""
    for mm in [n for n in g.nodes if _is(n, "MatMulInteger")]:
        plog.running(mm)
        found = _match(g, mm)
        if isinstance(found, str):
            plog.not_fused(mm.inputs[0].producer or mm.inputs[0].name, mm, found)
            continue
        dql, nodes, scales, w_scale = found
        w, w_zp = mm.inputs[1], _const(mm.inputs[3] if len(mm.inputs) > 3 else None)
        n = w.shape[-1]
        quant = {"x_dtype": "uint8", "w_axis": 1,
                 "w_scale": np.broadcast_to(w_scale.reshape(-1), (n,)).astype(float).tolist(),
                 "w_zero_point": np.broadcast_to((w_zp if w_zp is not None else np.zeros(1)).reshape(-1),
                                                 (n,)).astype(int).tolist()}
        origin = tuple(o for node in nodes for o in node.origin)
        for node in nodes[1:]:
            plog.fusing(nodes[0], node)
        plog.fusing(dql, mm)
        layer = replace_nodes(g, nodes, Node(fused_layer_name(origin), "DynamicQMatMul", [dql.inputs[0], w],
                                             [nodes[-1].outputs[0]], {"quant": quant}, "kiln", origin))
        for absorbed in (scales, dql):   # the last product reading them stands for them
            if _remove_if_unread(g, absorbed):
                layer.origin += tuple(o for o in absorbed.origin if o not in layer.origin)
        layer.name = fused_layer_name(layer.origin)


def _match(g: Graph, mm: Node) -> tuple[Node, list[Node], Node, np.ndarray] | str:
    """(the DynamicQuantizeLinear, [MatMulInteger, Cast, Mul], the Mul(x_scale, W_scale), W_scale), or why the
    chain is not one."""
    dql = mm.inputs[0].producer
    if not _is(dql, "DynamicQuantizeLinear") or dql.outputs[0] is not mm.inputs[0]:
        return "its input is not quantized by a DynamicQuantizeLinear"
    if len(mm.inputs) < 3 or mm.inputs[2] is not dql.outputs[2]:
        return "its input zero point is not the DynamicQuantizeLinear's"
    w = mm.inputs[1]
    if not w.is_const or w.const.ndim != 2 or np.dtype(w.dtype) not in (np.dtype(np.int8), np.dtype(np.uint8)):
        return "its second input is not a constant 2-D INT8 matrix"
    w_zp = _const(mm.inputs[3] if len(mm.inputs) > 3 else None)
    if len(mm.inputs) > 3 and mm.inputs[3] is not None and (w_zp is None or w_zp.size not in (1, w.shape[1])):
        return "its weight zero point is not a constant per tensor or per column"
    cast = sole_consumer(g, mm)
    if cast is None:
        return why_not_sole_consumer(g, mm)
    if not _is(cast, "Cast") or cast.attrs.get("to") != FLOAT:
        return f"{cast.name} is not a Cast to FLOAT"
    mul = sole_consumer(g, cast)
    if mul is None:
        return why_not_sole_consumer(g, cast)
    scales = None if not _is(mul, "Mul") else next((v for v in mul.inputs if v is not cast.outputs[0]), None)
    w_scale = _weight_scale(scales, dql)
    if w_scale is None or w_scale.size not in (1, w.shape[1]):
        return f"{cast.name} is not scaled by Mul(x_scale, constant weight scale) alone"
    return dql, [mm, cast, mul], scales.producer, w_scale


def _weight_scale(scales: Value | None, dql: Node) -> np.ndarray | None:
    """W_scale when `scales` is Mul(x_scale, W_scale) with the DynamicQuantizeLinear's x_scale."""
    product = scales.producer if scales is not None else None
    if not _is(product, "Mul") or dql.outputs[1] not in product.inputs:
        return None
    other = product.inputs[1] if product.inputs[0] is dql.outputs[1] else product.inputs[0]
    w_scale = _const(other)
    return w_scale if w_scale is not None and w_scale.dtype == np.float32 else None


def _const(v: Value | None) -> np.ndarray | None:
    return None if v is None or not v.is_const else np.asarray(v.const)


def _remove_if_unread(g: Graph, node: Node | None) -> bool:
    if node is None or node not in g.nodes or any(o.users or g.is_output(o) for o in node.outputs):
        return False
    g.remove_node(node)
    return True
