"""QOperatorUnfolding on IR graphs: a QLinearConv (int32 bias, per-channel weights) becomes DequantizeLinear ->
Conv -> QuantizeLinear with the bias in float, com.microsoft's QGemm without an output scale keeps a float output,
and the nodes it cannot unfold faithfully stay with the reason."""
from __future__ import annotations

import numpy as np

from kiln.passes.qoperator import unfold_qoperators
from tests.passes.ir_builder import IRBuilder, expected, run_pass

MS = "com.microsoft"


def scalars(b: IRBuilder, prefix: str, scale: float, zero: int, dtype=np.uint8):
    return b.const(f"{prefix}.scale", scale), b.const(f"{prefix}.zero", zero, dtype)


def test_qlinearconv_becomes_dq_conv_q_with_the_bias_in_float():
    b = IRBuilder()
    x = b.input("x", (1, 2, 3, 3), np.uint8)
    w = b.const("w", np.ones((2, 2, 1, 1)), np.int8)
    xs, xz = scalars(b, "x", 0.5, 3)
    ws, wz = b.const("w.scale", [0.25, 0.125]), b.const("w.zero", [0, 0], np.int8)
    ys, yz = scalars(b, "y", 0.25, 1)
    bias = b.const("bias", [4, -8], np.int32)     # 4 * 0.5 * 0.25 = 0.5 and -8 * 0.5 * 0.125 = -0.5
    y = b.node("QLinearConv", [x, xs, xz, w, ws, wz, ys, yz, bias], "y", (1, 2, 3, 3), dtype=np.uint8, name="conv",
               kernel_shape=[1, 1])
    g = b.graph(y)

    run = run_pass(g, "QOperatorUnfolding", unfold_qoperators)

    assert str(g) == expected("""
        graph g(%x: uint8[1x2x3x3]):
          %x_dequantized: float32[1x2x3x3] = DequantizeLinear(%x, const %x.scale, const %x.zero)  # conv [DequantizeLinear 0]
          %w_dequantized: float32[2x2x1x1] = DequantizeLinear(const %w, const %w.scale, const %w.zero) axis=0  # conv [DequantizeLinear 1]
          %y_float: float32[1x2x3x3] = Conv(%x_dequantized, %w_dequantized, const %conv_bias_float) kernel_shape=[1, 1]  # conv
          %y: uint8[1x2x3x3] = QuantizeLinear(%y_float, const %y.scale, const %y.zero)  # conv [QuantizeLinear]
          return %y
        """)
    assert g.values["conv_bias_float"].const.tolist() == [0.5, -0.5]
    assert all(n.origin == ("conv",) for n in g.nodes)   # layer info names the ONNX node whichever layer survives
    assert run.stat.matches == 1


def test_qgemm_without_an_output_scale_keeps_a_float_output():
    b = IRBuilder()
    a = b.input("a", (2, 4), np.uint8, dyn_dims=(0,), probe=(5, 4))
    as_, az = scalars(b, "a", 0.5, 0)
    w = b.const("w", np.ones((3, 4)), np.int8)
    ws, wz = b.const("w.scale", [0.5, 0.25, 0.125]), b.const("w.zero", [0, 0, 0], np.int8)
    y = b.node("QGemm", [a, as_, az, w, ws, wz], "y", (2, 3), dtype=np.float32, name="fc", domain=MS, transB=1,
               dyn_dims=(0,), probe=(5, 3))
    g = b.graph(y)

    run_pass(g, "QOperatorUnfolding", unfold_qoperators)

    assert [n.op_type for n in g.nodes] == ["DequantizeLinear", "DequantizeLinear", "Gemm"]
    assert g.nodes[1].attrs == {"axis": 0}                 # transB: B is [N, K], its scales run along axis 0
    assert g.nodes[2].outputs[0] is y and g.nodes[2].attrs == {"transB": 1}
    dequantized = g.nodes[0].outputs[0]
    assert (dequantized.dtype, dequantized.dyn_dims, dequantized.probe_shape) == (np.float32, (0,), (5, 4))


def test_what_cannot_unfold_faithfully_stays_with_the_reason():
    b = IRBuilder()
    x = b.input("x", (1, 4, 4, 2), np.uint8)
    xs, xz = scalars(b, "x", 0.5, 0)
    ys, yz = scalars(b, "y", 0.25, 0)
    y = b.node("QLinearGlobalAveragePool", [x, xs, xz, ys, yz], "y", (1, 1, 1, 2), name="gap", domain=MS,
               channels_last=1)
    g = b.graph(y)

    run = run_pass(g, "QOperatorUnfolding", unfold_qoperators)

    assert [n.op_type for n in g.nodes] == ["QLinearGlobalAveragePool"]
    assert run.stat.matches == 0
    assert any("gap: QLinearGlobalAveragePool stays as it is: channels_last=1" in line for line in run.lines)


def test_an_old_softmax_over_several_axes_stays_and_a_new_one_unfolds():
    for opset, axis, unfolded in [(11, 1, False), (11, 2, True), (13, 1, True)]:
        b = IRBuilder()
        x = b.input("x", (2, 3, 4), np.uint8)
        xs, xz = scalars(b, "x", 0.5, 0)
        ys, yz = scalars(b, "y", 1 / 256, 0)
        y = b.node("QLinearSoftmax", [x, xs, xz, ys, yz], "y", (2, 3, 4), name="softmax", domain=MS, axis=axis,
                   opset=opset)
        g = b.graph(y)
        run_pass(g, "QOperatorUnfolding", unfold_qoperators)
        ops = [n.op_type for n in g.nodes]
        assert ops == (["DequantizeLinear", "Softmax", "QuantizeLinear"] if unfolded else ["QLinearSoftmax"])
        if unfolded:
            assert g.nodes[1].attrs == {"axis": axis}   # opset is the QOperator node's, not Softmax's
