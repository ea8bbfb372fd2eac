"""Explicit quantization (Q/DQ): DequantizeLinear(x) -> Conv/MatMul/Gemm(DequantizeLinear(W_int8)) [-> QuantizeLinear]
becomes one INT8 layer carrying its scales (TensorRT's QuantizeDoubleInputNodes; the INT8 weights stay INT8:
ConstWeightsQuantizeFusion is constant folding of Q(W) plus ConstantFolding leaving DQ(W_int8) alone). A MatMul's
second input may also be an INT8 activation with a per-tensor scale (attention's products in a Q/DQ model).

A layer with no QuantizeLinear after it has no output scale: it computes in INT8 but writes FP32. TensorRT
does that silently; kiln warns and says how to fix it (add Q/DQ after the layer's output)."""
from __future__ import annotations

import logging

import numpy as np

from kiln.ir import Graph, Node, Value, same_shape
from kiln.passes.manager import PassLog
from kiln.passes.patterns import (activation_spec, other_input, remove_dead, replace_nodes, sole_consumer,
                                 why_not_sole_consumer)
from kiln.trt.vocab import fused_layer_name

log = logging.getLogger("kiln.build")
QUANTIZABLE = {"Conv": "QConv", "MatMul": "QMatMul", "Gemm": "QGemm"}
INT8_TYPES = ("uint8", "int8")


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


def _scalar_params(node: Node | None) -> tuple[float, int] | None:
    """(scale, zero point) of a per-tensor Q/DQ node with constant parameters, else None."""
    params = _params(node) if node is not None else None
    if params is None or params[0].size != 1 or params[1].size != 1:
        return None
    return float(params[0].reshape(-1)[0]), int(params[1].reshape(-1)[0])


def _output_quant(q: Node | None) -> dict | None:
    """{y_scale, y_zero_point, y_dtype} of a per-tensor QuantizeLinear to INT8 with constant parameters; None
    otherwise (a 16-bit one stays a QuantizeLinear: kiln's quantized layers write 8 bits)."""
    is_int8 = q is not None and q.op_type == "QuantizeLinear" and str(q.outputs[0].dtype) in INT8_TYPES
    params = _scalar_params(q) if is_int8 else None
    return None if params is None else {"y_scale": params[0], "y_zero_point": params[1],
                                        "y_dtype": str(q.outputs[0].dtype)}


def fuse_quantized_layers(g: Graph, plog: PassLog) -> None:
    """QuantizeDoubleInputNodes: INT8 input and INT8 weights (each with its scale) make one INT8 layer."""
    for node in [n for n in g.nodes if n.op_type in QUANTIZABLE and n.domain in ("", "ai.onnx")]:
        dqw = _dq(node.inputs[1])
        if dqw is None:
            continue
        plog.running(node)
        dqx = _dq(node.inputs[0])
        reason = _blocker(dqx, dqw, node.op_type)
        if reason:
            plog.not_fused(dqx.name if dqx else node.inputs[0].name, node, reason)
            continue
        (sx, zx), (sw, zw) = _params(dqx), _params(dqw)
        quant = {"x_scale": float(sx.reshape(-1)[0]), "x_zero_point": int(zx.reshape(-1)[0]),
                 "x_dtype": str(dqx.inputs[0].dtype), "w_scale": sw.reshape(-1).astype(float).tolist(),
                 "w_zero_point": zw.reshape(-1).astype(int).tolist(), "w_axis": int(dqw.attrs.get("axis", 1))}
        nodes, out = [node], node.outputs[0]
        q = sole_consumer(g, node)
        if (y := _output_quant(q)) is not None:
            quant.update(y)
            nodes, out = [node, q], q.outputs[0]
            plog.fusing(node, q)
        else:
            plog.note(f"{node.name}: INT8 {node.op_type} with FP32 output (no QuantizeLinear after it)")
            note = " It is a network output: if FP32 is what you want, nothing needs to change." \
                if g.is_output(node.outputs[0]) else ""
            log.warning("%s runs in INT8 but its output stays FP32: no QuantizeLinear follows it, so there is no "
                        "output scale. Add a QuantizeLinear/DequantizeLinear pair after its output '%s' to keep "
                        "the next layer in INT8 (TensorRT builds this silently).%s", node.name, node.outputs[0].name,
                        note)
        origin = _dq_origins(g, [dqx, dqw], nodes) + tuple(o for n in nodes for o in n.origin)
        name = _layer_name(nodes)
        plog.fusing(dqx, node)
        attrs = {**node.attrs, "quant": quant}
        inputs = [dqx.inputs[0], dqw.inputs[0]] + list(node.inputs[2:])
        replace_nodes(g, nodes, Node(name, QUANTIZABLE[node.op_type], inputs, [out], attrs, "kiln", origin))
        remove_dead(g, [dqx, dqw])   # the layer reads their INT8 tensors (a DQ another node reads stays)


