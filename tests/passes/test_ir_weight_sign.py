"""UnsignedWeightRecentering on IR graphs: u8 weights whose values less their zero point fit a signed byte become
s8 weights with zero point 0 (the same numbers); a zero point off 128 with the full u8 range stays, saying why.
End to end, a quantize_static model with u8 weights runs its convolutions and its linear layer on oneDNN's INT8
primitives, matching onnxruntime on the same model."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.passes.weight_sign import recenter_unsigned_weights
from tests.conftest import init, make_model, rand, run_ort
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

WEIGHTS = np.array([[0, 128, 255], [10, 100, 200]], np.uint8)   # [out 2, in 3]: per-row zero points below


def dequantized_weights(zero_points, axis=0):
    """W_u8 [2, 3] -> DequantizeLinear(scale 0.5, `zero_points`) -> MatMul(x [1, 2], W^T as written: W [2, 3])."""
    b = IRBuilder()
    x = b.input("x", (1, 2))
    zp = b.const("zp", zero_points, np.uint8)
    scale = b.const("s", np.full(np.shape(zero_points), 0.5))
    w = b.node("DequantizeLinear", [b.const("w", WEIGHTS, np.uint8), scale, zp], "wf", (2, 3), dtype=np.float32,
               name="dq", axis=axis)
    return b.graph(b.node("MatMul", [x, w], "y", (1, 3)))


def test_u8_weights_with_zero_point_128_become_s8_with_zero_point_0():
    g = dequantized_weights([128, 128])

    run = run_pass(g, "UnsignedWeightRecentering", recenter_unsigned_weights)

    assert str(g) == expected("""
        graph g(%x: float32[1x2]):
          %wf: float32[2x3] = DequantizeLinear(const %w_s8, const %s, const %w_s8_zero_point) axis=0  # dq
          %y: float32[1x3] = MatMul(%x, %wf)  # y
          return %y
        """)
    dq = g.nodes[0]
    np.testing.assert_array_equal(dq.inputs[0].const, [[-128, 0, 127], [-118, -28, 72]])
    assert dq.inputs[0].const.dtype == np.int8 and dq.inputs[2].const.dtype == np.int8
    np.testing.assert_array_equal(dq.inputs[2].const, [0, 0])
    assert run.stat.matches == 1
    assert "UnsignedWeightRecentering: Lowering dq to signed INT8 weights (zero point 0)" in run.lines


def test_per_row_zero_points_recentre_each_row():
    """Row 0 against 128, row 1 (values 10..200) against 73: both fit once each row's own point is taken off."""
    g = dequantized_weights([128, 73])
    run_pass(g, "UnsignedWeightRecentering", recenter_unsigned_weights)
    np.testing.assert_array_equal(g.nodes[0].inputs[0].const, [[-128, 0, 127], [-63, 27, 127]])


def test_a_zero_point_off_128_over_the_full_range_stays_unsigned():
    g = dequantized_weights([100, 100])

    run = run_pass_unchanged(g, "UnsignedWeightRecentering", recenter_unsigned_weights)

    assert any("not recentering dq: its u8 weights less their zero point span -100..155, more than a signed byte"
               in line for line in run.lines), run.lines


def test_zero_points_that_do_not_match_the_axis_are_left_to_the_op():
    """Three zero points for two rows: not this pass's to judge (no crash, nothing rewritten)."""
    run_pass_unchanged(dequantized_weights([128, 128, 128]), "UnsignedWeightRecentering", recenter_unsigned_weights)


def test_conv_integer_weights_recentre_along_output_channels():
    """quantize_dynamic's ConvInteger(x_u8, W_u8, x_zp, W_zp) with W's zero point 128 per output channel."""
    b = IRBuilder()
    x = b.input("x", (1, 2, 3, 3), np.uint8)
    w = b.const("w", np.arange(2 * 2 * 1 * 1).reshape(2, 2, 1, 1) * 60 + 10, np.uint8)
    y = b.node("ConvInteger", [x, w, b.const("xzp", 3, np.uint8), b.const("wzp", [128, 128], np.uint8)], "y",
               (1, 2, 3, 3), dtype=np.int32)
    g = b.graph(y)

    run_pass(g, "UnsignedWeightRecentering", recenter_unsigned_weights)

    conv = g.nodes[0]
    np.testing.assert_array_equal(conv.inputs[1].const.ravel(), [-118, -58, 2, 62])
    assert conv.inputs[2].name == "xzp" and conv.inputs[3].const.dtype == np.int8


def conv_then_fc() -> object:
    h = helper.make_node
    nodes = [h("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]), h("Relu", ["c"], ["r"], name="relu"),
             h("Conv", ["r", "w2"], ["c2"], name="conv2"), h("Relu", ["c2"], ["r2"], name="relu2"),
             h("GlobalAveragePool", ["r2"], ["p"], name="pool"), h("Flatten", ["p"], ["f"], name="flatten"),
             h("Gemm", ["f", "fw", "fb"], ["y"], name="fc", transB=1)]
    inits = [init("w", rand((16, 4, 3, 3), 1) * 0.3), init("b", rand((16,), 2)), init("w2", rand((16, 16, 1, 1), 5)),
             init("fw", rand((10, 16), 3) * 0.3), init("fb", rand((10,), 4))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)


def test_a_quantize_static_model_with_u8_weights_runs_on_the_signed_weight_primitives(tmp_path):
    pytest.importorskip("onnxruntime")
    import onnx
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    from kiln.tactics.onednn_prim import available
    from tests.precision.test_qdq import calibration_reader

    fp32, path = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(conv_then_fc(), fp32)
    quantize_static(str(fp32), str(path), calibration_reader("x", (1, 4, 8, 8), 4), quant_format=QuantFormat.QDQ,
                    per_channel=True, weight_type=QuantType.QUInt8, activation_type=QuantType.QUInt8)
    quantized = onnx.load(path)
    u8_weights = {t.name for t in quantized.graph.initializer if t.data_type == TensorProto.UINT8 and len(t.dims) > 1}
    assert len([n for n in quantized.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in u8_weights]) == 3
    engine = kiln.build(path, int8=True, tactic_sources="-openvino,-onnxruntime", autotune=False)
    products = [l for l in engine.plan.layers if l.op_type in ("QConv", "QGemm")]
    assert len(products) == 3 and all(l.precision == "INT8" for l in products)
    if available():
        assert {l.tactic_name for l in products} <= {"onednn.qconv2d_primitive", "onednn.qlinear_primitive"}
    x = {"x": rand((1, 4, 8, 8), 9)}
    got, want = engine.run(x)["y"], run_ort(str(path), x)[0]
    step = float(want.max() - want.min()) / 255   # the output's u8 grid: a rounding apart at most
    np.testing.assert_allclose(got, want, atol=1.01 * step)


def test_a_constant_no_product_weighs_with_stays_unsigned():
    """DQ(u8 constant) added to an activation (a bias-like table): not a product's weight, left as written."""
    b = IRBuilder()
    x = b.input("x", (2, 3))
    c = b.node("DequantizeLinear", [b.const("w", WEIGHTS, np.uint8), b.const("s", 0.5), b.const("zp", 128, np.uint8)],
               "c", (2, 3), dtype=np.float32, name="dq")
    g = b.graph(b.node("Add", [x, c], "y", (2, 3)))
    run_pass_unchanged(g, "UnsignedWeightRecentering", recenter_unsigned_weights)
