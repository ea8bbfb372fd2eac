"""QProductTableFusion on IR graphs: a PointWise chain reading only an INT8 product's output (and one-value
constants) joins the product as a 256-entry table of output bytes; chains it cannot tabulate stay."""
from __future__ import annotations

import numpy as np

from kiln.passes.qproduct_table import fuse_product_tables
from tests.passes.ir_builder import IRBuilder, run_pass, run_pass_unchanged

NAME = "QProductTableFusion"
QUANT = {"x_scale": 0.1, "x_zero_point": 128, "x_dtype": "uint8", "w_scale": [0.1], "w_zero_point": [128],
         "y_scale": 0.5, "y_zero_point": 10, "y_dtype": "uint8"}
# DQ at (0.5, 10), Neg, Q at (0.25, 0) to int8: y = clamp(round(-(x - 10) * 2))
REVERSAL = [{"op": "DequantizeLinear", "attrs": {}, "args": ["x0", "x1", "x2"]},
            {"op": "Neg", "attrs": {}, "args": ["t0"]},
            {"op": "QuantizeLinear", "attrs": {}, "args": ["t1", "x3", "x4"]}]


def chain(b: IRBuilder, x, out: str, tag: str, shape=(2, 4, 4)):
    consts = [b.const(f"{tag}_s", 0.5), b.const(f"{tag}_zp", 10, np.uint8), b.const(f"{tag}_ys", 0.25),
              b.const(f"{tag}_yzp", 0, np.int8)]
    return b.node("PointWise", [x] + consts, out, shape, domain="kiln", dtype=np.int8, name=f"PWN({tag})",
                  program=REVERSAL)


def product(b: IRBuilder, a, k, out: str, quant=QUANT, dtype=np.uint8):
    return b.node("QMatMul", [a, k], out, (2, 4, 4), domain="kiln", dtype=dtype, quant=quant)


def test_a_chain_on_an_int8_products_output_becomes_its_output_table():
    b = IRBuilder()
    q, k = b.input("q", (2, 4, 8), np.uint8), b.input("k", (2, 8, 4), np.uint8)
    g = b.graph(chain(b, product(b, q, k, "scores"), "scaled", "scale"))

    run = run_pass(g, NAME, fuse_product_tables, folds_constants=True)   # the table: the chain on 256 bytes

    (layer,) = g.nodes
    assert (layer.op_type, layer.name, [v.name for v in layer.inputs]) == ("QMatMul", "scores + PWN(scale)", ["q", "k"])
    assert layer.outputs[0].name == "scaled" and layer.outputs[0].dtype == np.int8
    codes = np.arange(256)
    want = np.clip(np.rint(-(codes - 10) * 0.5 / 0.25), -128, 127).astype(np.int8).view(np.uint8)
    assert layer.attrs["out_table"] == {"bytes": want.tolist(), "dtype": "int8"}
    assert {k: v for k, v in layer.attrs.items() if k != "out_table"} == {"quant": QUANT}
    assert layer.origin == ("scores", "PWN(scale)")
    assert (run.stat.matches, run.stat.layers_before, run.stat.layers_after) == (1, 2, 1)


def test_chains_it_cannot_tabulate_stay():
    b = IRBuilder()
    q, k, other = b.input("q", (2, 4, 8), np.uint8), b.input("k", (2, 8, 4), np.uint8), b.input("o", (2, 4, 4))
    two = b.node("PointWise", [product(b, q, k, "p1"), other], "two", (2, 4, 4), domain="kiln", name="PWN(two)",
                 program=[{"op": "Add", "attrs": {}, "args": ["x0", "x1"]}])
    fp32 = {key: v for key, v in QUANT.items() if not key.startswith("y_")}
    floats = chain(b, product(b, q, k, "p2", quant=fp32, dtype=np.float32), "floats", "floats")
    g = b.graph(two, floats)

    run = run_pass_unchanged(g, NAME, fuse_product_tables)

    assert run.not_fusing == [
        f"{NAME}: Not fusing p1 with PWN(two): PWN(two) reads more than the product's output and one-value constants",
        f"{NAME}: Not fusing p2 with PWN(floats): the product's output or the chain's is not INT8"]


