"""Transformer fusions: horizontal merge of matrix products sharing an input (`q || k || v`), attention (Q·Kᵀ,
scale, mask, softmax, ·V and the data movement around it) and residual-add + LayerNorm (GELU: kiln.passes.gelu).

    MatMulHorizontalMerge: MatMul(x, Wq [+bq]), MatMul(x, Wk [+bk]), ...     ==>  MatMul(x, [Wq|Wk|..]) -> Split
    AttentionFusion:     [Shuffle] MatMul(q, kᵀ) [*s] [+mask] Softmax MatMul(·, v) [Shuffle]  ==>  Attention
    SkipLayerNormFusion: LayerNormalization(a + b)                           ==>  SkipLayerNormalization(a, b)
"""
from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node, Value, same_shape
from kiln.passes.manager import PassLog
from kiln.passes.patterns import (fused_name, graph_order, is_op, is_shuffle, other_input, replace_nodes, scalar_const,
                                  sole_consumer)
from kiln.trt.vocab import merged_layer_name

HEAD_STEPS = ("q_steps", "k_steps", "v_steps")   # the attention layer's data movement on Q, Kᵀ and V


def _fused(g: Graph, nodes: list[Node]) -> tuple[str, tuple[str, ...]]:
    return fused_name(graph_order(g, nodes))


# ---- horizontal MatMul merge ---------------------------------------------------------------------------
def merge_matmuls(g: Graph, plog: PassLog) -> None:
    """MatMulHorizontalMerge: matrix products of one activation with constant weights (Q, K, V projections; FP32
    or dynamically quantized) become one wider product and a Split, named `a || b || c` as TensorRT names
    horizontal merges."""
    for x in [v for v in list(g.values.values()) if len(v.users) > 1 and not v.is_const]:
        group = [n for n in x.users if _mergeable(n, x)]
        group = [n for n in group if (n.op_type, n.inputs[1].dtype) == (group[0].op_type, group[0].inputs[1].dtype)]
        if len(group) < 2:
            continue
        k = group[0].inputs[1].shape[0]
        with_bias = [n for n in group if _bias(n) is not None]
        group = [n for n in group if n.inputs[1].shape[0] == k and (_bias(n) is not None) == (len(with_bias) > 1)]
        if len(group) < 2:
            continue
        group = graph_order(g, group)
        for n in group[1:]:
            plog.running(group[0])
            plog.fusing(group[0], n)
        _merge(g, group, x)


def _bias(n: Node) -> Value | None:
    return n.inputs[2] if len(n.inputs) > 2 and n.inputs[2] is not None else None


def _mergeable(n: Node, x: Value) -> bool:
    w = n.inputs[1] if len(n.inputs) > 1 else None
    bias = _bias(n)
    product = is_op(n, ("MatMul", "DynamicQMatMul"))
    return (product and n.inputs[0] is x and w is not None and w.is_const and w.const.ndim == 2
            and "activation" not in n.attrs and (bias is None or (bias.is_const and bias.const.size == w.shape[1])))


def _merge(g: Graph, group: list[Node], x: Value) -> None:
    widths = [n.inputs[1].shape[1] for n in group]
    weight = g.add_const(g.fresh_name("merged_weight"), np.concatenate([n.inputs[1].const for n in group], axis=1))
    inputs = [x, weight]
    if _bias(group[0]) is not None:
        bias = np.concatenate([n.inputs[2].const.reshape(-1) for n in group])
        inputs.append(g.add_const(g.fresh_name("merged_bias"), bias.astype(group[0].inputs[2].const.dtype)))
    name = merged_layer_name(n.name for n in group)
    out = g.value(g.fresh_name(f"{group[0].outputs[0].name}_merged"))
    out.shape = group[0].outputs[0].shape[:-1] + (sum(widths),)
    out.dtype, out.dyn_dims = group[0].outputs[0].dtype, group[0].outputs[0].dyn_dims
    probe = group[0].outputs[0].probe_shape
    out.probe_shape = None if probe is None else probe[:-1] + (sum(widths),)
    sizes = g.add_const(g.fresh_name("merged_split"), np.array(widths, dtype=np.int64))
    outputs = [n.outputs[0] for n in group]
    origin = tuple(o for n in group for o in n.origin)
    index = min(g.nodes.index(n) for n in group)
    for n in group:
        g.remove_node(n)
    g.add_node(Node(f"{name} [Split]", "Split", [out, sizes], outputs, {"axis": -1}, "", ()), index)
    g.add_node(Node(name, group[0].op_type, inputs, [out], _merged_attrs(group), group[0].domain, origin), index)