def _dq_origins(g: Graph, dqs: list[Node], nodes: list[Node]) -> tuple[str, ...]:
    """The ONNX nodes a fused layer names for the DequantizeLinear nodes it absorbs: those of a DQ only this layer
    reads, less any another node stands for. A DQ merged with another consumer's (HorizontalMergeQNodes) carries
    that consumer's origin too: an unfolded QOperator model's DQs stand for the QLinear node reading them, and a
    ResNet block's downsample convolution named its neighbouring conv1 after reading conv1's merged DQ."""
    others = {o for n in g.nodes if n not in dqs and n not in nodes for o in n.origin}
    return tuple(o for d in dqs if len(d.outputs[0].users) == 1 for o in d.origin if o not in others)


def _layer_name(nodes: list[Node]) -> str:
    """The fused layer's name, from its nodes' names; a QuantizeLinear that an unfolded QOperator node made (its
    origin, that node, already named by the op: kiln.passes.qoperator) adds nothing to it."""
    named = {o for n in nodes if n.op_type != "QuantizeLinear" for o in n.origin}
    return fused_layer_name(n.name for n in nodes
                            if n.op_type != "QuantizeLinear" or not n.origin or not set(n.origin) <= named)


def _blocker(dqx: Node | None, dqw: Node, op_type: str) -> str | None:
    """Why the layer stays FP32; None where it runs in INT8. A MatMul's second input may be an INT8 activation (a
    Q/DQ model's attention products) with a per-tensor scale; convolutions and Gemms take constant weights."""
    if dqx is None:
        return "the input is not dequantized from INT8 (no input scale): the layer stays FP32"
    if dqx.inputs[0].is_const:
        return "the dequantized input is a constant"
    if str(dqx.inputs[0].dtype) not in INT8_TYPES:
        return f"the input is dequantized from {dqx.inputs[0].dtype}: kiln's quantized kernels read 8-bit activations"
    px, pw = _params(dqx), _params(dqw)
    if px is None or px[0].size != 1:
        return "the input scale is not a constant per-tensor scale"
    if pw is not None and not dqw.inputs[0].is_const and op_type == "MatMul":
        if pw[0].size != 1:
            return "the second input is an activation without a per-tensor scale"
        ranks = (len(dqx.outputs[0].shape or ()), len(dqw.outputs[0].shape or ()))
        if ranks[0] != ranks[1] or ranks[0] < 2:   # what kiln's INT8 kernel multiplies (else DQ + FP32 MatMul)
            return f"the second input is an activation of rank {ranks[1]} against {ranks[0]}: kiln's INT8 product " \
                   "of two activations takes equal ranks of at least 2"
    elif pw is None or not dqw.inputs[0].is_const:
        return "the weights are not constant INT8 with constant scales"
    if str(dqw.inputs[0].dtype) not in INT8_TYPES:
        return f"a second input of type {dqw.inputs[0].dtype} is not INT8"
    return None


def _same_params(a: Node, b: Node) -> bool:
    pa, pb = _params(a), _params(b)
    return pa is not None and pb is not None and np.array_equal(pa[0], pb[0]) and np.array_equal(pa[1], pb[1]) \
        and a.attrs.get("axis", 1) == b.attrs.get("axis", 1)


