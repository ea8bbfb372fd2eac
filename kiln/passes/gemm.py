"""Matrix-multiply fusions: a constant bias Add folds into the MatMul/Gemm before it."""
from __future__ import annotations

from kiln.ir import Graph, Node
from kiln.passes.manager import PassLog
from kiln.passes.patterns import fused_name, replace_nodes, sole_consumer, why_not_sole_consumer


def fuse_matmul_bias(g: Graph, plog: PassLog) -> None:
    """MatMulAddFusion:  MatMul(x, W) + b  ==>  MatMul(x, W, bias=b)   (also Gemm without C)."""
    for add in [n for n in g.nodes if n.op_type == "Add"]:
        for mm_out, bias in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            mm = mm_out.producer
            if mm is None or mm.op_type not in ("MatMul", "Gemm") or mm.domain not in ("", "ai.onnx"):
                continue
            plog.running(mm)
            reason = _bias_blocker(g, mm, add, mm_out, bias)
            if reason:
                plog.not_fused(mm, add, reason)
                continue
            name, origin = fused_name([mm, add])
            inputs = list(mm.inputs[:2]) + [bias]
            plog.fusing(mm, add)
            replace_nodes(g, [mm, add], Node(name, mm.op_type, inputs, [add.outputs[0]], dict(mm.attrs), "", origin))
            break


def _bias_blocker(g: Graph, mm: Node, add: Node, mm_out, bias) -> str | None:
    if sole_consumer(g, mm) is not add:
        return why_not_sole_consumer(g, mm)
    if not bias.is_const:
        return "the other operand is not a constant bias"
    if len(mm.inputs) > 2 and mm.inputs[2] is not None:
        return f"{mm.name} already has a bias"
    if "activation" in mm.attrs:
        return f"{mm.name} already applies an activation"
    n = mm_out.shape[-1] if mm_out.shape else None
    if tuple(d for d in bias.shape if d != 1) not in ((), (n,)) or (bias.shape and bias.shape[-1] not in (1, n)):
        return f"bias shape {list(bias.shape)} does not broadcast along the last axis only"
    if len(bias.shape) > len(mm_out.shape):
        return "bias has more dimensions than the product"
    return None
