"""Convolution fusions: fold a zero Pad and BatchNormalization, absorb a residual Add, absorb an activation."""
from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node, Value, same_shape, shape_at_points
from kiln.ops.shape import pad_widths
from kiln.passes.manager import PassLog
from kiln.passes.patterns import (activation_spec, batchnorm_factors, const_value, fused_name, is_op, replace_nodes,
                                  sole_consumer, why_not_sole_consumer)


def fold_pad_into_conv(g: Graph, plog: PassLog) -> None:
    """PaddingConvFusion:  Pad(x, zeros around H/W) -> Conv  ==>  Conv(x) with the Pad's widths added to its pads,
    as TensorRT's ONNX parser folds it (tf2onnx and Keras exports pad explicitly: ZeroPadding2D, TF's SAME)."""
    for conv in [n for n in g.nodes if is_op(n, "Conv")]:
        pad = conv.inputs[0].producer
        if pad is None or pad.op_type != "Pad" or pad.domain not in ("", "ai.onnx"):
            continue
        plog.running(pad)
        widths, reason = _zero_pad_widths(g, pad, conv)
        if reason is not None:
            plog.not_fused(pad, conv, reason)
            continue
        rank = len(widths) // 2
        begins, ends = widths[2:rank], widths[rank + 2:]
        old, k = list(conv.attrs["pads"]), rank - 2
        attrs = {key: v for key, v in conv.attrs.items() if key != "padding_mode"}   # explicit pads now
        attrs["pads"] = [a + b for a, b in zip(old[:k], begins)] + [a + b for a, b in zip(old[k:], ends)]
        name, origin = fused_name([pad, conv])
        plog.fusing(pad, conv)
        replace_nodes(g, [pad, conv], Node(name, "Conv", [pad.inputs[0], *conv.inputs[1:]], list(conv.outputs), attrs,
                                           "", origin))


def _zero_pad_widths(g: Graph, pad: Node, conv: Node) -> tuple[list[int], str | None]:
    """The Pad's widths per axis [begins..., ends...] where a convolution can take them as its own zero padding,
    else the reason it cannot."""
    if sole_consumer(g, pad) is not conv:
        return [], why_not_sole_consumer(g, pad)
    if pad.attrs.get("mode", "constant") != "constant":
        return [], f"{pad.name} pads in mode '{pad.attrs['mode']}', not with a constant"
    inputs = list(pad.inputs) + [None] * (4 - len(pad.inputs))
    pads, value, axes = (const_value(v) for v in inputs[1:4])
    pads = pad.attrs.get("pads") if inputs[1] is None else pads
    value = pad.attrs.get("value", 0.0) if inputs[2] is None else value
    if pads is None or (inputs[3] is not None and axes is None) or value is None:
        return [], f"{pad.name}'s pads, constant or axes are computed at run time"
    if np.any(np.asarray(value, dtype=np.float64) != 0):
        return [], f"{pad.name} pads with {np.asarray(value).reshape(-1)[0]}, not 0"
    rank = len(pad.inputs[0].shape)
    widths = pad_widths(rank, np.asarray(pads).reshape(-1), None if axes is None else np.asarray(axes).reshape(-1))
    if any(w < 0 for w in widths):
        return [], f"{pad.name} crops (a negative pad)"
    if any(widths[a] or widths[a + rank] for a in (0, 1)):
        return [], f"{pad.name} pads the batch or channel axis"
    return widths, None


