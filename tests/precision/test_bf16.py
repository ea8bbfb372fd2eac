"""BF16 on kiln's own kernels: with --bf16, convolutions and linear layers run oneDNN's BF16 kernels (AMX or
AVX512-BF16) where the CPU has native BF16 arithmetic, say so in layer info, stay within cosine 0.999 of
onnxruntime's FP32 outputs, and fall back (one warning per kernel) when loaded on a CPU without it."""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from kiln import hardware
from kiln.tactics.onednn_conv import bf16_available
from kiln.tactics.registry import TACTICS_BY_NAME, reduced_precisions
from tests.conftest import cosine, init, make_model, rand, run_ort
from tests.precision.models import conv_net, transformer_net

pytestmark = pytest.mark.skipif(not bf16_available(), reason="this CPU has no native BF16 arithmetic (AVX512-BF16 "
                                "or AMX): --bf16 is denied per layer here, as tests/precision/test_qdq.py checks")


# kiln's BF16 kernels: oneDNN's through torch, kiln's own on vdpbf16ps or AMX tiles (Winograd with bf16 storage
# among them), torch's for layers that only move data. The autotuner picks one per layer by timing (conv_net's conv2
# races oneDNN's, the direct and the Winograd kernel; AMX CPUs add the AMX GEMMs): any of them may win
BF16_TACTICS = frozenset(name for name, tactic in TACTICS_BY_NAME.items() if "BF16" in reduced_precisions(tactic))


def run_both(model, engine, seed: int = 0):
    name, dims = engine.input_names[0], engine.plan.inputs[0].dims
    x = np.random.default_rng(seed).standard_normal(dims).astype(np.float32)
    return engine.run({name: x})[engine.output_names[0]], run_ort(model, {name: x})[0]


@pytest.mark.parametrize("make, bf16_layers", [
    (conv_net, {"conv1 + relu1", "conv2 + relu2", "fc", "head"}),
    (transformer_net, {"q_proj || k_proj || v_proj", "k_t + scores + scale_mul + softmax + attn",
                       "o_proj + residual1", "ffn2 + residual2", "ln"}),   # the residual Adds in the products' stores
])
def test_bf16_is_granted_on_kiln_kernels_and_stays_close_to_fp32(make, bf16_layers):
    model = make()
    engine = kiln.build(model, bf16=True, precision_constraints="prefer")   # prefer: BF16 wherever a kernel exists
    layers = {l["Name"]: l for l in engine.layer_info()["Layers"]}
    granted = {n for n, l in layers.items() if l.get("GrantedPrecision") == "BF16"}
    assert bf16_layers <= granted
    for name in granted:
        assert layers[name]["RequestedPrecision"] == "BF16" and "PrecisionReason" not in layers[name]
        assert layers[name]["TacticName"] in BF16_TACTICS
    denied = [l for l in layers.values() if l.get("RequestedPrecision") == "BF16" and l["GrantedPrecision"] == "FP32"]
    assert all(l["PrecisionReason"].startswith("kiln has no BF16 kernel for ") for l in denied)
    got, want = run_both(model, engine)
    assert cosine(got, want) >= 0.999


def test_bf16_is_allowed_not_required_a_faster_fp32_kernel_keeps_the_layer_fp32(monkeypatch):
    """TensorRT's semantics without constraints: --bf16 lets BF16 kernels race the FP32 ones; where FP32 wins
    the layer is granted FP32 and the reason gives both times."""
    from kiln.tactics.autotune import Autotuner

    def measure(self, view, tactics, signature, have, dying):
        return {t.name: (2.0 if t.name.endswith("_bf16") else 1.0) for t in tactics}
    monkeypatch.setattr(Autotuner, "_measure", measure)
    engine = kiln.build(conv_gemm_net(), bf16=True, tactic_sources="-onnxruntime,-openvino")
    convs = [l for l in engine.plan.layers if l.op_type == "Conv"]
    assert convs and all(l.precision == "FP32" and l.requested_precision == "BF16" for l in convs)
    # the FP32 kernel's time may carry the bf16/FP32 conversions its choice costs the BF16 neighbours
    timed = re.compile(r"the FP32 kernel \S+ timed faster \(1 ms( \+ [0-9.e-]+ ms conversions, reformats and "
                       r"hand-overs)? against 2 ms for onednn.conv2d_(primitive|nhwc_prepacked)_bf16\)")
    assert all(timed.fullmatch(l.precision_reason) for l in convs)
    monkeypatch.setattr(Autotuner, "_measure", lambda self, view, tactics, *a: {
        t.name: (0.5 if t.name.endswith("_bf16") else 1.0) for t in tactics})
    engine = kiln.build(conv_gemm_net(), bf16=True, tactic_sources="-onnxruntime,-openvino")
    assert {l.precision for l in engine.plan.layers if l.op_type == "Conv"} == {"BF16"}


