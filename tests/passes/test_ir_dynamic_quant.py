"""DynamicQuantizeMatMulFusion on IR graphs: quantize_dynamic's DynamicQuantizeLinear -> MatMulInteger -> Cast ->
Mul(x_scale * W_scale) chain becomes one DynamicQMatMul; chains that differ stay as they are, with the reason. The
products then take their bias (MatMulAddFusion) and merge (MatMulHorizontalMerge) as FP32 MatMuls do. Around a
ConvInteger the chain (with its bias Add) becomes a DynamicQConv, which BatchNormalization and ReLU then join."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.passes.attention import merge_matmuls
from kiln.passes.conv import fold_batchnorm_into_conv, fuse_activation, fuse_residual_add
from kiln.passes.dynamic_quant import fuse_dynamic_quantized_conv, fuse_dynamic_quantized_matmul
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


FILTER = np.arange(3 * 2 * 3 * 3).reshape(3, 2, 3, 3) % 7 - 3   # [Cout 3, Cin 2, 3, 3]


def conv_chain(b: IRBuilder, x, tag: str, bias=None, scale_shape=(3, 1, 1)):
    """quantize_dynamic's chain around a 3x3 ConvInteger (pads 1) on x [1, 2, 4, 4]: DynamicQuantizeLinear ->
    ConvInteger -> Cast -> Mul(Mul(x_scale, W_scale)) [-> Add(bias)], named after `tag`."""
    q, s, z = b.multi("DynamicQuantizeLinear", [x], [(f"xq{tag}", (1, 2, 4, 4)), (f"xs{tag}", ()), (f"xz{tag}", ())],
                      name=f"dql{tag}", dtype=np.uint8)
    s.dtype = np.dtype(np.float32)
    conv = b.node("ConvInteger", [q, b.const(f"w{tag}", FILTER, np.int8), z], f"i{tag}", (1, 3, 4, 4), dtype=np.int32,
                  name=f"convi{tag}", pads=[1, 1, 1, 1], kernel_shape=[3, 3], strides=[1, 1], dilations=[1, 1], group=1)
    cast = b.node("Cast", [conv], f"f{tag}", (1, 3, 4, 4), dtype=np.float32, name=f"cast{tag}", to=1)
    w_scale = b.const(f"ws{tag}", np.array([0.5, 0.25, 0.125]).reshape(scale_shape))
    scale = b.node("Mul", [s, w_scale], f"s{tag}", scale_shape, name=f"scale{tag}")
    y = b.node("Mul", [cast, scale], f"y{tag}", (1, 3, 4, 4), name=f"mul{tag}")
    return y if bias is None else b.node("Add", [y, bias], f"a{tag}", (1, 3, 4, 4), name=f"bias{tag}")


def test_the_convolution_chain_and_its_bias_become_one_int8_convolution():
    b = IRBuilder()
    bias = b.const("b1", np.array([1.0, 2.0, 3.0]).reshape(1, 3, 1, 1))
    g = b.graph(conv_chain(b, b.input("x", (1, 2, 4, 4)), "1", bias=bias))

    run = run_pass(g, "DynamicQuantizeConvFusion", fuse_dynamic_quantized_conv)

    (layer,) = g.nodes
    assert (layer.op_type, layer.domain, layer.origin) == ("DynamicQConv", "kiln",
                                                          ("convi1", "cast1", "mul1", "bias1", "scale1", "dql1"))
    assert layer.attrs == {"pads": [1, 1, 1, 1], "kernel_shape": [3, 3], "strides": [1, 1], "dilations": [1, 1],
                           "group": 1, "quant": {"x_dtype": "uint8", "w_axis": 0, "w_scale": [0.5, 0.25, 0.125],
                                                 "w_zero_point": [0, 0, 0]}}
    assert [v.name for v in layer.inputs[:2]] == ["x", "w1"] and layer.inputs[2].const.tolist() == [1.0, 2.0, 3.0]
    assert layer.outputs[0].name == "a1" and run.stat.matches == 4
    assert [line for line in run.lines if "Fusing" in line] == [
        f"DynamicQuantizeConvFusion: Fusing {a} with {b}" for a, b in (("convi1", "cast1"), ("convi1", "mul1"),
                                                                       ("convi1", "bias1"), ("dql1", "convi1"))]


def test_batchnorm_scales_the_int8_convolutions_dequantization_and_relu_joins_it():
    """ConvScaleFusion folds BN into w_scale and the bias, not the INT8 weights; ConvReluFusion then adds ReLU."""
    b = IRBuilder()
    y = conv_chain(b, b.input("x", (1, 2, 4, 4)), "1")
    params = [b.const(name, values) for name, values in (("gamma", [1.0, 2.0, -1.0]), ("beta", [0.5, 0.0, 1.0]),
                                                         ("mean", [1.0, 0.0, 2.0]), ("var", [3.0, 0.0, 0.0]))]
    bn = b.node("BatchNormalization", [y, *params], "bn_out", (1, 3, 4, 4), name="bn", epsilon=1.0)
    g = b.graph(b.node("Relu", [bn], "out", (1, 3, 4, 4), name="relu"))

    run_pass(g, "DynamicQuantizeConvFusion", fuse_dynamic_quantized_conv)
    scale = run_pass(g, "ConvScaleFusion", fold_batchnorm_into_conv)
    act = run_pass(g, "ConvReluFusion", fuse_activation)

    (layer,) = g.nodes
    assert (layer.op_type, layer.domain) == ("DynamicQConv", "kiln")
    assert layer.origin == ("convi1", "cast1", "mul1", "scale1", "dql1", "bn", "relu")
    k = np.array([1.0, 2.0, -1.0]) / np.sqrt(np.array([3.0, 0.0, 0.0]) + 1.0)   # gamma / sqrt(var + eps)
    assert layer.attrs["quant"]["w_scale"] == pytest.approx((np.array([0.5, 0.25, 0.125]) * k).tolist())
    assert layer.inputs[2].const.tolist() == pytest.approx((-np.array([1.0, 0.0, 2.0]) * k + [0.5, 0.0, 1.0]).tolist())
    assert np.array_equal(layer.inputs[1].const, FILTER) and layer.attrs["activation"] == {"op": "Relu", "attrs": {}}
    assert (scale.stat.matches, act.stat.matches) == (1, 1)


def test_convolution_chains_that_differ_stay_or_leave_their_bias_with_the_reason():
    b = IRBuilder()
    x = b.input("x", (1, 2, 4, 4))
    along_width = conv_chain(b, x, "1", bias=b.const("b1", [1.0, 2.0, 3.0, 4.0]))   # broadcasts along W, not C
    per_width = conv_chain(b, x, "2", scale_shape=(3,))   # a scale per W position would be [3] against [..., 4]
    g = b.graph(along_width, per_width)

    run = run_pass(g, "DynamicQuantizeConvFusion", fuse_dynamic_quantized_conv)

    assert sorted(n.name for n in g.nodes) == ["bias1", "cast2", "convi1 + cast1 + mul1 + scale1 + dql1", "convi2",
                                               "dql2", "mul2", "scale2"]
    assert len(g.nodes[0].inputs) == 2   # the chain fused without its bias, whose Add stays a layer of its own
    assert run.not_fusing == [
        "DynamicQuantizeConvFusion: Not fusing convi1 with bias1: bias1 adds a constant that is not one FP32 value per "
        "output channel",
        "DynamicQuantizeConvFusion: Not fusing dql2 with convi2: cast2 is not scaled by Mul(x_scale, constant weight "
        "scale) alone"]


def test_the_int8_convolution_takes_an_fp32_residual_sum_before_its_relu():
    """ConvEltwiseSumFusion gives a DynamicQConv the sum's other operand as its residual input (after the bias, as a
    Conv's), ReLU then joins; a sum that broadcasts stays an Add, with the reason."""
    b = IRBuilder()
    x, skip, row = b.input("x", (1, 2, 4, 4)), b.input("skip", (1, 3, 4, 4)), b.input("row", (1, 3, 1, 4))
    summed = b.node("Add", [skip, conv_chain(b, x, "1", bias=b.const("b1", np.ones((3, 1, 1))))], "s", (1, 3, 4, 4),
                    name="sum")
    broadcast = b.node("Add", [conv_chain(b, x, "2"), row], "t", (1, 3, 4, 4), name="broadcast")
    g = b.graph(b.node("Relu", [summed], "out", (1, 3, 4, 4), name="relu"), broadcast)

    run_pass(g, "DynamicQuantizeConvFusion", fuse_dynamic_quantized_conv)
    run = run_pass(g, "ConvEltwiseSumFusion", fuse_residual_add)
    act = run_pass(g, "ConvReluFusion", fuse_activation)

    layer = next(n for n in g.nodes if "sum" in n.origin)
    assert (layer.op_type, layer.domain) == ("DynamicQConv", "kiln")
    assert layer.origin == ("convi1", "cast1", "mul1", "bias1", "scale1", "dql1", "sum", "relu")
    assert [v.name for v in layer.inputs[::3]] == ["x", "skip"] and layer.inputs[2].const.tolist() == [1.0] * 3
    assert layer.outputs[0].name == "out" and layer.attrs["activation"] == {"op": "Relu", "attrs": {}}
    assert sorted(n.op_type for n in g.nodes) == ["Add", "DynamicQConv", "DynamicQConv"]
    assert (run.stat.matches, act.stat.matches) == (1, 1)
    assert run.not_fusing == ["ConvEltwiseSumFusion: Not fusing convi2 + cast2 + mul2 + scale2 + dql2 with broadcast: "
                              "shapes differ ([1, 3, 1, 4] vs [1, 3, 4, 4]): broadcasting sum is not fusable"]
