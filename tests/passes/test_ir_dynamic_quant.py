"""DynamicQuantizeMatMulFusion on IR graphs: quantize_dynamic's DynamicQuantizeLinear -> MatMulInteger -> Cast ->
Mul(x_scale * W_scale) chain becomes one DynamicQMatMul; chains that differ stay as they are, with the reason. The
products then take their bias (MatMulAddFusion) and merge (MatMulHorizontalMerge) as FP32 MatMuls do."""
from __future__ import annotations

import numpy as np

from kiln.passes.attention import merge_matmuls
from kiln.passes.dynamic_quant import fuse_dynamic_quantized_matmul
from kiln.passes.gemm import fuse_matmul_bias
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

W = np.arange(12).reshape(4, 3) - 6


def quantized_input(b: IRBuilder, x):
    """DynamicQuantizeLinear(x): (x_u8, x_scale, x_zp), typed as onnxruntime writes them."""
    q, s, z = b.multi("DynamicQuantizeLinear", [x], [("xq", (2, 4)), ("xs", ()), ("xz", ())], name="dql",
                      dtype=np.uint8)
    s.dtype = np.dtype(np.float32)
    return q, s, z


def product(b: IRBuilder, q, s, z, tag: str, w_zp=None, cast_to: int = 1):
    """MatMulInteger -> Cast -> Mul(Mul(x_scale, W_scale)), each node named after `tag`: (the MatMulInteger's
    output, the result)."""
    inputs = [q, b.const(f"w{tag}", W, np.int8), z] + ([w_zp] if w_zp is not None else [])
    mm = b.node("MatMulInteger", inputs, f"i{tag}", (2, 3), dtype=np.int32, name=f"mmi{tag}")
    cast = b.node("Cast", [mm], f"f{tag}", (2, 3), dtype=np.float32, name=f"cast{tag}", to=cast_to)
    scale = b.node("Mul", [s, b.const(f"ws{tag}", [0.5, 0.25, 0.125])], f"s{tag}", (3,), name=f"scale{tag}")
    return mm, b.node("Mul", [cast, scale], f"y{tag}", (2, 3), name=f"mul{tag}")


def test_the_chain_becomes_one_dynamic_int8_product_and_the_quantizer_goes_with_its_last_reader():
    b = IRBuilder()
    x = b.input("x", (2, 4))
    q, s, z = quantized_input(b, x)
    g = b.graph(product(b, q, s, z, "1")[1], product(b, q, s, z, "2", w_zp=b.const("wz", 0, np.int8))[1])

    run = run_pass(g, "DynamicQuantizeMatMulFusion", fuse_dynamic_quantized_matmul)

    quant = "quant={'x_dtype': 'uint8', 'w_axis': 1, 'w_scale': [0.5, 0.25, 0.125], 'w_zero_point': [0, 0, 0]}"
    assert str(g) == expected(f"""
        graph g(%x: float32[2x4]):
          %y1: float32[2x3] = kiln.DynamicQMatMul(%x, const %w1) {quant}  # mmi1 + cast1 + mul1 + scale1
          %y2: float32[2x3] = kiln.DynamicQMatMul(%x, const %w2) {quant}  # mmi2 + cast2 + mul2 + scale2 + dql
          return %y1, %y2
        """)
    assert [n.origin for n in g.nodes] == [("mmi1", "cast1", "mul1", "scale1"),
                                           ("mmi2", "cast2", "mul2", "scale2", "dql")]
    assert (run.stat.matches, run.stat.rejections) == (6, 0)
    assert [line for line in run.lines if "Fusing" in line][:3] == [
        "DynamicQuantizeMatMulFusion: Fusing mmi1 with cast1", "DynamicQuantizeMatMulFusion: Fusing mmi1 with mul1",
        "DynamicQuantizeMatMulFusion: Fusing dql with mmi1"]


def test_chains_that_differ_stay_with_the_reason():
    b = IRBuilder()
    x = b.input("x", (2, 4))
    q, s, z = quantized_input(b, x)
    _, to_int = product(b, q, s, z, "1", cast_to=6)                            # Cast to INT32
    _, computed_zp = product(b, q, s, z, "2", w_zp=b.node("Abs", [b.const("wz", [0, 0, 0], np.int8)], "zabs", (3,)))
    raw = b.node("MatMulInteger", [b.input("u", (2, 4), np.uint8), b.const("w3", W, np.int8)], "i3", (2, 3),
                 dtype=np.int32, name="mmi3")                                   # static u8 input, no quantizer
    sums, read_twice = product(b, q, s, z, "4")                               # its int32 sums are an output too
    g = b.graph(to_int, computed_zp, raw, read_twice, sums)
    run = run_pass_unchanged(g, "DynamicQuantizeMatMulFusion", fuse_dynamic_quantized_matmul)
    assert run.not_fusing == [
        "DynamicQuantizeMatMulFusion: Not fusing dql with mmi1: cast1 is not a Cast to FLOAT",
        "DynamicQuantizeMatMulFusion: Not fusing dql with mmi2: its weight zero point is not a constant per tensor "
        "or per column",
        "DynamicQuantizeMatMulFusion: Not fusing u with mmi3: its input is not quantized by a DynamicQuantizeLinear",
        "DynamicQuantizeMatMulFusion: Not fusing dql with mmi4: mmi4's output 'i4' is a network output"]


def test_products_take_their_bias_and_merge_with_their_scales_concatenated():
    b = IRBuilder()
    x = b.input("x", (2, 4))

    def projection(tag: str, scale: float, zp: int):
        quant = {"x_dtype": "uint8", "w_axis": 1, "w_scale": [scale] * 3, "w_zero_point": [zp] * 3}
        y = b.node("DynamicQMatMul", [x, b.const(f"w{tag}", W, np.int8)], f"m{tag}", (2, 3), name=f"mm{tag}",
                   domain="kiln", quant=quant)
        return b.node("Add", [y, b.const(f"b{tag}", [1.0, 2.0, 3.0])], f"y{tag}", (2, 3), name=f"add{tag}")
    g = b.graph(projection("q", 0.5, 0), projection("k", 0.25, 0), projection("v", 0.125, 1))

    bias = run_pass(g, "MatMulAddFusion", fuse_matmul_bias)
    merge = run_pass(g, "MatMulHorizontalMerge", merge_matmuls)

    (product, split) = g.nodes
    assert (product.op_type, product.domain, product.name) == ("DynamicQMatMul", "kiln",
                                                               "mmq + addq || mmk + addk || mmv + addv")
    assert product.attrs["quant"] == {"x_dtype": "uint8", "w_axis": 1, "w_scale": [0.5] * 3 + [0.25] * 3 + [0.125] * 3,
                                      "w_zero_point": [0] * 6 + [1] * 3}
    assert np.array_equal(product.inputs[1].const, np.concatenate([W] * 3, axis=1))
    assert product.inputs[2].const.tolist() == [1.0, 2.0, 3.0] * 3
    assert split.op_type == "Split" and [v.name for v in split.outputs] == ["yq", "yk", "yv"]
    assert (bias.stat.matches, merge.stat.matches) == (3, 2)
