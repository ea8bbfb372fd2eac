"""Lint findings grouped by cause: trex's INT8 MobileNet engine (TensorRT's own test input) with and without its
profile, and hand-built engines for the joining rules."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from kiln.inspect.causes import group_by_cause
from kiln.inspect.lint import Finding, lint
from kiln.trt.artifacts import read_artifact
from kiln.trt.records import EngineInfo, LayerRecord, TensorInfo

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GRAPH = FIXTURES / "mobilenet.qat.onnx.engine.graph.json"
PROFILE = FIXTURES / "mobilenet.qat.onnx.engine.profile.json"


def _profile_ms() -> dict[str, float]:
    """averageMs per layer, read from the JSON directly (not through kiln's reader)."""
    return {r["name"]: r["averageMs"] for r in json.loads(PROFILE.read_text()) if "name" in r}


def test_mobilenet_flat_findings_and_tensor_core_tactics():
    found = lint(read_artifact(GRAPH))
    assert len(read_artifact(GRAPH).layers) == 73
    assert Counter(f.rule_id for f in found) == {"INT8_FLOAT_OUTPUT": 17, "REFORMAT_CHANGES_TYPE": 17,
                                                 "QDQ_UNFUSED": 17, "CHANNELS_NOT_ALIGNED": 9,
                                                 "CONV_NO_TENSOR_CORES": 2}
    # turing_fp16_i8816cudnn_* runs IMMA (m8n8k16) on tensor cores; int8x4 (dp4a) and simt kernels do not
    tactics = {f.hazard.split("tactic ")[1].split()[0] for f in found if f.rule_id == "CONV_NO_TENSOR_CORES"}
    assert tactics == {"volta_int8x4_icudnn_int8x4_128x32_relu_xregs_medium_c32_nn_v1",
                       "sm70_xmma_fprop_conv1x1_i8f32_f32_f32_nchw_vect_c_4kcrs_vect_c_4_nchw_simt_small_batch_bias_relu"}


def test_mobilenet_causes_ranked_by_time_at_stake():
    engine, profile = read_artifact(GRAPH), read_artifact(PROFILE)
    findings = lint(engine, profile)
    causes = group_by_cause(engine, findings, profile)
    assert sum(c.num_findings for c in causes) == len(findings) == 64
    assert [c.cause_id for c in causes] == ["INT8_FLOAT_OUTPUT", "REFORMAT_TIME_SHARE", "CHANNELS_NOT_ALIGNED",
                                            "CONV_NO_TENSOR_CORES", "INT8_FLOAT_OUTPUT", "REFORMAT_CHANGES_TYPE",
                                            "REFORMAT_CHANGES_TYPE", "TINY_LAYERS"]
    top = causes[0]
    convs = [n for n in top.layers if "Conv_" in n]
    reformats = [n for n in top.layers if n.startswith("QuantizeLinear_")]
    assert len(convs) == 16 and len(reformats) == 15 and len(top.layers) == 31
    assert top.rule_ids == ("INT8_FLOAT_OUTPUT", "REFORMAT_CHANGES_TYPE", "QDQ_UNFUSED") and top.num_findings == 46
    assert top.summary.startswith("16 INT8 layers write a float output") and "15 Q/DQ reformats" in top.summary
    assert "QuantizeLinear_98" in reformats and "features.2.conv.2.weight + QuantizeLinear_90 + Conv_94" in convs
    times = _profile_ms()
    assert abs(top.time_ms - sum(times[n] for n in top.layers)) < 1e-9
    assert abs(top.time_percent - 100 * top.time_ms / sum(times.values())) < 1e-9
    assert [c.time_ms for c in causes[:-1]] == sorted((c.time_ms for c in causes[:-1]), reverse=True)
    # the classifier's float logits feed the engine output: a cause of its own (often intended)
    assert causes[4].layers == ("classifier.1.weight + QuantizeLinear_860 + Gemm_864 + classifier.1.bias + "
                                "(Unnamed Layer* 849) [Shuffle] + unsqueeze_node_after_classifier.1.bias + "
                                "(Unnamed Layer* 849) [Shuffle]_(Unnamed Layer* 849) [Shuffle]_output + "
                                "(Unnamed Layer* 850) [ElementWise]",)
    assert causes[-1].time_ms is None and causes[-1].layers == ()     # launch-bound: no per-layer time at stake


def test_mobilenet_causes_without_profile_rank_by_severity_then_size():
    engine = read_artifact(GRAPH)
    causes = group_by_cause(engine, lint(engine))
    assert all(c.time_ms is None for c in causes)
    assert [(c.cause_id, c.severity, len(c.layers)) for c in causes] == [
        ("INT8_FLOAT_OUTPUT", "warning", 31), ("CONV_NO_TENSOR_CORES", "warning", 2),
        ("INT8_FLOAT_OUTPUT", "warning", 1), ("REFORMAT_CHANGES_TYPE", "warning", 1),
        ("REFORMAT_CHANGES_TYPE", "warning", 1), ("CHANNELS_NOT_ALIGNED", "info", 9)]


I8 = "Thirty-two wide channel vectorized row major Int8 format"
FP32 = "Row major linear FP32"


def _layer(name, layer_type, inp, out, in_fmt, out_fmt, **params):
    dims = (1, 64, 8, 8)
    return LayerRecord(name, layer_type, "Convolution" if layer_type == "CaskConvolution" else "Reformat",
                       (TensorInfo(inp, dims, in_fmt),), (TensorInfo(out, dims, out_fmt),), dict(params),
                       "sm80_xmma_fprop_implicit_gemm_i8i8_i8i32_f32" if layer_type == "CaskConvolution" else None)


def test_requantizing_reformat_joins_the_layer_that_wrote_float():
    engine = EngineInfo("t", "detailed", (
        _layer("conv0", "CaskConvolution", "x", "a", I8, FP32, Weights={"Type": "Int8", "Count": 9}),
        _layer("q1", "Reformat", "a", "b", FP32, I8, Origin="QDQ"),
        _layer("conv2", "CaskConvolution", "b", "y", I8, I8)), ())
    findings = lint(engine)
    assert {(f.rule_id, f.layer) for f in findings} >= {("INT8_FLOAT_OUTPUT", "conv0"),
                                                         ("REFORMAT_CHANGES_TYPE", "q1"), ("QDQ_UNFUSED", "q1")}
    [cause] = [c for c in group_by_cause(engine, findings) if c.cause_id == "INT8_FLOAT_OUTPUT"]
    assert cause.layers == ("conv0", "q1") and cause.num_findings == 3
    assert "1 Q/DQ reformats after them quantize those outputs again" in cause.summary


def test_engine_wide_findings_carry_their_layers_and_one_rule_never_swallows_another():
    a = Finding("REFORMAT_TIME_SHARE", None, "warning", "h", "m", ("r1", "r2"))
    b = Finding("CHANNELS_NOT_ALIGNED", "c1", "info", "h2", "m2")
    engine = EngineInfo("t", "detailed", (), ())
    causes = group_by_cause(engine, [b, a])
    assert [(c.cause_id, c.layers, c.num_findings) for c in causes] == [
        ("REFORMAT_TIME_SHARE", ("r1", "r2"), 1), ("CHANNELS_NOT_ALIGNED", ("c1",), 1)]
