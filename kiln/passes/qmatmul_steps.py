"""QMatMulShuffleFusion: a Q/DQ attention's INT8 head split and merge join its products of two activations.

quantize_static leaves a BERT's attention as INT8 layers: Q·Kᵀ and P·V are QMatMuls of two INT8 activations, each
operand reshaped and transposed into heads by a Shuffle of its own, the context transposed and reshaped back by
another. As kiln's FP32 Attention layer takes its shuffles as steps, the product takes them: `a_steps` and
`b_steps` applied to its operands as they are read, `out_steps` to its result. Four layers less per attention.
Dynamic shapes too: the steps' reshape targets copy (0) or infer (-1) those axes, and the kernel applies the
steps per call."""
from __future__ import annotations

from kiln.ir import Graph, Node
from kiln.ops.fused import OPERAND_STEPS
from kiln.passes.manager import PassLog
from kiln.passes.patterns import is_shuffle, replace_nodes, sole_consumer
from kiln.trt.vocab import fused_layer_name


def fuse_product_shuffles(g: Graph, plog: PassLog) -> None:
    """QMatMulShuffleFusion: Shuffles feeding an INT8 product of two activations (each read by it alone) and one
    reading its result become its steps."""
    for mm in [n for n in g.nodes if n.op_type == "QMatMul" and n.domain == "kiln" and not n.inputs[1].is_const
               and all(v is None or v.is_const for v in n.inputs[2:])]:   # a bias (added before out_steps) at most
        before, inputs, attrs = [], list(mm.inputs), dict(mm.attrs)
        for i, key in enumerate(OPERAND_STEPS):
            shuffle = inputs[i].producer
            if inputs[0] is not inputs[1] and is_shuffle(shuffle) and sole_consumer(g, shuffle) is mm:
                attrs[key], inputs[i] = list(shuffle.attrs["steps"]), shuffle.inputs[0]
                before.append(shuffle)
        reader = sole_consumer(g, mm)
        after = [reader] if is_shuffle(reader) else []
        if after:
            attrs["out_steps"] = list(reader.attrs["steps"])
        if not before and not after:
            continue
        plog.running(mm)
        for shuffle in before:
            plog.fusing(shuffle, mm)
        for shuffle in after:
            plog.fusing(mm, shuffle)
        nodes = before + [mm] + after
        name = fused_layer_name([s.name for s in before] + [mm.name] + [s.name for s in after])
        origin = tuple(o for n in nodes for o in n.origin)
        replace_nodes(g, nodes, Node(name, "QMatMul", inputs, list(nodes[-1].outputs), attrs, "kiln", origin))
