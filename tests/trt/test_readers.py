"""kiln.trt's readers on real trtexec artifacts (tests/fixtures) and on kiln's own exports."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.errors import ArtifactError
from kiln.runtime.profiler import InferenceTime, LayerProfiler
from kiln.trt.artifacts import read_artifact
from kiln.trt.layer_info import dumps, layer_info, oneline
from kiln.trt.plan_records import engine_info_from_plan
from kiln.trt.profile import profile_json, read_profile_json, read_times_json, times_json
from kiln.trt.vocab import metadata_text
from kiln.trt.readers import read_layer_info_json, read_oneline
from kiln.trt.records import EngineInfo, InferenceTimes, Profile
from tests.conftest import force_plan, make_model

FIXTURES = Path(__file__).parent.parent / "fixtures"


def test_resnet18_detailed_json():
    info = read_artifact(FIXTURES / "resnet18_trt10_detailed.layers.json")
    assert isinstance(info, EngineInfo) and info.verbosity == "detailed" and info.source == "trtexec-json"
    assert len(info.layers) == 25
    assert info.layer_types == {"Reformat": 1, "CaskConvActPool": 1, "CaskConvolution": 20, "CaskPooling": 1,
                                "NoOp": 2}
    assert info.precisions == {"INT8": 23, "FP32": 2}
    assert info.bindings == ("data", "resnetv15_dense0_fwd")
    first, conv = info.layers[0], info.layers[1]
    assert first.is_reformat and first.params["Origin"] == "REFORMAT" and first.origin == ()
    assert conv.origin == ("resnetv15_conv0_fwd", "resnetv15_batchnorm0_fwd", "resnetv15_relu0_fwd",
                           "resnetv15_pool0_fwd")
    assert conv.parameter_type == "ConvActPool" and conv.params["ConvKernel"] == [7, 7]
    assert conv.tactic_value == "0xb71c75095873646c" and conv.params["StreamId"] == 0
    assert conv.inputs[0].location == "Device" and conv.outputs[0].dims == (1, 64, 56, 56)


def test_resnet18_names_only_json():
    info = read_artifact(FIXTURES / "resnet18_trt10_names_only.layers.json")
    assert info.verbosity == "layer_names_only" and len(info.layers) == 25
    assert info.bindings == ("data", "resnetv15_dense0_fwd")
    assert info.layers[1].fused_names == ("resnetv15_conv0_fwd", "resnetv15_batchnorm0_fwd", "resnetv15_relu0_fwd",
                                          "resnetv15_pool0_fwd")
    detailed = read_artifact(FIXTURES / "resnet18_trt10_detailed.layers.json")
    assert [l.name for l in info.layers] == [l.name for l in detailed.layers]


def test_conv_dynamic_trt8_json():
    info = read_artifact(FIXTURES / "conv_dynamic_int8_fp32out_trt8.layers.json")
    assert len(info.layers) == 3 and info.layer_types == {"NoOp": 1, "Reformat": 1, "CaskConvolution": 1}
    noop, reformat, conv = info.layers
    assert noop.inputs[0].dims == (-1, 25088) and noop.inputs[0].dynamic
    assert all(t.format == "N/A due to dynamic shapes" and t.precision is None
               for l in info.layers for t in l.inputs + l.outputs)
    assert info.precisions == {"unknown": 3}
    assert reformat.is_reformat and reformat.params["Origin"] == "REFORMAT"
    assert conv.tactic_name.startswith("sm80_xmma_fprop_implicit_gemm_interleaved_i8f32")
    assert conv.params["Weights"] == {"Type": "Int8", "Count": 13824} and conv.origin == ()


def test_bert_names_only_oneline_dump():
    info = read_artifact(FIXTURES / "bert_fp16_trt10.10_names_only.oneline.log")
    assert info.verbosity == "layer_names_only" and info.source == "trtexec-oneline"
    myelin, reformat = info.layers
    assert myelin.layer_type == "Myelin" and myelin.name.startswith("{ForeignNode[/encoder/Unsqueeze_3")
    assert [t.name for t in myelin.inputs] == ["concat_ids", "concat_mask", "sent_ids", "pos_ids"]
    assert myelin.inputs[1].dims == (1, 40) and myelin.inputs[1].precision == "BOOL"
    assert myelin.outputs[0].name.startswith("Reformatted Output Tensor 0 to {ForeignNode[")
    assert reformat.layer_type == "Reformat" and reformat.outputs[0].name == "score"
    assert reformat.outputs[0].precision == "FP32" and reformat.inputs[0].precision == "FP16"


def test_bert_detailed_oneline_dump():
    info = read_artifact(FIXTURES / "bert_fp16_trt10.10_detailed.oneline.log")
    assert info.verbosity == "detailed" and len(info.layers) == 89 and info.notes == ()
    assert info.layer_types == {"kgen": 39, "gemm": 36, "fusion": 13, "Reformat": 1}
    assert info.precisions == {"FP16": 88, "FP32": 1}
    first, last = info.layers[0], info.layers[-1]
    assert first.inputs[0].location is None and first.inputs[0].format == "Int32"
    assert first.outputs[0].format == "Half" and first.precision == "FP16"
    assert first.origin[0] == "/encoder/embedding/Gather" and len(first.origin) == 8
    assert first.tactic_name.startswith("__myl_GathGath")
    assert last.is_reformat and last.params == {"Origin": "REFORMAT", "StreamId": 0}
    assert last.tactic_value == "0x00000000000003e8" and last.origin == ()
    assert last.inputs[0].location == "Device" and last.outputs[0].name == "score"


def test_yolov8_log_both_dumps():
    text = (FIXTURES / "yolov8_qdq_trt8.4_verbose.excerpt.log").read_text()
    engine = read_oneline(text, "yolo", dump="engine")           # "Engine Layer Information" Layer(...) lines
    assert engine.verbosity == "layer_names_only" and len(engine.layers) == 2
    myelin, q = engine.layers
    assert myelin.layer_type == "Myelin" and myelin.inputs == () and len(myelin.outputs) == 5
    assert myelin.outputs[2].name == "(Unnamed Layer* 689) [Shuffle]_output" and myelin.outputs[2].dims == (1, 1, 1)
    assert q.tactic_value == "0x00000000000003ea" and q.inputs[0].name == "images"
    assert q.inputs[0].precision == "FP32" and q.outputs[0].precision == "INT8"
    layers = read_artifact(FIXTURES / "yolov8_qdq_trt8.4_verbose.excerpt.log")   # auto: the "Layers:" block wins
    assert layers.verbosity == "detailed" and len(layers.layers) == 3
    assert layers.layer_types == {"Myelin": 1, "Reformat": 1, "CaskConvolution": 1}
    assert layers.layers[1].params == {"Origin": "QDQ"} and layers.layers[1].is_reformat
    conv = layers.layers[2]
    assert conv.params["Weights"] == {"Type": "Int8", "Count": 864} and conv.params["Kernel"] == [3, 3]
    assert conv.tactic_name == "ampere_first_layer_filter3x3_imma_fwd" and conv.precision == "INT8"


def test_oneline_older_forms():
    text = ("Layer(Constant): wiliConstant-0, Tactic: 0,  -> (Unnamed Layer* 0) [Constant]_output[Float(1,4,64,512)]\n"
            "Layer(MatrixMultiply): MatMul_61, Tactic: 1, 582[Float(-8,-10,4864)], (Unnamed Layer* 13) [Shuffle]_output"
            "[Float(1,4864,256)] -> 584[Float(-8,-10,256)]\n"
            "Layer(NoOp): a, b [x], Tactic: 0x0, in, x (Half[2,3]) -> out (Int8[2,3])\n")
    const, mm, noop = read_oneline(text).layers
    assert const.inputs == () and const.outputs[0].dims == (1, 4, 64, 512) and const.tactic_value == "0"
    assert [t.name for t in mm.inputs] == ["582", "(Unnamed Layer* 13) [Shuffle]_output"] and mm.outputs[0].dynamic
    assert noop.name == "a, b [x]" and noop.inputs[0].name == "in, x" and noop.outputs[0].precision == "INT8"


def test_profile_json_4_and_5_keys():
    five = ('[\n  { "count" : 641 }\n, { "name" : "PWN(PWN(/Sub), PWN(/Div))", "timeMs" : 15.1954, "averageMs" : '
            '0.0237058, "medianMs" : 0.023296, "percentage" : 0.569632 }\n]\n')
    p = read_profile_json(five)
    assert p.count == 641 and p.records[0].median_ms == 0.023296 and p.records[0].name == "PWN(PWN(/Sub), PWN(/Div))"
    four = '[\n  { "count" : 7075 }\n, { "name" : "QuantizeLinear_2", "timeMs" : 83.9859, "averageMs" : 0.0118708, ' \
           '"percentage" : 2.91082 }\n]\n'
    p = read_profile_json(four)
    assert p.records[0].median_ms is None and p.total_average_ms == pytest.approx(0.0118708)
    raw = five.replace("PWN(PWN(/Sub), PWN(/Div))", 'say "hi"')     # trtexec does not escape names
    assert read_profile_json(raw).records[0].name == 'say "hi"'


def test_times_json_key_sets():
    cur = '[\n  { "startEnqMs" : 12.6, "endEnqMs" : 12.7, "startH2dMs" : 12.5, "endH2dMs" : 12.5, "startComputeMs" ' \
          ': 12.5, "endComputeMs" : 12.9, "startD2hMs" : 12.9, "endD2hMs" : 12.9, "h2dMs" : 0, "computeMs" : 0.45, ' \
          '"d2hMs" : 0, "latencyMs" : 0.46 }\n]\n'
    t = read_times_json(cur)
    assert t.key_set == "trt8.4+" and t.latency_ms == (0.46,) and t.compute_ms == (0.45,)
    assert read_times_json(cur.replace(" }", ', "endToEndMs" : 0.5 }')).key_set == "trt8.0-8.3"
    old = '[{"startInMs": 1, "endInMs": 1, "startComputeMs": 1, "endComputeMs": 2, "startOutMs": 2, "endOutMs": 2, ' \
          '"inMs": 0, "computeMs": 1, "outMs": 0, "latencyMs": 1, "endToEndMs": 1}]'
    assert read_times_json(old).key_set == "trt7"


def _tiny_model():
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits)


@pytest.fixture(scope="module")
def kiln_exports(tmp_path_factory):
    d = tmp_path_factory.mktemp("readers")
    engine = kiln.build(_tiny_model(), autotune=False)
    engine.save(d / "m.kiln")
    (d / "layers.json").write_text(dumps(engine.layer_info("detailed")))
    (d / "names.json").write_text(dumps(engine.layer_info("layer_names_only")))
    (d / "layers.log").write_text(oneline(engine.layer_info("detailed")))
    profiler = LayerProfiler()
    for _ in range(3):
        engine.run(engine.random_inputs(), profiler=profiler)
        profiler.end_inference()
    profiler.finish()
    (d / "profile.json").write_text(profile_json(profiler))
    (d / "times.json").write_text(times_json([InferenceTime(0.0, 1.5), InferenceTime(2.0, 2.25)]))
    return d, engine


def test_kiln_exports_round_trip(kiln_exports):
    d, engine = kiln_exports
    from_engine = read_artifact(d / "m.kiln")
    from_json = read_artifact(d / "layers.json")
    from_log = read_artifact(d / "layers.log")
    assert from_engine.source == "kiln-engine" and from_engine.verbosity == "detailed"
    assert from_engine.bindings == from_json.bindings == from_log.bindings == ("x", "y")
    assert from_engine.layers == from_json.layers
    assert [l.name for l in from_log.layers] == [l.name for l in from_json.layers] == \
        [l.name for l in engine.plan.layers]
    conv = from_json.layers[1]
    assert conv.origin == ("conv", "relu") and conv.params["Kernel"] == [3, 3]
    assert from_log.layers[1].params["Kernel"] == [3, 3] and from_log.layers[1].origin == conv.origin
    assert any(n.startswith("kiln tactic sources") for n in from_json.notes)
    exported = engine.layer_info("detailed")["Layers"]
    assert [d["Metadata"] for d in exported] == [metadata_text(l.origin) for l in engine.plan.layers]
    names = read_artifact(d / "names.json")
    assert names.verbosity == "layer_names_only" and len(names.layers) == len(engine.plan.layers)
    profile = read_artifact(d / "profile.json")
    assert isinstance(profile, Profile) and profile.count == 3
    assert [r.name for r in profile.records] == [l.name for l in engine.plan.layers]
    times = read_artifact(d / "times.json")
    assert isinstance(times, InferenceTimes) and times.latency_ms == (1.5, 0.25) and times.key_set == "trt8.4+"


def test_kiln_regions_tag_inner_layers(kiln_exports):
    _, engine = kiln_exports
    plan = engine.plan
    outer = plan.layers[0]
    region = dataclasses.replace(outer, name="{ForeignNode[conv...relu]}", op_type="Region", source="onnxruntime",
                                 tactic_name="onnxruntime.region", inner=(outer, dataclasses.replace(outer, name="x2")))
    info = engine_info_from_plan(dataclasses.replace(plan, layers=(region,) + plan.layers[1:]))
    assert [l.name for l in info.layers[:2]] == [outer.name, "x2"]
    assert [l.region for l in info.layers[:2]] == [region.name] * 2
    assert all(l.region is None for l in info.layers[2:])
    assert len(info.layers) == len(layer_info(plan)["Layers"]) + 1


def _mixed_dtype_model():
    """Conv + ReLU with a float, a bool and an int64 output."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.zeros((), np.float32), "zero")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu"),
             helper.make_node("Greater", ["y", "zero"], ["b"], name="positive"),
             helper.make_node("Cast", ["y"], ["i"], name="to_int", to=TensorProto.INT64)]
    outputs = [helper.make_tensor_value_info(name, dtype, [1, 4, 8, 8])
               for name, dtype in (("y", TensorProto.FLOAT), ("b", TensorProto.BOOL), ("i", TensorProto.INT64))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])], outputs, inits)