def test_an_int8_product_read_as_any_input_is_tabulated_by_raw_byte_and_odd_chains_stay():
    """An s8 product's bytes index the table as raw bytes (-1 reads entry 255), its output read as the chain's
    second input; a per-column constant, a chain that broadcasts, and a product already tabulated stay."""
    b = IRBuilder()
    q, k = b.input("q", (2, 4, 8), np.uint8), b.input("k", (2, 8, 4), np.uint8)
    signed = {**QUANT, "y_zero_point": 0, "y_dtype": "int8"}
    s8 = product(b, q, k, "s8", quant=signed, dtype=np.int8)
    consts = [b.const("c_s", 0.5), b.const("c_zp", 0, np.int8), b.const("c_ys", 0.25), b.const("c_yzp", 0, np.uint8)]
    program = [{"op": "DequantizeLinear", "attrs": {}, "args": ["x1", "x0", "x2"]},
               {"op": "Neg", "attrs": {}, "args": ["t0"]},
               {"op": "QuantizeLinear", "attrs": {}, "args": ["t1", "x3", "x4"]}]
    flipped = b.node("PointWise", [consts[0], s8] + consts[1:], "flipped", (2, 4, 4), domain="kiln", dtype=np.uint8,
                     name="PWN(flip)", program=program)
    cols = b.node("PointWise", [product(b, q, k, "p1"), b.const("cols", np.arange(4.0))], "cols_out", (2, 4, 4),
                  domain="kiln", name="PWN(cols)", program=[{"op": "Add", "attrs": {}, "args": ["x0", "x1"]}])
    wide = chain(b, product(b, q, k, "p2"), "wide", "wide", shape=(3, 2, 4, 4))
    g = b.graph(flipped, cols, wide)

    run = run_pass(g, NAME, fuse_product_tables, folds_constants=True)

    fused = next(n for n in g.nodes if n.outputs[0].name == "flipped")
    codes = np.arange(256).astype(np.uint8).view(np.int8).astype(np.float64)   # raw byte order
    want = np.clip(np.rint(-codes * 0.5 / 0.25), 0, 255).astype(np.uint8)
    assert fused.attrs["out_table"] == {"bytes": want.tolist(), "dtype": "uint8"}
    assert run.not_fusing == [
        f"{NAME}: Not fusing p1 with PWN(cols): PWN(cols) reads more than the product's output and one-value constants",
        f"{NAME}: Not fusing p2 with PWN(wide): PWN(wide) broadcasts the product's output"]
    again = run_pass_unchanged(g, NAME, fuse_product_tables)   # a tabulated product is not a chain's reader now
    assert again.stat.matches == 0


def test_a_chain_after_a_convolution_and_its_residual_sum_becomes_its_table_and_other_ops_stay():
    """A SiLU-like chain after a QConv that sums a residual joins it (the table maps the requantized sum) and keeps
    its op, inputs and attributes; the same chain after an INT8 sum (not a product) stays a layer."""
    b = IRBuilder()
    x, res = b.input("x", (1, 2, 4, 4), np.uint8), b.input("res", (1, 2, 4, 4), np.uint8)
    quant = {**QUANT, "w_scale": [0.1, 0.2], "w_zero_point": [0, 0], "w_axis": 0, "r_scale": 0.3, "r_zero_point": 3}
    conv = b.node("QConv", [x, b.const("w", np.ones((2, 2, 1, 1)), np.int8), b.const("bias", [0.5, -0.5]), res], "c",
                  (1, 2, 4, 4), domain="kiln", dtype=np.uint8, name="conv + add", kernel_shape=[1, 1], quant=quant)
    summed = b.node("QAdd", [x, res], "s", (1, 2, 4, 4), domain="kiln", dtype=np.uint8, name="sum", quant={})
    g = b.graph(chain(b, conv, "silu", "silu", shape=(1, 2, 4, 4)), chain(b, summed, "after", "after", (1, 2, 4, 4)))

    run = run_pass(g, NAME, fuse_product_tables, folds_constants=True)

    assert sorted(n.op_type for n in g.nodes) == ["PointWise", "QAdd", "QConv"] and run.stat.matches == 1
    fused = next(n for n in g.nodes if n.op_type == "QConv")
    assert fused.name == "conv + add + PWN(silu)" and [v.name for v in fused.inputs] == ["x", "w", "bias", "res"]
    assert {k: v for k, v in fused.attrs.items() if k != "out_table"} == {"kernel_shape": [1, 1], "quant": quant}
    assert fused.attrs["out_table"]["dtype"] == "int8" and fused.outputs[0].name == "silu"
