"""Precision is a build stage before lowering: an impossible `obey` request fails before any timing, a granted
reduced precision selects the tactics that compute in it, and the timing cache keeps precisions apart."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kiln
from kiln import hardware
from kiln.precision.policy import OUTPUT_TAIL, PrecisionDecision, PrecisionOptions, decide, output_tail
from kiln.tactics import registry
from kiln.tactics.autotune import layer_signature
from kiln.tactics.base import LINEAR, LayerView
from tests.passes.ir_builder import IRBuilder
from tests.precision.models import conv_net, transformer_net


class ClockThatMustNotBeRead:
    def now_ms(self) -> float:
        raise AssertionError("a tactic or plan was timed before the precision stage refused the build")


@pytest.mark.parametrize("make_model", [lambda: conv_net(pool="Einsum"), lambda: transformer_net(pooled=True)],
                         ids=["conv", "transformer"])
def test_an_impossible_obey_request_fails_before_any_timing(make_model):
    with pytest.raises(kiln.ModelError, match=r"layer '[^']+' \(\w+\): --precision-constraints obey asks for BF16, "
                                              r"which kiln cannot give: "):
        kiln.build(make_model(), bf16=True, precision_constraints="obey", clock=ClockThatMustNotBeRead())


def test_prefer_falls_back_with_the_reason_recorded_per_layer(monkeypatch):
    isa = hardware.cpu_isa() - {"avx512_fp16"}
    monkeypatch.setattr(hardware, "cpu_isa", lambda: isa)   # a CPU without FP16 arithmetic (AVX512-FP16 grants it)
    engine = kiln.build(conv_net(), fp16=True, precision_constraints="prefer", autotune=False)
    convs = [l for l in engine.plan.layers if l.op_type == "Conv"]
    assert convs and all(l.requested_precision == "FP16" and l.precision == "FP32" for l in convs)
    assert all("FP16" in l.precision_reason for l in convs)


def test_decide_grants_a_reduced_precision_only_where_a_kernel_offers_it():
    b = IRBuilder()
    g = b.graph(b.node("MatMul", [b.input("x", (4, 8)), b.const("w", np.ones((8, 8)))], "y", (4, 8), name="mm"))
    asked = []

    def offers(n, precision):
        asked.append((n.name, precision))
        return precision == "BF16"
    bf16 = decide(g.nodes, PrecisionOptions(bf16=True), offers, support={"BF16": True, "FP16": False})
    assert bf16 == {"mm": PrecisionDecision("BF16", "BF16", "")} and asked == [("mm", "BF16")]
    fp16 = decide(g.nodes, PrecisionOptions(fp16=True), offers, support={"BF16": True, "FP16": False})
    assert fp16["mm"].granted == "FP32" and fp16["mm"].reason.startswith("this CPU has no native FP16 arithmetic")
    asked.clear()
    plain = decide(g.nodes, PrecisionOptions(), offers)
    assert plain == {"mm": PrecisionDecision("FP32", "FP32", "")} and asked == []   # native requests ask nothing


def test_a_layer_reading_and_writing_no_float_asks_for_no_reduced_precision_and_obey_passes():
    """A mask's Cast to bool and its Not compute no float: --bf16 asks nothing of them (before: BF16 requested,
    "kiln has no BF16 kernel for Cast", and `obey` failed on every masked BERT). A Greater reading floats still asks."""
    b = IRBuilder()
    x, ids = b.input("x", (4, 8)), b.input("ids", (4, 8), dtype=np.int64)
    mm = b.node("MatMul", [x, b.const("w", np.ones((8, 8)))], "y", (4, 8), name="mm")
    cast = b.node("Cast", [ids], "as_bool", (4, 8), dtype=np.bool_, name="cast", to=9)
    mask = b.node("Not", [cast], "mask", (4, 8), name="mask")
    above = b.node("Greater", [x, b.const("zero", np.zeros(()))], "above", (4, 8), dtype=np.bool_, name="above")
    g = b.graph(mm, mask, above)
    support = {"BF16": True, "FP16": False}
    got = decide([n for n in g.nodes if n.name != "above"], PrecisionOptions(bf16=True, constraints="obey"),
                 lambda n, p: n.op_type == "MatMul", support=support)
    assert got == {"mm": PrecisionDecision("BF16", "BF16", ""), "cast": PrecisionDecision("FP32", "FP32", ""),
                   "mask": PrecisionDecision("FP32", "FP32", "")}
    best = decide(g.nodes, PrecisionOptions(best=True), lambda n, p: n.op_type == "MatMul", support=support)
    assert {n: d.requested for n, d in best.items()} == {"mm": "BF16", "cast": "FP32", "mask": "FP32",
                                                         "above": "BF16"}


def test_an_openvino_region_counts_int8_only_where_a_layer_asked_for_it():
    """OpenVINO reports a mask's And as u8 and a Where reading one as u8 too: not INT8 arithmetic in a --bf16
    build. A quantized convolution's i8 is."""
    from kiln.builder.build import with_runtime_precisions
    from kiln.plan.model import Layer, TensorDesc

    def layer(name, op_type, dtype, requested, precision="FP32", reason=""):
        return Layer(name, op_type, "", (), (), (TensorDesc(name, (4,), dtype),), {}, "x", 0, "openvino", (name,),
                     precision, (), requested, reason)
    inner = (layer("and", "And", "bool", "FP32"), layer("where", "Where", "float32", "BF16"),
             layer("conv", "Conv", "float32", "BF16"), layer("qconv", "QConv", "uint8", "INT8", "INT8"),
             layer("ln", "LayerNormalization", "float32", "BF16"))
    region = dataclasses.replace(layer("{ForeignNode[and...ln]}", "ForeignNode", "float32", "BF16"), inner=inner)
    ran = {"and": frozenset({"INT8"}), "where": frozenset({"INT8", "FP32"}), "conv": frozenset({"BF16", "FP32"}),
           "qconv": frozenset({"INT8", "FP32"})}
    got = {i.name: (i.precision, i.precision_reason) for i in with_runtime_precisions(region, ran).inner}
    assert got == {"and": ("FP32", ""),
                   "where": ("FP32", "the OpenVINO region ran it in FP32"), "conv": ("BF16", ""),
                   "qconv": ("INT8", ""), "ln": ("FP32", "the OpenVINO region ran it in FP32")}


