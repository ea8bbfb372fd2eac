"""Convolution fusions on IR graphs: BatchNormalization folds into the weights, a residual Add becomes the
convolution's fourth input, an activation becomes its `activation` attribute; and the reasons when they do not."""
from __future__ import annotations

import numpy as np

from kiln.passes.conv import fold_batchnorm_into_conv, fuse_activation, fuse_residual_add
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

X = (1, 2, 3, 3)


def conv(b: IRBuilder, x, out: str = "c", name: str = "conv", **attrs):
    """A 1x1 convolution from 2 to 2 channels with constant weights and bias."""
    w = b.const(f"{name}.w", np.ones((2, 2, 1, 1)))
    bias = b.const(f"{name}.b", [0.5, -0.5])
    return b.node("Conv", [x, w, bias], out, X, name=name, **attrs)


# ---------------------------------------------------------------- ConvScaleFusion
def bn_params(b: IRBuilder, mean=None):
    return [b.const("scale", [4.0, 3.0]), b.const("shift", [0.5, -1.0]),
            mean if mean is not None else b.const("mean", [1.0, 2.0]), b.const("var", [3.0, 8.0])]


def test_batchnorm_folds_into_the_convolution_weights_and_bias():
    b = IRBuilder()
    x = b.input("x", (1, 1, 3, 3))
    c = b.node("Conv", [x, b.const("w", [[[[1.5]]], [[[2.0]]]]), b.const("b", [1.0, 0.0])], "c", X, name="conv",
               kernel_shape=[1, 1])
    y = b.node("BatchNormalization", [c] + bn_params(b), "y", X, name="bn", epsilon=1.0)
    g = b.graph(y)

    run = run_pass(g, "ConvScaleFusion", fold_batchnorm_into_conv)

    assert str(g) == expected("""
        graph g(%x: float32[1x1x3x3]):
          %y: float32[1x2x3x3] = Conv(%x, const %conv + bn.weight, const %conv + bn.bias) kernel_shape=[1, 1]  # conv + bn
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (1, 0)
    assert "ConvScaleFusion: Fusing conv with bn" in run.lines
    # k = scale / sqrt(var + epsilon) = [2, 1]; weight * k; (bias - mean) * k + shift
    np.testing.assert_array_equal(g.values["conv + bn.weight"].const, np.array([[[[3.0]]], [[[2.0]]]], np.float32))
    np.testing.assert_array_equal(g.values["conv + bn.bias"].const, np.array([0.5, -3.0], np.float32))
    assert g.nodes[0].origin == ("conv", "bn")


def test_batchnorm_folds_into_a_grouped_transposed_convolutions_output_channels():
    """ConvTranspose weights are [C_in, C_out/group, k...]: with 2 groups of 1 input and 1 output channel each,
    output channel o is weights[o, 0]; no bias input gets the BatchNorm's shifted one."""
    b = IRBuilder()
    x = b.input("x", (1, 2, 3, 3))
    c = b.node("ConvTranspose", [x, b.const("w", [[[[1.5]]], [[[2.0]]]])], "c", X, name="up", group=2)
    g = b.graph(b.node("BatchNormalization", [c] + bn_params(b), "y", X, name="bn", epsilon=1.0))

    run_pass(g, "ConvScaleFusion", fold_batchnorm_into_conv)

    assert str(g) == expected("""
        graph g(%x: float32[1x2x3x3]):
          %y: float32[1x2x3x3] = ConvTranspose(%x, const %up + bn.weight, const %up + bn.bias) group=2  # up + bn
          return %y
        """)
    np.testing.assert_array_equal(g.values["up + bn.weight"].const, np.array([[[[3.0]]], [[[2.0]]]], np.float32))
    np.testing.assert_array_equal(g.values["up + bn.bias"].const, np.array([-1.5, -3.0], np.float32))


def test_batchnorm_does_not_fold_into_a_convolution_read_elsewhere():
    b = IRBuilder()
    x = b.input("x", X)
    c = conv(b, x)
    y = b.node("BatchNormalization", [c] + bn_params(b), "y", X, name="bn")
    r = b.node("Relu", [c], "r", X)
    g = b.graph(y, r)
    run = run_pass_unchanged(g, "ConvScaleFusion", fold_batchnorm_into_conv)
    assert (run.stat.matches, run.stat.rejections) == (0, 1)
    assert run.not_fusing == ["ConvScaleFusion: Not fusing conv with bn: conv's output 'c' has 2 consumers"]


def test_batchnorm_with_a_computed_mean_does_not_fold():
    b = IRBuilder()
    x, mean = b.input("x", X), b.input("mean", (2,))
    y = b.node("BatchNormalization", [conv(b, x)] + bn_params(b, mean), "y", X, name="bn")
    g = b.graph(y)

    run = run_pass(g, "ConvScaleFusion", fold_batchnorm_into_conv)

    assert [n.op_type for n in g.nodes] == ["Conv", "BatchNormalization"]
    assert run.not_fusing == ["ConvScaleFusion: Not fusing conv with bn: BatchNormalization parameters or the "
                              "convolution's bias are not constant"]


def qat_conv(b: IRBuilder, filt: np.ndarray, name: str = "conv", w_scale=(0.5,), dq=None, w_zp=(0,)):
    """A TensorRT-style QAT convolution: Conv(DequantizeLinear(x_s8), DequantizeLinear(W_s8)) with an FP32 bias."""
    xq = b.input(f"{name}.xq", (1, filt.shape[1], 3, 3), np.int8)
    x_dq = b.node("DequantizeLinear", [xq, b.const(f"{name}.xs", 0.1), b.const(f"{name}.xz", 0, np.int8)],
                  f"{name}.x", (1, filt.shape[1], 3, 3), dtype=np.float32, name=f"{name}.dqx")
    if dq is None:
        scale = np.asarray(w_scale, np.float32)
        dq = b.node("DequantizeLinear", [b.const(f"{name}.wq", filt, np.int8), b.const(f"{name}.ws", scale),
                                         b.const(f"{name}.wz", np.asarray(w_zp).reshape(scale.shape), np.int8)],
                    f"{name}.w", filt.shape, dtype=np.float32, name=f"{name}.dqw", **({"axis": 0} if scale.size > 1 else {}))
    return b.node("Conv", [x_dq, dq, b.const(f"{name}.b", [0.5, -0.5])], f"{name}.c", X, name=name)


def test_batchnorm_folds_into_a_dequantized_filters_scales_and_a_negative_one_flips_its_channel():
    """k = [2, -1] (gamma [4, -3]): the per-channel scales [0.5, 0.25] become [1.0, 0.25], channel 1's INT8
    weights and zero point change sign (scales stay positive), and the FP32 bias takes the fold."""
    b = IRBuilder()
    filt = np.array([[[[3]], [[-7]]], [[[127]], [[-5]]]])
    c = qat_conv(b, filt, w_scale=(0.5, 0.25), w_zp=(2, 3))
    params = [b.const("scale", [4.0, -3.0]), b.const("shift", [0.5, -1.0]), b.const("mean", [1.0, 2.0]),
              b.const("var", [3.0, 8.0])]
    g = b.graph(b.node("BatchNormalization", [c] + params, "y", X, name="bn", epsilon=1.0))

    run = run_pass(g, "ConvScaleFusion", fold_batchnorm_into_conv)

    dq, conv = g.nodes[1:]
    assert [n.op_type for n in g.nodes] == ["DequantizeLinear", "DequantizeLinear", "Conv"]
    assert (dq.name, dq.attrs, conv.name, conv.origin) == ("conv.dqw", {"axis": 0}, "conv + bn", ("conv", "bn"))
    w, scale, zp = (v.const for v in dq.inputs)
    assert w.dtype == np.int8 and w.reshape(2, 2).tolist() == [[3, -7], [-127, 5]]
    assert scale.dtype == np.float32 and scale.tolist() == [1.0, 0.25] and zp.tolist() == [2, -3]
    np.testing.assert_array_equal(conv.inputs[2].const, np.array([(0.5 - 1) * 2 + 0.5, (-0.5 - 2) * -1 - 1.0],
                                                                 np.float32))
    assert conv.inputs[1] is dq.outputs[0] and run.stat.matches == 1


def test_batchnorm_stays_where_the_dequantized_filter_cannot_take_it():
    """-(-128) does not fit in s8; a DequantizeLinear another convolution reads would change that one too."""
    b = IRBuilder()
    negated = qat_conv(b, np.array([[[[-128]], [[1]]], [[[2]], [[3]]]]), "narrow")
    shared = qat_conv(b, np.ones((2, 2, 1, 1)), "first")
    second = qat_conv(b, np.ones((2, 2, 1, 1)), "second", dq=shared.producer.inputs[1])
    flip = [b.const("scale", [-1.0, 1.0]), b.const("shift", [0.0, 0.0]), b.const("mean", [0.0, 0.0]),
            b.const("var", [1.0, 1.0])]
    g = b.graph(*(b.node("BatchNormalization", [c] + flip, f"y{i}", X, name=f"bn{i}", epsilon=0.0)
                  for i, c in enumerate((negated, shared))), second)

    run = run_pass_unchanged(g, "ConvScaleFusion", fold_batchnorm_into_conv)

    assert run.not_fusing == [
        "ConvScaleFusion: Not fusing narrow with bn0: BatchNormalization negates channels whose int8 weights or zero "
        "points cannot be negated",
        "ConvScaleFusion: Not fusing first with bn1: first.dqw's output 'first.w' has 2 consumers"]


# ---------------------------------------------------------------- ConvEltwiseSumFusion
def test_residual_add_becomes_the_convolution_sum_input():
    b = IRBuilder()
    x, skip = b.input("x", X), b.input("skip", X)
    y = b.node("Add", [skip, conv(b, x)], "y", X, name="add")
    g = b.graph(y)

    run = run_pass(g, "ConvEltwiseSumFusion", fuse_residual_add)

    assert str(g) == expected("""
        graph g(%x: float32[1x2x3x3], %skip: float32[1x2x3x3]):
          %y: float32[1x2x3x3] = Conv(%x, const %conv.w, const %conv.b, %skip)  # conv + add
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (1, 0)


def test_sum_of_two_convolutions_absorbs_into_the_later_one():
    b = IRBuilder()
    x = b.input("x", X)
    first = conv(b, x, "c1", "conv1")
    second = conv(b, x, "c2", "conv2")
    y = b.node("Add", [first, second], "y", X, name="add")
    g = b.graph(y)

    run = run_pass(g, "ConvEltwiseSumFusion", fuse_residual_add)

    assert str(g) == expected("""
        graph g(%x: float32[1x2x3x3]):
          %c1: float32[1x2x3x3] = Conv(%x, const %conv1.w, const %conv1.b)  # conv1
          %y: float32[1x2x3x3] = Conv(%x, const %conv2.w, const %conv2.b, %c1)  # conv2 + add
          return %y
        """)
    assert run.stat.matches == 1


def test_constant_and_broadcast_operands_are_not_residuals():
    b = IRBuilder()
    x, row = b.input("x", X), b.input("row", (1, 2, 1, 1))
    y1 = b.node("Add", [conv(b, x, "c1", "conv1"), b.const("bias", np.ones(X))], "y1", X, name="add1")
    y2 = b.node("Add", [conv(b, x, "c2", "conv2"), row], "y2", X, name="add2")
    g = b.graph(y1, y2)
    run = run_pass_unchanged(g, "ConvEltwiseSumFusion", fuse_residual_add)
    assert run.not_fusing == [
        "ConvEltwiseSumFusion: Not fusing conv1 with add1: the other operand is a constant (a bias, not a residual)",
        "ConvEltwiseSumFusion: Not fusing conv2 with add2: shapes differ ([1, 2, 1, 1] vs [1, 2, 3, 3]): "
        "broadcasting sum is not fusable"]
    assert run.stat.rejections == 2


def test_an_operand_that_matches_only_at_the_opt_point_is_not_a_residual():
    """Both 1x2x-1x-1 and 3x3 at the opt point, but at the probe point one is 5x5 and the other 1x1 (it broadcasts
    there): the sum is not the convolution's residual."""
    b = IRBuilder()
    x = b.input("x", X, dyn_dims=(2, 3), probe=(1, 2, 5, 5))
    pooled = b.input("pooled", X, dyn_dims=(2, 3), probe=(1, 2, 1, 1))
    c = b.node("Conv", [x, b.const("conv.w", np.ones((2, 2, 1, 1))), b.const("conv.b", [0.5, -0.5])], "c", X,
               name="conv", dyn_dims=(2, 3), probe=(1, 2, 5, 5))
    g = b.graph(b.node("Add", [c, pooled], "y", X, name="add", dyn_dims=(2, 3), probe=(1, 2, 5, 5)))
    run = run_pass_unchanged(g, "ConvEltwiseSumFusion", fuse_residual_add)
    assert run.not_fusing == [
        "ConvEltwiseSumFusion: Not fusing conv with add: the shapes may differ at other input shapes "
        "(1x2x3(1)x3(1) vs 1x2x3(5)x3(5); probe sizes in brackets): the sum may broadcast at run time"]


# ---------------------------------------------------------------- ConvReluFusion
def test_relu_and_clip_become_the_convolution_activation():
    b = IRBuilder()
    x = b.input("x", X)
    r = b.node("Relu", [conv(b, x, "c1", "conv1")], "r", X, name="relu")
    y = b.node("Clip", [conv(b, r, "c2", "conv2"), b.const("lo", 0.0), b.const("hi", 6.0)], "y", X, name="clip")
    g = b.graph(y)

    run = run_pass(g, "ConvReluFusion", fuse_activation)

    assert str(g) == expected("""
        graph g(%x: float32[1x2x3x3]):
          %r: float32[1x2x3x3] = Conv(%x, const %conv1.w, const %conv1.b) activation={'op': 'Relu', 'attrs': {}}  # conv1 + relu
          %y: float32[1x2x3x3] = Conv(%r, const %conv2.w, const %conv2.b) activation={'op': 'Clip', 'attrs': {'min': 0.0, 'max': 6.0}}  # conv2 + clip
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (2, 0)
    assert "lo" not in g.values and "hi" not in g.values


def test_activation_does_not_fuse_into_an_output_or_an_activated_convolution():
    b = IRBuilder()
    x = b.input("x", X)
    c1 = conv(b, x, "c1", "conv1")
    y1 = b.node("Relu", [c1], "y1", X, name="relu1")
    c2 = conv(b, x, "c2", "conv2", activation={"op": "Relu", "attrs": {}})
    y2 = b.node("Sigmoid", [c2], "y2", X, name="sigmoid2")
    g = b.graph(y1, y2, c1)
    run = run_pass_unchanged(g, "ConvReluFusion", fuse_activation)
    assert run.not_fusing == ["ConvReluFusion: Not fusing conv1 with relu1: conv1's output 'c1' is a network output",
                              "ConvReluFusion: Not fusing conv2 with sigmoid2: conv2 already applies Relu"]
