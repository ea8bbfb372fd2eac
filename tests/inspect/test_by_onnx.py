"""Attribution by ONNX node (kiln.inspect.by_onnx, kiln.trt.layer_names, kiln.inspect.onnx_nodes): TensorRT's layer
names parsed back into nodes, FLOPs from the model, and node-by-node views of the real TensorRT fixtures (ResNet-18
at both verbosities, BERT's Myelin region against its 89 layers) and of kiln engines (a region engine's names-only
layer info, the demo CNN in FP32 against INT8, two Q/DQ placements of a residual block)."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.inspect.by_onnx import NO_NODE_ROW, REFORMAT_ROW, by_onnx, to_json
from kiln.inspect.onnx_nodes import model_nodes
from kiln.trt.artifacts import read_artifact, read_text
from kiln.trt.layer_names import NodeRange, ParsedName, parse_layer_name
from kiln.trt.plan_records import engine_info_from_plan
from kiln.trt.records import EngineInfo, LayerRecord, Profile, ProfileRecord
from kiln.trt.vocab import fused_layer_name, merged_layer_name, pointwise_layer_name, region_layer_name
from tests.conftest import force_plan, init, make_model, rand

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RESNET_DETAILED = FIXTURES / "resnet18_trt10_detailed.layers.json"
RESNET_NAMES = FIXTURES / "resnet18_trt10_names_only.layers.json"
BERT_DETAILED = FIXTURES / "bert_fp16_trt10.10_detailed.oneline.log"
BERT_NAMES = FIXTURES / "bert_fp16_trt10.10_names_only.oneline.log"
BERT_REGION = "{ForeignNode[/encoder/Unsqueeze_3 + /encoder/Unsqueeze_4.../match_model/Squeeze]}"


def profile(times: dict[str, float]) -> Profile:
    return Profile(10, tuple(ProfileRecord(n, 10 * t, t, t, 0.0) for n, t in times.items()))


def rows_by_node(result):
    return {r.onnx_node: r for r in result.rows}


# ---- names ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, nodes", [
    ("conv1 + bn1 + relu1", ("conv1", "bn1", "relu1")),
    ("q || k || v", ("q", "k", "v")),
    ("PWN(/act/Sigmoid, /act/Mul)", ("/act/Sigmoid", "/act/Mul")),
    ("PWN(a, PWN(b, c))", ("a", "b", "c")),
    ("PWN(PWN(/m.0/act/Sigmoid), /m.0/act/Mul) + /m.1/conv/Conv", ("/m.0/act/Sigmoid", "/m.0/act/Mul", "/m.1/conv/Conv")),
    ("resnetv15_dense0_fwd + (Unnamed Layer* 78) [ElementWise]", ("resnetv15_dense0_fwd",)),
    ("node(with, commas) + x", ("node(with, commas)", "x")),
])
def test_fused_merged_and_pointwise_names_give_their_nodes(name, nodes):
    assert parse_layer_name(name).nodes == nodes


def test_foreign_node_range_takes_the_first_and_last_node_of_its_ends():
    parsed = parse_layer_name(BERT_REGION)
    assert parsed == ParsedName(ranges=(NodeRange("/encoder/Unsqueeze_3", "/match_model/Squeeze", BERT_REGION),))
    both = parse_layer_name("{ForeignNode[a...b]} + PWN(c)")
    assert both.nodes == ("c",) and both.ranges == (NodeRange("a", "b", "{ForeignNode[a...b]}"),)


def test_reformat_and_unnamed_layers_have_no_nodes():
    reformat = parse_layer_name(f"Reformatting CopyNode for Output Tensor 0 to {BERT_REGION}")
    assert reformat == ParsedName(reformat=True)
    assert parse_layer_name("(Unnamed Layer* 7) [Shuffle]") == ParsedName(unnamed=("(Unnamed Layer* 7) [Shuffle]",))


def test_names_kiln_writes_parse_back():
    assert parse_layer_name(fused_layer_name(["a", "b"])).nodes == ("a", "b")
    assert parse_layer_name(merged_layer_name(["q", "k"])).nodes == ("q", "k")
    assert parse_layer_name(pointwise_layer_name(["s", "m"])).nodes == ("s", "m")
    region = region_layer_name(fused_layer_name(["c", "r"]), "add")
    assert parse_layer_name(region).ranges == (NodeRange("c", "add", region),)


# ---- FLOPs ---------------------------------------------------------------------------------------------------------

def small_net():
    """conv (3->4, 3x3, 8x8) -> relu -> reshape -> matmul (256x10)."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1] * 4),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Reshape", ["r", "shape"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "m"], ["y"]),
             helper.make_node("MaxPool", ["c"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2])]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10]),
                       helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 4, 4, 4])],
                      [init("w", rand((4, 3, 3, 3))), init("shape", np.array([1, 256], np.int64)),
                       init("m", rand((256, 10)))])


