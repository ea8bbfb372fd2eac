"""Matrix-multiply fusions: a constant bias Add folds into the MatMul/Gemm before it, then a residual Add of an
activation; a Gemm between the Reshapes that flatten and restore an activation's leading axes becomes a MatMul on
the activation."""
from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node, same_extent
from kiln.passes.conv import fuse_residual_add
from kiln.passes.manager import PassLog
from kiln.passes.patterns import fused_name, is_op, replace_nodes, sole_consumer, why_not_sole_consumer


def fuse_matmul_bias(g: Graph, plog: PassLog) -> None:
    """MatMulAddFusion:  MatMul(x, W) + b  ==>  MatMul(x, W, bias=b)   (also Gemm without C)."""
    for add in [n for n in g.nodes if n.op_type == "Add"]:
        for mm_out, bias in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            mm = mm_out.producer
            if not is_op(mm, ("MatMul", "Gemm", "DynamicQMatMul")):
                continue
            plog.running(mm)
            reason = _bias_blocker(g, mm, add, mm_out, bias)
            if reason:
                plog.not_fused(mm, add, reason)
                continue
            name, origin = fused_name([mm, add])
            inputs = list(mm.inputs[:2]) + [bias]
            plog.fusing(mm, add)
            replace_nodes(g, [mm, add], Node(name, mm.op_type, inputs, [add.outputs[0]], dict(mm.attrs), mm.domain,
                                             origin))
            break


def fuse_matmul_residual(g: Graph, plog: PassLog) -> None:
    """MatMulEltwiseSumFusion:  MatMul(x, W, b) + r  ==>  MatMul(x, W, b, residual=r)  (also Gemm): a pre-LN
    block's residual sum (x + proj(...)) added as the product's output is stored, not as one more pass over the
    activation. W is a constant matrix, r an activation of the product's shape, the product read only by the Add;
    the sums a LayerNorm reads are SkipLayerNormFusion's, which runs first."""
    fuse_residual_add(g, plog, producer_ops=("MatMul", "Gemm"))


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


def gemm_between_reshapes(g: Graph, plog: PassLog) -> None:
    """GemmToMatMul:  Reshape(x [..., K] -> [M, K]) -> Gemm(W, C) -> Reshape([M, N] -> [..., N])  ==>  MatMul(x, W,
    bias=C). onnxruntime's MatMulAddFusion writes this into the models it saves (Optimum O1+, the transformers
    optimizer); as a MatMul on the 3-D activation the product takes its activation and residual epilogues again
    and the two copies go. Where the first Reshape also merges trailing axes (GPT-2's attention output
    [1, S, H, D] -> [S, H*D] before c_proj), it stays, retargeted to [..., K], and the product becomes the MatMul."""
    for gemm in [n for n in g.nodes if n.op_type == "Gemm" and n.domain in ("", "ai.onnx")]:
        before, after = gemm.inputs[0].producer, sole_consumer(g, gemm)
        if before is None or before.op_type != "Reshape" or after is None or after.op_type != "Reshape":
            continue
        plog.running(gemm)
        reason = _flattening_blocker(g, before, gemm, after)
        if reason:
            plog.not_fused(before, gemm, reason)
            continue
        weight = gemm.inputs[1]
        if gemm.attrs.get("transB", 0):
            weight = g.add_const(g.fresh_name(f"{weight.name}_transposed"), weight.const.T.copy())
        bias = gemm.inputs[2] if len(gemm.inputs) > 2 else None
        merged = _merges_trailing_axes(before)
        rows = _retarget(g, before, after) if merged else before.inputs[0]
        group = [gemm, after] if merged else [before, gemm, after]
        name, origin = fused_name(group)
        for first, second in zip(group, group[1:]):
            plog.fusing(first, second)
        replace_nodes(g, group, Node(name, "MatMul", [rows, weight] + ([bias] if bias else []), [after.outputs[0]],
                                     {}, "", origin))


def _merges_trailing_axes(before: Node) -> bool:
    """Whether the flattening Reshape merges more than the leading axes ([1, S, H, D] -> [S, H*D])."""
    x, flat = before.inputs[0], before.outputs[0]
    return flat.shape != (int(np.prod(x.shape[:-1])), x.shape[-1])


def _retarget(g: Graph, before: Node, after: Node):
    """The flattening Reshape rewritten to give [*restored leading axes, K]: the MatMul's rows."""
    flat, out = before.outputs[0], after.outputs[0]
    target = (*out.shape[:-1], flat.shape[-1])
    shape = g.add_const(g.fresh_name(f"{before.name}_rows"), np.array(target, dtype=np.int64))
    replace_nodes(g, [before], Node(before.name, "Reshape", [before.inputs[0], shape], [flat], {}, "",
                                    before.origin))
    flat.shape = target
    return flat


def _flattening_blocker(g: Graph, before: Node, gemm: Node, after: Node) -> str | None:
    x, flat, out = before.inputs[0], before.outputs[0], after.outputs[0]
    if sole_consumer(g, before) is not gemm:
        return why_not_sole_consumer(g, before)
    if x.shape is None or len(x.shape) < 3 or flat.shape is None or len(flat.shape) != 2:
        return "the first Reshape does not flatten a 3-D or larger tensor to rows"
    regrouped = _merges_trailing_axes(before)
    if regrouped and (x.dyn_dims or out.dyn_dims or out.shape is None or len(out.shape) < 3
                      or int(np.prod(out.shape[:-1])) != flat.shape[0]):
        return "the first Reshape does not flatten the leading axes of a 3-D or larger tensor"
    if gemm.attrs.get("transA", 0) or gemm.attrs.get("alpha", 1.0) != 1.0 or gemm.attrs.get("beta", 1.0) != 1.0:
        return "the Gemm has transA, alpha or beta"
    bias = gemm.inputs[2] if len(gemm.inputs) > 2 else None
    n = gemm.outputs[0].shape[-1]
    if not gemm.inputs[1].is_const or (bias is not None and not (bias.is_const and bias.shape in ((n,), (1, n)))):
        return "its weights or bias are not constants of the product's width"
    if not regrouped and (out.shape != tuple(x.shape[:-1]) + (n,) or tuple(out.dyn_dims) != tuple(x.dyn_dims) or
                          not all(same_extent(out, i, x, i) for i in range(len(x.shape) - 1))):
        return "the second Reshape does not restore the leading axes"
    if regrouped and out.shape[-1] != n:
        return "the second Reshape does not keep the product's width"
    return None
