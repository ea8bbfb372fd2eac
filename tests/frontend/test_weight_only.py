"""Weight-only quantized products as onnxruntime's matmul_nbits_quantizer writes them: com.microsoft MatMulNBits
(2/4/8-bit weights packed per output column, blockwise scales and zero points) and opset 21's blocked
DequantizeLinear of INT4/UINT4 weights before a MatMul. kiln dequantizes the weights once, at build time, and runs
one FP32 product on constant weights (bias inside); outputs against onnxruntime (rel 1e-4: the sums' order
differs; onnxruntime's unfused graph for the Q/DQ form, whose fused path quantizes the activations too)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.errors import ModelError, UnsupportedOpError
from kiln.frontend.weight_only import unpack_bits
from tests.conftest import assert_close_to_ort, init, make_model, rand, run_ort, unfused_onnxruntime
from tests.frontend.test_contrib import ms, ms_model

vi = helper.make_tensor_value_info
N, BATCH, SEQ = 24, 2, 3


def pack_bits(values: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes holding `values` (last axis) `8 / bits` to a byte, the lowest bits first (zero-padded)."""
    per_byte = 8 // bits
    pad = -values.shape[-1] % per_byte
    v = np.concatenate([values, np.zeros((*values.shape[:-1], pad), values.dtype)], -1).astype(np.uint8)
    v = v.reshape(*values.shape[:-1], -1, per_byte)
    return np.bitwise_or.reduce(v << (np.arange(per_byte, dtype=np.uint8) * bits), axis=-1).astype(np.uint8)


def test_packing_round_trips():
    values = np.random.default_rng(0).integers(0, 16, (3, 10)).astype(np.uint8)
    assert pack_bits(values, 4)[0, 0] == values[0, 0] | (values[0, 1] << 4)
    np.testing.assert_array_equal(unpack_bits(pack_bits(values, 4), 4)[:, :10], values)