def test_flops_per_node_from_inferred_shapes():
    import onnx

    nodes = model_nodes(onnx.shape_inference.infer_shapes(small_net()))
    assert nodes.order == ("conv", "relu", "flat", "(Unnamed Layer* 3) [MatMul]", "pool")
    assert nodes.flops == {"conv": 2.0 * 256 * 27, "relu": 256.0, "flat": 0.0,
                           "(Unnamed Layer* 3) [MatMul]": 2.0 * 10 * 256, "pool": 64.0 * 4}
    assert nodes.resolve("node_of_y") == "(Unnamed Layer* 3) [MatMul]" and nodes.resolve("c") == "conv"
    assert nodes.resolve("w") is None and nodes.resolve("conv") == "conv"


def test_fused_layer_time_splits_by_flops_with_the_model_else_evenly():
    import onnx

    model = model_nodes(onnx.shape_inference.infer_shapes(small_net()))
    engine = EngineInfo("test", "layer_names_only", (LayerRecord("conv + relu"), LayerRecord("flat + node_of_y")))
    times = profile({"conv + relu": 1.0, "flat + node_of_y": 0.5})
    with_model = rows_by_node(by_onnx(engine, times, model=model))
    assert with_model["conv"].a.time_ms == pytest.approx(54 / 55) and with_model["conv"].a.primary.split == "flops"
    assert with_model["relu"].a.time_ms == pytest.approx(1 / 55)   # 2·256·27 FLOPs against 256
    assert with_model["flat"].a.time_ms == 0.0                                  # a reshape does no arithmetic
    assert with_model["(Unnamed Layer* 3) [MatMul]"].a.time_ms == pytest.approx(0.5)
    plain = rows_by_node(by_onnx(engine, times))
    assert plain["conv"].a.time_ms == plain["relu"].a.time_ms == pytest.approx(0.5)
    assert plain["conv"].a.primary.split == "even" and "evenly" in by_onnx(engine, times).split


# ---- the real TensorRT fixtures ------------------------------------------------------------------------------------

def test_resnet18_trt10_names_only_against_detailed():
    names, detailed = read_artifact(RESNET_NAMES), read_artifact(RESNET_DETAILED)
    times = profile({layer.name: 0.01 * (i + 1) for i, layer in enumerate(detailed.layers)})
    result = by_onnx(names, None, detailed, times)
    rows = rows_by_node(result)
    metadata_nodes = {o for layer in detailed.layers for o in layer.origin}
    assert len(metadata_nodes) == 68 and metadata_nodes <= {r.onnx_node for r in result.rows if r.a and r.b}
    add = rows["resnetv15_stage2__plus0"]
    assert add.a.primary.layer == add.b.primary.layer == detailed.layers[8].name
    assert add.b.primary.precision == "INT8" and add.a.primary.precision is None     # names only: no formats
    assert add.b.time_ms == pytest.approx(0.09 / 4)                                  # 4 nodes share the layer
    dense = rows["resnetv15_dense0_fwd"].b                       # the FC layer and the NoOp reshape after it
    assert [s.layer for s in dense.shares] == ["resnetv15_dense0_fwd + (Unnamed Layer* 78) [ElementWise]",
                                               "reshape_after_resnetv15_dense0_fwd"]
    assert dense.primary.precision == "FP32" and dense.time_ms == pytest.approx(0.24 + 0.25)
    assert [s.layer for s in rows[REFORMAT_ROW].b.shares] == [detailed.layers[0].name, detailed.layers[22].name]
    # only the names-only side reads the reshape's name as a node; the detailed side's Metadata says dense0
    assert rows["reshape_after_resnetv15_dense0_fwd"].b is None
    assert sum(r.b.time_ms for r in result.rows if r.b) == pytest.approx(times.total_average_ms)
    deltas = [abs(r.delta_ms) for r in result.rows]
    assert deltas == sorted(deltas, reverse=True)


