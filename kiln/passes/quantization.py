"""Explicit quantization (Q/DQ): DequantizeLinear(x) -> Conv/MatMul/Gemm(DequantizeLinear(W_int8)) [-> QuantizeLinear]
becomes one INT8 layer carrying its scales (TensorRT's QuantizeDoubleInputNodes; the INT8 weights stay INT8:
ConstWeightsQuantizeFusion is constant folding of Q(W) plus ConstantFolding leaving DQ(W_int8) alone).

A layer with no QuantizeLinear after it has no output scale: it computes in INT8 but writes FP32. TensorRT
does that silently; kiln warns and says how to fix it (add Q/DQ after the layer's output)."""
from __future__ import annotations

import logging

import numpy as np

from kiln.ir import Graph, Node, Value
from kiln.passes.manager import PassLog
from kiln.passes.patterns import replace_nodes, sole_consumer

log = logging.getLogger("kiln.build")
QUANTIZABLE = {"Conv": "QConv", "MatMul": "QMatMul", "Gemm": "QGemm"}


def _dq(v: Value | None) -> Node | None:
    p = v.producer if v is not None else None
    return p if p is not None and p.op_type == "DequantizeLinear" and p.domain in ("", "ai.onnx") else None


def _const(v: Value | None) -> np.ndarray | None:
    return None if v is None or not v.is_const else np.asarray(v.const)


def _params(dq: Node) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, zero point) of a Q/DQ node when both are constants (zero point defaults to 0)."""
    scale = _const(dq.inputs[1])
    zp_v = dq.inputs[2] if len(dq.inputs) > 2 else None
    zp = _const(zp_v) if zp_v is not None else np.zeros_like(scale, dtype=np.int8)
    if scale is None or zp is None or dq.attrs.get("block_size"):
        return None
    return scale, zp


def fuse_quantized_layers(g: Graph, plog: PassLog) -> None:
    """QuantizeDoubleInputNodes: INT8 input and INT8 weights (each with its scale) make one INT8 layer."""
    for node in [n for n in g.nodes if n.op_type in QUANTIZABLE and n.domain in ("", "ai.onnx")]:
        dqw = _dq(node.inputs[1])
        if dqw is None:
            continue
        plog.running(node)
        dqx = _dq(node.inputs[0])
        reason = _blocker(dqx, dqw)
        if reason:
            plog.not_fused(dqx.name if dqx else node.inputs[0].name, node, reason)
            continue
        (sx, zx), (sw, zw) = _params(dqx), _params(dqw)
        quant = {"x_scale": float(sx.reshape(-1)[0]), "x_zero_point": int(zx.reshape(-1)[0]),
                 "x_dtype": str(dqx.inputs[0].dtype), "w_scale": sw.reshape(-1).astype(float).tolist(),
                 "w_zero_point": zw.reshape(-1).astype(int).tolist(), "w_axis": int(dqw.attrs.get("axis", 1))}
        nodes, out = [node], node.outputs[0]
        q = sole_consumer(g, node)
        if q is not None and q.op_type == "QuantizeLinear" and _params(q) is not None and _params(q)[0].size == 1:
            sy, zy = _params(q)
            quant.update(y_scale=float(sy.reshape(-1)[0]), y_zero_point=int(zy.reshape(-1)[0]),
                         y_dtype=str(q.outputs[0].dtype))
            nodes, out = [node, q], q.outputs[0]
            plog.fusing(node, q)
        else:
            plog.note(f"{node.name}: INT8 {node.op_type} with FP32 output (no QuantizeLinear after it)")
            log.warning("%s runs in INT8 but its output stays FP32: no QuantizeLinear follows it, so there is no "
                        "output scale. Add a QuantizeLinear/DequantizeLinear pair after its output '%s' to keep "
                        "the next layer in INT8 (TensorRT builds this silently).", node.name, node.outputs[0].name)
        origin = tuple(o for n in [dqx, dqw] if len(n.outputs[0].users) == 1 for o in n.origin) + \
            tuple(o for n in nodes for o in n.origin)
        name = " + ".join(n.name for n in nodes)
        plog.fusing(dqx, node)
        attrs = {**node.attrs, "quant": quant}
        inputs = [dqx.inputs[0], dqw.inputs[0]] + list(node.inputs[2:])
        replace_nodes(g, nodes, Node(name, QUANTIZABLE[node.op_type], inputs, [out], attrs, "kiln", origin))


def _blocker(dqx: Node | None, dqw: Node) -> str | None:
    if dqx is None:
        return "the input is not dequantized from INT8 (no input scale): the layer stays FP32"
    if dqx.inputs[0].is_const:
        return "the dequantized input is a constant"
    px, pw = _params(dqx), _params(dqw)
    if px is None or px[0].size != 1:
        return "the input scale is not a constant per-tensor scale"
    if pw is None or not dqw.inputs[0].is_const:
        return "the weights are not constant INT8 with constant scales"
    if np.dtype(dqw.inputs[0].dtype) not in (np.dtype(np.int8), np.dtype(np.uint8)):
        return f"weights of type {dqw.inputs[0].dtype} are not INT8"
    return None
