"""MatMulScaleFusion: an inference BatchNormalization over a matrix product's output columns folds into the product's
weights and bias, through the reshapes between them that keep the columns as the last axis::

    x -> MatMul(W) [-> Add(b)] [-> Flatten/Reshape...] -> BatchNormalization(s, B, mean, var)   (rank-2 input)
    ==>  x -> MatMul(W*k, bias=(b-mean)*k + B) [-> Flatten/Reshape...]                          k = s/sqrt(var+eps)

torch's Linear -> BatchNorm1d: LeViT writes MatMul -> Flatten -> BN -> Reshape 58 times (each BN and both reshapes
a layer of its own), face-recognition heads (ArcFace) and tabular MLPs export Gemm -> BN. The reshapes that remain
merge and vanish in the shuffle passes that follow."""
from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node, Value
from kiln.passes.manager import PassLog
from kiln.passes.patterns import (batchnorm_factors, fused_name, is_op, is_shuffle, replace_nodes, sole_consumer,
                                  why_not_sole_consumer)

RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


def fold_batchnorm_into_matmul(g: Graph, plog: PassLog) -> None:
    for bn in [n for n in g.nodes if is_op(n, "BatchNormalization")]:
        found = _product_before(bn)
        if found is None:
            continue
        product, add, movers = found
        plog.running(product)
        reason = _blocker(g, [product, add, *movers, bn], movers, bn)
        folded = reason or _folded_inputs(g, product, add, *batchnorm_factors(bn))
        if isinstance(folded, str):
            plog.not_fused(product, bn, folded)
            continue
        group = [n for n in (product, add) if n is not None]
        name, origin = fused_name([*group, bn])
        inputs, attrs = folded
        plog.fusing(product, bn)
        y = bn.outputs[0]
        if movers:   # the last reshape now writes the BatchNorm's output (its name, perhaps a network output)
            last = movers[-1]
            replace_nodes(g, [last, bn], Node(last.name, last.op_type, list(last.inputs), [y], last.attrs,
                                              last.domain, last.origin))
            out = movers[0].inputs[0]
        else:
            group, out = group + [bn], y
        replace_nodes(g, group, Node(name, product.op_type, inputs, [out], attrs, product.domain, origin))


def _product_before(bn: Node) -> tuple[Node, Node | None, list[Node]] | None:
    """(MatMul or Gemm, its constant-bias Add or None, the reshapes after them) leading to the BatchNorm's input."""
    movers: list[Node] = []
    node = bn.inputs[0].producer
    while node is not None and (is_op(node, RESHAPES) or (is_shuffle(node) and
                                                           all("reshape" in s for s in node.attrs["steps"]))):
        movers.insert(0, node)
        node = node.inputs[0].producer
    add = None
    if is_op(node, "Add") and sorted(v.is_const for v in node.inputs) == [False, True]:   # an activation + a constant
        add, node = node, next(v for v in node.inputs if not v.is_const).producer
    return (node, add, movers) if is_op(node, ("MatMul", "Gemm")) else None


def _blocker(g: Graph, chain: list[Node | None], movers: list[Node], bn: Node) -> str | None:
    """Why the BatchNorm cannot fold into the product before it; None where it can."""
    chain = [n for n in chain if n is not None]
    for node, reader in zip(chain, chain[1:]):
        if sole_consumer(g, node) is not reader:
            return why_not_sole_consumer(g, node)
    x = bn.inputs[0]
    if x.shape is None or len(x.shape) != 2:
        rank = "an unknown rank" if x.shape is None else f"a rank-{len(x.shape)} tensor"
        return f"{bn.name} normalizes axis 1 of {rank}, not the product's columns"
    if batchnorm_factors(bn) is None:
        return "BatchNormalization parameters are not constant"
    if bn.attrs.get("training_mode", 0) or any(v.users or g.is_output(v) for v in bn.outputs[1:]):
        return f"{bn.name} runs in training mode"
    columns = chain[0].outputs[0]
    n = columns.shape[-1] if columns.shape else None
    for mover in movers:
        out = mover.outputs[0]
        if not out.shape or out.shape[-1] != n or len(out.shape) - 1 in out.dyn_dims:
            return f"{mover.name} does not keep the product's {n} columns as its last axis"
    if "activation" in chain[0].attrs or len(chain[0].inputs) > 3:
        return f"{chain[0].name} already has a fused activation or residual"
    return None


def _folded_inputs(g: Graph, product: Node, add: Node | None, k: np.ndarray, shift: np.ndarray
                   ) -> tuple[list[Value], dict] | str:
    """The product's inputs and attributes with k folded into its weights' output columns and the bias, or why
    not."""
    gemm = product.op_type == "Gemm"
    w = product.inputs[1]
    if w is None or not w.is_const or w.const.ndim != 2 or w.const.dtype.kind != "f":
        return f"{product.name}'s weights are not a constant float matrix"
    trans_b = gemm and product.attrs.get("transB", 0)
    n = w.const.shape[0] if trans_b else w.const.shape[1]
    if len(k) != n:
        return f"the BatchNormalization has {len(k)} channels, the product {n} columns"
    bias = np.zeros(n) if not gemm else np.zeros(1)
    extra = product.inputs[2] if len(product.inputs) > 2 else None
    if extra is not None:
        if not extra.is_const:
            return f"{product.name}'s bias is computed at run time"
        bias = bias + extra.const.astype(np.float64) * (product.attrs.get("beta", 1.0) if gemm else 1.0)
    if add is not None:
        c = next(v for v in add.inputs if v.is_const).const
        if c.size not in (1, n) or (c.ndim and c.size == n and c.shape[-1] != n) or \
                add.outputs[0].shape != product.outputs[0].shape:   # a constant that broadcasts the product up
            return f"{add.name} adds a constant that is not one value per column"
        bias = bias + c.astype(np.float64).reshape(-1)
    name = fused_name([product])[0]
    scaled = w.const.astype(np.float64) * (k.reshape(-1, 1) if trans_b else k.reshape(1, -1))
    folded_w = g.add_const(f"{name}.weight_scaled", scaled.astype(w.const.dtype))
    folded_b = g.add_const(f"{name}.bias_scaled", (bias * k + shift).astype(w.const.dtype))
    attrs = {**product.attrs, **({"beta": 1.0} if gemm else {})}
    return [product.inputs[0], folded_w, folded_b], attrs