def merge_duplicate_qdq(g: Graph, plog: PassLog) -> None:
    """HorizontalMergeQNodes: QuantizeLinear (or DequantizeLinear) nodes reading one tensor with the same scale
    and zero point compute the same thing once."""
    for v in [v for v in list(g.values.values()) if len(v.users) > 1]:
        for op in ("QuantizeLinear", "DequantizeLinear"):
            group = [n for n in v.users if n.op_type == op and n.inputs[0] is v and _params(n) is not None]
            keep = group[0] if group else None
            for dup in group[1:]:
                if not _same_params(keep, dup) or g.is_output(dup.outputs[0]) or dup not in g.nodes:
                    continue
                plog.running(keep)
                plog.fusing(keep, dup)
                keep.origin += tuple(o for o in dup.origin if o not in keep.origin)   # each consumer's, for metadata
                g.remove_node(dup)
                g.replace_all_uses(dup.outputs[0], keep.outputs[0])


# ops whose data input (0) only moves or is compared: a per-tensor Q/DQ commutes with them (Resize: nearest only)
SWAPPABLE = ("MaxPool", "Shuffle", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Gather",
             "Expand", "Tile", "Resize")


def _moves_only(op: Node) -> bool:
    """A SWAPPABLE op that only moves or compares its data input: a nearest Resize copies pixels, a linear or cubic
    one interpolates (in INT8 it would round differently)."""
    return op.op_type in SWAPPABLE and op.domain in ("", "ai.onnx", "kiln") and \
        (op.op_type != "Resize" or (op.attrs.get("mode", "nearest") == "nearest" and
                                    op.attrs.get("coordinate_transformation_mode") != "tf_crop_and_resize"))


def swap_dq_q_around_movement(g: Graph, plog: PassLog) -> None:
    """VanillaSwapWithFollowingQ: DQ -> (max pooling or data movement) -> Q with equal scales runs the op on the
    INT8 tensor itself (max and moves commute with a monotonic per-tensor quantization). A DQ read by several such
    ops (YOLOv8's C2f splits its SiLU's output with two Slices, each quantized again) stays for its other readers
    until none is left."""
    for op in [n for n in g.nodes if _moves_only(n)]:
        dq, q = _dq(op.inputs[0]), sole_consumer(g, op)
        if dq is None or q is None or q.op_type != "QuantizeLinear":
            continue
        if not _same_params(dq, q) or _params(q)[0].size != 1 or q.outputs[0].dtype != dq.inputs[0].dtype or \
                str(q.outputs[0].dtype) not in INT8_TYPES or g.is_output(q.outputs[0]):
            continue   # a network output keeps its name; a 16-bit tensor is not moved (kiln moves uint16 no further)
        plog.running(op)
        plog.fusing(dq, op)
        plog.fusing(op, q)
        out = q.outputs[0]
        g.remove_node(q)
        g.set_input(op, 0, dq.inputs[0])
        if not dq.outputs[0].users and not g.is_output(dq.outputs[0]):
            g.remove_node(dq)
        op.outputs[0].dtype = out.dtype
        g.replace_all_uses(out, op.outputs[0])


def fuse_quantized_add(g: Graph, plog: PassLog) -> None:
    """INT8 residual add: Q(act(DQ(a) + DQ(b))) with per-tensor scales becomes one INT8 ElementWise layer."""
    for add in [n for n in g.nodes if n.op_type == "Add" and n.domain in ("", "ai.onnx")]:
        dqs = [_dq(v) for v in add.inputs]
        if any(d is None or _scalar_params(d) is None or d.inputs[0].is_const or
               str(d.inputs[0].dtype) not in INT8_TYPES for d in dqs):
            continue
        nodes, act, nxt = [add], None, sole_consumer(g, add)
        if nxt is not None and activation_spec(g, nxt) is not None:
            act, nodes, nxt = activation_spec(g, nxt), nodes + [nxt], sole_consumer(g, nxt)
        plog.running(add)
        y = _output_quant(nxt)
        if y is None:
            plog.not_fused(add, nxt.name if nxt is not None else "its consumers",
                           "no per-tensor QuantizeLinear after the sum: it stays an FP32 add")
            continue
        (sa, za), (sb, zb) = _scalar_params(dqs[0]), _scalar_params(dqs[1])
        quant = {"a_scale": sa, "a_zero_point": za, "b_scale": sb, "b_zero_point": zb, "y_scale": y["y_scale"],
                 "y_zero_point": y["y_zero_point"], "a_dtype": str(dqs[0].inputs[0].dtype),
                 "b_dtype": str(dqs[1].inputs[0].dtype), "y_dtype": y["y_dtype"]}
        nodes.append(nxt)
        for n in nodes[1:]:
            plog.fusing(add, n)
        origin = _dq_origins(g, dqs, nodes) + tuple(o for n in nodes for o in n.origin)
        attrs = {"quant": quant, **({"activation": act} if act else {})}
        replace_nodes(g, nodes, Node(_layer_name(nodes), "QAdd", [dqs[0].inputs[0], dqs[1].inputs[0]],
                                     [nxt.outputs[0]], attrs, "kiln", origin))
        remove_dead(g, dqs)   # the sum reads the INT8 tensors: the producers' sole consumer is the sum again


