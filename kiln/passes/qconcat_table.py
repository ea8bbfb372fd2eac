"""QConcatTableFusion: requantizations feeding an INT8 Concat join it as tables on its inputs.

A Concat of quantized tensors at different scales (YOLOv8's C2f: the split halves and each bottleneck's sum,
concatenated at one output scale) is left by SplitQAcrossPrecedingFanIn with a requantization before each input
whose scale differs, DQ -> Q at the Concat's scale: a PointWise layer reading one INT8 tensor, a pass over that
input before the copy. Each such chain (any pointwise program on one INT8 tensor with one-value constants) becomes a
256-entry table on that input (as kiln.passes.qproduct_table makes for products): the copy maps the bytes as it
moves them, one layer instead of one per requantized input.

    x1 ─► PWN(DQ, Q) ─┐                   x1 ─┐
    x2 ───────────────┼─► Concat   ==>    x2 ─┼─► QConcat (in_tables: [table, None, table])
    x3 ─► PWN(DQ, Q) ─┘                   x3 ─┘
"""
from __future__ import annotations

from kiln.ir import Graph, Node, Value
from kiln.passes.manager import PassLog
from kiln.passes.patterns import replace_nodes
from kiln.passes.qproduct_table import output_table
from kiln.passes.quantization import INT8_TYPES
from kiln.trt.vocab import fused_layer_name


def fuse_concat_tables(g: Graph, plog: PassLog) -> None:
    """QConcatTableFusion (see the module docstring)."""
    for cat in [n for n in g.nodes if n.op_type == "Concat" and n.domain in ("", "ai.onnx")]:
        if str(cat.outputs[0].dtype) not in INT8_TYPES:
            continue
        plog.running(cat)
        chains: dict[int, Node] = {}
        for i, x in enumerate(cat.inputs):
            chain = x.producer if x is not None else None
            if chain is None or chain.op_type != "PointWise" or chain.domain != "kiln":
                continue
            reason = _blocker(g, chain, cat, x)
            if reason:
                plog.not_fused(chain, cat, reason)
            else:
                chains[i] = chain
        if chains:
            _fuse(g, cat, chains)
            for chain in chains.values():
                plog.fusing(chain, cat)


def _blocker(g: Graph, chain: Node, cat: Node, x: Value) -> str | None:
    """Why `chain` cannot be a table on its input of `cat`: its output is read elsewhere, it reads other than one
    INT8 tensor and one-value constants, or it changes the tensor's shape or type."""
    if x.users != [cat] or cat.inputs.count(x) != 1 or g.is_output(x):
        return f"{chain.name}'s output is read by other layers too"
    reads = [v for v in chain.inputs if v is not None and not v.is_const]
    if len(reads) != 1 or str(reads[0].dtype) not in INT8_TYPES or \
            any(v.const.size != 1 for v in chain.inputs if v is not None and v.is_const):
        return f"{chain.name} reads more than one INT8 tensor and one-value constants"
    if reads[0].shape != x.shape or reads[0].dyn_dims != x.dyn_dims or x.dtype != cat.outputs[0].dtype:
        return f"{chain.name} broadcasts its input or its type is not the Concat's"
    return None


def _fuse(g: Graph, cat: Node, chains: dict[int, Node]) -> None:
    tables, inputs = [None] * len(cat.inputs), list(cat.inputs)
    for i, chain in chains.items():
        index = next(k for k, v in enumerate(chain.inputs) if v is not None and not v.is_const)
        tables[i], inputs[i] = output_table(chain, index), chain.inputs[index]
    ordered = [chains[i] for i in sorted(chains)]
    origin = tuple(o for n in [*ordered, cat] for o in n.origin)
    fused = Node(fused_layer_name([n.name for n in [*ordered, cat]]), "QConcat", inputs, list(cat.outputs),
                 {"axis": cat.attrs.get("axis", 0), "in_tables": tables}, "kiln", origin)
    replace_nodes(g, [*ordered, cat], fused)