def test_best_allows_bf16_and_keeps_qdq_layers_int8():
    engine = kiln.build(conv_net(), best=True, precision_constraints="prefer", autotune=False)
    assert {l.requested_precision for l in engine.plan.layers if l.op_type in ("Conv", "MatMul", "Gemm")} == {"BF16"}
    assert {l.precision for l in engine.plan.layers if l.op_type == "Conv"} == {"BF16"}


def test_the_default_build_stays_fp32():
    engine = kiln.build(conv_net(), autotune=False)
    assert {l.precision for l in engine.plan.layers} == {"FP32"}
    assert not any(l.tactic_name.endswith("_bf16") for l in engine.plan.layers)


def conv_gemm_net():
    """Conv+ReLU -> Conv (residual) -> Flatten-free head: only layers with BF16 kernels, so `obey` can be met."""
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    inits = [init("w1", rand((8, 4, 3, 3), 1) * 0.3), init("b1", rand((8,), 2) * 0.1),
             init("w2", rand((8, 8, 3, 3), 3) * 0.2), init("b2", rand((8,), 4) * 0.1)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 12, 12])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 12, 12])], inits)


def test_obey_is_met_where_every_layer_has_a_bf16_kernel_and_fails_where_one_has_not():
    model = conv_gemm_net()
    engine = kiln.build(model, bf16=True, precision_constraints="obey", autotune=False)
    assert {l.precision for l in engine.plan.layers if l.op_type == "Conv"} == {"BF16"}
    got, want = run_both(model, engine)
    assert cosine(got, want) >= 0.999
    with pytest.raises(kiln.ModelError, match=r"layer 'sumpool' \(Einsum\): --precision-constraints obey "
                                              r"asks for BF16, which kiln cannot give: kiln has no BF16 kernel"):
        kiln.build(conv_net(pool="Einsum"), bf16=True, precision_constraints="obey")


def test_an_engine_with_bf16_kernels_runs_in_fp32_where_the_cpu_lacks_bf16(tmp_path, monkeypatch, caplog):
    model = conv_net()
    engine = kiln.build(model, bf16=True, autotune=False)
    path = tmp_path / "bf16.kiln"
    engine.save(path)
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2", "avx512f"}))
    with pytest.raises(kiln.EngineFormatError, match=r"with (\w+, )*avx512_bf16(, \w+)*, which this CPU lacks"):
        kiln.load(path)
    caplog.set_level(logging.WARNING, logger="kiln.runtime")
    loaded = kiln.load(path, allow_other_device=True)
    got, want = run_both(model, loaded)
    # the reference kernels compute in FP32; the tensors the plan stores in bf16 between layers stay bf16
    stored = [t.name for layer in loaded.plan.layers for t in layer.outputs if t.dtype == "bfloat16"]
    assert stored, "the BF16 build stores some tensors in bf16"
    assert cosine(got, want) > 0.9999
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)
    warned = [r.getMessage() for r in caplog.records if "this CPU lacks it" in r.getMessage()]
    assert len(warned) == 2 and all("avx512_bf16 or amx_bf16" in m for m in warned)   # one per BF16 kernel


def test_an_openvino_region_joins_a_bf16_build_at_bf16_and_reports_what_each_layer_ran_in(monkeypatch, tmp_path,
                                                                                           caplog):
    """Allowed BF16 (no constraints): the whole graph as one OpenVINO region compiled at bf16 races kiln's plan;
    its inner layers are granted what OpenVINO's execution graph ran them in, and the engine reloads at bf16."""
    pytest.importorskip("openvino")
    from kiln.tactics.autotune import Autotuner
    from tests.conftest import force_plan

    monkeypatch.setattr(Autotuner, "_measure", lambda self, view, tactics, *a: {
        t.name: (0.5 if t.name.endswith("_bf16") else 1.0) for t in tactics})   # kiln's plan keeps its BF16 layers
    force_plan(monkeypatch, "openvino")
    model = conv_net()
    engine = kiln.build(model, bf16=True, tactic_sources="-onnxruntime")
    (region,) = [l for l in engine.plan.layers if l.inner]
    assert region.tactic_name == "openvino.region" and region.attrs == {"precision": "bf16"}
    convs = [i for i in region.inner if i.op_type == "Conv"]
    assert convs and all(i.precision == "BF16" and i.requested_precision == "BF16" for i in convs)
    info = {l["Name"]: l for l in engine.layer_info()["Layers"]}
    first = info[convs[0].name]
    assert (first["GrantedPrecision"], first["LayerType"]) == ("BF16", "OpenVINOConvolution")
    got, want = run_both(model, engine)
    assert cosine(got, want) >= 0.999
    engine.save(tmp_path / "ov.kiln")
    again, _ = run_both(model, kiln.load(tmp_path / "ov.kiln"))
    np.testing.assert_array_equal(again, got)
    caplog.set_level(logging.INFO, logger="kiln.build")
    strict = kiln.build(model, bf16=True, precision_constraints="prefer", tactic_sources="-onnxruntime")
    assert not any(l.inner for l in strict.plan.layers)
    assert "precision constraints ask for kiln's BF16 kernels" in caplog.text