def _int8_io_blocker(x_params: tuple | None, x_dtype: str, y_quant: dict | None) -> str | None:
    """Why an op between a DequantizeLinear and a QuantizeLinear (softmax, LayerNorm) cannot run INT8 in and out;
    None where it can."""
    if y_quant is None or y_quant["y_dtype"] not in INT8_TYPES:
        return "no per-tensor INT8 QuantizeLinear is its only reader"
    if x_params is None or x_dtype not in INT8_TYPES:
        return "the input's DequantizeLinear is not per-tensor INT8"
    return None


def replace_between_qdq(g: Graph, plog: PassLog, node: Node, blocker: str | None, op_type: str, attrs: dict,
                        more_inputs: tuple = ()) -> None:
    """`node` between a per-tensor INT8 DequantizeLinear and QuantizeLinear (_between_qdq) as one kiln `op_type`
    layer reading the INT8 tensor (then `more_inputs`), with `attrs` and the quantization; left as it is, with
    the reason logged, where it is not."""
    found = _between_qdq(g, node, plog, blocker)
    if found is None:
        return
    dq, q, quant = found
    plog.fusing(dq, node)
    plog.fusing(node, q)
    origin = _dq_origins(g, [dq], [node, q]) + node.origin + q.origin
    replace_nodes(g, [node, q], Node(_layer_name([node, q]), op_type, [dq.inputs[0], *more_inputs], [q.outputs[0]],
                                     {**attrs, "quant": quant}, "kiln", origin))
    remove_dead(g, [dq])


def _between_qdq(g: Graph, node: Node, plog: PassLog, blocker: str | None) -> tuple[Node, Node, dict] | None:
    """(its DequantizeLinear, its QuantizeLinear, the quantization) of an FP32 op that reads an INT8 activation
    through a per-tensor DequantizeLinear and whose one reader is a per-tensor QuantizeLinear; None where it is
    not (logged with the reason, `blocker` among them, where it reads such an activation)."""
    dq = _dq(node.inputs[0])
    if dq is None or dq.inputs[0].is_const or node.inputs[0].shape is None:
        return None
    plog.running(node)
    out = node.outputs[0]
    q = out.users[0] if len(out.users) == 1 and not g.is_output(out) else None
    x_params, y_quant, x_dtype = _scalar_params(dq), _output_quant(q), str(dq.inputs[0].dtype)
    reason = _int8_io_blocker(x_params, x_dtype, y_quant) or blocker
    if reason:
        plog.not_fused(node, q.name if q is not None else "its consumers", reason + ": it stays FP32")
        return None
    return dq, q, {"x_scale": x_params[0], "x_zero_point": x_params[1], "x_dtype": x_dtype, **y_quant}


def fuse_quantized_layer_norm(g: Graph, plog: PassLog) -> None:
    """INT8 LayerNorm, per-tensor scales, constant scale and bias::

        x (INT8) -> DequantizeLinear -> LayerNormalization -> QuantizeLinear -> y (INT8)
        ==>  x -> QLayerNorm -> y          (FP32 inside)

    Where x is a QAdd's sum that nothing else reads (a post-LN encoder's residual), the sum joins too: a, b ->
    QLayerNorm -> y, the sum still rounded to INT8 inside as its QuantizeLinear asked."""
    for ln in [n for n in g.nodes if n.op_type == "LayerNormalization" and n.domain in ("", "ai.onnx")]:
        found = _between_qdq(g, ln, plog, _layer_norm_blocker(g, ln))
        if found is None:
            continue
        dq, q, quant = found
        attrs = {**{k: ln.attrs[k] for k in ("axis", "epsilon") if k in ln.attrs}, "quant": quant}
        nodes, inputs, add = [ln, q], [dq.inputs[0]] + list(ln.inputs[1:]), dq.inputs[0].producer
        if _residual_sum(g, add, dq, ln):
            nodes, inputs, attrs["skip_quant"] = [add] + nodes, list(add.inputs) + inputs[1:], add.attrs["quant"]
            plog.fusing(add, ln)
        plog.fusing(dq, ln)
        plog.fusing(ln, q)
        origin = _dq_origins(g, [dq], nodes) + tuple(o for n in nodes for o in n.origin)
        replace_nodes(g, nodes, Node(_layer_name(nodes), "QLayerNorm", inputs, [q.outputs[0]], attrs, "kiln", origin))
        remove_dead(g, [dq])


