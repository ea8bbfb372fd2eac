"""A build on kiln's own kernels races its per-layer choices against the same plan with kiln's oneDNN primitives
wherever one runs a layer (per-layer timing runs each kernel alone; in the plan consecutive primitives run as one
C call): the faster whole plan is kept, the log says both times, and no race is run where the two plans are one."""
from __future__ import annotations

import logging

import pytest
from onnx import TensorProto, helper

import kiln
import kiln.planning.race as race
from kiln.tactics import onednn_prim
from kiln.tactics.autotune import Autotuner
from tests.conftest import assert_close_to_ort, init, make_model, rand, run_ort

pytestmark = pytest.mark.skipif(not onednn_prim.available(), reason="oneDNN's C API is not installed here")
OWN = "-openvino,-onnxruntime"
C = 16


def conv_chain():
    nodes, inits, src = [], [], "x"
    for i in range(3):
        nodes.append(helper.make_node("Conv", [src, f"w{i}"], [f"t{i}"], name=f"conv{i}"))
        nodes.append(helper.make_node("Relu", [f"t{i}"], [f"r{i}"], name=f"relu{i}"))
        inits.append(init(f"w{i}", rand((C, C, 1, 1), i) * 0.3))
        src = f"r{i}"
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, 8, 8])],
                      [helper.make_tensor_value_info(src, TensorProto.FLOAT, [1, C, 8, 8])], inits)


def per_layer_times(monkeypatch, primitive_ms: float):
    """Per-layer timing where oneDNN's primitives take `primitive_ms` and every other kernel 0.1 ms."""
    monkeypatch.setattr(Autotuner, "_measure", lambda self, views, tactics, *a: {
        t.name: primitive_ms if t.source == race.PRIMITIVES_SOURCE else 0.1 for t in tactics})


def conv_sources(engine) -> list[str]:
    return [l.source for l in engine.plan.layers if l.op_type == "Conv"]


@pytest.mark.parametrize("plan_ms, primitives_kept", [({"kiln": 10.0, "kiln-onednn": 9.0}, True),
                                                      ({"kiln": 9.0, "kiln-onednn": 10.0}, False)])
def test_the_faster_whole_plan_is_kept(monkeypatch, caplog, plan_ms, primitives_kept):
    per_layer_times(monkeypatch, 1.0)   # alone, every primitive loses
    timed = []
    monkeypatch.setattr(race, "measure_plans", lambda candidates, *a, **k: timed.append(sorted(candidates)) or
                        {name: plan_ms[name] for name in candidates})
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    model = conv_chain()
    engine = kiln.build(model, tactic_sources=OWN, threads=2)
    assert timed == [["kiln", "kiln-onednn"]]
    sources = conv_sources(engine)
    assert sources == ["onednn"] * 3 if primitives_kept else "onednn" not in sources
    winner = "kiln-onednn" if primitives_kept else "kiln"
    assert f"Whole-plan latency: kiln {plan_ms['kiln']:.4g} ms, kiln-onednn {plan_ms['kiln-onednn']:.4g} ms -> " \
           f"{winner}" in caplog.text
    x = rand((1, C, 8, 8), 9)
    assert_close_to_ort(engine.run({"x": x})[engine.output_names[0]], run_ort(model, {"x": x})[0])


def test_no_race_where_the_layers_chose_the_primitives_already(monkeypatch):
    per_layer_times(monkeypatch, 0.01)
    monkeypatch.setattr(race, "measure_plans", lambda *a, **k: pytest.fail("raced two identical plans"))
    engine = kiln.build(conv_chain(), tactic_sources=OWN, threads=2)
    assert conv_sources(engine) == ["onednn"] * 3


def test_a_bf16_build_with_the_accuracy_check_off_races_nothing(monkeypatch):
    """Reduced-precision candidates are judged by the accuracy budget; with none there is no judge."""
    per_layer_times(monkeypatch, 1.0)
    monkeypatch.setattr(race, "measure_plans", lambda *a, **k: pytest.fail("raced without an accuracy budget"))
    engine = kiln.build(conv_chain(), tactic_sources=OWN, threads=2, bf16=True, accuracy="off")
    assert "onednn" not in conv_sources(engine)


def test_the_real_race_runs_both_plans_and_keeps_a_correct_one(caplog):
    """Unpatched: both candidates are checked against onnxruntime and timed (the winner depends on the CPU)."""
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    model = conv_chain()
    engine = kiln.build(model, tactic_sources=OWN, threads=2)
    x = rand((1, C, 8, 8), 10)
    assert_close_to_ort(engine.run({"x": x})[engine.output_names[0]], run_ort(model, {"x": x})[0])
    lines = [line for line in caplog.text.splitlines() if "Whole-plan latency: " in line]
    plans = {l.source for l in engine.plan.layers if l.op_type == "Conv"}
    if lines:   # the per-layer choices differed from the primitives: both timed, one kept
        assert len(lines) == 1 and "kiln " in lines[0] and "kiln-onednn " in lines[0]
        assert lines[0].endswith("-> kiln-onednn") == (plans == {"onednn"})
    else:
        assert plans == {"onednn"}
