"""QuantizedLayerNormFusion on IR graphs: DQ -> LayerNormalization -> Q with per-tensor INT8 scales becomes one
kiln.QLayerNorm; a post-LN residual QAdd whose sum nothing else reads joins it; the reasons it does not fire."""
from __future__ import annotations

import numpy as np

from kiln.passes.quantization import fuse_quantized_add, fuse_quantized_layer_norm
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged
from tests.passes.test_ir_quantization import dq, q

X = (2, 4, 8)
PASS = "QuantizedLayerNormFusion"


def layer_norm(b: IRBuilder, x, *, gamma=None, stash_type=None, mean_out=False):
    """LayerNormalization over the last axis of `x`: scale `gamma` (a constant unless given), bias 1/4."""
    gamma = b.const("gamma", np.full(8, 0.5)) if gamma is None else gamma
    extra = {} if stash_type is None else {"stash_type": stash_type}
    if not mean_out:
        return b.node("LayerNormalization", [x, gamma, b.const("beta", np.full(8, 0.25))], "n", X, name="ln",
                      axis=-1, epsilon=1e-5, **extra), None
    n, mean = b.multi("LayerNormalization", [x, gamma, b.const("beta", np.full(8, 0.25))],
                      [("n", X), ("mean", (2, 4, 1))], name="ln", axis=-1, epsilon=1e-5, **extra)
    return n, mean


def test_dq_layernorm_q_becomes_one_int8_layer_norm():
    b = IRBuilder()
    x = b.input("x", X, np.int8)
    n, _ = layer_norm(b, dq(b, x, "dx", 0.5))
    g = b.graph(q(b, n, "y", 0.125))

    run = run_pass(g, PASS, fuse_quantized_layer_norm)

    assert str(g) == expected("""
        graph g(%x: int8[2x4x8]):
          %y: int8[2x4x8] = kiln.QLayerNorm(%x, const %gamma, const %beta) axis=-1 epsilon=1e-05 quant={'x_scale': 0.5, 'x_zero_point': 0, 'x_dtype': 'int8', 'y_scale': 0.125, 'y_zero_point': 0, 'y_dtype': 'int8'}  # ln + y
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (2, 0)   # dx with ln, ln with y


def residual_layer_norm(b: IRBuilder, *, sum_read_elsewhere=False):
    """Q(LayerNorm(DQ(Q(DQ(a) + DQ(c))))): a post-LN encoder's residual sum; optionally the sum is also returned
    through a Relu (a pre-LN encoder's residual stream)."""
    a, c = b.input("a", X, np.int8), b.input("c", X, np.int8)
    total = q(b, b.node("Add", [dq(b, a, "da", 0.5), dq(b, c, "dc", 0.25)], "s", X, name="add"), "sq", 0.25)
    n, _ = layer_norm(b, dq(b, total, "dsq", 0.25))
    outputs = [q(b, n, "y", 0.125)]
    if sum_read_elsewhere:
        outputs.append(b.node("Relu", [dq(b, total, "dsq2", 0.25)], "r", X, name="relu"))
    return b.graph(*outputs)


def test_the_residual_sum_joins_the_int8_layer_norm():
    b = IRBuilder()
    g = residual_layer_norm(b)
    run_pass(g, "QuantizedAddFusion", fuse_quantized_add)

    run = run_pass(g, PASS, fuse_quantized_layer_norm)

    assert str(g) == expected("""
        graph g(%a: int8[2x4x8], %c: int8[2x4x8]):
          %y: int8[2x4x8] = kiln.QLayerNorm(%a, %c, const %gamma, const %beta) axis=-1 epsilon=1e-05 quant={'x_scale': 0.25, 'x_zero_point': 0, 'x_dtype': 'int8', 'y_scale': 0.125, 'y_zero_point': 0, 'y_dtype': 'int8'} skip_quant={'a_scale': 0.5, 'a_zero_point': 0, 'b_scale': 0.25, 'b_zero_point': 0, 'y_scale': 0.25, 'y_zero_point': 0, 'a_dtype': 'int8', 'b_dtype': 'int8', 'y_dtype': 'int8'}  # add + sq + ln + y
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (3, 0)   # and the sum with ln


def test_a_sum_read_elsewhere_stays_its_own_int8_add():
    b = IRBuilder()
    g = residual_layer_norm(b, sum_read_elsewhere=True)
    run_pass(g, "QuantizedAddFusion", fuse_quantized_add)

    run_pass(g, PASS, fuse_quantized_layer_norm)

    assert [n.op_type for n in g.nodes] == ["QAdd", "QLayerNorm", "DequantizeLinear", "Relu"]
    norm = g.nodes[1]
    assert norm.inputs[0] is g.nodes[0].outputs[0] and "skip_quant" not in norm.attrs


def test_layer_norm_stays_fp32_without_its_quantization():
    def per_channel(b, x):
        return dq(b, x, "dx", np.full(8, 0.5), axis=-1)

    cases = {"no per-tensor INT8 QuantizeLinear is its only reader": ({}, False),
             "the input's DequantizeLinear is not per-tensor INT8": ({"dequantize": per_channel}, True),
             "its mean or inverse standard deviation output is read": ({"mean_out": True}, True),
             "its scale or bias is not an FP32 constant": ({"gamma": "input"}, True),
             "it computes in a stash type other than FP32": ({"stash_type": 11}, True)}
    for reason, (kwargs, quantized) in cases.items():
        b = IRBuilder()
        x = b.input("x", X, np.int8)
        kwargs = dict(kwargs)
        xf = kwargs.pop("dequantize", lambda b, x: dq(b, x, "dx", 0.5))(b, x)
        if kwargs.get("gamma") == "input":
            kwargs["gamma"] = b.input("g", (8,))
        n, mean = layer_norm(b, xf, **kwargs)
        outputs = [q(b, n, "y", 0.125) if quantized else n] + ([mean] if mean is not None else [])
        g = b.graph(*outputs)
        run = run_pass_unchanged(g, PASS, fuse_quantized_layer_norm)
        reader = "y" if quantized else "its consumers"
        assert run.not_fusing == [f"{PASS}: Not fusing ln with {reader}: {reason}: it stays FP32"], reason