def _merged_attrs(group: list[Node]) -> dict:
    """A DynamicQMatMul's per-column weight scales and zero points, concatenated as the weights are."""
    if "quant" not in group[0].attrs:
        return {}
    quants = [n.attrs["quant"] for n in group]
    return {"quant": {**quants[0], **{key: [v for q in quants for v in q[key]] for key in ("w_scale", "w_zero_point")}}}


# ---- attention -----------------------------------------------------------------------------------------
def fuse_attention(g: Graph, plog: PassLog) -> None:
    """AttentionFusion: one Attention layer per softmax(Q·Kᵀ·s + mask)·V, with the head split/merge shuffles."""
    for sm in [n for n in g.nodes if is_op(n, "Softmax")]:
        plog.running(sm)
        found = _match_core(g, sm)
        if isinstance(found, str):
            pv = sole_consumer(g, sm)
            plog.not_fused(sm, pv.name if pv is not None else "its consumers", found)
            continue
        nodes, inputs, attrs = found
        out = _absorb_movement(g, nodes, inputs, attrs)
        name, origin = _fused(g, nodes)
        plog.fusing(nodes[0], name)
        masks = inputs[3:]
        attention = replace_nodes(g, nodes, Node(name, "Attention", inputs[:3] + [None] * bool(masks), [out], attrs,
                                                 "kiln", origin))
        if masks:   # several masks (padding + position bias) are summed once, before the attention layer
            g.set_input(attention, 3, _sum_masks(g, masks, g.nodes.index(attention)))


def _match_core(g: Graph, sm: Node):
    s = sm.inputs[0]
    rank = len(s.shape)
    if sm.attrs.get("axis", -1) % rank != rank - 1:
        return "softmax is not over the last axis"
    probs, guard = sm.outputs[0], _nan_guard(g, sm)
    if guard:
        probs = guard[-1].outputs[0]
    pv, transposed, swap = _times_v(g, probs)
    if pv is None:
        return "its output is not multiplied by V"
    nodes, masks, scale, cur = [sm, pv] + guard + transposed, [], 1.0, s.producer
    while is_op(cur, "Add") and sole_consumer(g, cur) is not None and len(masks) < 3:   # mask, position bias, ...
        chain_in = next((v for v in cur.inputs if v.producer is not None and
                         v.producer.op_type in ("MatMul", "Mul", "Div", "Add")), None)
        if chain_in is None:
            return "the mask add does not follow Q·Kᵀ"
        masks.append(other_input(cur, chain_in))
        nodes, cur = nodes + [cur], chain_in.producer
    while (is_op(cur, "Mul") or is_op(cur, "Div")) and sole_consumer(g, cur) is not None:
        c = scalar_const(cur.inputs[1])
        if c is None:
            break
        scale *= c if cur.op_type == "Mul" else 1 / c
        nodes, cur = nodes + [cur], cur.inputs[0].producer
    if not is_op(cur, "MatMul") or len(cur.inputs) > 2 or sole_consumer(g, cur) is None:
        return "the scores are not Q·Kᵀ (a MatMul read only by the scaling, mask and softmax)"
    if any(m.dtype is None or np.dtype(m.dtype).kind != "f" for m in masks):
        return "the mask is not additive floating point"
    q, kt = cur.inputs
    nodes.append(cur)
    q, scale = _absorb_scale(g, q, scale, nodes)
    kt, scale = _absorb_scale(g, kt, scale, nodes)
    inputs = [q, kt, pv.inputs[0] if transposed else pv.inputs[1]] + masks
    return nodes, inputs, {"scale": float(scale), "nan_to_zero": bool(guard), "v_swap": swap}


def _times_v(g: Graph, probs: Value) -> tuple[Node | None, list[Node], list[dict]]:
    """(the MatMul multiplying the probabilities by V, the transposing Shuffle if any, its steps): P·V, or V'·Pᵀ
    with V' = Vᵀ (the attention block of latent-diffusion VAEs: bmm(v, w.permute(0, 2, 1)) on [B, C, HW] maps)."""
    reader = probs.users[0] if len(probs.users) == 1 and not g.is_output(probs) else None
    if is_op(reader, "MatMul") and reader.inputs[0] is probs and len(reader.inputs) == 2:
        return reader, [], []
    rank = len(probs.shape)
    swap = [{"transpose": list(range(rank - 2)) + [rank - 1, rank - 2]}]
    pv = sole_consumer(g, reader) if is_shuffle(reader) and reader.attrs["steps"] == swap else None
    if is_op(pv, "MatMul") and pv.inputs[1] is reader.outputs[0] and len(pv.inputs) == 2:
        return pv, [reader], swap
    return None, [], []


