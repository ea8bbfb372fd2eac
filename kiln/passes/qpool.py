"""INT8-in, INT8-out layers for an op between a per-tensor DQ and Q: QuantizedSoftmaxFusion and
QuantizedResizeFusion (a linear or cubic Resize: kiln's QResize; a nearest one only moves bytes and is swapped with
its Q/DQ instead), both below, and QuantizedPoolFusion, an average pool run on INT8 tensors::

    x (INT8) -> DequantizeLinear -> AveragePool | GlobalAveragePool | ReduceMean(H, W) -> QuantizeLinear -> y (INT8)
    ==>  x -> QAveragePool -> y          (integer window sums, one rounding to the output scale)

onnxruntime runs these as QLinearAveragePool / QLinearGlobalAveragePool and OpenVINO on INT8 too; left FP32, each
is a dequantize, a float pool and a quantize (DenseNet's transitions, Inception's pooled branch, every squeeze-excite
block's global average, a classifier's final pool). QOperator models' QLinear pools arrive here unfolded."""
from __future__ import annotations

from kiln.ir import Graph, Node
from kiln.ops.nn import reduce_axes
from kiln.passes.manager import PassLog
from kiln.passes.quantization import replace_between_qdq

AVERAGE_POOLS = ("AveragePool", "GlobalAveragePool", "ReduceMean")


def _blocker(node: Node) -> str | None:
    """Why kiln's INT8 pool cannot take this average pool; None where it can."""
    rank = len(node.inputs[0].shape or ())
    if rank != 4:
        return f"its input is {rank}-D: kiln's INT8 average pools take 4-D NCHW maps"
    if node.op_type == "AveragePool":
        if len(node.attrs.get("kernel_shape") or ()) != 2:
            return "it is not a 2-D window"
        if node.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", ""):
            return f"auto_pad {node.attrs['auto_pad']} is not resolved to explicit pads"
    if node.op_type == "ReduceMean":
        given = node.inputs[1] if len(node.inputs) > 1 else None
        if given is not None and not given.is_const:
            return "its axes are computed at run time"
        axes = reduce_axes(node.attrs, [None, None if given is None else given.const.reshape(-1).tolist()], rank)
        if axes is None or sorted(axes) != [2, 3]:
            return f"it averages axes {axes}, not the spatial axes (2, 3)"
    return None


def fuse_quantized_pools(g: Graph, plog: PassLog) -> None:
    for pool in [n for n in g.nodes if n.op_type in AVERAGE_POOLS and n.domain in ("", "ai.onnx")]:
        replace_between_qdq(g, plog, pool, _blocker(pool), "QAveragePool", {**pool.attrs, "pool": pool.op_type},
                            tuple(pool.inputs[1:]))


def fuse_quantized_softmax(g: Graph, plog: PassLog) -> None:
    """INT8 Softmax (TensorRT's int8 softmax inside its fused attention)::

        x (INT8) -> DequantizeLinear -> Softmax(last axis) -> QuantizeLinear -> y (INT8)
        ==>  x -> QSoftmax -> y          (FP32 inside, each probability quantized as the Q node would)

    per-tensor scales only. The attention probabilities of a quantize_static model are read by P.V as INT8."""
    for sm in [n for n in g.nodes if n.op_type == "Softmax" and n.domain in ("", "ai.onnx")]:
        rank = len(sm.inputs[0].shape or ())
        axis = sm.attrs.get("axis", -1 if g.opset >= 13 else 1) % max(rank, 1)
        replace_between_qdq(g, plog, sm, f"it normalizes axis {axis}, not the last" if axis != rank - 1 else None,
                            "QSoftmax", {"axis": axis})


def _resize_blocker(node: Node) -> str | None:
    """Why kiln's INT8 Resize cannot take this Resize; None where it can."""
    rank = len(node.inputs[0].shape or ())
    if rank != 4:
        return f"its input is {rank}-D: kiln's INT8 Resize takes 4-D NCHW maps"
    if node.attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        return "tf_crop_and_resize fills pixels outside the crop with a float"
    if any(v is not None and not v.is_const for v in node.inputs[1:]):
        return "its roi, scales or sizes are computed at run time"
    return None


def fuse_quantized_resizes(g: Graph, plog: PassLog) -> None:
    """INT8 linear or cubic Resize (a segmentation head's or FPN's bilinear upsample in a quantize_static model)::

        x (INT8) -> DequantizeLinear -> Resize(linear | cubic) -> QuantizeLinear -> y (INT8)
        ==>  x -> QResize -> y          (FP32 sums of the centred taps, each output quantized as the Q node would)
    """
    for rz in [n for n in g.nodes if n.op_type == "Resize" and n.domain in ("", "ai.onnx")]:
        if rz.attrs.get("mode", "nearest") in ("linear", "cubic"):
            replace_between_qdq(g, plog, rz, _resize_blocker(rz), "QResize", dict(rz.attrs), tuple(rz.inputs[1:]))