def test_bert_myelin_region_takes_the_other_engines_nodes():
    names, detailed = read_artifact(BERT_NAMES), read_artifact(BERT_DETAILED)
    result = by_onnx(names, profile({BERT_REGION: 3.34, f"Reformatting CopyNode for Output Tensor 0 to {BERT_REGION}":
                                     0.01}), detailed)
    rows = rows_by_node(result)
    nodes = {r.onnx_node for r in result.rows} - {REFORMAT_ROW}
    assert len(nodes) == 334 and all(rows[n].a.primary.layer == BERT_REGION for n in nodes)
    assert rows["/encoder/layers.3/mha/attn/mha_prob/Softmax"].a.time_ms == pytest.approx(0.01)
    assert rows["/encoder/layers.3/mha/attn/mha_prob/Softmax"].b.primary.layer == "_gemm_mha_v2_myl0_24"
    assert rows["/encoder/layers.3/mha/attn/mha_prob/Softmax"].b.primary.precision == "FP16"
    assert rows[REFORMAT_ROW].a.time_ms == pytest.approx(0.01)
    assert any("takes the 334 nodes of the other engine" in n for n in result.notes)
    alone = by_onnx(names)                                       # nothing to resolve against: kept as the range
    assert [r.onnx_node for r in alone.rows] == [BERT_REGION, REFORMAT_ROW]
    assert "kept as the range" in alone.notes[0]


def test_json_schema():
    doc = to_json(by_onnx(read_artifact(RESNET_NAMES), None, read_artifact(RESNET_DETAILED)))
    assert set(doc) == {"nodes", "split", "notes"}
    row = next(r for r in doc["nodes"] if r["onnx_node"] == "resnetv15_pool1_fwd")
    assert set(row) == {"onnx_node", "a", "b", "delta_ms"}
    assert row["b"] == {"layer": "resnetv15_pool1_fwd", "precision": "INT8", "time_ms": None,
                        "layer_type": "CaskPooling", "share": 1.0, "split": "whole",
                        "layers": [{"layer": "resnetv15_pool1_fwd", "layer_type": "CaskPooling", "precision": "INT8",
                                    "share": 1.0, "split": "whole", "time_ms": None}]}
    only_a = next(r for r in doc["nodes"] if r["onnx_node"] == "reshape_after_resnetv15_dense0_fwd")
    assert only_a["b"] == {} and only_a["a"]["layer"] == "reshape_after_resnetv15_dense0_fwd"
    one = to_json(by_onnx(read_artifact(RESNET_DETAILED)))
    assert all(set(r) == {"onnx_node", "a"} for r in one["nodes"])


def test_layers_without_nodes_and_profile_only_records():
    engine = read_text(json.dumps({"Layers": [
        {"Name": "(Unnamed Layer* 3) [Shuffle]", "LayerType": "Shuffle", "Outputs": [], "Inputs": []},
        {"Name": "conv", "LayerType": "CaskConvolution", "Inputs": [], "Outputs": [],
         "Metadata": "[ONNX Layer: conv]"}]}))
    result = by_onnx(engine, profile({"(Unnamed Layer* 3) [Shuffle]": 0.2, "conv": 1.0, "relu": 0.3}))
    assert [(r.onnx_node, r.a.time_ms) for r in result.rows] == [("conv", 1.0), ("relu", 0.3), (NO_NODE_ROW, 0.2)]
    assert "1 profile record(s) name no layer of the engine" in result.notes[0]