@pytest.mark.parametrize("winner", ["kiln", "onnxruntime"])
def test_kiln_engine_records_from_facts_equal_its_layer_info_records(tmp_path, monkeypatch, winner):
    """An engine's records come from its plan (precision from dtypes, origins, regions); its detailed layer-info
    export, read back from the prose, gives the same records: per-layer and region plans, three dtypes."""
    force_plan(monkeypatch, winner)
    engine = kiln.build(_mixed_dtype_model(), avg_timing=1, min_timing=1)
    engine.save(tmp_path / "m.kiln")
    from_engine = read_artifact(tmp_path / "m.kiln")
    from_json = read_layer_info_json(dumps(engine.layer_info("detailed")))
    assert [dataclasses.replace(l, region=None) for l in from_engine.layers] == list(from_json.layers)
    assert from_engine.notes == from_json.notes and from_engine.bindings == ("x", "y", "b", "i")
    by_name = {l.name: l for l in from_engine.layers}
    assert [t.precision for t in by_name["positive"].outputs] == ["BOOL"]
    assert [t.precision for t in by_name["to_int"].outputs] == ["INT64"]
    assert by_name["conv + relu"].origin == ("conv", "relu")
    regions = {l.region for l in from_engine.layers}
    assert regions == ({engine.plan.layers[0].name} if winner == "onnxruntime" else {None})


