"""An INT8 product with the bias quantize_static adds after the product's requantized output (RequantizedBiasFusion):
kiln's INT8 kernels round the sums at the product's own (mid) scale, dequantize, add the bias, apply the activation
and requantize, in the float steps the unfused ONNX graph takes, so the outputs are bit-identical to that graph
computed in FP32 (GELU, a few ulps off, at most one step); oneDNN declines the layer; the reference op and the
region writer give the same numbers; a Q/DQ model of that form matches onnxruntime's unfused graph."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.ops import lookup
from kiln.tactics import onnx_emit
from kiln.tactics.onednn_int8 import OneDnnInt8ConvTactic, OneDnnInt8LinearTactic, int8_available
from kiln.tactics.qgemm_c import QLinearGemmTactic, vnni_available
from tests.conftest import make_model, unfused_onnxruntime
from tests.tactics.amx import built_with, quantize_path  # noqa: F401  (fixtures)
from tests.tactics.test_qgemm_c import (RANGES, assert_requantized_equal, centred, int8_case, linear_case,
                                        needs_vnni, rand_q)

RELU, GELU = {"op": "Relu", "attrs": {}}, {"op": "Gelu", "attrs": {}}
CASES = {
    # name: (op, x (dtype, zp, scale), mid (dtype, zp, scale), y (None: FP32 out), activation)
    "matmul_u8_mid_s8_relu": ("QMatMul", ("uint8", 7, 0.02), ("int8", -3, 0.2), ("uint8", 9, 0.1), RELU),
    "gemm_s8_mid_u8_fp32_out": ("QGemm", ("int8", -2, 0.03), ("uint8", 120, 0.15), None, None),
    "conv3x3_mid_u8_gelu": ("QConv", ("uint8", 9, 0.02), ("uint8", 100, 0.25), ("int8", -5, 0.05), GELU),
    "conv1x1_mid_s8": ("QConv", ("int8", 4, 0.03), ("int8", 0, 0.3), ("uint8", 128, 0.1), None),
}


def with_mid(view, mid, act):
    """`view` rounding its product at `mid` before its bias (and `act`): the fused layer's quant."""
    q = {**view.attrs["quant"], "mid_dtype": mid[0], "mid_zero_point": mid[1], "mid_scale": mid[2]}
    attrs = {**view.attrs, "quant": q, **({"activation": act} if act else {})}
    return dataclasses.replace(view, attrs=attrs)


def mid_case(case):
    """(view, quantized input, VNNI tactic) of CASES[case]."""
    op, x, mid, y, act = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    view, x_shape, tactic = int8_case(op, case, x, y, g)
    return with_mid(view, mid, act), rand_q(x_shape, x[0], g), tactic


def mid_formula(view, x, mid_rounding=True, rounding=torch.round):
    """The unfused graph in the kernel's float32 steps: exact integer sums, times x_scale * w_scale, QuantizeLinear
    and DequantizeLinear at the mid scale, + bias, activation, QuantizeLinear (or FP32)."""
    q, conv = view.attrs["quant"], view.op_type == "QConv"
    xc = x.double() - q["x_zero_point"]
    w = centred(view)
    if conv:
        p = view.attrs["pads"]
        sums = F.conv2d(F.pad(xc, [p[1], p[3], p[0], p[2]]), w, stride=view.attrs["strides"])
    else:
        sums = xc @ (w.t() if view.attrs.get("transB", 0) else w)
    channel = (-1, 1, 1) if conv else (-1,)
    scale = (torch.tensor(q["w_scale"], dtype=torch.float32).double() * q["x_scale"]).float()
    y = sums.float() * scale.reshape(channel)
    if mid_rounding:
        lo, hi = RANGES[q["mid_dtype"]]
        m = torch.clamp(rounding(y / q["mid_scale"]) + q["mid_zero_point"], lo, hi)
        y = (m - q["mid_zero_point"]) * torch.tensor(q["mid_scale"], dtype=torch.float32)
    y = y + view.const_inputs[2].float().reshape(channel)
    spec = view.attrs.get("activation")
    y = torch.relu(y) if spec == RELU else F.gelu(y.double()).float() if spec == GELU else y
    if "y_scale" not in q:
        return y
    lo, hi = RANGES[q["y_dtype"]]
    return torch.clamp(rounding(y / q["y_scale"]) + q["y_zero_point"], lo, hi)