# ---- kiln engines --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from kiln.demo import demo_model

    folder = tmp_path_factory.mktemp("demo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        demo_model(folder / "demo.onnx")
    np.savez(folder / "calib.npz", image=np.random.default_rng(0).standard_normal((4, 1, 3, 64, 64)).astype(np.float32))
    fp32 = kiln.build(str(folder / "demo.onnx"), autotune=False, regions=False)
    int8 = kiln.build(str(folder / "demo.onnx"), autotune=False, regions=False, int8=True,
                      calibration=str(folder / "calib.npz"))
    return folder, engine_info_from_plan(fp32.plan), engine_info_from_plan(int8.plan)


def test_kiln_demo_fp32_against_int8(demo):
    from kiln.inspect.onnx_nodes import load_model_nodes

    folder, fp32, int8 = demo
    model = load_model_nodes(str(folder / "demo.onnx"))
    times = [profile({layer.name: 0.1 for layer in e.layers}) for e in (fp32, int8)]
    result = by_onnx(fp32, times[0], int8, times[1], model)
    rows = rows_by_node(result)
    removed = {"Identity_0", "Identity_1"}                       # the exporter's Identity nodes: removed by kiln
    assert set(model.order) - removed <= {r.onnx_node for r in result.rows if r.a and r.b}
    assert "2 node(s) of the model are in no layer (removed or folded by the build): Identity_0, Identity_1" in \
        result.notes
    relu = rows["/stem/stem.2/Relu"]
    assert relu.a.primary.layer == "/stem/stem.0/Conv + /stem/stem.1/BatchNormalization + /stem/stem.2/Relu"
    assert relu.a.primary.precision == "FP32" and relu.b.primary.precision == "INT8"
    assert relu.b.primary.layer.startswith(relu.a.primary.layer) and relu.precision_differs   # folded, one INT8 layer
    assert rows["/stem/stem.1/BatchNormalization"].b.primary.layer == relu.b.primary.layer
    conv = rows["/stem/stem.0/Conv"]                 # the conv takes nearly all of its fused layer's time (FLOPs)
    assert conv.a.primary.split == "flops" and conv.a.time_ms > 0.09
    inserted = [r for r in result.rows if r.a is None]       # the Q/DQ nodes calibration inserted exist in B only
    assert inserted and all("QuantizeLinear" in r.onnx_node or "DequantizeLinear" in r.onnx_node for r in inserted)
    assert any("no node of the model" in n for n in result.notes)
    for side, times_side in (("a", times[0]), ("b", times[1])):
        total = sum(getattr(r, side).time_ms for r in result.rows if getattr(r, side))
        assert total == pytest.approx(times_side.total_average_ms)


def residual_block(residual_aware: bool):
    """conv1 -> relu1 -> conv2 -> add(conv2, relu1) -> relu2 -> conv3, every conv input quantized (Q/DQ). Residual-
    aware (NVIDIA's recommendation for ResNet QAT): Q/DQ on both Add inputs too; otherwise the Add sees FP32."""
    def qdq(x):
        return [helper.make_node("QuantizeLinear", [x, "s", "zp"], [f"{x}_q"], name=f"{x}_Q"),
                helper.make_node("DequantizeLinear", [f"{x}_q", "s", "zp"], [f"{x}_dq"], name=f"{x}_DQ")]

    nodes = qdq("x")
    inits = [init("s", np.float32(0.05)), init("zp", np.int8(0)), init("zpw", np.int8(0))]
    for i, (co, k) in enumerate([(8, 3), (8, 3), (4, 1)], 1):
        inits += [init(f"w{i}", rand((co, 8, k, k), seed=i) * 0.3), init(f"w{i}_s", np.float32(0.01)),
                  init(f"b{i}", rand((co,), seed=10 + i))]
        nodes += [helper.make_node("QuantizeLinear", [f"w{i}", f"w{i}_s", "zpw"], [f"w{i}_q"], name=f"w{i}_Q"),
                  helper.make_node("DequantizeLinear", [f"w{i}_q", f"w{i}_s", "zpw"], [f"w{i}_dq"], name=f"w{i}_DQ")]
    nodes += [helper.make_node("Conv", ["x_dq", "w1_dq", "b1"], ["c1"], name="conv1", pads=[1] * 4),
              helper.make_node("Relu", ["c1"], ["a"], name="relu1"), *qdq("a"),
              helper.make_node("Conv", ["a_dq", "w2_dq", "b2"], ["c2"], name="conv2", pads=[1] * 4)]
    if residual_aware:
        nodes += [*qdq("c2"), helper.make_node("Add", ["c2_dq", "a_dq"], ["s2"], name="add")]
    else:
        nodes += [helper.make_node("Add", ["c2", "a"], ["s2"], name="add")]
    nodes += [helper.make_node("Relu", ["s2"], ["r"], name="relu2"), *qdq("r"),
              helper.make_node("Conv", ["r_dq", "w3_dq", "b3"], ["y"], name="conv3")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])], inits)