class Bf16Tactic:
    name, source, reduced_precisions = "test.bf16_matmul", "kiln", frozenset({"BF16"})

    def supports(self, layer):
        return layer.op_type == "MatMul"


VIEW = LayerView("MatMul", "", {}, ((4, 8), (8, 8)), ("float32", "float32"), {}, ("float32",), 17, ((), ()))


def test_a_granted_reduced_precision_selects_the_tactics_that_compute_in_it(monkeypatch):
    assert not registry.offers(VIEW, None, "BF16")   # kiln's BF16 linear needs a constant matrix
    monkeypatch.setitem(registry.REGISTRY, "MatMul", [*registry.REGISTRY["MatMul"], Bf16Tactic()])
    assert registry.offers(VIEW, None, "BF16") and not registry.offers(VIEW, frozenset({"torch"}), "BF16")
    assert [t.name for t in registry.candidates(VIEW, None, "BF16")] == ["test.bf16_matmul"]
    assert "test.bf16_matmul" not in [t.name for t in registry.candidates(VIEW, None)]   # FP32 layers: FP32 kernels


def test_the_timing_cache_keys_layers_by_precision():
    assert layer_signature(VIEW, [LINEAR], "FP32") != layer_signature(VIEW, [LINEAR], "BF16")


def test_bad_precision_options_are_clear_errors():
    with pytest.raises(kiln.ModelError, match=r"unknown precision constraints 'strict'; use one of none, prefer, obey"):
        kiln.build(conv_net(), precision_constraints="strict")
    with pytest.raises(kiln.ModelError, match=r"unknown layer precision\(s\) \{'conv1': 'fp8'\}"):
        kiln.build(conv_net(), layer_precisions={"conv1": "fp8"})
    with pytest.raises(kiln.Error, match=r"unknown tactic source 'cuda'"):
        kiln.build(conv_net(), tactic_sources="-openvino,+cuda")



def test_the_python_api_takes_the_cli_spellings(tmp_path):
    import torch

    from kiln.builder.spellings import build_options

    opts, threads = build_options({"bf16": True, "layer_precisions": "conv1:fp32,*:bf16", "shapes": "x:1x3x8x8",
                                   "calib": "data.npz", "calib_method": "minmax", "builder_optimization_level": 0,
                                   "tactic_sources": "-openvino,-onnxruntime", "disable_pass": "ConvReluFusion",
                                   "threads": 1, "precision_constraints": "prefer"})
    assert opts.precision == PrecisionOptions(bf16=True, layer_precisions={"conv1": "FP32", "*": "BF16"},
                                              constraints="prefer")
    assert (opts.input_shapes, opts.calibration, opts.calibration_method, opts.autotune) == \
        ({"x": (1, 3, 8, 8)}, "data.npz", "minmax", False)
    assert "openvino" not in opts.tactic_sources and "kiln" in opts.tactic_sources
    assert opts.disabled_passes == frozenset({"ConvReluFusion"}) and threads == 1
    assert build_options({"layer_precisions": {"conv1": "bf16"}})[0].precision.layer_precisions == {"conv1": "BF16"}
    before = torch.get_num_threads()
    try:
        engine = kiln.build(conv_net(), threads=1, builder_optimization_level=0)
        assert torch.get_num_threads() == 1 and engine.plan.layers
    finally:
        torch.set_num_threads(before)


