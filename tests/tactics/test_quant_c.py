"""QuantizeLinear / DequantizeLinear in C (kiln/native/csrc/quant.c) against onnxruntime's operators: exact
integers and floats for u8/s8, ties rounded half to even, saturation, the channel-major output of a 4-D quantize
and the layout a dequantize keeps; what stays on the reference kernel; and a Q/DQ network whose edge layers run
on them with no Reformat after the input's QuantizeLinear."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import native
from kiln.tactics.base import HWC, LINEAR, LayerView
from kiln.tactics.quant_c import QUANT_TACTIC, QuantizeLinearTactic
from tests.conftest import run_ort
from tests.tactics.amx import built_with, quantize_path  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: kiln's C kernels are not offered")
TACTIC = QuantizeLinearTactic()
NP = {"uint8": np.uint8, "int8": np.int8}


def q_model(op: str, shape, dtype: str, scale: float, zero_point: int) -> onnx.ModelProto:
    """One QuantizeLinear or DequantizeLinear node with constant per-tensor parameters."""
    elem = {"uint8": TensorProto.UINT8, "int8": TensorProto.INT8}[dtype]
    x_type, y_type = (TensorProto.FLOAT, elem) if op == "QuantizeLinear" else (elem, TensorProto.FLOAT)
    inits = [numpy_helper.from_array(np.array(scale, np.float32), "scale"),
             numpy_helper.from_array(np.array(zero_point, NP[dtype]), "zp")]
    graph = helper.make_graph([helper.make_node(op, ["x", "scale", "zp"], ["y"])], "q",
                              [helper.make_tensor_value_info("x", x_type, shape)],
                              [helper.make_tensor_value_info("y", y_type, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def view(op: str, shape, dtype: str, scale=0.02, zero_point=3) -> LayerView:
    types = ("float32", dtype) if op == "QuantizeLinear" else (dtype, "float32")
    consts = {1: torch.tensor(scale), 2: torch.tensor(zero_point, dtype=getattr(torch, dtype))}
    return LayerView(op, "", {}, (tuple(shape), (), ()), (types[0], "float32", dtype), consts, (types[1],))


@pytest.mark.parametrize("dtype, zero_point", [("uint8", 128), ("uint8", 0), ("int8", -3), ("int8", 0)])
@pytest.mark.parametrize("shape", [(1, 3, 224, 224), (2, 5, 7, 9), (1, 1000), (4097,)])
def test_quantize_and_dequantize_equal_onnxruntime(dtype, zero_point, shape):
    rng = np.random.default_rng(0)
    scale = 0.02
    x = (rng.standard_normal(shape) * 2).astype(np.float32)
    flat = x.reshape(-1)
    flat[:8] = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 1e9, -1e9, 0.0], np.float32) * scale   # ties, saturation
    got = TACTIC.prepare(view("QuantizeLinear", shape, dtype, scale, zero_point))([torch.from_numpy(x)])[0]
    want = run_ort(q_model("QuantizeLinear", shape, dtype, scale, zero_point), {"x": x})[0]
    np.testing.assert_array_equal(got.numpy(), want)
    assert got.is_contiguous(memory_format=torch.channels_last) if len(shape) == 4 else got.is_contiguous()
    back = TACTIC.prepare(view("DequantizeLinear", shape, dtype, scale, zero_point))([got])[0]
    np.testing.assert_array_equal(back.numpy(), run_ort(q_model("DequantizeLinear", shape, dtype, scale,
                                                                 zero_point), {"x": want})[0])
    assert back.stride() == got.stride()   # dequantizing keeps the layout it is given


@pytest.mark.parametrize("dtype, zero_point", [("uint8", 131), ("int8", -7)])
def test_values_beside_every_rounding_boundary_quantize_as_onnxruntime(dtype, zero_point, quantize_path):
    """x at the float32 nearest (n + 1/2) * scale and one and two ulps either side, for every level: where x / scale
    and x * (1 / scale) round to different integers. Equal to onnxruntime by division and by the corrected
    reciprocal (quantize_path)."""
    scale = np.float32(0.0137)
    n = np.arange(-300, 300, dtype=np.float32)
    centre = ((n + np.float32(0.5)) * scale).astype(np.float32)
    values, up, down = [centre], centre, centre
    for _ in range(2):
        up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(-np.inf))
        values += [up, down]
    x = np.concatenate(values + [np.array([np.inf, -np.inf], np.float32)])
    got = TACTIC.prepare(view("QuantizeLinear", x.shape, dtype, float(scale), zero_point))([torch.from_numpy(x)])[0]
    want = run_ort(q_model("QuantizeLinear", list(x.shape), dtype, float(scale), zero_point), {"x": x})[0]
    np.testing.assert_array_equal(got.numpy(), want)


def test_a_channels_last_input_quantizes_in_place_of_its_layout():
    x = torch.randn(1, 16, 5, 5).contiguous(memory_format=torch.channels_last)
    got = TACTIC.prepare(view("QuantizeLinear", x.shape, "uint8"))([x])[0]
    assert got.is_contiguous(memory_format=torch.channels_last)
    want = run_ort(q_model("QuantizeLinear", x.shape, "uint8", 0.02, 3), {"x": x.contiguous().numpy()})[0]
    np.testing.assert_array_equal(got.numpy(), want)


def test_formats_a_4d_quantize_writes_channel_major_and_dequantize_keeps_its_input_layout():
    assert TACTIC.output_format(view("QuantizeLinear", (1, 3, 8, 8), "uint8"), [LINEAR]) == HWC
    assert TACTIC.output_format(view("QuantizeLinear", (1, 8), "uint8"), [LINEAR]) == LINEAR
    assert TACTIC.output_format(view("DequantizeLinear", (1, 3, 8, 8), "uint8"), [HWC]) == HWC
    assert TACTIC.output_format(view("DequantizeLinear", (1, 3, 8, 8), "uint8"), [LINEAR]) == LINEAR


def test_per_axis_blocked_and_non_int8_quantization_stay_on_the_reference_kernel():
    per_axis = view("QuantizeLinear", (1, 4, 2, 2), "uint8")
    per_axis.const_inputs[1] = torch.full((4,), 0.1)
    assert not TACTIC.supports(per_axis)
    blocked = LayerView("DequantizeLinear", "", {"block_size": 2}, ((4, 4), (2, 4), ()), ("int8", "float32", "int8"),
                        {1: torch.ones(2, 4), 2: torch.zeros(2, 4, dtype=torch.int8)}, ("float32",))
    assert not TACTIC.supports(blocked)
    wide = LayerView("QuantizeLinear", "", {}, ((8,), (), ()), ("float32", "float32", "int32"),
                     {1: torch.tensor(0.1), 2: torch.tensor(0, dtype=torch.int32)}, ("int32",))
    assert not TACTIC.supports(wide)
    dynamic_scale = LayerView("QuantizeLinear", "", {}, ((8,), (), ()), ("float32", "float32", "uint8"), {},
                              ("uint8",))
    assert not TACTIC.supports(dynamic_scale)
    folded_later = view("DequantizeLinear", (8,), "int8")   # a constant input: the reference kernel runs it
    folded_later.const_inputs[0] = torch.zeros(8, dtype=torch.int8)
    assert not TACTIC.supports(folded_later)
    assert TACTIC.supports(view("QuantizeLinear", (8,), "int8"))


def test_a_qdq_network_runs_its_edges_on_the_c_kernels_without_an_input_reformat(tmp_path):
    """Q(input) -> DQ -> Conv -> Q -> DQ (the shape quantize_static gives one convolution): the input's Quantize
    writes channel major straight for the INT8 convolution, the last Dequantize runs in C (keeping the layout: the
    graph output is copied back to row major after it), and the outputs equal onnxruntime's within one
    quantization step."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((16, 3, 3, 3)) * 0.3).astype(np.float32)
    w_scale = np.abs(w).reshape(16, -1).max(1) / 127
    inits = [numpy_helper.from_array(a, n) for a, n in [
        (np.array(0.03, np.float32), "xs"), (np.array(128, np.uint8), "xz"),
        (np.round(w / w_scale[:, None, None, None]).astype(np.int8), "wq"), (w_scale.astype(np.float32), "ws"),
        (np.zeros(16, np.int8), "wz"), (np.array(0.05, np.float32), "ys"), (np.array(10, np.uint8), "yz")]]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="input_Q"),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="input_DQ"),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], name="w_DQ", axis=0),
             helper.make_node("Conv", ["xd", "wd"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["cq"], name="out_Q"),
             helper.make_node("DequantizeLinear", ["cq", "ys", "yz"], ["y"], name="out_DQ")]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 64, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 64, 64])], inits)
    path = tmp_path / "qdq.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    # kiln's kernels only: with every source a noisy host can time torch's Dequantize faster on this small map
    engine = kiln.build(str(path), tactic_sources="kiln", avg_timing=1, min_timing=1)
    tactics = {l.name: l.tactic_name for l in engine.plan.layers}
    assert tactics["input_Q"] == tactics["out_DQ"] == QUANT_TACTIC
    types = [l.op_type for l in engine.plan.layers]
    if "nhwc" in engine.plan.layers[types.index("QConv")].tactic_name:   # INT8 convolutions read channel major
        assert types[:2] == ["QuantizeLinear", "QConv"], tactics   # no Reformat between: Q wrote channel major
    x = rng.standard_normal((1, 3, 64, 64)).astype(np.float32)
    got, want = engine.run({"x": x})["y"], run_ort(str(path), {"x": x})[0]
    assert np.abs(got - want).max() <= 0.05 + 1e-6   # at most one output quantization step apart
