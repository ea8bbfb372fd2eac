"""QProductTableFusion: a pointwise chain on an INT8 product's output joins the product as a 256-entry table.

quantize_static leaves pointwise chains between Q/DQ pairs as PointWise layers reading one INT8 tensor: the scores'
scaling after Q·Kᵀ (DQ, Div or Mul, Q) and the GELU after BERT's first FFN product (DQ, Div, Erf, Q, DQ, Add, Q, DQ,
Mul, Q, DQ, Mul, Q); every SiLU of a convolutional net (DQ, Sigmoid, Q, DQ, Mul, Q: YOLO, EfficientNet); a ReLU
quantized at a scale of its own (ActivationSymmetric). They can produce only 256 distinct outputs, one per byte.
Their program is evaluated once here on every byte (constant folding, as the lookup_table kernel does at load) and
the product's epilogue maps each requantized byte through the table as it stores it, exactly what the two layers
gave: no second pass over the tensor, one layer less. Products: QMatMul, QGemm and QConv (with a fused residual,
the table maps the requantized sum).

    QConv ─► PWN(DQ, Sigmoid, Q, DQ, Mul, Q) ─►   ==>   QConv (out_table) ─►
"""
from __future__ import annotations

import numpy as np
import torch

from kiln.ir import Graph, Node
from kiln.ops.fused import program_on_bytes
from kiln.passes.manager import PassLog
from kiln.passes.patterns import replace_nodes, sole_consumer
from kiln.passes.quantization import INT8_TYPES
from kiln.trt.vocab import fused_layer_name

PRODUCTS = ("QMatMul", "QGemm", "QConv")


def fuse_product_tables(g: Graph, plog: PassLog) -> None:
    """QProductTableFusion (see the module docstring)."""
    for mm in [n for n in g.nodes if n.op_type in PRODUCTS and n.domain == "kiln"]:
        chain = sole_consumer(g, mm)
        if chain is None or chain.op_type != "PointWise" or chain.domain != "kiln":
            continue
        plog.running(mm)
        reason = _blocker(mm, chain)
        if reason:
            plog.not_fused(mm, chain, reason)
            continue
        plog.fusing(mm, chain)
        attrs = {**mm.attrs, "out_table": output_table(chain, chain.inputs.index(mm.outputs[0]))}
        origin = mm.origin + chain.origin
        replace_nodes(g, [mm, chain], Node(fused_layer_name([mm.name, chain.name]), mm.op_type, list(mm.inputs),
                                           list(chain.outputs), attrs, "kiln", origin))


def _blocker(mm: Node, chain: Node) -> str | None:
    """Why `chain` cannot be a table on `mm`'s output: the product's output or the chain's is not INT8, the chain
    reads another tensor or a constant of more than one value, or its output is not the product's shape."""
    y, out = mm.outputs[0], chain.outputs[0]
    if "y_scale" not in mm.attrs.get("quant", {}) or str(y.dtype) not in INT8_TYPES or str(out.dtype) not in INT8_TYPES:
        return "the product's output or the chain's is not INT8"
    if "out_table" in mm.attrs:
        return "the product already maps its output through a table"
    reads = [v for v in chain.inputs if v is not None and not v.is_const]
    if reads != [y] or any(v.const.size != 1 for v in chain.inputs if v is not None and v.is_const):
        return f"{chain.name} reads more than the product's output and one-value constants"
    if out.shape != y.shape or out.dyn_dims != y.dyn_dims:
        return f"{chain.name} broadcasts the product's output"
    return None


def output_table(chain: Node, index: int) -> dict:
    """The chain's output byte for each byte its INT8 input can hold, in raw-byte order."""
    consts = [None if i == index else torch.tensor(np.array(v.const)).reshape(()) for i, v in enumerate(chain.inputs)]
    y = program_on_bytes(chain.attrs["program"], consts, index, str(chain.inputs[index].dtype) == "int8")
    return {"bytes": y.view(torch.uint8).tolist(), "dtype": str(chain.outputs[0].dtype)}