def fold_batchnorm_into_conv(g: Graph, plog: PassLog) -> None:
    """ConvScaleFusion:  x -> Conv(W, b) -> BatchNormalization(s, B, mean, var)  ==>  Conv(W*k, (b-mean)*k + B);
    likewise a ConvTranspose (DCGAN's generator, decoders), whose weights are [C_in, C_out/group, k...], an INT8
    DynamicQConv, whose weight scales take k instead of its weights, and a Conv of DequantizeLinear(INT8 W) (a
    TensorRT-style QAT export keeps its BatchNorms), whose DequantizeLinear's scales take k."""
    for bn in [n for n in g.nodes if n.op_type == "BatchNormalization"]:
        conv = bn.inputs[0].producer
        if not is_op(conv, ("Conv", "ConvTranspose", "DynamicQConv")):
            continue
        plog.running(conv)
        if sole_consumer(g, conv) is not bn:
            plog.not_fused(conv, bn, why_not_sole_consumer(g, conv))
            continue
        if "activation" in conv.attrs or len(conv.inputs) > 3:
            plog.not_fused(conv, bn, f"{conv.name} already has a fused activation or residual")
            continue
        factors, bias = batchnorm_factors(bn), conv.inputs[2] if len(conv.inputs) > 2 else None
        if factors is None or (bias is not None and not bias.is_const):
            plog.not_fused(conv, bn, "BatchNormalization parameters or the convolution's bias are not constant")
            continue
        k, shift = factors
        name, origin = fused_name([conv, bn])
        attrs = dict(conv.attrs)
        folded = _folded_weights(g, conv, k, name, attrs)
        if isinstance(folded, str):
            plog.not_fused(conv, bn, folded)
            continue
        new_w, bias_dtype = folded
        b = bias.const if bias is not None else np.zeros(len(k))
        new_b = g.add_const(f"{name}.bias", (b.astype(np.float64) * k + shift).astype(bias_dtype))
        plog.fusing(conv, bn)
        replace_nodes(g, [conv, bn], Node(name, conv.op_type, [conv.inputs[0], new_w, new_b], [bn.outputs[0]], attrs,
                                          conv.domain, origin))


def _folded_weights(g: Graph, conv: Node, k: np.ndarray, name: str, attrs: dict) -> tuple[Value, np.dtype] | str:
    """The weights scaled by k per output channel and the folded bias's dtype, or why they cannot be: constant
    weights are scaled; a DynamicQConv's scales (in `attrs`, updated) or a DequantizeLinear's take k instead."""
    w = conv.inputs[1]
    if "quant" in attrs:   # an INT8 DynamicQConv: k scales its per-channel dequantization, the weights stay
        attrs["quant"] = {**attrs["quant"], "w_scale": (np.asarray(attrs["quant"]["w_scale"]) * k).tolist()}
        return w, np.dtype(np.float32)
    if w.is_const:
        scaled = _scaled_output_channels(w.const, k, conv.op_type == "ConvTranspose", conv.attrs.get("group", 1))
        return g.add_const(f"{name}.weight", scaled), w.const.dtype
    dq = w.producer
    if not is_op(dq, "DequantizeLinear"):
        return "the convolution's weights are not constant"
    if conv.op_type != "Conv":
        return f"only a Conv's DequantizeLinear filter takes the BatchNorm, not a {conv.op_type}'s"
    folded = _scaled_filter_quantization(dq, k)
    if isinstance(folded, str):
        return folded
    if sole_consumer(g, dq) is not conv:
        return why_not_sole_consumer(g, dq)
    q_w, q_scale, q_zp = folded
    inputs = [g.add_const(f"{name}.{part}", v) for part, v in (("weight", q_w), ("weight_scale", q_scale),
                                                                ("weight_zero_point", q_zp))]
    replace_nodes(g, [dq], Node(dq.name, "DequantizeLinear", inputs, [w], {**dq.attrs, "axis": 0}, dq.domain,
                                dq.origin))
    return w, q_scale.dtype   # the dequantized filter's type (FP32, or FP16 scales in an FP16 model)