def _sum_masks(g: Graph, masks: list[Value], index: int) -> Value:
    """One additive mask from several (a padding mask plus a relative-position bias): their sum."""
    total = masks[0]
    for k, m in enumerate(masks[1:]):
        out = g.value(g.fresh_name(f"{total.name}_plus_mask"))
        shape = np.broadcast_shapes(total.shape, m.shape)
        out.shape, out.dtype = tuple(shape), total.dtype
        out.dyn_dims = tuple(sorted({len(shape) - len(v.shape) + i for v in (total, m) for i in v.dyn_dims}))
        if total.probe_shape is not None and m.probe_shape is not None:
            out.probe_shape = tuple(np.broadcast_shapes(total.probe_shape, m.probe_shape))
        g.add_node(Node(f"{out.name} [Add]", "Add", [total, m], [out], {}, "", ()), index + k)
        total = out
    return total


def _nan_guard(g: Graph, sm: Node) -> list[Node]:
    """Where(IsNaN(p), 0, p) after the softmax (SDPA exports: fully masked rows give 0, not NaN)."""
    p = sm.outputs[0]
    if len(p.users) != 2 or g.is_output(p):
        return []
    isnan = next((u for u in p.users if is_op(u, "IsNaN")), None)
    where = next((u for u in p.users if is_op(u, "Where")), None)
    if isnan is None or where is None or sole_consumer(g, isnan) is not where:
        return []
    cond, zero, kept = where.inputs
    if cond is not isnan.outputs[0] or kept is not p or scalar_const(zero) != 0.0:
        return []
    return [isnan, where]


def _absorb_scale(g: Graph, v: Value, scale: float, nodes: list[Node]) -> tuple[Value, float]:
    """A scalar Mul/Div on Q or Kᵀ joins the scale; also one behind the head shuffles (a scalar commutes with data
    movement: Keras/tf2onnx scale the query before its transpose), which then read the Mul's input."""
    p, shuffles = v.producer, []
    while is_shuffle(p) and sole_consumer(g, p) is not None:
        shuffles.append(p)
        p = p.inputs[0].producer
    if (is_op(p, "Mul") or is_op(p, "Div")) and sole_consumer(g, p) is not None and \
            scalar_const(p.inputs[1]) is not None:
        c = scalar_const(p.inputs[1])
        nodes.append(p)
        if shuffles:
            g.set_input(shuffles[-1], 0, p.inputs[0])
            g.set_input(p, 0, None)   # the Mul goes with the attention layer; its input has the shuffle alone
            return v, scale * (c if p.op_type == "Mul" else 1 / c)
        return p.inputs[0], scale * (c if p.op_type == "Mul" else 1 / c)
    return v, scale


def _absorb_movement(g: Graph, nodes: list[Node], inputs: list[Value], attrs: dict) -> Value:
    """Shuffles feeding Q/Kᵀ/V (and one reading the output) join the layer as steps; so does a Split whose
    every output feeds this attention (a merged QKV projection). Returns the layer's output value."""
    for i, key in enumerate(HEAD_STEPS):
        v, steps = inputs[i], []
        p = v.producer
        while is_shuffle(p) and len(v.users) == 1 and not g.is_output(v):   # a chain: reshape, scale moved, transpose
            steps, v = list(p.attrs["steps"]) + steps, p.inputs[0]
            nodes.append(p)
            p = v.producer
        inputs[i], attrs[key] = v, steps
    if not _absorb_split(nodes, inputs, attrs):
        _absorb_gathers(g, nodes, inputs, attrs)
    pv = nodes[1]
    swap = attrs.pop("v_swap")   # V'·Pᵀ = (P·V'ᵀ)ᵀ: V' transposed in, the output transposed out
    attrs["v_steps"] = attrs["v_steps"] + swap
    reader = sole_consumer(g, pv)
    attrs["out_steps"] = swap
    if is_shuffle(reader):
        attrs["out_steps"] = swap + list(reader.attrs["steps"])
        nodes.append(reader)
        return reader.outputs[0]
    return pv.outputs[0]


def _read_packed(inputs: list[Value], attrs: dict, packed: Value, picks: list[list[dict]]) -> None:
    """Q, K and V read from one packed tensor, each through its own steps `picks[i]` first."""
    for i, key in enumerate(HEAD_STEPS):
        attrs[key] = picks[i] + attrs[key]
        inputs[i] = packed