def _layer_norm_blocker(g: Graph, ln: Node) -> str | None:
    """Why a LayerNormalization between INT8 Q/DQ stays FP32 (beyond its quantization); None where it need not."""
    if any(o.users or g.is_output(o) for o in ln.outputs[1:]):
        return "its mean or inverse standard deviation output is read"
    if any(v is not None and (not v.is_const or str(v.dtype) != "float32") for v in ln.inputs[1:]):
        return "its scale or bias is not an FP32 constant"
    if ln.attrs.get("stash_type", 1) != 1:
        return "it computes in a stash type other than FP32"
    return None


def _residual_sum(g: Graph, add: Node | None, dq: Node, ln: Node) -> bool:
    """`add` a QAdd without activation of two same-shape tensors (QAdd's inputs are INT8 by construction) whose
    sum only `dq` reads, and `dq` only `ln`: the sum is needed nowhere else."""
    if add is None or add.op_type != "QAdd" or add.domain != "kiln" or add.attrs.get("activation"):
        return False
    a, b, total = add.inputs[0], add.inputs[1], add.outputs[0]
    alike = same_shape(a, b) and same_shape(a, total)
    only = [u for v in (total, dq.outputs[0]) for u in v.users] == [dq, ln] and len(total.users) == 1
    return alike and only and not g.is_output(total) and not g.is_output(dq.outputs[0])


def split_q_across_concat(g: Graph, plog: PassLog) -> None:
    """SplitQAcrossPrecedingFanIn: Q(Concat(x1, x2, ...)) == Concat(Q(x1), Q(x2), ...) (Q is elementwise); where
    an input is DQ with the same scale and zero point, Q(DQ(a)) is `a` itself, so the concat runs on INT8."""
    for cat in [n for n in g.nodes if n.op_type == "Concat" and n.domain in ("", "ai.onnx")]:
        q = sole_consumer(g, cat)
        if _output_quant(q) is None or g.is_output(q.outputs[0]):
            continue
        plog.running(cat)
        for i, x in enumerate(list(cat.inputs)):
            dq = _dq(x)
            if dq is not None and _same_params(dq, q) and len(x.users) == 1 and not g.is_output(x) \
                    and dq.inputs[0].dtype == q.outputs[0].dtype:
                g.set_input(cat, i, dq.inputs[0])
                g.remove_node(dq)
                continue
            out = g.value(g.fresh_name(f"{x.name}_quantized"))
            out.shape, out.dtype, out.dyn_dims = x.shape, q.outputs[0].dtype, x.dyn_dims
            out.probe_shape = x.probe_shape
            g.add_node(Node(f"{q.name} [{i}]", "QuantizeLinear", [x] + list(q.inputs[1:]), [out], dict(q.attrs), "",
                            q.origin), g.nodes.index(cat))
            g.set_input(cat, i, out)
        plog.fusing(cat, q)
        result = q.outputs[0]
        g.remove_node(q)
        cat.outputs[0].dtype = result.dtype
        g.replace_all_uses(result, cat.outputs[0])