def nbits_model(k: int, bits: int, block: int, zero_points: str, bias: bool, g_idx: bool = False):
    """x [BATCH, SEQ, k] @ dequantized B -> y [BATCH, SEQ, N] through one MatMulNBits; zero_points: "packed"
    (uint8, `bits` each), "float" (one per block, the scales' type) or "none" (2^(bits-1))."""
    rng = np.random.default_rng(bits + k)
    blocks = -(-k // block)
    q = rng.integers(0, 1 << bits, (N, blocks * block)).astype(np.uint8)
    inits = [init("B", pack_bits(q.reshape(N, blocks, block), bits)),
             init("scales", (rng.random(N * blocks) * 0.05 + 0.01).astype(np.float32))]
    inputs = ["x", "B", "scales"]
    if zero_points == "packed":
        inits.append(init("zp", pack_bits(rng.integers(0, 1 << bits, (N, blocks)).astype(np.uint8), bits).ravel()))
    elif zero_points == "float":
        inits.append(init("zp", rng.uniform(0, 1 << bits, N * blocks).astype(np.float32)))
    inputs.append("zp" if zero_points != "none" else "")
    if g_idx:
        inits.append(init("g_idx", (np.arange(k) // block).astype(np.int32)))
    inputs.append("g_idx" if g_idx else "")
    if bias:
        inits.append(init("bias", rand(N, 7)))
    inputs.append("bias" if bias else "")
    while not inputs[-1]:
        inputs.pop()
    node = ms("MatMulNBits", inputs, ["y"], "nbits", K=k, N=N, bits=bits, block_size=block)
    return ms_model([node], [vi("x", TensorProto.FLOAT, [BATCH, SEQ, k])],
                    [vi("y", TensorProto.FLOAT, [BATCH, SEQ, N])], inits)


@pytest.mark.parametrize("k, bits, block, zero_points, bias", [
    (80, 4, 32, "packed", True),    # K not a whole number of blocks: the last block padded
    (64, 8, 16, "none", False),
    (64, 4, 32, "float", True),
    (96, 2, 32, "packed", False),
])
def test_matmul_nbits_is_one_fp32_product_on_constant_weights(k, bits, block, zero_points, bias):
    model = nbits_model(k, bits, block, zero_points, bias)
    feeds = {"x": rand((BATCH, SEQ, k), 3)}
    want = run_ort(model, feeds)[0]
    engine = kiln.build(model, tactic_sources="-openvino,-onnxruntime", autotune=False)
    (layer,) = engine.plan.layers
    assert layer.op_type == "MatMul" and [a.kind for a in layer.args[1:]] == ["weight"] * (1 + bias)
    assert layer.name == ("nbits" if bias else "nbits/matmul")   # fused, the unfolded nodes take the contrib node's
    assert_close_to_ort(engine.run(feeds)["y"], want, 1e-4)


def test_matmul_nbits_without_bits_is_four_bit():
    model = nbits_model(64, 4, 32, "packed", True)
    node = model.graph.node[0]
    node.attribute.remove(next(a for a in node.attribute if a.name == "bits"))   # optional, default 4
    feeds = {"x": rand((BATCH, SEQ, 64), 5)}
    engine = kiln.build(model, tactic_sources="-openvino,-onnxruntime", autotune=False)
    assert_close_to_ort(engine.run(feeds)["y"], run_ort(model, feeds)[0], 1e-4)


def test_matmul_nbits_refusals_name_the_node_and_the_reason():
    with pytest.raises(UnsupportedOpError, match=r"nbits.*g_idx \(act-order block indices\) is not unfolded"):
        kiln.build(nbits_model(64, 4, 32, "packed", False, g_idx=True))
    wrong_width = nbits_model(64, 4, 32, "none", False)
    wrong_width.graph.node[0].attribute.append(helper.make_attribute("K", 96))   # 3 blocks a column, 2 stored
    wrong_width.graph.node[0].attribute.remove(next(a for a in wrong_width.graph.node[0].attribute if a.name == "K"))
    with pytest.raises(UnsupportedOpError, match=r"nbits.*its packed weights hold 768 values, not the 1152 that "
                                                 r"K=96, N=24, bits=4, block_size=32 make"):
        kiln.build(wrong_width)
    three_bit = nbits_model(64, 4, 32, "none", False)
    next(a for a in three_bit.graph.node[0].attribute if a.name == "bits").i = 3
    with pytest.raises(UnsupportedOpError, match=r"nbits.*bits=3: only 2, 4 and 8 bits are unpacked"):
        kiln.build(three_bit)
    model = nbits_model(64, 4, 32, "none", False)
    model.graph.input.append(vi("scales", TensorProto.FLOAT, [N * 2]))   # scales fed at run time
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "scales"))
    with pytest.raises(UnsupportedOpError, match="its scales 'scales' is not an initializer"):
        kiln.build(model)


def blocked_int4_model(signed: bool, k: int = 64, block: int = 32, scale_rows: int | None = None):
    """DQ(INT4/UINT4 weights [k, N], one scale per `block` rows, axis 0) -> MatMul, as matmul_nbits_quantizer's
    QDQ format writes it."""
    rng = np.random.default_rng(11)
    lo, hi, kind = (-8, 8, TensorProto.INT4) if signed else (0, 16, TensorProto.UINT4)
    blocks = scale_rows or -(-k // block)
    w = rng.integers(lo, hi, (k, N))
    inits = [helper.make_tensor("w4", kind, [k, N], w.ravel().tolist()),
             init("w_scale", (rng.random((blocks, N)) * 0.05 + 0.01).astype(np.float32))]
    dq_inputs = ["w4", "w_scale"]
    if not signed:
        inits.append(helper.make_tensor("w_zp", kind, [blocks, N], rng.integers(lo, hi, (blocks, N)).ravel().tolist()))
        dq_inputs.append("w_zp")
    nodes = [helper.make_node("DequantizeLinear", dq_inputs, ["w"], name="dq_w", axis=0, block_size=block),
             helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")]
    model = make_model(nodes, [vi("x", TensorProto.FLOAT, [BATCH, k])], [vi("y", TensorProto.FLOAT, [BATCH, N])],
                       inits, opset=21)
    model.ir_version = 10
    return model


@pytest.mark.parametrize("signed", [True, False])
def test_blocked_int4_dequantize_linear_folds_into_fp32_weights(signed):
    model = blocked_int4_model(signed)
    feeds = {"x": rand((BATCH, 64), 4)}
    want = unfused_onnxruntime(model, feeds)
    engine = kiln.build(model, tactic_sources="-openvino,-onnxruntime", autotune=False)
    (layer,) = engine.plan.layers
    assert layer.op_type == "MatMul" and layer.args[1].kind == "weight"
    assert engine.plan.weights[layer.args[1].name].dtype == np.float32
    assert_close_to_ort(engine.run(feeds)["y"], want, 1e-4)


def test_int4_weights_in_a_constant_node_are_read_as_initializers_are():
    model = blocked_int4_model(True)
    w4 = next(t for t in model.graph.initializer if t.name == "w4")
    model.graph.node.insert(0, helper.make_node("Constant", [], ["w4"], name="weights", value=w4))
    model.graph.initializer.remove(w4)
    feeds = {"x": rand((BATCH, 64), 6)}
    want = unfused_onnxruntime(model, feeds)
    engine = kiln.build(model, tactic_sources="-openvino,-onnxruntime", autotune=False)
    assert [l.op_type for l in engine.plan.layers] == ["MatMul"]
    assert_close_to_ort(engine.run(feeds)["y"], want, 1e-4)


def test_a_blocked_scale_of_the_wrong_shape_is_an_error_naming_the_node():
    with pytest.raises(ModelError, match=r"dq_w.*scale shape \[3, 24\] must be \[2, 24\]"):
        kiln.build(blocked_int4_model(True, scale_rows=3))


def test_a_four_bit_initializer_outside_dequantize_linear_is_refused():
    """Read widened to int8, an INT4 value is exact only as DequantizeLinear's data or zero point."""
    four = helper.make_tensor("four", TensorProto.INT4, [4], [1, -2, 3, -8])
    model = make_model([helper.make_node("Cast", ["four"], ["f"], name="cast", to=TensorProto.FLOAT),
                        helper.make_node("Add", ["x", "f"], ["y"], name="add")],
                       [vi("x", TensorProto.FLOAT, [4])], [vi("y", TensorProto.FLOAT, [4])], [four], opset=21)
    model.ir_version = 10
    with pytest.raises(ModelError, match=r"initializer 'four' is INT4, read as input 0 of node 'cast' \(Cast\): kiln "
                                         r"reads 4-bit values only as DequantizeLinear's data or zero point"):
        kiln.build(model)