def _absorb_split(nodes: list[Node], inputs: list[Value], attrs: dict) -> bool:
    """Q, K and V the three outputs of one Split (a merged QKV projection) that only this layer reads: they read
    its input through slice steps. Whether they did."""
    split = inputs[0].producer
    if not is_op(split, "Split") or len(split.outputs) != 3 or len({id(inputs[i]) for i in range(3)}) != 3 or \
            any(inputs[i].producer is not split for i in range(3)) or any(len(o.users) != 1 for o in split.outputs):
        return False
    axis = split.attrs.get("axis", 0) % len(split.inputs[0].shape)
    if any(axis in o.dyn_dims for o in split.outputs):
        return False
    sizes = [o.shape[axis] for o in split.outputs]
    bounds = {id(o): (s0, s0 + n) for o, s0, n in zip(split.outputs, np.cumsum([0] + sizes[:-1]), sizes)}
    _read_packed(inputs, attrs, split.inputs[0],
                 [[{"slice": [axis, int(bounds[id(v)][0]), int(bounds[id(v)][1])]}] for v in inputs[:3]])
    nodes.append(split)
    return True


def _absorb_gathers(g: Graph, nodes: list[Node], inputs: list[Value], attrs: dict) -> None:
    """Q, K and V each picked from one packed tensor by a Gather of a constant index (nn.MultiheadAttention's
    export: in_proj, then unflatten/transpose to [3, ...] and Gather 0, 1, 2) read it through a slice step, and so
    does the layer: no copy of each head's third. A shuffle producing the packed tensor for these Gathers alone
    joins too."""
    gathers = [inputs[i].producer for i in range(3)]
    if not all(is_op(n, "Gather") for n in gathers) or len({id(n) for n in gathers}) != 3:
        return
    packed = gathers[0].inputs[0]
    axes = {n.attrs.get("axis", 0) % max(len(packed.shape), 1) for n in gathers}
    picks = [_constant_index(n, packed) for n in gathers]
    if len(axes) != 1 or None in picks or any(n.inputs[0] is not packed or len(n.outputs[0].users) != 1 or
                                              g.is_output(n.outputs[0]) for n in gathers):
        return
    axis = axes.pop()
    if axis in packed.dyn_dims:
        return
    _read_packed(inputs, attrs, packed, [[{"slice": [axis, index, index + 1]}] +
                                         (_dropped(axis, len(packed.shape)) if scalar else []) for index, scalar in picks])
    nodes.extend(gathers)
    shuffle = packed.producer
    if is_shuffle(shuffle) and not g.is_output(packed) and all(u in gathers for u in packed.users):
        _read_packed(inputs, attrs, shuffle.inputs[0], [list(shuffle.attrs["steps"])] * 3)
        nodes.append(shuffle)


def _constant_index(gather: Node, packed: Value) -> tuple[int, bool] | None:
    """(the one index a Gather picks, whether it is a scalar that drops the axis); None unless a constant scalar or
    one-element vector (a deeper index adds axes)."""
    index = gather.inputs[1] if len(gather.inputs) > 1 else None
    if index is None or not index.is_const or index.const.size != 1 or index.const.ndim > 1 or \
            index.const.dtype.kind not in "iu":
        return None
    size = packed.shape[gather.attrs.get("axis", 0) % len(packed.shape)]
    i = int(index.const.reshape(-1)[0])
    i = i + size if i < 0 else i
    return (i, index.const.ndim == 0) if 0 <= i < size else None


def _dropped(axis: int, rank: int) -> list[dict]:
    """Steps removing `axis` (size 1 after the slice) for any input shape: moved last, then a reshape copying the
    other axes (ONNX's 0), so dynamic axes need no size."""
    move = [{"transpose": [k for k in range(rank) if k != axis] + [axis]}] if axis != rank - 1 else []
    return move + [{"reshape": [0] * (rank - 1)}]


# ---- residual add + LayerNorm --------------------------------------------------------------------------
def fuse_skip_layer_norm(g: Graph, plog: PassLog) -> None:
    """SkipLayerNormFusion: LayerNormalization(a + b) of two same-shape activations (the residual sum)."""
    for ln in [n for n in g.nodes if is_op(n, "LayerNormalization")]:
        add = ln.inputs[0].producer
        if not is_op(add, "Add"):
            continue
        plog.running(add)
        a, b = add.inputs
        if sole_consumer(g, add) is not ln:
            plog.not_fused(add, ln, f"the sum '{add.outputs[0].name}' is also read elsewhere")
            continue
        if a.is_const or b.is_const or not same_shape(a, b):
            plog.not_fused(add, ln, "the sum is not of two same-shape activations (a residual)")
            continue
        if len(ln.outputs) > 1 and any(o.users for o in ln.outputs[1:]):
            plog.not_fused(add, ln, "the LayerNorm's mean/inv-std outputs are used")
            continue
        plog.fusing(add, ln)
        name, origin = _fused(g, [add, ln])
        attrs = {k: v for k, v in ln.attrs.items() if k in ("axis", "epsilon")}
        replace_nodes(g, [add, ln], Node(name, "SkipLayerNormalization", [a, b] + list(ln.inputs[1:]),
                                         [ln.outputs[0]], attrs, "kiln", origin))
