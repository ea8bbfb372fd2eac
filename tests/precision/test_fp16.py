"""FP16 on oneDNN's kernels through torch (`onednn.conv2d_nhwc_prepacked_fp16`, `onednn.linear_prepacked_fp16`):
offered only where the CPU has AVX512-FP16 and torch's oneDNN computes FP16 there; with --fp16 the convolutions
and linear layers are granted FP16 and stay within cosine 0.999 of onnxruntime's FP32; loaded on a CPU without
it, they run on torch's FP32 kernels. Where the CPU lacks AVX512-FP16 (AMD Zen 3/4) only the refusal runs: the
kernels cannot be built there (torch refuses FP16 weights)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import kiln
from kiln import hardware
from kiln.tactics.onednn_conv import OneDnnFp16ConvTactic, fp16_available
from kiln.tactics.onednn_linear import OneDnnFp16LinearTactic
from kiln.tactics.base import LayerView
from tests.conftest import cosine, rand, run_ort
from tests.precision.models import conv_net

needs_fp16 = pytest.mark.skipif(not fp16_available(), reason="this CPU has no AVX512-FP16 (or torch's oneDNN does "
                                "not compute FP16 here): --fp16 is denied per layer, as the test below checks")
FP16_TACTICS = {"onednn.conv2d_nhwc_prepacked_fp16", "onednn.linear_prepacked_fp16"}
CONV = LayerView("Conv", "", {"pads": [1, 1, 1, 1], "strides": [1, 1], "dilations": [1, 1], "group": 1},
                 ((1, 8, 6, 6), (16, 8, 3, 3), (16,)), ("float32",) * 3, {1: torch.randn(16, 8, 3, 3),
                                                                          2: torch.randn(16)}, ("float32",), 17,
                 ((), (), ()))


def test_fp16_kernels_are_offered_only_with_avx512_fp16(monkeypatch):
    linear = dataclasses.replace(CONV, op_type="MatMul", attrs={}, input_shapes=((4, 8), (8, 16)),
                                 input_dtypes=("float32",) * 2, const_inputs={1: torch.randn(8, 16)},
                                 input_dynamic=((), ()))
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}))
    assert not OneDnnFp16ConvTactic().supports(CONV) and not OneDnnFp16LinearTactic().supports(linear)
    assert OneDnnFp16ConvTactic.required_isa == ("avx512_fp16",)   # a loaded engine falls back without it


def test_fp16_is_denied_with_the_reason_where_the_cpu_has_no_fp16_kernels():
    engine = kiln.build(conv_net(), fp16=True, precision_constraints="prefer", autotune=False)
    convs = [l for l in engine.plan.layers if l.op_type == "Conv"]
    assert convs and all(l.requested_precision == "FP16" for l in convs)
    if fp16_available():
        assert all(l.precision == "FP16" and l.tactic_name in FP16_TACTICS for l in convs)
    else:
        assert all(l.precision == "FP32" and l.precision_reason.startswith("this CPU has no native FP16 arithmetic")
                   for l in convs)


@needs_fp16
def test_fp16_is_granted_on_onednn_and_stays_close_to_fp32(tmp_path, monkeypatch):
    model = conv_net()
    engine = kiln.build(model, fp16=True, precision_constraints="prefer")
    layers = {l["Name"]: l for l in engine.layer_info()["Layers"]}
    granted = {n for n, l in layers.items() if l.get("GrantedPrecision") == "FP16"}
    assert {"conv1 + relu1", "conv2 + relu2", "fc", "head"} <= granted
    assert all(layers[n]["TacticName"] in FP16_TACTICS for n in granted)
    x = rand((1, 3, 16, 16), seed=3)
    assert cosine(engine.run({"x": x})[engine.output_names[0]], run_ort(model, {"x": x})[0]) >= 0.999
    engine.save(tmp_path / "fp16.kiln")
    monkeypatch.setattr(hardware, "cpu_isa", lambda: frozenset({"avx2", "avx512f"}))
    loaded = kiln.load(tmp_path / "fp16.kiln", allow_other_device=True)   # torch's FP32 kernels stand in
    assert cosine(loaded.run({"x": x})[engine.output_names[0]], run_ort(model, {"x": x})[0]) >= 0.9999