@pytest.mark.parametrize("content, words", [
    (b"", "empty"), (b"   \n", "empty"), (b"\x00\x01\x02junk", "binary"), (b"\xff\xfe\xfa", "UTF-8"),
    (b'{"Layers": [{"Name": "a", "LayerType"', "not valid JSON"), (b'[\n  { "count" : 3 }\n, { "name" : "a"', "JSON"),
    (b'{"foo": 1}', "Layers"), (b'{"Layers": [1, 2]}', "layer #0"), (b"[1, 2]", "not of records"),
    (b'[{"a": 1}]', "unknown kind"), (b"hello\nworld\n", "no layer dump"), (b"KILNPLAN\x00\x01", "kiln engine"),
    (b'{"Layers": ["a"], "Bindings": 3}', "Bindings"), (b'[{"latencyMs": "x", "computeMs": 1, "startH2dMs": 0}]',
                                                       "not a number"),
])
def test_bad_inputs_raise_artifact_error(tmp_path, content, words):
    p = tmp_path / "bad.json"
    p.write_bytes(content)
    with pytest.raises(ArtifactError) as exc:
        read_artifact(p)
    msg = str(exc.value)
    assert str(p) in msg and words in msg
    assert "; hint: " in msg


def test_missing_file_and_direct_reader_errors(tmp_path):
    with pytest.raises(ArtifactError, match="cannot read"):
        read_artifact(tmp_path / "nope.json")
    with pytest.raises(ArtifactError, match="not a layer-info document"):
        read_layer_info_json(json.dumps([1]), "x.json")
    with pytest.raises(ArtifactError, match="not a profile"):
        read_profile_json('{"count": 1}', "p.json")
    with pytest.raises(ArtifactError, match="latencyMs"):
        read_times_json('[{"foo": 1}]', "t.json")