@needs_vnni
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_round_the_product_before_its_bias_as_the_graph_does(case, quantize_path):
    view, x, tactic = mid_case(case)
    assert tactic.supports(view)
    got = tactic.prepare(view)([x, None, None])[0]
    want = mid_formula(view, x)
    assert got.shape == want.shape and torch.unique(got).numel() >= 20
    if CASES[case][-1] == GELU:   # the kernel's erf is a rational approximation: one step at most, rarely
        assert_requantized_equal(got, want)
    else:
        assert torch.equal(got.float(), want.float())
    # the mid rounding is no formality here: without it a good part of the outputs would differ
    assert (got.float() != mid_formula(view, x, mid_rounding=False).float()).float().mean() > 0.1


def tie_case():
    """A QMatMul whose scales make exact ties common: the sums times 2^-10 (x 2^-4, weights 2^-6) over a mid scale of
    7 * 2^-9 fall on k + 1/2 for sums 7 mod 14, and the output scale (twice the mid's) with a bias of whole output
    steps puts every odd mid value on a tie again; all of it exact in float32."""
    view = linear_case("QMatMul", (4, 9, 40), 0, ("uint8", 7, 2.0**-4), ("int8", 3, 7 * 2.0**-8), n=48)[0]
    n = view.const_inputs[1].shape[1]
    view = with_mid(view, ("int8", -2, 7 * 2.0**-9), None)
    q = {**view.attrs["quant"], "w_scale": [2.0**-6] * n}
    steps = torch.arange(n, dtype=torch.float32) % 9 - 4
    return dataclasses.replace(view, attrs={**view.attrs, "quant": q},
                               const_inputs={**view.const_inputs, 2: steps * q["y_scale"]})


@needs_vnni
def test_kernels_round_exact_ties_to_even_at_both_roundings(quantize_path):
    view, g = tie_case(), torch.Generator().manual_seed(8)
    x = rand_q(view.input_shapes[0], "uint8", g)
    sums = (x.double() - view.attrs["quant"]["x_zero_point"]) @ centred(view)
    mid_steps = torch.round(sums / 14)   # the product over the mid scale is sums / 14
    assert (torch.remainder(sums, 14) == 7).double().mean() > 0.04   # ties at the mid rounding
    assert (torch.remainder(mid_steps, 2) != 0).double().mean() > 0.3   # and at the output's
    got = QLinearGemmTactic().prepare(view)([x, None, None])[0]
    assert torch.unique(got).numel() >= 20
    assert torch.equal(got.float(), mid_formula(view, x).float())   # torch.round: half to even, as ONNX rounds
    half_away = mid_formula(view, x, rounding=lambda t: torch.sign(t) * torch.floor(t.abs() + 0.5))
    assert (got.float() != half_away.float()).double().mean() > 0.1


@pytest.mark.parametrize("case", list(CASES))
def test_reference_op_and_region_writer_round_before_the_bias_too(case):
    view, x, _ = mid_case(case)
    if int8_available():   # oneDNN's post-ops cannot round in the middle
        assert not (OneDnnInt8ConvTactic() if view.op_type == "QConv" else OneDnnInt8LinearTactic()).supports(view)
    want = mid_formula(view, x)
    ref = lookup(view.op_type, "kiln").impl(view.attrs, [x, view.const_inputs[1], view.const_inputs[2]])[0]
    model, external = onnx_emit.emit(view, 17)
    inits = [numpy_helper.from_array(external[t.name], t.name) if t.name in external else t
             for t in model.graph.initializer]   # the weights kiln hands over from memory, put back in the file
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)
    emitted = unfused_onnxruntime(model, {"x0": x.numpy()})
    for got in (ref, torch.from_numpy(emitted)):   # the float product, not integer sums: one step at most, rarely
        if CASES[case][3] is None:   # a whole mid step (0.15) apart on a tie, rarely
            diff = (got.float() - want).abs()
            assert diff.max() <= 0.16 and (diff <= 1e-4).float().mean() >= 0.99
        else:
            assert_requantized_equal(got, want)


