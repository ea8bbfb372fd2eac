"""The DequantizeLinear nodes of constants that no INT8 layer takes or took:

    WeightOnlyDequantizeFolding (first, before constant folding):  DQ(W_int8) [─► Transpose ...] ─► MatMul(x, ·)
        where x is no DequantizeLinear's output: a weight-only quantized product runs in FP32 on its dequantized
        weights, as onnxruntime runs it; folded this early, the weights are plain constants for every FP32 fusion
        (transposes folded, biases, Q/K/V merges, attention) and are packed once;
    GatherDequantizeSwap:  DQ(table_int8) ─► Gather(ids)  ==>  Gather(table_int8, ids) ─► DQ
        an embedding table is gathered as INT8 and only the rows read are dequantized (BERT's 30522 x 768 word
        embeddings: 65 ms a run dequantized whole, as onnxruntime's quantize_static leaves it);
    ConstantDequantizeFolding:  DQ(bias_int32), DQ(gamma_int8) ...  ==>  FP32 constants
        what a LayerNorm or a bias Add reads is dequantized once, at build time
        (the same values: DequantizeLinear is exact in FP32 for INT8 and for int32 biases' scale products).
"""
from __future__ import annotations

from kiln.ir import Graph, Node
from kiln.passes.cleanup import FOLD_MAX_ELEMENTS, fold_node
from kiln.passes.manager import PassLog
from kiln.passes.patterns import is_op, remove_dead


def _constant_dequantize(node: Node) -> bool:
    return is_op(node, "DequantizeLinear") and all(v is None or v.is_const for v in node.inputs)


PRODUCTS = ("MatMul", "Gemm", "Conv", "ConvTranspose")
MOVEMENT = ("Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")


def fold_weight_only_dequantize(g: Graph, plog: PassLog) -> None:
    """WeightOnlyDequantizeFolding: a DequantizeLinear of a constant whose every use, through movement ops, is
    the weight of a product whose data input is not dequantized becomes an FP32 constant."""
    for dq in [n for n in g.nodes if _constant_dequantize(n)]:
        products = weight_uses(dq)
        if not products or g.is_output(dq.outputs[0]):
            continue
        if any(_through_movement(p.inputs[0]) is not None for p in products):
            continue   # an INT8 product: QuantizeDoubleInputNodes takes it
        _fold(g, dq, plog)


def _fold(g: Graph, dq: Node, plog: PassLog) -> None:
    """`dq` evaluated into the FP32 constant it computes (up to FOLD_MAX_ELEMENTS values, as constant folding)."""
    plog.running(dq)
    if dq.inputs[0].const.size > FOLD_MAX_ELEMENTS:
        plog.note(f"not folding {dq.name}: {dq.inputs[0].const.size} values, more than constant folding makes")
        return
    fold_node(g, dq)
    plog.removing(dq)


def weight_uses(dq: Node) -> list[Node]:
    """The products reading `dq`'s output as their weight (input 1), through single-input movement ops; empty
    when any use is something else."""
    products, frontier = [], [dq.outputs[0]]
    while frontier:
        v = frontier.pop()
        for user in v.users:
            if is_op(user, PRODUCTS) and user.inputs.index(v) == 1 and user.inputs[0] is not v:
                products.append(user)
            elif is_op(user, MOVEMENT) and user.inputs[0] is v and all(i is v or i.is_const for i in user.inputs
                                                                       if i is not None):
                frontier.append(user.outputs[0])
            else:
                return []
    return products


def _through_movement(v) -> Node | None:
    """The DequantizeLinear producing `v`, directly or through movement ops and Pads (PaddingConvFusion later makes
    `DQ -> Pad -> Conv` an INT8 convolution's padding); None when there is none."""
    node = v.producer
    while is_op(node, (*MOVEMENT, "Pad")):
        node = node.inputs[0].producer
    return node if is_op(node, "DequantizeLinear") else None


def swap_gather_dequantize(g: Graph, plog: PassLog) -> None:
    """GatherDequantizeSwap: each Gather of a per-tensor DequantizeLinear of a constant gathers the INT8 constant
    and dequantizes what it gathered (Gather only moves elements, which one scale and zero point map alike)."""
    for dq in [n for n in g.nodes if _constant_dequantize(n)]:
        gathers = [u for u in dq.outputs[0].users if is_op(u, "Gather") and u.inputs[0] is dq.outputs[0]]
        if not gathers:
            continue
        plog.running(dq)
        if dq.inputs[1].const.size != 1:
            for gather in gathers:
                plog.not_fused(dq, gather, "per-axis scales: only a per-tensor table is gathered as INT8")
            continue
        for gather in gathers:
            _gather_quantized(g, dq, gather)
            plog.fusing(dq, gather)
        remove_dead(g, [dq])


def _gather_quantized(g: Graph, dq: Node, gather: Node) -> None:
    out = gather.outputs[0]
    gathered = g.value(g.fresh_name(f"{out.name}_quantized"))
    gathered.shape, gathered.dtype, gathered.dyn_dims = out.shape, dq.inputs[0].dtype, out.dyn_dims
    gathered.probe_shape = out.probe_shape
    index = g.nodes.index(gather)
    g.remove_node(gather)
    g.add_node(Node(gather.name, "Gather", [dq.inputs[0], *gather.inputs[1:]], [gathered], dict(gather.attrs),
                    gather.domain, gather.origin), index)
    g.add_node(Node(f"{dq.name} [{gather.name}]", "DequantizeLinear", [gathered, *dq.inputs[1:]], [out],
                    dict(dq.attrs), dq.domain, dq.origin), index + 1)


def fold_constant_dequantize(g: Graph, plog: PassLog) -> None:
    """ConstantDequantizeFolding: a DequantizeLinear of constants still in the graph after the Q/DQ fusions feeds
    FP32 arithmetic; it becomes an FP32 constant (up to FOLD_MAX_ELEMENTS values, as constant folding)."""
    for dq in [n for n in g.nodes if _constant_dequantize(n)]:
        if g.is_output(dq.outputs[0]):
            continue
        _fold(g, dq, plog)