def test_qdq_placement_residual_aware_against_not(recwarn):
    aware = engine_info_from_plan(kiln.build(residual_block(True), autotune=False, regions=False).plan)
    plain = engine_info_from_plan(kiln.build(residual_block(False), autotune=False, regions=False).plan)
    rows = rows_by_node(by_onnx(aware, None, plain, None, model_nodes(residual_block(True))))

    def where(node):
        r = rows[node]
        return [(p.primary.layer, p.primary.precision) if p else None for p in (r.a, r.b)]

    # without Q/DQ on the residual input relu1's output stays FP32 and a separate Quantize layer feeds conv2
    assert where("relu1") == [("conv1 + relu1 + a_Q", "INT8"), ("conv1 + relu1", "FP32")]
    assert where("a_Q") == [("conv1 + relu1 + a_Q", "INT8"), ("a_Q", "INT8")]
    # the Add fuses into conv2 both ways: with an INT8 residual (both inputs quantized), else an FP32 one
    assert where("add") == [("conv2 + c2_Q + add + relu2 + r_Q", "INT8"), ("conv2 + add + relu2 + r_Q", "INT8")]
    conv2 = next(layer for layer in plain.layers if layer.name == "conv2 + add + relu2 + r_Q")
    assert [t.precision for t in conv2.inputs] == ["INT8", "FP32"]
    aware_conv2 = next(layer for layer in aware.layers if layer.name == "conv2 + c2_Q + add + relu2 + r_Q")
    assert [t.precision for t in aware_conv2.inputs] == ["INT8", "INT8"]
    assert where("c2_Q") == [("conv2 + c2_Q + add + relu2 + r_Q", "INT8"), None]   # only the residual-aware model
    assert rows["relu1"].precision_differs and not rows["add"].precision_differs


@pytest.fixture(scope="module")
def region_engine():
    """A kiln engine whose whole graph is one onnxruntime region (that plan forced to win)."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["s"], name="sig"),
             helper.make_node("Mul", ["c", "s"], ["m"], name="mul"),
             helper.make_node("Conv", ["m", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
                       [init("w", rand((4, 3, 3, 3))), init("w2", rand((4, 4, 3, 3), seed=1))])
    with pytest.MonkeyPatch.context() as mp:
        force_plan(mp, "onnxruntime")
        engine = kiln.build(model, avg_timing=1, min_timing=1)
    return model, engine


def test_kiln_region_names_only_resolved_by_the_model_and_by_the_detailed_engine(region_engine):
    import onnx

    model, engine = region_engine
    names_only = read_text(json.dumps(engine.layer_info("layer_names_only")))
    [region] = [layer.name for layer in names_only.layers]
    assert region.startswith("{ForeignNode[")
    by_model = by_onnx(names_only, profile({region: 2.0}), model=model_nodes(onnx.shape_inference.infer_shapes(model)))
    assert [r.onnx_node for r in by_model.rows] == ["conv2", "conv", "sig", "mul"]    # by FLOPs, largest first
    assert sum(r.a.time_ms for r in by_model.rows) == pytest.approx(2.0)
    assert "resolved against the model's topological order" in by_model.notes[0]
    detailed = engine_info_from_plan(engine.plan)
    both = by_onnx(names_only, None, detailed)
    assert {r.onnx_node for r in both.rows if r.a and r.b} == {"conv", "sig", "mul", "conv2"}
    assert "resolved against the other engine's layers" in both.notes[0]


def test_html_report_has_the_by_onnx_node_table():
    from kiln.inspect.report import html_report

    detailed = read_artifact(RESNET_DETAILED)
    evil = LayerRecord("<b>x</b>", "CaskPooling", origin=("<script>alert(1)</script>",))
    engine = EngineInfo(detailed.source, detailed.verbosity, detailed.layers + (evil,), detailed.bindings)
    page = html_report(engine, profile({layer.name: 0.1 for layer in engine.layers}), findings=[])
    table = page[page.index('<table class="sortable" id="by-onnx">'):]
    table = table[:table.index("</table>")]
    assert "<h2>By ONNX node (70)</h2>" in page and "split evenly" in page
    plus = f"<tr><td class=name>resnetv15_stage2__plus0</td><td class=name>{detailed.layers[8].name}</td>" \
           "<td>CaskConvolution</td><td>INT8</td><td class=num data-v=\"25\">25.0</td>" \
           "<td class=num data-v=\"0.025\">0.0250</td></tr>"
    assert plus in table
    assert "and 1 more layer(s)" in table                          # dense0: the FC layer and the NoOp reshape
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in table
