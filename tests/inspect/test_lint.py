"""Lint rules on hand-built engines (a positive and a negative case per rule) and on the real TensorRT fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest

from kiln.inspect.lint import Finding, lint, tactic_types
from kiln.trt.records import EngineInfo, LayerRecord, Profile, ProfileRecord, TensorInfo

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
I8_32 = "Thirty-two wide channel vectorized row major Int8 format"
FP32 = "Row major linear FP32"
FP16 = "Row major linear FP16 format"


def t(name, dims=(1, 64, 8, 8), fmt=I8_32):
    return TensorInfo(name, tuple(dims), fmt, "Device")


def conv(name, inp, out, in_fmt=I8_32, out_fmt=I8_32, tactic="sm80_xmma_fprop_implicit_gemm_i8i8_i8i32_f32_nchw",
         in_dims=(1, 64, 8, 8), out_dims=(1, 64, 8, 8), **params):
    return LayerRecord(name, "CaskConvolution", "Convolution", (t(inp, in_dims, in_fmt),),
                       (t(out, out_dims, out_fmt),), dict(params), tactic, "0x1", (name,))


def layer(name, layer_type, inp, out, in_fmt, out_fmt, parameter_type=None, dims=(1, 64, 8, 8), **params):
    return LayerRecord(name, layer_type, parameter_type, (t(inp, dims, in_fmt),), (t(out, dims, out_fmt),),
                       dict(params))


def engine(*layers, verbosity="detailed", bindings=()):
    return EngineInfo("test", verbosity, tuple(layers), tuple(bindings))


def profile(times: dict[str, float]) -> Profile:
    total = sum(times.values()) or 1.0
    return Profile(10, tuple(ProfileRecord(n, v * 10, v, v, 100 * v / total) for n, v in times.items()))


def rules(findings: list[Finding], rule_id: str) -> list[Finding]:
    return [f for f in findings if f.rule_id == rule_id]


def int8_chain(*middle):
    """input -> conv0 (INT8) -> middle... -> conv9 (INT8) -> output, all INT8 unless the middle says otherwise."""
    return [conv("conv0", "x", "a0"), *middle, conv("conv9", "a1", "y")]


def test_tactic_types_decodes_type_groups():
    assert tactic_types("sm80_xmma_fprop_implicit_gemm_interleaved_i8f32_i8i32_f32_nchw") == ("INT8", "FP32")
    assert tactic_types("sm80_xmma_gemm_f16f16_f16f16_f16_nn_n_tilesize32x32x64") == ("FP16", "FP16")
    assert tactic_types("sm80_xmma_fprop_avdt_sparse_int8int8_tilesize64x64x64") == ("INT8", "INT8")
    assert tactic_types("__myl_GathGathMulAdd_0xd6fb") is None


def test_findings_are_a_list_of_frozen_records_and_rules_do_not_overwrite():
    bad = conv("c1", "a0", "a1", out_fmt=FP32, tactic="sm70_xmma_fprop_conv1x1_i8f32_f32_f32_nchw_simt_small")
    found = lint(engine(*int8_chain(bad)))
    assert isinstance(found, list) and all(isinstance(f, Finding) for f in found)
    assert {f.rule_id for f in found if f.layer == "c1"} >= {"INT8_FLOAT_OUTPUT", "CONV_NO_TENSOR_CORES"}
    with pytest.raises(Exception):
        found[0].severity = "error"


def test_int8_float_output_positive_and_negative():
    bad = conv("c1", "a0", "a1", out_fmt=FP32, Weights={"Type": "Int8", "Count": 10})
    [f] = rules(lint(engine(*int8_chain(bad))), "INT8_FLOAT_OUTPUT")
    assert f.layer == "c1" and f.severity == "warning" and "FP32" in f.hazard and "a1" in f.hazard
    assert "QuantizeLinear/DequantizeLinear" in f.mitigation and "a1" in f.mitigation and "c1" in f.mitigation
    assert not rules(lint(engine(*int8_chain(conv("c1", "a0", "a1")))), "INT8_FLOAT_OUTPUT")
    fp16 = conv("c1", "a0", "a1", in_fmt=FP16, out_fmt=FP16, tactic="sm80_xmma_fprop_f16f16_f16f16_f16_hmma")
    assert not rules(lint(engine(fp16)), "INT8_FLOAT_OUTPUT")


def test_int8_float_output_from_tactic_name_when_formats_are_dynamic():
    na = "N/A due to dynamic shapes"
    dyn = conv("c1", "a0", "a1", in_fmt=na, out_fmt=na, tactic="sm80_xmma_fprop_implicit_gemm_interleaved_i8f32_i8i32")
    [f] = rules(lint(engine(dyn)), "INT8_FLOAT_OUTPUT")
    assert "i8f32" in f.hazard
    same = conv("c1", "a0", "a1", in_fmt=na, out_fmt=na, tactic="sm80_xmma_fprop_implicit_gemm_interleaved_i8i8_i8i32")
    assert not rules(lint(engine(same)), "INT8_FLOAT_OUTPUT")


def test_conv_no_tensor_cores_positive_and_negative():
    simt = conv("c1", "a0", "a1", tactic="sm70_xmma_fprop_conv1x1_i8i8_f32_f32_nchw_simt_small")
    cudnn = conv("c2", "a1", "a2", tactic="cudnn_convolution_fwd_generic")
    found = rules(lint(engine(*int8_chain(simt, cudnn))), "CONV_NO_TENSOR_CORES")
    assert [f.layer for f in found] == ["c1", "c2"]
    ok = conv("c1", "a0", "a1", tactic="sm80_xmma_fprop_implicit_gemm_imma_i8i8")
    assert not rules(lint(engine(*int8_chain(ok))), "CONV_NO_TENSOR_CORES")
    fp32 = conv("c1", "a0", "a1", in_fmt=FP32, out_fmt=FP32, tactic="sm70_fprop_f32f32_simt")
    assert not rules(lint(engine(fp32)), "CONV_NO_TENSOR_CORES")   # an FP32 engine: SIMT is expected


def test_channels_not_aligned_positive_and_negative():
    odd16 = conv("c1", "x", "y", in_fmt=FP16, out_fmt=FP16, in_dims=(1, 3, 32, 32), out_dims=(1, 20, 32, 32))
    [f] = rules(lint(engine(odd16)), "CHANNELS_NOT_ALIGNED")
    assert f.severity == "info" and "3 channels" in f.hazard and "20 channels" in f.hazard
    assert "multiple of 8" in f.hazard
    odd8 = conv("c1", "x", "y", in_dims=(1, 48, 8, 8))
    assert "multiple of 32" in rules(lint(engine(odd8)), "CHANNELS_NOT_ALIGNED")[0].hazard
    four = conv("c1", "x", "y", in_fmt="Four wide channel vectorized row major Int8 format", in_dims=(1, 48, 8, 8))
    assert not rules(lint(engine(four)), "CHANNELS_NOT_ALIGNED")
    assert not rules(lint(engine(conv("c1", "x", "y"))), "CHANNELS_NOT_ALIGNED")


def test_reformat_changes_type_positive_and_negative():
    r = layer("Reformatting CopyNode for Input Tensor 0 to c9", "Reformat", "a0", "a1", FP16, I8_32, "Reformat")
    found = rules(lint(engine(*int8_chain(r))), "REFORMAT_CHANGES_TYPE")
    assert len(found) == 1 and found[0].severity == "warning" and "FP16 to INT8" in found[0].hazard
    edge = layer("Reformatting CopyNode for Input Tensor 0 to c0", "Reformat", "x", "x2", FP32, I8_32, "Reformat")
    assert rules(lint(engine(edge, conv("conv0", "x2", "y"), bindings=("x", "y"))), "REFORMAT_CHANGES_TYPE")[0] \
        .severity == "info"
    same = layer("Reformatting CopyNode for Input Tensor 0 to c9", "Reformat", "a0", "a1", I8_32,
                 "Four wide channel vectorized row major Int8 format", "Reformat")
    assert not rules(lint(engine(*int8_chain(same))), "REFORMAT_CHANGES_TYPE")


def test_qdq_unfused_positive_and_negative():
    by_origin = layer("q0", "Reformat", "a0", "a1", I8_32, I8_32, "Reformat", Origin="QDQ")
    by_name = layer("/model.3/act/DequantizeLinear", "Scale", "a1", "a2", I8_32, FP16)
    found = rules(lint(engine(*int8_chain(by_origin, by_name))), "QDQ_UNFUSED")
    assert [f.layer for f in found] == ["q0", "/model.3/act/DequantizeLinear"]
    assert "QuantizeLinear/DequantizeLinear" in found[0].mitigation
    fused = conv("/m/conv + /m/QuantizeLinear_3 + /m/DequantizeLinear_4", "a0", "a1")
    assert not rules(lint(engine(*int8_chain(fused))), "QDQ_UNFUSED")


def test_reformat_time_share_positive_and_negative():
    r = layer("Reformatting CopyNode for Input Tensor 0 to conv9", "Reformat", "a0", "a1", I8_32, I8_32, "Reformat")
    e = engine(*int8_chain(r))
    [f] = rules(lint(e, profile({"conv0": 1.0, r.name: 0.5, "conv9": 1.0})), "REFORMAT_TIME_SHARE")
    assert f.layer is None and "20.0%" in f.hazard and r.name in f.hazard
    assert not rules(lint(e, profile({"conv0": 1.0, r.name: 0.01, "conv9": 1.0})), "REFORMAT_TIME_SHARE")
    assert not rules(lint(e), "REFORMAT_TIME_SHARE")


def test_fp32_in_reduced_engine_positive_cap_and_negative():
    fp32 = layer("softmax", "CaskSoftMax", "a0", "a1", FP32, FP32, "SoftMax")
    base = [conv(f"c{i}", f"x{i}", f"y{i}") for i in range(3)]
    [f] = rules(lint(engine(*base, fp32)), "FP32_IN_REDUCED_ENGINE")
    assert f.layer == "softmax" and "mostly-INT8" in f.hazard
    many = [layer(f"s{i}", "CaskSoftMax", f"p{i}", f"q{i}", FP32, FP32) for i in range(25)]
    found = rules(lint(engine(*[conv(f"c{i}", f"x{i}", f"y{i}") for i in range(30)], *many)), "FP32_IN_REDUCED_ENGINE")
    assert len(found) == 21 and found[-1].layer is None and "25 in all" in found[-1].hazard
    shuffle = layer("reshape", "NoOp", "a0", "a1", FP32, FP32)
    assert not rules(lint(engine(*base, shuffle)), "FP32_IN_REDUCED_ENGINE")
    assert not rules(lint(engine(fp32, layer("s2", "CaskSoftMax", "b", "c", FP32, FP32))), "FP32_IN_REDUCED_ENGINE")


def _region(i):
    return LayerRecord(f"{{ForeignNode[/l{i}/MatMul.../l{i}/Add]}}", "Myelin", None,
                       (t(f"r{i}", fmt=I8_32),), (t(f"r{i + 1}q", fmt=FP16),))


def test_qdq_splits_region_positive_and_negative():
    parts = []
    for i in range(3):
        parts += [_region(i), layer(f"/l{i}/QuantizeLinear", "Reformat", f"r{i + 1}q", f"r{i + 1}", FP16, I8_32,
                                    "Reformat", Origin="QDQ")]
    [f] = rules(lint(engine(*parts)), "QDQ_SPLITS_REGION")
    assert f.layer is None and "3 Myelin/ForeignNode regions" in f.hazard
    plain = [_region(0), layer("shuffle", "NoOp", "r1q", "r1", FP16, FP16), _region(1)]
    assert not rules(lint(engine(*plain)), "QDQ_SPLITS_REGION")


def test_tiny_layers_positive_and_negative():
    layers = [conv(f"c{i}", f"x{i}", f"y{i}") for i in range(30)]
    tiny = profile({f"c{i}": (0.005 if i < 20 else 0.5) for i in range(30)})
    [f] = rules(lint(engine(*layers), tiny), "TINY_LAYERS")
    assert "20 of 30" in f.hazard and "--useCudaGraph" in f.mitigation
    assert not rules(lint(engine(*layers), profile({f"c{i}": 0.5 for i in range(30)})), "TINY_LAYERS")


def test_names_only_input_positive_and_negative():
    names = engine(LayerRecord("conv0"), LayerRecord("conv1"), verbosity="layer_names_only")
    found = lint(names)
    assert [f.rule_id for f in found] == ["NAMES_ONLY_INPUT"]
    assert "--profilingVerbosity=detailed" in found[0].mitigation and "formats" in found[0].hazard
    assert not rules(lint(engine(conv("c", "x", "y"))), "NAMES_ONLY_INPUT")


# --- the real fixtures, through the readers -------------------------------------------------------------------------

def _read(name):
    readers = pytest.importorskip("kiln.trt.artifacts")
    return readers.read_artifact(FIXTURES / name)


def test_fixture_dynamic_int8_conv_with_fp32_output():
    found = lint(_read("conv_dynamic_int8_fp32out_trt8.layers.json"))
    [f] = rules(found, "INT8_FLOAT_OUTPUT")
    assert f.layer == "(Unnamed Layer* 1) [Convolution]"
    assert "FP32" in f.hazard and "i8f32" in f.hazard
    assert "QuantizeLinear/DequantizeLinear pair after (Unnamed Layer* 1) [Convolution]'s output" in f.mitigation
    assert "(Unnamed Layer* 1) [Convolution]_output" in f.mitigation


def test_fixture_resnet18_detailed_findings_pinned():
    found = lint(_read("resnet18_trt10_detailed.layers.json"))
    dense = "resnetv15_dense0_fwd + (Unnamed Layer* 78) [ElementWise]"
    conv0 = "resnetv15_conv0_fwd + resnetv15_batchnorm0_fwd + resnetv15_relu0_fwd + resnetv15_pool0_fwd"
    got = [(f.rule_id, f.layer, f.severity) for f in found]
    assert got == [("INT8_FLOAT_OUTPUT", dense, "warning"),
                   ("CONV_NO_TENSOR_CORES", dense, "warning"),
                   ("CHANNELS_NOT_ALIGNED", conv0, "info"),
                   ("REFORMAT_CHANGES_TYPE", f"Reformatting CopyNode for Input Tensor 0 to {conv0}", "info")]
    assert "engine output" in found[0].hazard            # the classifier's FP32 logits feed the output binding
    assert "simt" in found[1].hazard and "3 channels" in found[2].hazard and "FP32 to INT8" in found[3].hazard


def test_fixture_resnet18_names_only():
    found = lint(_read("resnet18_trt10_names_only.layers.json"))
    assert [f.rule_id for f in found] == ["NAMES_ONLY_INPUT"]


def test_fixture_bert_dumps():
    detailed = lint(_read("bert_fp16_trt10.10_detailed.oneline.log"))
    assert [(f.rule_id, f.severity) for f in detailed] == [("REFORMAT_CHANGES_TYPE", "info")]   # Half -> Float score
    names = lint(_read("bert_fp16_trt10.10_names_only.oneline.log"))
    assert [f.rule_id for f in names] == ["NAMES_ONLY_INPUT", "REFORMAT_CHANGES_TYPE"]