def test_sixteen_bit_qdq_asks_for_and_is_given_fp32_and_eight_bit_int8():
    """kiln emulates 16-bit quantization in FP32 (no 16-bit integer kernels; TensorRT has no such type): a Q/DQ of
    uint16/int16 asks for FP32 and its own types fix FP32, whichever side the 16-bit tensor is on."""
    from kiln.precision.policy import native_precision, requested

    options = PrecisionOptions()
    for op, out, reads in (("QuantizeLinear", ["uint16"], ["float32"]), ("DequantizeLinear", ["float32"], ["int16"])):
        assert requested("q", op, out, options, (), reads) == "FP32"
        assert native_precision(op, out, reads) == "FP32"
    for op, out, reads in (("QuantizeLinear", ["uint8"], ["float32"]), ("DequantizeLinear", ["float32"], ["int8"])):
        assert requested("q", op, out, options, (), reads) == "INT8"
        assert native_precision(op, out, reads) == "INT8"


def test_unknown_or_doubled_build_options_are_clear_errors():
    with pytest.raises(kiln.ModelError, match=r"unknown build option\(s\) bf_16; known: .*\bbf16\b.*\bcalib\b"):
        kiln.build(conv_net(), bf_16=True)
    with pytest.raises(kiln.ModelError, match=r"build options 'calib' and 'calibration' are the same option"):
        kiln.build(conv_net(), calib="a.npz", calibration="b.npz")
    # a pass kiln does not run (a typo, or a pass's old name) would build with the pass on
    with pytest.raises(kiln.ModelError,
                       match=r"kiln has no pass 'QProductTableFusoin'; did you mean QProductTableFusion"):
        kiln.build(conv_net(), disable_pass="QProductTableFusoin")
    with pytest.raises(kiln.ModelError, match=r"kiln has no pass 'QMatMulTableFusion'; did you mean .*TableFusion"):
        kiln.build(conv_net(), disable_pass="QMatMulTableFusion")


def test_the_output_tail_is_the_arithmetic_after_the_last_matrix_layers():
    """A detector's box arithmetic after its last convolution, and a class Sigmoid, reach the outputs through no
    matrix layer: the tail. Data movement on the way is not arithmetic; a Sigmoid feeding a convolution is not the
    tail, nor is anything before that convolution."""
    b = IRBuilder()
    x = b.input("x", (1, 4, 8, 8))
    conv1 = b.node("Conv", [x, b.const("w1", np.ones((4, 4, 1, 1)))], "c1", (1, 4, 8, 8), name="conv1")
    gate = b.node("Sigmoid", [conv1], "g", (1, 4, 8, 8), name="gate")
    conv2 = b.node("Conv", [gate, b.const("w2", np.ones((4, 4, 1, 1)))], "c2", (1, 4, 8, 8), name="conv2")
    flat = b.node("Reshape", [conv2, b.const("s", np.array([1, 4, 64]), np.int64)], "r", (1, 4, 64), name="flat")
    scores = b.node("Sigmoid", [flat], "p", (1, 4, 64), name="scores")
    scaled = b.node("Mul", [scores, b.const("k", np.float32(32.0))], "y", (1, 4, 64), name="scale")
    g = b.graph(scaled, b.node("Add", [conv1, conv1], "side", (1, 4, 8, 8), name="side"))
    assert output_tail(g) == {"scores", "scale", "side"}


@pytest.mark.skipif(not hardware.has_any(hardware.BF16_ISA),
                    reason="BF16 is granted only where the CPU computes it natively (an AVX2 CPU denies --bf16)")
def test_the_output_tail_keeps_fp32_unless_the_user_asks():
    """Without constraints the encoder block's last residual Add (after ffn2, writing the output) stays FP32 with
    the reason; a layer precision naming it, or `prefer`, grants BF16. (The Adds are layers of their own with
    MatMulEltwiseSumFusion off; on, each joins its product, a matrix layer and no tail.)"""
    model = transformer_net()
    separate = {"disabled_passes": ["MatMulEltwiseSumFusion"]}
    layers = {l.name: l for l in kiln.build(model, bf16=True, autotune=False, **separate).plan.layers}
    assert layers["residual2"].precision == "FP32" and layers["residual2"].requested_precision == "BF16"
    assert layers["residual2"].precision_reason == OUTPUT_TAIL
    assert layers["residual1"].precision == "BF16"   # the same Add between matrix layers
    for options in ({"layer_precisions": {"residual2": "BF16"}}, {"precision_constraints": "prefer"}):
        named = {l.name: l for l in kiln.build(model, bf16=True, autotune=False, **separate, **options).plan.layers}
        assert named["residual2"].precision == "BF16", options


def test_a_layer_precision_names_a_fused_layer_by_any_of_its_onnx_nodes(caplog):
    """transformer_net's o_proj and residual1 become one layer "o_proj + residual1": "residual1:fp16" still names
    it, and a pattern naming nothing is a warning (TensorRT ignores it silently)."""
    import logging

    caplog.set_level(logging.WARNING, logger="kiln.build")
    engine = kiln.build(transformer_net(), autotune=False, layer_precisions={"residual1": "fp16", "typo*": "bf16"})
    layers = {l.name: l for l in engine.plan.layers}
    assert layers["o_proj + residual1"].requested_precision == "FP16"
    assert layers["ffn2 + residual2"].requested_precision == "FP32"
    assert "--layer-precisions: 'typo*' names no layer and no ONNX node of this model" in caplog.text
    assert "'residual1'" not in caplog.text