def half_quantized_net():
    """conv1 between Q/DQ pairs (INT8 by the model), conv2 plain FP32: what --int8 --bf16 must split."""
    h = helper.make_node
    w1 = np.clip(np.round(rand((8, 4, 3, 3), 1) * 60), -127, 127).astype(np.int8)
    nodes = [h("QuantizeLinear", ["x", "sx", "zx"], ["xq"], name="x_q"),
             h("DequantizeLinear", ["xq", "sx", "zx"], ["xd"], name="x_dq"),
             h("DequantizeLinear", ["w1q", "sw"], ["w1"], name="w1_dq"),
             h("Conv", ["xd", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             h("Relu", ["c1"], ["r1"], name="relu1"),
             h("Conv", ["r1", "w2", "b2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    inits = [init("sx", np.array(0.02, np.float32)), helper.make_tensor("zx", TensorProto.INT8, [], [0]),
             helper.make_tensor("w1q", TensorProto.INT8, list(w1.shape), w1.flatten().tolist()),
             init("sw", np.array(0.005, np.float32)), init("b1", rand((8,), 2) * 0.1),
             init("w2", rand((8, 8, 3, 3), 3) * 0.2), init("b2", rand((8,), 4) * 0.1)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 12, 12])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 12, 12])], inits)


@pytest.mark.parametrize("make, int8_layers", [(conv_gemm_net, 0), (half_quantized_net, 1)])
def test_int8_with_bf16_runs_what_int8_cannot_in_bf16(make, int8_layers, caplog):
    """TensorRT's --int8 --fp16: a layer INT8 cannot run (no Q/DQ scale, no --calib) falls back to the other
    precision allowed, not to FP32, and says so."""
    model = make()
    engine = kiln.build(model, int8=True, bf16=True, precision_constraints="prefer", autotune=False)
    convs = [l for l in engine.plan.layers if l.op_type in ("Conv", "QConv")]
    assert sum(l.precision == "INT8" for l in convs) == int8_layers
    fallen = [l for l in convs if l.precision != "INT8"]
    assert fallen and all(l.precision == "BF16" and l.requested_precision == "INT8" for l in fallen)
    assert all(l.precision_reason == "no input scale: INT8 needs Q/DQ around the layer or calibration "
               "(--int8 --calib); it runs in BF16, also allowed" for l in fallen)
    got, want = run_both(model, engine)
    assert cosine(got, want) >= 0.999
    plain = kiln.build(model, int8=True, precision_constraints="prefer", autotune=False)   # --int8 alone: FP32
    assert {l.precision for l in plain.plan.layers if l.op_type == "Conv"} == {"FP32"}
    granted_none = "INT8 was asked for by 2 layer(s) and granted to none: no input scale"   # one warning, not per layer
    assert (granted_none in caplog.text) == (int8_layers == 0)


def test_fp16_with_bf16_takes_bf16_where_fp16_is_denied():
    """--fp16 --bf16: FP16 is asked for (as trtexec's --fp16 wins); on a CPU without FP16 arithmetic the layer is
    granted BF16, the other precision allowed, not FP32."""
    engine = kiln.build(conv_gemm_net(), fp16=True, bf16=True, precision_constraints="prefer", autotune=False)
    convs = [l for l in engine.plan.layers if l.op_type == "Conv"]
    assert convs and all(l.requested_precision == "FP16" and l.precision in ("FP16", "BF16") for l in convs)
    assert all(l.precision_reason == "this CPU has no native FP16 arithmetic; it runs in BF16"
               for l in convs if l.precision == "BF16")