def fuse_quantized_residual(g: Graph, plog: PassLog) -> None:
    """ConvEltwiseSumFusion on INT8: QAdd(QConv(x), r) becomes QConv(x, residual=r); the convolution adds the
    dequantized residual before its activation and requantizes once to the sum's scale (oneDNN's sum post-op),
    so the convolution's own requantized output (and its rounding) disappears. Its scale stays in the layer's
    quant as `sum_input_*`: an external library given the layer back as Q/DQ ONNX needs it to fuse the
    convolution (onnxruntime's QLinearConv, then QLinearAdd)."""
    for add in [n for n in g.nodes if n.op_type == "QAdd" and n.domain == "kiln"]:
        convs = [(i, v.producer) for i, v in enumerate(add.inputs) if v.producer is not None
                 and v.producer.op_type == "QConv" and v.producer.domain == "kiln"]
        convs.sort(key=lambda c: g.nodes.index(c[1]), reverse=True)   # the later conv: the residual is ready
        reasons = []
        for i, conv in convs:
            plog.running(conv)
            reason = _quantized_residual_blocker(g, conv, add, i)
            if reason is None:
                _fuse_residual(g, conv, add, i)
                plog.fusing(conv, add)
                break
            reasons.append((conv, reason))
        else:
            for conv, reason in reasons:
                plog.not_fused(conv, add, reason)


def _quantized_residual_blocker(g: Graph, conv: Node, add: Node, i: int) -> str | None:
    q, a = conv.attrs["quant"], add.attrs["quant"]
    side, other = "ab"[i], add.inputs[1 - i]
    if sole_consumer(g, conv) is not add:
        return why_not_sole_consumer(g, conv)
    if "activation" in conv.attrs:
        return f"{conv.name} applies an activation before the sum"
    if len(conv.inputs) > 3 or "y_scale" not in q:
        return f"{conv.name} already has a residual input" if len(conv.inputs) > 3 else f"{conv.name} writes FP32"
    if (q["y_scale"], q["y_zero_point"]) != (a[f"{side}_scale"], a[f"{side}_zero_point"]):
        return "the convolution's output scale differs from the scale the sum reads it with"
    if other.shape != add.inputs[i].shape:
        return f"shapes differ ({list(other.shape)} vs {list(add.inputs[i].shape)}): broadcasting sum is not fusable"
    if str(other.dtype) != a["y_dtype"]:
        return f"the residual ({other.dtype}) and the sum ({a['y_dtype']}) have different INT8 types"
    return None


def _fuse_residual(g: Graph, conv: Node, add: Node, i: int) -> None:
    a, other_side = add.attrs["quant"], "ab"[1 - i]
    quant = {**conv.attrs["quant"], "y_scale": a["y_scale"], "y_zero_point": a["y_zero_point"],
             "y_dtype": a["y_dtype"], "r_scale": a[f"{other_side}_scale"],
             "r_zero_point": a[f"{other_side}_zero_point"], "sum_input_scale": conv.attrs["quant"]["y_scale"],
             "sum_input_zero_point": conv.attrs["quant"]["y_zero_point"],
             "sum_input_dtype": conv.attrs["quant"]["y_dtype"]}
    attrs = {**conv.attrs, "quant": quant, **({"activation": add.attrs["activation"]} if "activation" in add.attrs
                                              else {})}
    bias = conv.inputs[2] if len(conv.inputs) > 2 else None
    inputs = [conv.inputs[0], conv.inputs[1], bias, add.inputs[1 - i]]
    replace_nodes(g, [conv, add], Node(fused_layer_name([conv.name, add.name]), "QConv", inputs, [add.outputs[0]],
                                       attrs, "kiln", conv.origin + add.origin))


def fuse_requantized_bias(g: Graph, plog: PassLog) -> None:
    """RequantizedBiasFusion: quantize_static writes a MatMul and its bias Add as two quantized steps, Q(DQ(Q(x·W))
    + b): an INT8 product, then the bias added to its dequantized INT8 output. The product's kernel does both: it
    rounds its sums to INT8 at that (mid) scale as the model did, dequantizes, adds the bias [, activation] and
    requantizes to the Add's QuantizeLinear (or writes FP32 where none follows), in the graph's float steps; a
    separate pointwise layer (BERT-base: 72 of them) and its INT8 round trip through memory go.

    Only kiln's INT8 kernels round in the middle (oneDNN's post-ops cannot), so the pass takes what they run: a
    MatMul (a Gemm's or convolution's bias is its own input in quantize_static files) and the activations of
    their epilogue (kiln.tactics.gemm_c.fused_activation); with another activation after the bias it declines."""
    for layer in [n for n in g.nodes if n.op_type == "QMatMul" and n.domain == "kiln"]:
        q = layer.attrs["quant"]
        dq = sole_consumer(g, layer) if "y_scale" in q else None
        add = sole_consumer(g, dq) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx"):
            continue
        plog.running(layer)
        bias = other_input(add, dq.outputs[0])
        reason = _requantized_bias_blocker(g, layer, dq, add, bias)
        if reason:
            plog.not_fused(layer, add, reason)
            continue
        _fuse_requantized_bias(g, plog, layer, dq, add, bias)