def bias_after_product_model(relu: bool):
    """quantize_static's MatMul with its bias: Q/DQ input, DQ(s8 per-column weights), Q -> DQ after the product,
    + DQ(u8 bias) [, ReLU], Q -> DQ, FP32 out."""
    h, rng = helper.make_node, np.random.default_rng(3)
    k, n = 48, 40
    inits = [numpy_helper.from_array(rng.integers(-127, 128, (k, n)).astype(np.int8), "w_q"),
             numpy_helper.from_array(np.linspace(0.002, 0.006, n).astype(np.float32), "w_s"),
             numpy_helper.from_array(np.zeros(n, np.int8), "w_z"),
             numpy_helper.from_array(rng.integers(0, 256, n).astype(np.uint8), "b_q")]
    for name, scale, zp, dtype in (("x", 0.03, 110, np.uint8), ("p", 0.12, -4, np.int8), ("b", 0.01, 128, np.uint8),
                                   ("y", 0.05, 20, np.uint8)):
        inits += [numpy_helper.from_array(np.float32(scale), f"{name}_s"),
                  numpy_helper.from_array(dtype(zp), f"{name}_z")]
    nodes = [h("QuantizeLinear", ["x", "x_s", "x_z"], ["xq"]), h("DequantizeLinear", ["xq", "x_s", "x_z"], ["xf"]),
             h("DequantizeLinear", ["w_q", "w_s", "w_z"], ["wf"], axis=1), h("MatMul", ["xf", "wf"], ["p"], name="mm"),
             h("QuantizeLinear", ["p", "p_s", "p_z"], ["pq"], name="mm_q"),
             h("DequantizeLinear", ["pq", "p_s", "p_z"], ["pf"]),
             h("DequantizeLinear", ["b_q", "b_s", "b_z"], ["bf"]), h("Add", ["pf", "bf"], ["s"], name="add"),
             *([h("Relu", ["s"], ["r"], name="relu")] if relu else []),
             h("QuantizeLinear", ["r" if relu else "s", "y_s", "y_z"], ["yq"], name="add_q"),
             h("DequantizeLinear", ["yq", "y_s", "y_z"], ["y"])]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 9, k])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 9, n])], inits)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("sources", ["-openvino,-onnxruntime", "torch"])
def test_quantize_static_product_and_bias_are_one_layer_matching_onnxruntime(relu, sources):
    """One QMatMul on kiln's kernel where the CPU has VNNI (else the reference), equal to onnxruntime's unfused
    graph: the kernel's steps are the graph's (max difference 0 here; one output step allowed for the reference,
    whose product is a float matmul)."""
    model = bias_after_product_model(relu)
    engine = kiln.build(model, tactic_sources=sources, autotune=False)
    (product,) = [l for l in engine.plan.layers if l.op_type == "QMatMul"]
    assert product.attrs["quant"]["mid_scale"] == pytest.approx(0.12) and product.precision == "INT8"
    assert [l.op_type for l in engine.plan.layers] == ["QuantizeLinear", "QMatMul", "DequantizeLinear"]
    assert product.name == "mm + mm_q + add" + (" + relu" if relu else "") + " + add_q"
    x = {"x": np.random.default_rng(5).normal(0, 1.5, (2, 9, 48)).astype(np.float32)}
    got, want = engine.run(x)["y"], unfused_onnxruntime(model, x)
    assert len(np.unique(want)) > 30
    own = sources != "torch" and vnni_available()
    assert product.tactic_name == ("kiln.qmatmul_gemm_int8" if own else "torch.reference")
    np.testing.assert_allclose(got, want, rtol=0, atol=0 if own else 0.05 + 1e-6)
