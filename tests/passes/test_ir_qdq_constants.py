"""WeightOnlyDequantizeFolding, GatherDequantizeSwap and ConstantDequantizeFolding on IR graphs: a weight-only
quantized product's weights become FP32 constants before the fusions (an INT8 product's stay); an INT8 embedding
table is gathered as INT8 and only the gathered rows are dequantized; the DequantizeLinear of other constants (a
bias, a LayerNorm's scale) becomes an FP32 constant of the same values. Then a whole quantize_static embedding and
a weight-only quantized block run against onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.passes.qdq_constants import fold_constant_dequantize, fold_weight_only_dequantize, swap_gather_dequantize
from tests.conftest import make_model, run_ort
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged
from tests.passes.test_ir_quantization import dq, q

TABLE = (np.arange(24).reshape(6, 4) * 11 % 255 - 127).astype(np.int8)


def dequantized_table(b: IRBuilder, scale=0.5, name="table", **attrs):
    zp = np.full(np.shape(scale), 3)
    return b.node("DequantizeLinear", [b.const(name, TABLE, np.int8), b.const(f"{name}_s", scale),
                                       b.const(f"{name}_z", zp, np.int8)], f"{name}_f", (6, 4), dtype=np.float32,
                  name=f"dq_{name}", **attrs)


def test_a_gathered_table_is_gathered_as_int8_and_only_its_rows_dequantized():
    b = IRBuilder()
    ids = b.input("ids", (2, 3), np.int64, dyn_dims=(1,), probe=(2, 7))   # a dynamic sequence
    table = dequantized_table(b)
    rows = b.node("Gather", [table, ids], "rows", (2, 3, 4), name="gather", dyn_dims=(1,), probe=(2, 7, 4))
    head = b.node("MatMul", [b.input("h", (2, 4)), b.node("Transpose", [table], "tt", (4, 6), perm=[1, 0])],
                  "logits", (2, 6), name="head")   # tied weights: the table is read by a product too
    g = b.graph(rows, head)

    run = run_pass(g, "GatherDequantizeSwap", swap_gather_dequantize)

    assert str(g) == expected("""
        graph g(%ids: int64[2x-1], %h: float32[2x4]):
          %table_f: float32[6x4] = DequantizeLinear(const %table, const %table_s, const %table_z)  # dq_table
          %rows_quantized: int8[2x-1x4] = Gather(const %table, %ids)  # gather
          %rows: float32[2x-1x4] = DequantizeLinear(%rows_quantized, const %table_s, const %table_z)  # dq_table [gather]
          %tt: float32[4x6] = Transpose(%table_f) perm=[1, 0]  # tt
          %logits: float32[2x6] = MatMul(%h, %tt)  # head
          return %rows, %logits
        """)
    assert [n.origin for n in g.nodes][1:3] == [("gather",), ("dq_table",)]
    gathered = g.values["rows_quantized"]
    assert (gathered.dyn_dims, gathered.probe_shape) == ((1,), (2, 7, 4))
    assert (run.stat.matches, run.stat.rejections) == (1, 0)


def test_per_axis_tables_stay_with_the_reason():
    b = IRBuilder()
    table = dequantized_table(b, scale=[0.5, 0.25, 0.5, 0.25, 0.5, 0.25], axis=0)   # one scale per row
    g = b.graph(b.node("Gather", [table, b.input("ids", (3,), np.int64)], "rows", (3, 4), name="gather"))
    run = run_pass_unchanged(g, "GatherDequantizeSwap", swap_gather_dequantize)
    assert run.not_fusing == ["GatherDequantizeSwap: Not fusing dq_table with gather: per-axis scales: only a "
                              "per-tensor table is gathered as INT8"]


def test_the_dequantized_constants_left_become_fp32_constants():
    b = IRBuilder()
    x = b.input("x", (2, 4))
    bias = b.node("DequantizeLinear", [b.const("b_q", [100, -7, 0, 2**20], np.int32), b.const("b_s", 0.001)], "bias",
                  (4,), dtype=np.float32, name="dq_bias")
    of_tensor = dq(b, q(b, x, "xq", 0.125), "xf", 0.125)   # stays
    g = b.graph(b.node("Add", [of_tensor, bias], "y", (2, 4), name="add"), dequantized_table(b))   # an output: stays

    run = run_pass(g, "ConstantDequantizeFolding", fold_constant_dequantize, folds_constants=True)

    assert [n.name for n in g.nodes] == ["xq", "xf", "add", "dq_table"]
    want = np.int32([100, -7, 0, 2**20]).astype(np.float32) * np.float32(0.001)   # DequantizeLinear, in float32
    np.testing.assert_array_equal(g.values["bias"].const, want)
    assert g.values["bias"].const.dtype == np.float32
    assert (run.stat.matches, run.stat.rejections) == (1, 0)


def test_a_quantized_embedding_runs_on_int8_rows_and_matches_onnxruntime(tmp_path):
    """Word + position embeddings as onnxruntime's quantize_static leaves them (DequantizeLinear of each INT8 table,
    Gather, Add) and a LayerNorm with a dequantized scale: no DequantizeLinear of a constant is left to run."""
    h = helper.make_node
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(a, n) for n, a in (
        ("words_q", rng.integers(-128, 128, (50, 8)).astype(np.int8)), ("words_s", np.float32(0.02)),
        ("words_z", np.int8(-3)), ("pos_q", rng.integers(-128, 128, (16, 8)).astype(np.int8)),
        ("pos_s", np.float32(0.01)), ("pos_z", np.int8(0)), ("pos_ids", np.arange(16, dtype=np.int64)[None]),
        ("gamma_q", rng.integers(0, 256, (8,)).astype(np.uint8)), ("gamma_s", np.float32(0.01)),
        ("gamma_z", np.uint8(0)), ("beta", rng.standard_normal(8).astype(np.float32)))]
    nodes = [h("DequantizeLinear", ["words_q", "words_s", "words_z"], ["words"], name="dq_words"),
             h("DequantizeLinear", ["pos_q", "pos_s", "pos_z"], ["pos"], name="dq_pos"),
             h("DequantizeLinear", ["gamma_q", "gamma_s", "gamma_z"], ["gamma"], name="dq_gamma"),
             h("Gather", ["words", "ids"], ["w"], name="gather_words"),
             h("Gather", ["pos", "pos_ids"], ["p"], name="gather_pos"),
             h("Add", ["w", "p"], ["e"], name="sum"),
             h("LayerNormalization", ["e", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5)]
    model = make_model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 16])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8])], inits)
    path = tmp_path / "emb.onnx"
    onnx.save(model, path)
    engine = kiln.build(str(path), tactic_sources="-openvino,-onnxruntime", autotune=False)
    gathers = [l for l in engine.plan.layers if l.op_type == "Gather" and l.args[0].kind == "weight"]
    assert len(gathers) == 2 and all(engine.plan.weights[l.args[0].name].dtype == np.int8 for l in gathers)
    assert not any(l.op_type == "DequantizeLinear" and all(a.kind == "weight" for a in l.args)
                   for l in engine.plan.layers)
    ids = {"ids": rng.integers(0, 50, (1, 16)).astype(np.int64)}
    np.testing.assert_allclose(engine.run(ids)["y"], run_ort(str(path), ids)[0], rtol=1e-5, atol=1e-5)


def test_a_weight_only_quantized_product_gets_fp32_weights_and_an_int8_product_keeps_its_dequantize():
    b = IRBuilder()
    x = b.input("x", (2, 4))
    transposed = b.node("Transpose", [dequantized_table(b)], "w_t", (4, 6), perm=[1, 0], name="transpose")
    weight_only = b.node("MatMul", [x, transposed], "y", (2, 6), name="weight_only")
    w8 = dequantized_table(b, name="w8")
    of_int8 = b.node("MatMul", [dq(b, q(b, x, "xq", 0.125), "xf", 0.125),
                                b.node("Transpose", [w8], "w8_t", (4, 6), perm=[1, 0], name="transpose8")],
                     "z", (2, 6), name="int8")
    g = b.graph(weight_only, of_int8)

    run = run_pass(g, "WeightOnlyDequantizeFolding", fold_weight_only_dequantize, folds_constants=True)

    assert [n.name for n in g.nodes] == ["transpose", "weight_only", "dq_w8", "xq", "xf", "transpose8", "int8"]
    want = (TABLE.astype(np.float32) - np.float32(3)) * np.float32(0.5)
    np.testing.assert_array_equal(g.nodes[0].inputs[0].const, want)
    assert g.nodes[0].inputs[0].const.dtype == np.float32
    assert (run.stat.matches, run.stat.rejections) == (1, 0)


def test_a_convolution_whose_input_is_dequantized_behind_a_pad_keeps_its_int8_weights():
    """Keras/tf2onnx write `DQ(x) -> Pad -> Conv(DQ(W))`; PaddingConvFusion later makes it one INT8 convolution."""
    b = IRBuilder()
    x = dq(b, q(b, b.input("x", (1, 4, 6, 6)), "xq", 0.125), "xf", 0.125)
    padded = b.node("Pad", [x, b.const("pads", [0, 0, 1, 1, 0, 0, 1, 1], np.int64)], "xp", (1, 4, 8, 8), name="pad")
    w = b.node("DequantizeLinear", [b.const("w_q", np.ones((6, 4, 3, 3)), np.int8), b.const("w_s", 0.5)], "w",
               (6, 4, 3, 3), dtype=np.float32, name="dq_w")
    g = b.graph(b.node("Conv", [padded, w], "y", (1, 6, 6, 6), name="conv"))
    run_pass_unchanged(g, "WeightOnlyDequantizeFolding", fold_weight_only_dequantize)


def test_a_dequantized_constant_read_other_than_as_a_weight_stays():
    """Gathered (the embedding swap's case), a product's data input, or a graph output (also a product's weight):
    left for the later passes."""
    b = IRBuilder()
    gathered = b.node("Gather", [dequantized_table(b), b.input("ids", (3,), np.int64)], "rows", (3, 4), name="g")
    as_data = b.node("MatMul", [dequantized_table(b, name="lhs"), b.input("w", (4, 2))], "p", (6, 2), name="mm")
    out = dequantized_table(b, name="out")
    as_weight = b.node("MatMul", [b.input("h", (2, 6)), out], "o", (2, 4), name="mm_out")
    g = b.graph(gathered, as_data, out, as_weight)
    run_pass_unchanged(g, "WeightOnlyDequantizeFolding", fold_weight_only_dequantize)


def test_a_tied_table_gathered_and_read_as_a_weight_stays_int8():
    """A tied embedding (gathered, and the LM head's transposed weight): folding it for the product would take the
    INT8 gather away."""
    b = IRBuilder()
    table = dequantized_table(b)
    rows = b.node("Gather", [table, b.input("ids", (3,), np.int64)], "rows", (3, 4), name="gather")
    head = b.node("MatMul", [b.input("h", (2, 4)), b.node("Transpose", [table], "tt", (4, 6), perm=[1, 0])],
                  "logits", (2, 6), name="head")
    g = b.graph(rows, head)
    run_pass_unchanged(g, "WeightOnlyDequantizeFolding", fold_weight_only_dequantize)


def test_a_weight_only_quantized_block_runs_packed_and_matches_onnxruntime(tmp_path):
    """DQ(per-channel INT8 weights stored [N, K]) -> Transpose -> MatMul -> bias Add -> Relu, and a weight-only
    convolution: each one FP32 layer on constant weights (no runtime Transpose), equal to onnxruntime's output."""
    h = helper.make_node
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(a, n) for n, a in (
        ("w_q", rng.integers(-127, 128, (16, 8)).astype(np.int8)), ("w_s", (rng.random(16) * 0.01 + 1e-3).astype(
            np.float32)), ("b", rng.standard_normal(16).astype(np.float32)),
        ("k_q", rng.integers(-127, 128, (4, 3, 3, 3)).astype(np.int8)), ("k_s", np.float32(0.02)))]
    nodes = [h("DequantizeLinear", ["w_q", "w_s"], ["w"], name="dq_w", axis=0),
             h("Transpose", ["w"], ["w_t"], name="transpose", perm=[1, 0]),
             h("MatMul", ["x", "w_t"], ["mm"], name="matmul"), h("Add", ["mm", "b"], ["biased"], name="bias"),
             h("Relu", ["biased"], ["y"], name="relu"),
             h("DequantizeLinear", ["k_q", "k_s"], ["k"], name="dq_k"),
             h("Conv", ["image", "k"], ["c"], name="conv", pads=[1, 1, 1, 1])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8]),
                               helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 3, 8, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16]),
                        helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    path = tmp_path / "weight_only.onnx"
    onnx.save(model, path)
    engine = kiln.build(str(path), tactic_sources="-openvino,-onnxruntime", autotune=False)
    layers = {l.op_type: l for l in engine.plan.layers if l.op_type != "Reformat"}   # Reformat: NCHW <-> NHWC
    assert sorted(layers) == ["Conv", "MatMul"]
    assert layers["MatMul"].name.count(" + ") == 2 and all(a.kind == "weight" for a in layers["MatMul"].args[1:])
    assert layers["Conv"].args[1].kind == "weight"
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32),
             "image": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)}
    got, want = engine.run(feeds), run_ort(str(path), feeds)
    np.testing.assert_allclose(got["y"], want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["c"], want[1], rtol=1e-5, atol=1e-5)