def _requantized_bias_blocker(g: Graph, layer: Node, dq: Node, add: Node, bias: Value | None) -> str | None:
    q = layer.attrs["quant"]
    if len(layer.inputs) > 2 and any(v is not None for v in layer.inputs[2:]):
        return f"{layer.name} already has a bias or residual"
    if "activation" in layer.attrs:
        return f"{layer.name} applies an activation before its output is requantized"
    if layer.attrs.get("out_steps"):
        return f"{layer.name} moves its output after the product (out_steps): a bias would come before them"
    if _scalar_params(dq) != (q["y_scale"], q["y_zero_point"]):
        return "the DequantizeLinear after it has another scale or zero point than its output's"
    if bias is None or not bias.is_const or np.dtype(bias.dtype) != np.float32:
        return "the Add's other operand is not a constant FP32 bias"
    if _bias_vector(layer, bias) is None:
        return f"bias shape {list(bias.shape)} does not broadcast along the output channels only"
    nxt = sole_consumer(g, add)
    spec = activation_spec(g, nxt) if nxt is not None else None
    if spec is not None and not _epilogue_activation(spec):
        return f"the INT8 kernels' epilogue has no {spec['op']} (the activation after the bias)"
    return None


def _epilogue_activation(spec: dict) -> bool:
    """Whether kiln's INT8 kernels apply this activation after the bias (kiln.tactics.gemm_c.fused_activation)."""
    attrs = spec.get("attrs", {})
    return spec["op"] in ("Relu", "Clip", "Gelu") or (spec["op"] == "Swish" and attrs.get("alpha", 1.0) == 1.0)


def _bias_vector(layer: Node, bias: Value) -> np.ndarray | None:
    """The bias as one FP32 value per output column (the product's last axis); None where it broadcasts along any
    other axis or would widen the output."""
    out = layer.outputs[0].shape
    if not out:
        return None
    axis = len(out) - 1
    shape = (1,) * (len(out) - len(bias.shape)) + tuple(bias.shape)
    if len(bias.shape) > len(out) or any(d != 1 for i, d in enumerate(shape) if i != axis) or \
            shape[axis] not in (1, out[axis]):
        return None
    return np.ascontiguousarray(np.broadcast_to(np.asarray(bias.const).reshape(-1), (out[axis],)), np.float32)


def _fuse_requantized_bias(g: Graph, plog: PassLog, layer: Node, dq: Node, add: Node, bias: Value) -> None:
    q = {k: v for k, v in layer.attrs["quant"].items() if not k.startswith("y_")}
    q.update(mid_scale=layer.attrs["quant"]["y_scale"], mid_zero_point=layer.attrs["quant"]["y_zero_point"],
             mid_dtype=layer.attrs["quant"]["y_dtype"])
    nodes, attrs, nxt = [layer, dq, add], dict(layer.attrs), sole_consumer(g, add)
    if nxt is not None and activation_spec(g, nxt) is not None:
        attrs["activation"], nodes, nxt = activation_spec(g, nxt), nodes + [nxt], sole_consumer(g, nxt)
    if (y := _output_quant(nxt)) is not None:
        q.update(y)
        nodes.append(nxt)
    for n in nodes[1:]:
        plog.fusing(layer, n)
    vector = g.add_const(g.fresh_name(f"{add.name}.bias"), _bias_vector(layer, bias))
    origin = tuple(o for n in nodes for o in n.origin)
    name = _layer_name([n for n in nodes if n is not dq])
    inputs = [layer.inputs[0], layer.inputs[1], vector]
    replace_nodes(g, nodes, Node(name, layer.op_type, inputs, [nodes[-1].outputs[0]], {**attrs, "quant": q}, "kiln",
                                 origin))
