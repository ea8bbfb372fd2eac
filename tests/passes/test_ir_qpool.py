"""QuantizedPoolFusion on IR graphs: DQ -> AveragePool / GlobalAveragePool / spatial ReduceMean -> Q becomes one
INT8 QAveragePool (the output scale may differ from the input's: the pool requantizes); other averages stay FP32
with the reason."""
from __future__ import annotations

import numpy as np

from kiln.passes.qpool import fuse_quantized_pools
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged
from tests.passes.test_ir_quantization import dq, q

X = (1, 2, 4, 4)


def test_window_global_and_spatial_reduce_mean_pools_become_int8_pools():
    b = IRBuilder()
    xq = b.input("xq", X, np.int8)
    x = dq(b, xq, "x", 0.5)
    window = b.node("AveragePool", [x], "a", (1, 2, 2, 2), name="avg", kernel_shape=[2, 2], strides=[2, 2])
    whole = b.node("GlobalAveragePool", [x], "gp", (1, 2, 1, 1), name="gap")
    mean = b.node("ReduceMean", [x, b.const("axes", [-1, -2], np.int64)], "m", (1, 2), name="mean", keepdims=0)
    g = b.graph(q(b, window, "aq", 0.25), q(b, whole, "gq", 0.5), q(b, mean, "mq", 0.125))

    run = run_pass(g, "QuantizedPoolFusion", fuse_quantized_pools)

    quant = "'x_scale': 0.5, 'x_zero_point': 0, 'x_dtype': 'int8', 'y_scale': {}, 'y_zero_point': 0, 'y_dtype': 'int8'"
    assert str(g) == expected(f"""
        graph g(%xq: int8[1x2x4x4]):
          %aq: int8[1x2x2x2] = kiln.QAveragePool(%xq) kernel_shape=[2, 2] pool='AveragePool' quant={{{quant.format(0.25)}}} strides=[2, 2]  # avg + aq
          %gq: int8[1x2x1x1] = kiln.QAveragePool(%xq) pool='GlobalAveragePool' quant={{{quant.format(0.5)}}}  # gap + gq
          %mq: int8[1x2] = kiln.QAveragePool(%xq, const %axes) keepdims=0 pool='ReduceMean' quant={{{quant.format(0.125)}}}  # mean + mq
          return %aq, %gq, %mq
        """)
    assert run.stat.matches == 6
    assert g.nodes[0].origin == ("avg", "aq")   # the DQ read by all three belongs to none of them


def test_averages_kiln_cannot_pool_in_int8_stay_float_with_the_reason():
    b = IRBuilder()
    xq = b.input("xq", X, np.int8)
    x = dq(b, xq, "x", 0.5)
    rows = b.node("ReduceMean", [x, b.const("axes", [1], np.int64)], "r", (1, 1, 4, 4), name="channel_mean")
    one_d = b.node("AveragePool", [dq(b, b.input("sq", (1, 2, 8), np.int8), "s", 0.5)], "p", (1, 2, 4),
                   name="avg1d", kernel_shape=[2], strides=[2])
    unquantized = b.node("GlobalAveragePool", [x], "gp", (1, 2, 1, 1), name="gap")
    g = b.graph(q(b, rows, "rq", 0.5), q(b, one_d, "pq", 0.5), unquantized)

    run = run_pass_unchanged(g, "QuantizedPoolFusion", fuse_quantized_pools)

    assert run.not_fusing == [
        "QuantizedPoolFusion: Not fusing channel_mean with rq: it averages axes [1], not the spatial axes (2, 3): "
        "it stays FP32",
        "QuantizedPoolFusion: Not fusing avg1d with pq: its input is 3-D: kiln's INT8 average pools take 4-D NCHW "
        "maps: it stays FP32",
        "QuantizedPoolFusion: Not fusing gap with its consumers: no per-tensor INT8 QuantizeLinear is its only "
        "reader: it stays FP32"]
    assert run.stat.matches == 0


def test_linear_resize_becomes_int8_and_what_it_cannot_take_stays_float_with_the_reason():
    from kiln.passes.qpool import fuse_quantized_resizes

    b = IRBuilder()
    xq = b.input("xq", X, np.int8)
    scales = b.const("scales", [1, 1, 2, 2])
    up = b.node("Resize", [dq(b, xq, "x", 0.5), None, scales], "u", (1, 2, 8, 8), name="up", mode="linear")
    given = b.input("runtime_scales", (4,))
    late = b.node("Resize", [dq(b, xq, "x2", 0.5), None, given], "l", (1, 2, 8, 8), name="late", mode="linear")
    near = b.node("Resize", [dq(b, xq, "x3", 0.5), None, scales], "n", (1, 2, 8, 8), name="near", mode="nearest")
    g = b.graph(q(b, up, "uq", 0.25), q(b, late, "lq", 0.25), q(b, near, "nq", 0.25))

    run = run_pass(g, "QuantizedResizeFusion", fuse_quantized_resizes)

    fused = next(n for n in g.nodes if n.op_type == "QResize")
    assert fused.name == "up + uq" and fused.inputs[0].name == "xq" and fused.attrs["mode"] == "linear"
    assert fused.attrs["quant"]["y_scale"] == 0.25 and [n.op_type for n in g.nodes].count("Resize") == 2
    assert run.not_fusing == ["QuantizedResizeFusion: Not fusing late with lq: its roi, scales or sizes are computed "
                              "at run time: it stays FP32"]
