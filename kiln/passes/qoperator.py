"""QOperator-format INT8 (onnxruntime's `quantize_static(..., quant_format=QuantFormat.QOperator)`: QLinearConv,
QLinearMatMul, and com.microsoft's QGemm, QLinearAdd, QLinearMul, QLinearGlobalAveragePool, QLinearAveragePool,
QLinearConcat, QLinearSigmoid, QLinearLeakyRelu, QLinearSoftmax) unfolded into the Q/DQ form the quantization
passes fuse: DequantizeLinear on each INT8 input, the float op, QuantizeLinear on its output (an int32 bias becomes
the float bias it stands for). A QLinearConv followed by a QLinearAdd then becomes one INT8 convolution with its
residual fused, on kiln's own INT8 kernels, as in a Q/DQ model; before, each op ran dequantize -> FP32 -> quantize
in torch. TensorRT reads only the Q/DQ form; kiln takes both.

Every node the unfolding makes keeps the QOperator node as its origin, so layer info still names the ONNX node."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.ir import Graph, Node, Value
from kiln.passes.manager import PassLog

MS = "com.microsoft"
FLOAT = np.dtype("float32")


@dataclass(frozen=True)
class Unfolding:
    """Where a QOperator node keeps its operands: (value, scale, zero point) index triples of its INT8 inputs, the
    index of an int32 bias (scaled by the first two inputs' scales), the output's (scale, zero point) indices."""

    float_op: str
    inputs: tuple[tuple[int, int, int], ...]
    output: tuple[int, int]   # absent inputs there (QGemm's): a float output
    bias: int | None = None


UNFOLDINGS = {
    ("QLinearConv", ""): Unfolding("Conv", ((0, 1, 2), (3, 4, 5)), (6, 7), bias=8),
    ("QLinearMatMul", ""): Unfolding("MatMul", ((0, 1, 2), (3, 4, 5)), (6, 7)),
    ("QGemm", MS): Unfolding("Gemm", ((0, 1, 2), (3, 4, 5)), (7, 8), bias=6),
    ("QLinearAdd", MS): Unfolding("Add", ((0, 1, 2), (3, 4, 5)), (6, 7)),
    ("QLinearMul", MS): Unfolding("Mul", ((0, 1, 2), (3, 4, 5)), (6, 7)),
    ("QLinearGlobalAveragePool", MS): Unfolding("GlobalAveragePool", ((0, 1, 2),), (3, 4)),
    ("QLinearSigmoid", MS): Unfolding("Sigmoid", ((0, 1, 2),), (3, 4)),
    ("QLinearLeakyRelu", MS): Unfolding("LeakyRelu", ((0, 1, 2),), (3, 4)),
    ("QLinearSoftmax", MS): Unfolding("Softmax", ((0, 1, 2),), (3, 4)),
    ("QLinearAveragePool", MS): Unfolding("AveragePool", ((0, 1, 2),), (3, 4)),
}


def _arg(node: Node, i: int) -> Value | None:
    return node.inputs[i] if i < len(node.inputs) else None


def _unfolding(node: Node) -> Unfolding | None:
    if node.op_type == "QLinearConcat" and node.domain == MS:   # y_scale, y_zp, then a triple per input
        return Unfolding("Concat", tuple((i, i + 1, i + 2) for i in range(2, len(node.inputs), 3)), (0, 1))
    return UNFOLDINGS.get((node.op_type, "" if node.domain == "ai.onnx" else node.domain))


def _blocker(node: Node, spec: Unfolding) -> str | None:
    if node.attrs.get("channels_last", 0):
        return "channels_last=1 (NHWC) is not unfolded"
    if node.op_type == "QLinearSoftmax" and node.attrs.get("opset", 13) < 13 and \
            node.attrs.get("axis", -1) % len(node.inputs[0].shape) != len(node.inputs[0].shape) - 1:
        return "opset < 13 softmax over several axes (Softmax-13 takes one)"
    if node.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET", ""):
        return "auto_pad is not unfolded (explicit pads are)"
    if node.op_type == "QGemm" and float(node.attrs.get("alpha", 1.0)) != 1.0:
        return "alpha != 1: the int32 bias's scale is then ambiguous"
    bias = _arg(node, spec.bias) if spec.bias is not None else None
    if bias is not None and not (bias.is_const and _arg(node, 1).is_const and _arg(node, 4).is_const):
        return "its int32 bias or the scales it is measured in are not constants"
    return None


def unfold_qoperators(g: Graph, plog: PassLog) -> None:
    """QLinear* -> DequantizeLinear -> float op -> QuantizeLinear (see the module's docstring)."""
    for node in list(g.nodes):
        spec = _unfolding(node)
        if spec is None:
            continue
        plog.running(node)
        reason = _blocker(node, spec)
        if reason:
            plog.note(f"{node.name}: {node.op_type} stays as it is: {reason}")
            continue
        _unfold(g, node, spec)
        plog.removing(node)


def _unfold(g: Graph, node: Node, spec: Unfolding) -> None:
    at, new = g.nodes.index(node), []
    inputs = [_dequantized(g, node, spec.float_op, i, triple, new) for i, triple in enumerate(spec.inputs)]
    if spec.bias is not None and _arg(node, spec.bias) is not None:
        inputs.append(_float_bias(g, node, spec))
    out = node.outputs[0]
    quantized = _arg(node, spec.output[0]) is not None
    y = _like(g, out, f"{out.name}_float") if quantized else out
    attrs = {k: v for k, v in node.attrs.items() if k not in ("channels_last", "opset")}
    g.remove_node(node)
    new.append(Node(node.name, spec.float_op, inputs, [y], attrs, "", node.origin))
    if quantized:
        scale, zp = (_arg(node, i) for i in spec.output)
        new.append(Node(f"{node.name} [QuantizeLinear]", "QuantizeLinear", [y, scale] + ([zp] if zp else []), [out],
                        {}, "", node.origin))
    for offset, n in enumerate(new):
        g.add_node(n, at + offset)


def _like(g: Graph, v: Value, name: str, dtype: np.dtype = FLOAT) -> Value:
    out = g.value(g.fresh_name(name))
    out.shape, out.dtype, out.dyn_dims = v.shape, dtype, v.dyn_dims
    out.probe_shape = v.probe_shape
    return out


def _dequantized(g: Graph, node: Node, float_op: str, index: int, triple: tuple[int, int, int],
                 new: list[Node]) -> Value:
    """Input `triple` of `node` as a float value: a DequantizeLinear node (per-channel along the axis its scale
    runs: Conv weights' output channels, a MatMul's or Gemm's columns)."""
    x, scale, zp = (_arg(node, i) for i in triple)
    attrs = {}
    if scale.shape and int(np.prod(scale.shape)) > 1 and index == 1:
        rank = len(x.shape)
        attrs["axis"] = {"Conv": 0, "Gemm": 0 if node.attrs.get("transB", 0) else 1}.get(
            float_op, rank - 1)
    out = _like(g, x, f"{x.name}_dequantized")
    new.append(Node(f"{node.name} [DequantizeLinear {index}]", "DequantizeLinear", [x, scale] + ([zp] if zp else []),
                    [out], attrs, "", node.origin))
    return out


def _float_bias(g: Graph, node: Node, spec: Unfolding) -> Value:
    """The int32 bias times x_scale * w_scale (per output channel where the weights are), as a float constant."""
    bias = np.asarray(_arg(node, spec.bias).const).astype(np.float64)
    scale = float(np.asarray(_arg(node, 1).const).reshape(-1)[0]) * \
        np.asarray(_arg(node, 4).const, dtype=np.float64).reshape(-1)
    return g.add_const(f"{node.name}_bias_float", (bias * scale).astype(np.float32))