def test_tolerant_layer_info_json_variants():
    doc = {"Layers": [
        {"Name": "conv [profile 1]", "LayerType": "CaskConvolution",
         "Inputs": [{"Name": "x [profile 1]", "Dimensions": [1, 3], "Format/Datatype": "Row major linear FP16 format"}],
         "Outputs": [{"Name": "y", "Dimensions": [1, 3], "Format/Datatype": "Channel major FP16 format",
                      "Extra": 1}],
         "ParameterType": "Convolution", "NewKey": {"a": 1}, "TacticValue": "0x0"},
        {"Name": "myplugin", "LayerType": "PluginV2", "Inputs": [], "Outputs": [], "ParameterType": "PluginV2",
         "TacticValue": 5},
        {"Name": "TrainStation1", "LayerType": "TrainStation", "Inputs": [], "Outputs": []}],
        "Bindings": ["x [profile 1]", "y"], "Future": True}
    info = read_layer_info_json(json.dumps(doc), "v.json")
    conv, plugin, station = info.layers
    assert conv.name == "conv [profile 1]" and conv.inputs[0].location is None and conv.precision == "FP16"
    assert conv.params == {"NewKey": {"a": 1}} and conv.tactic_value == "0x0"
    assert plugin.tactic_value == "0x0000000000000005" and station.layer_type == "TrainStation"
    assert info.bindings == ("x [profile 1]", "y") and any("Future" in n for n in info.notes)


def test_name_lines_with_prefix_and_names_only_block():
    line = ("[04/18/2025-03:51:19] [V] [TRT] Name: a, b, LayerType: NoOp, Inputs: [ { Name: in, x, Dimensions: [-1,2],"
            " Format/Datatype: N/A due to dynamic shapes }], Outputs: [], TacticValue: 0x0000000000000000, StreamId: 0,"
            " Metadata: [ONNX Layer: n, 1]\x1e[ONNX Layer: m]\r")
    (layer,) = read_oneline("other log\n[04/18/2025-03:51:19] [V] [TRT] Layers:\n" + line + "\n").layers
    assert layer.name == "a, b" and layer.inputs[0].name == "in, x" and layer.inputs[0].dynamic
    assert layer.origin == ("n, 1", "m") and layer.params == {"StreamId": 0} and layer.outputs == ()
    names = read_oneline("[01/10/2024-21:55:13] [I] Layers:\nfirst\nsecond + third\n\nBindings:\nx\ny\n")
    assert names.verbosity == "layer_names_only" and [l.name for l in names.layers] == ["first", "second + third"]
    assert names.bindings == ("x", "y")