def _scaled_filter_quantization(dq: Node, k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | str:
    """(W, scale, zero point) of DequantizeLinear(W) * k per output channel, or why not: the scales take |k|; a
    channel whose k is negative takes -W and -zero point, so every scale stays positive (as INT8 kernels and
    onnxruntime's QLinearConv want). W must be a constant INT8 filter, its scales per tensor or per channel."""
    w, scale = const_value(dq.inputs[0]), const_value(dq.inputs[1])
    zp = const_value(dq.inputs[2]) if len(dq.inputs) > 2 and dq.inputs[2] is not None else np.zeros(1, np.int8)
    if w is None or w.dtype not in (np.int8, np.uint8) or w.ndim < 3 or scale is None or zp is None or \
            dq.attrs.get("block_size"):
        return f"{dq.name} does not dequantize a constant INT8 filter with constant scales"
    channels = w.shape[0]
    if scale.size != 1 and (scale.size != channels or dq.attrs.get("axis", 1) not in (0, -w.ndim)):
        return f"{dq.name}'s scales are neither per tensor nor per output channel"
    signs = np.where(k < 0, -1, 1)
    flipped = w.astype(np.int64) * signs.reshape((-1,) + (1,) * (w.ndim - 1))
    new_zp = np.broadcast_to(zp.reshape(-1), (channels,)).astype(np.int64) * signs
    info = np.iinfo(w.dtype)
    if min(flipped.min(), new_zp.min()) < info.min or max(flipped.max(), new_zp.max()) > info.max:
        return f"BatchNormalization negates channels whose {w.dtype} weights or zero points cannot be negated"
    new_scale = np.broadcast_to(scale.reshape(-1).astype(np.float64), (channels,)) * np.abs(k)
    return flipped.astype(w.dtype), new_scale.astype(scale.dtype), new_zp.astype(w.dtype)


def _scaled_output_channels(w: np.ndarray, k: np.ndarray, transposed: bool, groups: int) -> np.ndarray:
    """Weights with output channel o scaled by k[o]: axis 0 of a Conv's [O, I/g, ...]; for a ConvTranspose's
    [I, O/g, ...], channel j of group gi is output gi * O/g + j."""
    if not transposed:
        return (w.astype(np.float64) * k.reshape((-1,) + (1,) * (w.ndim - 1))).astype(w.dtype)
    grouped = w.astype(np.float64).reshape(groups, w.shape[0] // groups, *w.shape[1:])
    factors = k.reshape(groups, 1, w.shape[1], *(1,) * (w.ndim - 2))
    return (grouped * factors).reshape(w.shape).astype(w.dtype)


def fuse_residual_add(g: Graph, plog: PassLog, producer_ops: tuple[str, ...] = ("Conv", "DynamicQConv")) -> None:
    """ConvEltwiseSumFusion:  Conv(x) + r  ==>  Conv(x, residual=r)  (same shapes, conv read only by the Add); a
    DynamicQConv takes its FP32 residual the same way (its kernel adds it before the activation), and so does a
    linear layer (kiln.passes.gemm.fuse_matmul_residual): input 3 in every case, after the bias."""
    for add in [n for n in g.nodes if is_op(n, "Add")]:
        a, b = add.inputs
        candidates = [(v, other) for v, other in ((a, b), (b, a)) if is_op(v.producer, producer_ops)]
        if not candidates:
            continue
        # prefer the later convolution: the other operand is then computed already
        candidates.sort(key=lambda c: g.nodes.index(c[0].producer), reverse=True)
        reasons = []
        for conv_out, other in candidates:
            conv = conv_out.producer
            plog.running(conv)
            reason = _residual_blocker(g, conv, add, conv_out, other)
            if reason is None:
                name, origin = fused_name([conv, add])
                bias = conv.inputs[2] if len(conv.inputs) > 2 else None
                inputs = [conv.inputs[0], conv.inputs[1], bias, other]
                plog.fusing(conv, add)
                replace_nodes(g, [conv, add], Node(name, conv.op_type, inputs, [add.outputs[0]], dict(conv.attrs),
                                                   conv.domain, origin))
                break
            reasons.append((conv, reason))
        else:
            for conv, reason in reasons:
                plog.not_fused(conv, add, reason)


def _residual_blocker(g: Graph, conv: Node, add: Node, conv_out, other) -> str | None:
    if sole_consumer(g, conv) is not add:
        return why_not_sole_consumer(g, conv)
    weight = conv.inputs[1]
    if conv.op_type in ("MatMul", "Gemm") and not (weight.is_const and weight.shape and len(weight.shape) == 2):
        return f"{conv.name} multiplies two activations (kiln adds residuals only in linear layers' kernels)"
    if "activation" in conv.attrs:
        return f"{conv.name} already applies an activation before the sum"
    if len(conv.inputs) > 3:
        return f"{conv.name} already has a residual input"
    if other.is_const:
        return "the other operand is a constant (a bias, not a residual)"
    if other.shape != conv_out.shape:
        return f"shapes differ ({list(other.shape)} vs {list(conv_out.shape)}): broadcasting sum is not fusable"
    if not same_shape(other, conv_out):
        return (f"the shapes may differ at other input shapes ({shape_at_points(other)} vs "
                f"{shape_at_points(conv_out)}; probe sizes in brackets): the sum may broadcast at run time")
    if other.dtype != conv_out.dtype:
        return "operand data types differ"
    return None


def fuse_activation(g: Graph, plog: PassLog, producer_ops: tuple[str, ...] = ("Conv", "ConvTranspose", "DynamicQConv"),
                    only: tuple[str, ...] | None = None) -> None:
    """ConvReluFusion:  Conv/ConvTranspose(...) -> Relu/Clip/LeakyRelu/Sigmoid/...  ==>  one layer with `activation`.
    `only`: the activations the producer's kernels apply, Swish with alpha 1 (others stay, the reason logged)."""
    for node in [n for n in g.nodes if is_op(n, producer_ops)]:
        users = node.outputs[0].users
        if len(users) != 1:
            if any(activation_spec(g, u) for u in users):
                act = next(u for u in users if activation_spec(g, u))
                plog.not_fused(node, act, why_not_sole_consumer(g, node))
            continue
        act = users[0]
        spec = activation_spec(g, act)
        if spec is None:
            continue
        plog.running(node)
        if g.is_output(node.outputs[0]):
            plog.not_fused(node, act, why_not_sole_consumer(g, node))
            continue
        if "activation" in node.attrs:
            plog.not_fused(node, act, f"{node.name} already applies {node.attrs['activation']['op']}")
            continue
        swish_scaled = spec["op"] == "Swish" and spec["attrs"].get("alpha", 1.0) != 1.0   # x * sigmoid(a x)
        if only is not None and (spec["op"] not in only or swish_scaled):
            plog.not_fused(node, act, f"kiln's {node.op_type} kernels apply {' and '.join(only)} only")
            continue
        name, origin = fused_name([node, act])
        attrs = dict(node.attrs, activation=spec)
        plog.fusing(node, act)
        replace_nodes(g, [node, act], Node(name, node.op_type, list(node.inputs), [act.outputs[0]], attrs, node.domain,
                                           origin))


def fuse_norm_activation(g: Graph, plog: PassLog) -> None:
    """NormActFusion:  Group/InstanceNormalization -> Relu | SiLU  ==>  one normalization layer applying it, as
    TensorRT's group-norm plugin takes SiLU: every GroupNorm of a diffusion U-Net or VAE is followed by one."""
    fuse_activation(g, plog, producer_ops=("GroupNormalization", "InstanceNormalization"), only=("Relu", "Swish"))


def fuse_gemm_activation(g: Graph, plog: PassLog) -> None:
    """GemmActFusion:  Gemm/MatMul(...) -> activation  ==>  one MatrixMultiply layer with the activation."""
    fuse_activation(g, plog, producer_ops=("Gemm", "MatMul", "DynamicQMatMul"))
