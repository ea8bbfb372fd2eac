"""Explicit-quantization passes on IR graphs: DQ -> Conv/MatMul(DQ(W_int8)) [-> Q] becomes one INT8 layer
(QuantizeDoubleInputNodes), Q(act(DQ + DQ)) one INT8 add (QuantizedAddFusion), an INT8 add of an INT8 conv's
output into the conv (QConvEltwiseSumFusion), an INT8 product's requantized output into its bias Add
(RequantizedBiasFusion), DQ -> Softmax -> Q one INT8 softmax (QuantizedSoftmaxFusion), duplicate Q nodes merge,
max pooling and concatenation run on INT8 tensors; and the reasons when the input has no INT8 scale."""
from __future__ import annotations

import numpy as np

from kiln.passes.qpool import fuse_quantized_softmax
from kiln.passes.quantization import (fuse_quantized_add, fuse_quantized_layers, fuse_quantized_residual,
                                     fuse_requantized_bias, merge_duplicate_qdq,
                                     split_q_across_concat, swap_dq_q_around_movement)
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

# The fused layers read the INT8 tensors directly; the DequantizeLinear nodes they leave behind have no readers
# and go in the pipeline's final DeadLayerRemoval, so the expected graphs below still list them (the INT8 sum drops
# its own at once: the convolution feeding it must see the sum as its sole consumer to absorb it).
X = (1, 2, 3, 3)


def dq(b: IRBuilder, v, out: str, scale, **attrs):
    """DequantizeLinear with a constant scale (scales that are powers of two print exactly)."""
    return b.node("DequantizeLinear", [v, b.const(f"{out}.scale", scale)], out, v.shape, dtype=np.float32, **attrs)


def q(b: IRBuilder, v, out: str, scale: float):
    zero = b.const(f"{out}.zero", 0, np.int8)
    return b.node("QuantizeLinear", [v, b.const(f"{out}.scale", scale), zero], out, v.shape, dtype=np.int8)


def int8_weight(b: IRBuilder, name: str, shape):
    return b.const(name, np.ones(shape), np.int8)


# ---------------------------------------------------------------- QuantizeDoubleInputNodes
def test_dq_conv_q_becomes_one_int8_convolution():
    b = IRBuilder()
    xq = b.input("xq", X, np.int8)
    wq = int8_weight(b, "wq", (2, 2, 1, 1))
    w = b.node("DequantizeLinear", [wq, b.const("w.scale", [0.25, 0.125]), b.const("w.zero", [0, 0], np.int8)],
               "w", (2, 2, 1, 1), dtype=np.float32, axis=0)
    c = b.node("Conv", [dq(b, xq, "x", 0.5), w, b.const("bias", [0.5, -0.5])], "c", X, name="conv",
               kernel_shape=[1, 1])
    g = b.graph(q(b, c, "y", 0.125))

    run = run_pass(g, "QuantizeDoubleInputNodes", fuse_quantized_layers)

    assert str(g) == expected("""
        graph g(%xq: int8[1x2x3x3]):
          %y: int8[1x2x3x3] = kiln.QConv(%xq, const %wq, const %bias) kernel_shape=[1, 1] quant={'x_scale': 0.5, 'x_zero_point': 0, 'x_dtype': 'int8', 'w_scale': [0.25, 0.125], 'w_zero_point': [0, 0], 'w_axis': 0, 'y_scale': 0.125, 'y_zero_point': 0, 'y_dtype': 'int8'}  # conv + y
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (2, 0)
    assert g.nodes[-1].origin == ("x", "w", "conv", "y")


def test_int8_matmul_without_a_following_q_keeps_a_float_output_and_warns():
    b = IRBuilder()
    xq = b.input("xq", (2, 3), np.int8)
    y = b.node("MatMul", [dq(b, xq, "x", 0.5), dq(b, int8_weight(b, "wq", (3, 4)), "w", 0.25)], "y", (2, 4),
               name="mm")
    g = b.graph(y)

    run = run_pass(g, "QuantizeDoubleInputNodes", fuse_quantized_layers)

    assert str(g) == expected("""
        graph g(%xq: int8[2x3]):
          %y: float32[2x4] = kiln.QMatMul(%xq, const %wq) quant={'x_scale': 0.5, 'x_zero_point': 0, 'x_dtype': 'int8', 'w_scale': [0.25], 'w_zero_point': [0], 'w_axis': 1}  # mm
          return %y
        """)
    assert run.stat.matches == 1
    assert "QuantizeDoubleInputNodes: mm: INT8 MatMul with FP32 output (no QuantizeLinear after it)" in run.lines
    assert any(line.startswith("mm runs in INT8 but its output stays FP32") and "It is a network output" in line
               for line in run.lines)


def test_layers_without_a_per_tensor_int8_input_stay_float():
    b = IRBuilder()
    x, xq = b.input("x", X), b.input("xq", X, np.int8)
    y1 = b.node("Conv", [x, dq(b, int8_weight(b, "wq1", (2, 2, 1, 1)), "w1", 0.25)], "y1", X, name="conv1")
    per_channel = dq(b, xq, "xc", [0.5, 0.25], axis=1)
    y2 = b.node("Conv", [per_channel, dq(b, int8_weight(b, "wq2", (2, 2, 1, 1)), "w2", 0.25)], "y2", X, name="conv2")
    wide = dq(b, b.input("x16", X, np.uint16), "x16f", 0.5)   # onnxruntime's QUInt16 activations
    y3 = b.node("Conv", [wide, dq(b, int8_weight(b, "wq3", (2, 2, 1, 1)), "w3", 0.25)], "y3", X, name="conv3")
    g = b.graph(y1, y2, y3)
    run = run_pass_unchanged(g, "QuantizeDoubleInputNodes", fuse_quantized_layers)
    assert run.not_fusing == [
        "QuantizeDoubleInputNodes: Not fusing x with conv1: the input is not dequantized from INT8 (no input scale): "
        "the layer stays FP32",
        "QuantizeDoubleInputNodes: Not fusing xc with conv2: the input scale is not a constant per-tensor scale",
        "QuantizeDoubleInputNodes: Not fusing x16f with conv3: the input is dequantized from uint16: kiln's quantized "
        "kernels read 8-bit activations"]
    assert (run.stat.matches, run.stat.rejections) == (0, 3)


def test_matmul_of_two_int8_activations_becomes_one_int8_product():
    """Attention's Q.K^T in a Q/DQ model: both inputs dequantized activations with per-tensor scales."""
    b = IRBuilder()
    qq, kq = b.input("qq", (1, 2, 3, 4), np.uint8), b.input("kq", (1, 2, 4, 3), np.uint8)
    k = b.node("DequantizeLinear", [kq, b.const("k.scale", 0.25), b.const("k.zero", 128, np.uint8)], "k",
               (1, 2, 4, 3), dtype=np.float32)
    s = b.node("MatMul", [dq(b, qq, "q", 0.5), k], "s", (1, 2, 3, 3), name="scores")
    g = b.graph(q(b, s, "y", 0.125))

    run = run_pass(g, "QuantizeDoubleInputNodes", fuse_quantized_layers)

    assert str(g) == expected("""
        graph g(%qq: uint8[1x2x3x4], %kq: uint8[1x2x4x3]):
          %y: int8[1x2x3x3] = kiln.QMatMul(%qq, %kq) quant={'x_scale': 0.5, 'x_zero_point': 0, 'x_dtype': 'uint8', 'w_scale': [0.25], 'w_zero_point': [128], 'w_axis': 1, 'y_scale': 0.125, 'y_zero_point': 0, 'y_dtype': 'int8'}  # scores + y
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (2, 0)
    assert g.nodes[-1].origin == ("q", "k", "scores", "y")


def test_only_a_matmul_takes_an_int8_activation_and_only_per_tensor():
    b = IRBuilder()
    xq, wq, cq = b.input("xq", (2, 3), np.int8), b.input("wq", (3, 4), np.int8), b.input("cq", (3, 4), np.int8)
    gemm = b.node("Gemm", [dq(b, xq, "x", 0.5), dq(b, wq, "w", 0.25)], "g", (2, 4), name="gemm")
    per_column = dq(b, cq, "c", [0.5, 0.25, 0.5, 0.25], axis=1)
    mm = b.node("MatMul", [dq(b, xq, "x2", 0.5), per_column], "m", (2, 4), name="mm")
    x3 = b.input("x3", (5, 2, 3), np.int8)
    head = b.node("MatMul", [dq(b, x3, "x3f", 0.5), dq(b, cq, "c2", 0.25)], "h", (5, 2, 4), name="head")
    v1, u1 = b.input("v1", (3,), np.int8), b.input("u1", (3,), np.int8)
    dot = b.node("MatMul", [dq(b, v1, "v1f", 0.5), dq(b, u1, "u1f", 0.25)], "d", (), name="dot")
    wide = b.input("wide", (3, 4), np.int32)
    int32 = b.node("MatMul", [dq(b, xq, "x4", 0.5), dq(b, wide, "widef", 0.25)], "i", (2, 4), name="int32")
    g = b.graph(gemm, mm, head, dot, int32)
    run = run_pass_unchanged(g, "QuantizeDoubleInputNodes", fuse_quantized_layers)
    assert run.not_fusing == [
        "QuantizeDoubleInputNodes: Not fusing x with gemm: the weights are not constant INT8 with constant scales",
        "QuantizeDoubleInputNodes: Not fusing x2 with mm: the second input is an activation without a per-tensor "
        "scale",
        "QuantizeDoubleInputNodes: Not fusing x3f with head: the second input is an activation of rank 2 against 3: "
        "kiln's INT8 product of two activations takes equal ranks of at least 2",
        "QuantizeDoubleInputNodes: Not fusing v1f with dot: the second input is an activation of rank 1 against 1: "
        "kiln's INT8 product of two activations takes equal ranks of at least 2",
        "QuantizeDoubleInputNodes: Not fusing x4 with int32: a second input of type int32 is not INT8"]


# ---------------------------------------------------------------- QuantizedAddFusion
def test_dq_add_relu_q_becomes_one_int8_add():
    b = IRBuilder()
    a, c = b.input("a", (2, 4), np.int8), b.input("c", (2, 4), np.int8)
    s = b.node("Add", [dq(b, a, "da", 0.5), dq(b, c, "dc", 0.25)], "s", (2, 4), name="add")
    g = b.graph(q(b, b.node("Relu", [s], "r", (2, 4), name="relu"), "y", 0.125))

    run = run_pass(g, "QuantizedAddFusion", fuse_quantized_add)

    assert str(g) == expected("""
        graph g(%a: int8[2x4], %c: int8[2x4]):
          %y: int8[2x4] = kiln.QAdd(%a, %c) activation={'op': 'Relu', 'attrs': {}} quant={'a_scale': 0.5, 'a_zero_point': 0, 'b_scale': 0.25, 'b_zero_point': 0, 'y_scale': 0.125, 'y_zero_point': 0, 'a_dtype': 'int8', 'b_dtype': 'int8', 'y_dtype': 'int8'}  # add + relu + y
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (2, 0)


def test_int8_sum_without_a_following_q_stays_a_float_add():
    b = IRBuilder()
    a, c = b.input("a", (2, 4), np.int8), b.input("c", (2, 4), np.int8)
    s = b.node("Add", [dq(b, a, "da", 0.5), dq(b, c, "dc", 0.25)], "s", (2, 4), name="add")
    g = b.graph(b.node("Neg", [s], "y", (2, 4), name="neg"))
    run = run_pass_unchanged(g, "QuantizedAddFusion", fuse_quantized_add)
    assert run.not_fusing == ["QuantizedAddFusion: Not fusing add with neg: no per-tensor QuantizeLinear after the "
                              "sum: it stays an FP32 add"]


def test_sixteen_bit_sums_and_outputs_form_no_int8_layer():
    """A sum of two uint16 tensors quantized to INT8 is no INT8 sum; an INT8 convolution whose output is quantized to
    16 bits keeps a float output and the 16-bit QuantizeLinear after it (kiln's quantized layers write 8 bits)."""
    b = IRBuilder()
    a, c = b.input("a", (2, 4), np.uint16), b.input("c", (2, 4), np.uint16)
    s = b.node("Add", [dq(b, a, "da", 0.5), dq(b, c, "dc", 0.25)], "s", (2, 4), name="add")
    g = b.graph(q(b, s, "y", 0.5))
    run = run_pass_unchanged(g, "QuantizedAddFusion", fuse_quantized_add)
    assert run.stat.matches == 0

    b = IRBuilder()
    x = dq(b, b.input("xq", X, np.int8), "x", 0.5)
    conv = b.node("Conv", [x, dq(b, int8_weight(b, "wq", (2, 2, 1, 1)), "w", 0.25)], "c", X, name="conv")
    wide = b.node("QuantizeLinear", [conv, b.const("y.scale", 0.5), b.const("y.zero", 0, np.uint16)], "y", X,
                  dtype=np.uint16)
    g = b.graph(wide)
    run_pass(g, "QuantizeDoubleInputNodes", fuse_quantized_layers)
    layer = next(n for n in g.nodes if n.op_type == "QConv")
    assert "y_scale" not in layer.attrs["quant"] and layer.outputs[0].dtype == np.float32
    assert [n.op_type for n in g.nodes if n.outputs[0] is g.outputs[0]] == ["QuantizeLinear"]


# ---------------------------------------------------------------- QuantizedSoftmaxFusion
def scores_softmax(b: IRBuilder, axis=-1, y_scale=1 / 256, dq_scale=0.5):
    x = b.input("x", (2, 4, 8), np.int8)
    p = b.node("Softmax", [dq(b, x, "dx", dq_scale)], "p", (2, 4, 8), name="softmax", axis=axis)
    return p if y_scale is None else q(b, p, "y", y_scale)


def test_dq_softmax_q_becomes_one_int8_softmax():
    b = IRBuilder()
    g = b.graph(scores_softmax(b))

    run = run_pass(g, "QuantizedSoftmaxFusion", fuse_quantized_softmax)

    assert str(g) == expected("""
        graph g(%x: int8[2x4x8]):
          %y: int8[2x4x8] = kiln.QSoftmax(%x) axis=2 quant={'x_scale': 0.5, 'x_zero_point': 0, 'x_dtype': 'int8', 'y_scale': 0.00390625, 'y_zero_point': 0, 'y_dtype': 'int8'}  # softmax + y
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (2, 0)


def test_softmax_stays_fp32_without_its_quantization_or_on_another_axis():
    cases = {"no per-tensor INT8 QuantizeLinear is its only reader": {"y_scale": None},
             "the input's DequantizeLinear is not per-tensor INT8": {"dq_scale": np.array([0.5, 0.25])},
             "it normalizes axis 1, not the last": {"axis": 1}}
    for reason, kwargs in cases.items():
        b = IRBuilder()
        g = b.graph(scores_softmax(b, **kwargs))
        run = run_pass_unchanged(g, "QuantizedSoftmaxFusion", fuse_quantized_softmax)
        reader = "its consumers" if kwargs.get("y_scale", 1) is None else "y"
        assert run.not_fusing == [f"QuantizedSoftmaxFusion: Not fusing softmax with {reader}: {reason}: "
                                  "it stays FP32"], reason


def test_an_int8_softmax_leaves_its_dq_to_other_readers_and_keeps_opset_11_axis_rules():
    b = IRBuilder()
    x = b.input("x", (2, 4, 8), np.int8)
    xf = dq(b, x, "dx", 0.5)
    p = b.node("Softmax", [xf], "p", (2, 4, 8), name="softmax", axis=-1)
    g = b.graph(q(b, p, "y", 1 / 256), b.node("Relu", [xf], "r", (2, 4, 8), name="relu"))
    run_pass(g, "QuantizedSoftmaxFusion", fuse_quantized_softmax)
    assert [n.op_type for n in g.nodes] == ["DequantizeLinear", "QSoftmax", "Relu"]   # the Relu's DQ stays
    b = IRBuilder()
    x = b.input("x", (2, 4, 8), np.int8)
    p = b.node("Softmax", [dq(b, x, "dx", 0.5)], "p", (2, 4, 8), name="softmax")   # no axis: opset 11's is 1
    g = b.graph(q(b, p, "y", 1 / 256))
    g.opset = 11
    run = run_pass_unchanged(g, "QuantizedSoftmaxFusion", fuse_quantized_softmax)
    assert run.not_fusing == ["QuantizedSoftmaxFusion: Not fusing softmax with y: it normalizes axis 1, not the "
                              "last: it stays FP32"]


# ---------------------------------------------------------------- HorizontalMergeQNodes
def test_equal_quantizations_of_one_tensor_merge_and_different_ones_do_not():
    b = IRBuilder()
    x = b.input("x", (2, 4))
    q1, q2, q3 = q(b, x, "q1", 0.5), q(b, x, "q2", 0.5), q(b, x, "q3", 0.25)
    g = b.graph(dq(b, q1, "y1", 0.5), dq(b, q2, "y2", 0.5), dq(b, q3, "y3", 0.25))

    run = run_pass(g, "HorizontalMergeQNodes", merge_duplicate_qdq)

    assert str(g) == expected("""
        graph g(%x: float32[2x4]):
          %q1: int8[2x4] = QuantizeLinear(%x, const %q1.scale, const %q1.zero)  # q1
          %q3: int8[2x4] = QuantizeLinear(%x, const %q3.scale, const %q3.zero)  # q3
          %y1: float32[2x4] = DequantizeLinear(%q1, const %y1.scale)  # y1
          %y2: float32[2x4] = DequantizeLinear(%q1, const %y2.scale)  # y2
          %y3: float32[2x4] = DequantizeLinear(%q3, const %y3.scale)  # y3
          return %y1, %y2, %y3
        """)
    assert run.stat.matches == 1


# ---------------------------------------------------------------- VanillaSwapWithFollowingQ, SplitQAcrossPrecedingFanIn
def test_max_pooling_between_equal_dq_and_q_runs_on_int8():
    b = IRBuilder()
    xq = b.input("xq", (1, 2, 4, 4), np.int8)
    p = b.node("MaxPool", [dq(b, xq, "x", 0.5)], "p", (1, 2, 2, 2), name="pool", kernel_shape=[2, 2])
    g = b.graph(dq(b, q(b, p, "y", 0.5), "z", 0.5))

    run = run_pass(g, "VanillaSwapWithFollowingQ", swap_dq_q_around_movement)

    assert str(g) == expected("""
        graph g(%xq: int8[1x2x4x4]):
          %p: int8[1x2x2x2] = MaxPool(%xq) kernel_shape=[2, 2]  # pool
          %z: float32[1x2x2x2] = DequantizeLinear(%p, const %z.scale)  # z
          return %z
        """)
    assert run.stat.matches == 2


def test_a_dq_read_by_several_moves_each_quantized_again_swaps_each_and_stays_for_a_float_reader():
    """YOLOv8's C2f: one dequantized tensor split by Slices, each quantized again at its scale. Each such Slice runs
    on the INT8 tensor; a third reader (a float Relu) keeps the DequantizeLinear; a Slice quantized at another scale
    stays float, and so does one whose Q writes a network output (its name is the engine's output name)."""
    b = IRBuilder()
    xq = b.input("xq", (1, 8, 2, 2), np.int8)
    x = dq(b, xq, "x", 0.5)
    halves = [b.node("Slice", [x, b.const(f"s{i}.starts", [2 * i]), b.const(f"s{i}.ends", [2 * i + 2]),
                               b.const(f"s{i}.axes", [1])], f"h{i}", (1, 2, 2, 2), name=f"slice{i}") for i in range(4)]
    quantized = [q(b, h, f"q{i}", 0.25 if i == 2 else 0.5) for i, h in enumerate(halves)]
    read = [b.node("Neg", [v], f"n{i}", (1, 2, 2, 2), dtype=np.int8, name=f"neg{i}") for i, v in enumerate(quantized[:3])]
    g = b.graph(*read, quantized[3], b.node("Relu", [x], "r", (1, 8, 2, 2), name="relu"))

    run = run_pass(g, "VanillaSwapWithFollowingQ", swap_dq_q_around_movement)

    assert [(n.name, n.inputs[0].name, str(n.outputs[0].dtype)) for n in g.nodes if n.op_type == "Slice"] == [
        ("slice0", "xq", "int8"), ("slice1", "xq", "int8"), ("slice2", "x", "float32"), ("slice3", "x", "float32")]
    assert [n.inputs[0].name for n in g.nodes if n.op_type == "Neg"] == ["h0", "h1", "q2"]
    assert [o.name for o in g.outputs] == ["n0", "n1", "n2", "q3", "r"] and run.stat.matches == 4   # 2 per swap
    assert [n.name for n in g.nodes if n.op_type == "DequantizeLinear"] == ["x"]   # the Relu still reads it


def test_pooling_between_different_scales_is_not_swapped():
    b = IRBuilder()
    xq = b.input("xq", (1, 2, 4, 4), np.int8)
    p = b.node("MaxPool", [dq(b, xq, "x", 0.5)], "p", (1, 2, 2, 2), name="pool", kernel_shape=[2, 2])
    g = b.graph(q(b, p, "y", 0.25))

    run = run_pass_unchanged(g, "VanillaSwapWithFollowingQ", swap_dq_q_around_movement)

    assert run.stat.matches == 0


def _resize_between(mode: str, transform: str = "half_pixel"):
    b = IRBuilder()
    xq = b.input("xq", (1, 2, 2, 2), np.int8)
    r = b.node("Resize", [dq(b, xq, "x", 0.5), b.const("roi", []), b.const("scales", [1, 1, 2, 2])], "r",
               (1, 2, 4, 4), name="resize", mode=mode, coordinate_transformation_mode=transform)
    return b.graph(dq(b, q(b, r, "y", 0.5), "z", 0.5))


def test_a_nearest_resize_between_equal_dq_and_q_copies_int8_pixels():
    g = _resize_between("nearest")

    run = run_pass(g, "VanillaSwapWithFollowingQ", swap_dq_q_around_movement)

    assert str(g) == expected("""
        graph g(%xq: int8[1x2x2x2]):
          %r: int8[1x2x4x4] = Resize(%xq, const %roi, const %scales) coordinate_transformation_mode='half_pixel' mode='nearest'  # resize
          %z: float32[1x2x4x4] = DequantizeLinear(%r, const %z.scale)  # z
          return %z
        """)
    assert run.stat.matches == 2


def test_an_interpolating_or_extrapolating_resize_is_not_swapped():
    """Linear and cubic Resize compute new values (rounded otherwise in INT8); tf_crop_and_resize fills pixels outside
    the crop with extrapolation_value, a float, not the zero point's byte."""
    for mode, transform in (("linear", "half_pixel"), ("cubic", "half_pixel"), ("nearest", "tf_crop_and_resize")):
        run = run_pass_unchanged(_resize_between(mode, transform), "VanillaSwapWithFollowingQ",
                                 swap_dq_q_around_movement)
        assert run.stat.matches == 0, (mode, transform)


def test_q_after_concat_moves_onto_its_inputs_and_cancels_an_equal_dq():
    b = IRBuilder()
    aq, f = b.input("aq", (2, 4), np.int8), b.input("f", (2, 4))
    cat = b.node("Concat", [dq(b, aq, "a", 0.5), f], "cat", (2, 8), axis=1)
    g = b.graph(dq(b, q(b, cat, "cq", 0.5), "y", 0.5))

    run = run_pass(g, "SplitQAcrossPrecedingFanIn", split_q_across_concat)

    assert str(g) == expected("""
        graph g(%aq: int8[2x4], %f: float32[2x4]):
          %f_quantized: int8[2x4] = QuantizeLinear(%f, const %cq.scale, const %cq.zero)  # cq [1]
          %cat: int8[2x8] = Concat(%aq, %f_quantized) axis=1  # cat
          %y: float32[2x8] = DequantizeLinear(%cat, const %y.scale)  # y
          return %y
        """)
    assert run.stat.matches == 1


def test_a_q_moved_onto_a_dynamic_input_keeps_its_dynamic_axes_and_probe_shape():
    b = IRBuilder()
    f, h = b.input("f", (2, 4), dyn_dims=(0,), probe=(5, 4)), b.input("h", (2, 4), dyn_dims=(0,), probe=(5, 4))
    cat = b.node("Concat", [f, h], "cat", (2, 8), axis=1, dyn_dims=(0,), probe=(5, 8))
    quantized = b.node("QuantizeLinear", [cat, b.const("cq.scale", 0.5), b.const("cq.zero", 0, np.int8)], "cq",
                       (2, 8), dtype=np.int8, dyn_dims=(0,), probe=(5, 8))
    g = b.graph(dq(b, quantized, "y", 0.5, dyn_dims=(0,), probe=(5, 8)))

    run_pass(g, "SplitQAcrossPrecedingFanIn", split_q_across_concat)

    moved = [g.values[n] for n in ("f_quantized", "h_quantized")]
    assert [(v.dtype, v.dyn_dims, v.probe_shape) for v in moved] == [(np.int8, (0,), (5, 4))] * 2


# ---------------------------------------------------------------- QConvEltwiseSumFusion
def residual_block(b: IRBuilder, conv_out_scale: float = 0.125, conv_act: bool = False):
    """QAdd(QConv(x), r) with a ReLU after the sum: what the two passes above leave of a ResNet block's tail."""
    xq, rq = b.input("xq", X, np.uint8), b.input("rq", X, np.uint8)
    quant = {"x_scale": 0.5, "x_zero_point": 0, "x_dtype": "uint8", "w_scale": [0.25, 0.125], "w_zero_point": [0, 0],
             "w_axis": 0, "y_scale": conv_out_scale, "y_zero_point": 0, "y_dtype": "uint8"}
    extra = {"activation": {"op": "Relu", "attrs": {}}} if conv_act else {}
    c = b.node("QConv", [xq, int8_weight(b, "wq", (2, 2, 1, 1)), b.const("bias", [0.5, -0.5])], "c", X,
               dtype=np.uint8, domain="kiln", name="conv + cq", kernel_shape=[1, 1], quant=quant, **extra)
    add_quant = {"a_scale": 0.125, "a_zero_point": 0, "b_scale": 0.25, "b_zero_point": 3, "y_scale": 0.5,
                 "y_zero_point": 0, "a_dtype": "uint8", "b_dtype": "uint8", "y_dtype": "uint8"}
    return b.graph(b.node("QAdd", [c, rq], "y", X, dtype=np.uint8, domain="kiln", name="add + relu + yq",
                          quant=add_quant, activation={"op": "Relu", "attrs": {}}))


def test_int8_sum_of_an_int8_conv_fuses_into_the_conv_with_the_sums_scale():
    g = residual_block(IRBuilder())

    run = run_pass(g, "QConvEltwiseSumFusion", fuse_quantized_residual)

    assert str(g) == expected("""
        graph g(%xq: uint8[1x2x3x3], %rq: uint8[1x2x3x3]):
          %y: uint8[1x2x3x3] = kiln.QConv(%xq, const %wq, const %bias, %rq) activation={'op': 'Relu', 'attrs': {}} kernel_shape=[1, 1] quant={'x_scale': 0.5, 'x_zero_point': 0, 'x_dtype': 'uint8', 'w_scale': [0.25, 0.125], 'w_zero_point': [0, 0], 'w_axis': 0, 'y_scale': 0.5, 'y_zero_point': 0, 'y_dtype': 'uint8', 'r_scale': 0.25, 'r_zero_point': 3, 'sum_input_scale': 0.125, 'sum_input_zero_point': 0, 'sum_input_dtype': 'uint8'}  # conv + cq + add + relu + yq
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (1, 0)


def test_int8_sum_stays_apart_when_the_conv_activates_first_or_scales_disagree():
    for graph, reason in [(residual_block(IRBuilder(), conv_act=True), "conv + cq applies an activation before the sum"),
                          (residual_block(IRBuilder(), conv_out_scale=0.0625),
                           "the convolution's output scale differs from the scale the sum reads it with")]:
        before = str(graph)
        run = run_pass(graph, "QConvEltwiseSumFusion", fuse_quantized_residual)
        assert str(graph) == before
        assert run.not_fusing == [f"QConvEltwiseSumFusion: Not fusing conv + cq with add + relu + yq: {reason}"]


# ---------------------------------------------------------------- RequantizedBiasFusion
PRODUCT_QUANT = {"x_scale": 0.5, "x_zero_point": 0, "x_dtype": "int8", "w_scale": [0.25], "w_zero_point": [0],
                 "w_axis": 1, "y_scale": 0.125, "y_zero_point": 0, "y_dtype": "int8"}


def product_then_bias(b: IRBuilder, bias_shape=(4,), dq_scale=0.125, act=None, final_q=True, product_attrs=None,
                      own_bias=False, dq_zero_point=None, bias_input=False):
    """What QuantizeDoubleInputNodes and ConstantDequantizeFolding leave of quantize_static's MatMul and its bias:
    QMatMul(x) -> DQ -> Add(FP32 constant; a graph input with `bias_input`) [-> activation] [-> Q]."""
    xq = b.input("xq", (2, 3, 3), np.int8)
    inputs = [xq, int8_weight(b, "wq", (3, 4))] + ([b.const("own_bias", np.ones(4))] if own_bias else [])
    mm = b.node("QMatMul", inputs, "mmq", (2, 3, 4), dtype=np.int8, domain="kiln",
                name="mm + mmq", quant=PRODUCT_QUANT, **(product_attrs or {}))
    zero = [] if dq_zero_point is None else [b.const("mm.zero", dq_zero_point, np.int8)]
    mid = b.node("DequantizeLinear", [mm, b.const("mm.scale", dq_scale), *zero], "mm", mm.shape, dtype=np.float32)
    bias = b.input("bias", bias_shape, np.float32) if bias_input else \
        b.const("bias", np.arange(4.0).reshape(bias_shape) if np.prod(bias_shape) == 4 else np.ones(bias_shape))
    y = b.node("Add", [mid, bias], "sum", (2, 3, 4) if len(bias_shape) <= 3 else bias_shape, name="add")
    if act:
        y = b.node(act, [y], "act", (2, 3, 4), name=act.lower())
    return b.graph(q(b, y, "y", 0.25) if final_q else y)


def test_int8_product_takes_its_bias_rounding_at_its_own_scale_first():
    g = product_then_bias(IRBuilder(), bias_shape=(1, 1, 4), act="Relu")

    run = run_pass(g, "RequantizedBiasFusion", fuse_requantized_bias)

    assert str(g) == expected("""
        graph g(%xq: int8[2x3x3]):
          %y: int8[2x3x4] = kiln.QMatMul(%xq, const %wq, const %add.bias) activation={'op': 'Relu', 'attrs': {}} quant={'x_scale': 0.5, 'x_zero_point': 0, 'x_dtype': 'int8', 'w_scale': [0.25], 'w_zero_point': [0], 'w_axis': 1, 'mid_scale': 0.125, 'mid_zero_point': 0, 'mid_dtype': 'int8', 'y_scale': 0.25, 'y_zero_point': 0, 'y_dtype': 'int8'}  # mm + mmq + add + relu + y
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (4, 0)   # the DQ, the Add, the ReLU and the Q
    assert g.nodes[0].inputs[2].const.tolist() == [0.0, 1.0, 2.0, 3.0]   # one value per output column
    assert g.nodes[0].origin == ("mm + mmq", "mm", "add", "relu", "y")


def test_int8_product_with_its_bias_and_no_q_after_writes_fp32():
    g = product_then_bias(IRBuilder(), bias_shape=(), final_q=False)

    run_pass(g, "RequantizedBiasFusion", fuse_requantized_bias)

    (node,) = g.nodes
    assert str(node.outputs[0].dtype) == "float32" and node.name == "mm + mmq + add"
    assert not any(k.startswith("y_") for k in node.attrs["quant"]) and node.attrs["quant"]["mid_scale"] == 0.125
    assert node.inputs[2].const.tolist() == [1.0] * 4   # a scalar bias, one value per column


def test_int8_product_and_bias_stay_apart_with_the_reason():
    cases = [(dict(dq_scale=0.0625), "the DequantizeLinear after it has another scale or zero point than its output's"),
             (dict(bias_shape=(3, 1)), "bias shape [3, 1] does not broadcast along the output channels only"),
             (dict(product_attrs={"activation": {"op": "Relu", "attrs": {}}}),
              "mm + mmq applies an activation before its output is requantized"),
             (dict(act="Sigmoid"), "the INT8 kernels' epilogue has no Sigmoid (the activation after the bias)"),
             (dict(own_bias=True), "mm + mmq already has a bias or residual"),
             (dict(dq_zero_point=3), "the DequantizeLinear after it has another scale or zero point than its output's"),
             (dict(bias_input=True), "the Add's other operand is not a constant FP32 bias"),
             (dict(bias_shape=(2, 2, 3, 4)), "bias shape [2, 2, 3, 4] does not broadcast along the output channels "
              "only")]   # a bias of higher rank widens the output
    for kwargs, reason in cases:
        run = run_pass_unchanged(product_then_bias(IRBuilder(), **kwargs), "RequantizedBiasFusion",
                                 fuse_requantized_bias)
        assert run.not_fusing == [f"RequantizedBiasFusion: Not fusing mm + mmq with add: {reason}"]


def test_int8_product_read_again_before_its_bias_is_left_whole():
    """The requantized product (or its dequantized value) read by another node too: no one consumer to fuse."""
    for reread in ("mmq", "mm"):
        b = IRBuilder()
        g = product_then_bias(b)
        g.outputs.append(b.node("Identity", [g.values[reread]], "copy", (2, 3, 4)))
        g.verify()
        run = run_pass_unchanged(g, "RequantizedBiasFusion", fuse_requantized_bias)
        assert run.stat.matches == 0 and run.not_fusing == []


def test_a_convolution_keeps_its_bias_add_apart():
    """quantize_static gives a convolution its bias as its own input: a later Add is something else, left as it is."""
    b = IRBuilder()
    xq = b.input("xq", X, np.uint8)
    quant = {**PRODUCT_QUANT, "x_dtype": "uint8", "y_dtype": "uint8"}
    c = b.node("QConv", [xq, int8_weight(b, "wq", (2, 2, 1, 1))], "cq", X, dtype=np.uint8, domain="kiln",
               name="conv + cq", kernel_shape=[1, 1], quant=quant)
    mid = b.node("DequantizeLinear", [c, b.const("c.scale", 0.125), b.const("c.zero", 0, np.uint8)], "c", X,
                 dtype=np.float32)
    g = b.graph(b.node("Add", [b.const("bias", [[[0.5]], [[-0.5]]]), mid], "y", X, name="add"))

    run = run_pass_unchanged(g, "RequantizedBiasFusion", fuse_requantized_bias)
    assert run.stat.matches == 0 and run.not_fusing == []
