"""Tactic sources, the autotuner and the timing cache: each source forced in turn stays correct; a warm cache
reproduces the same choices without timing; bad caches and source specs give clear errors."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

import kiln
from kiln.tactics import codegen, onednn_prim
from kiln.tactics.registry import available_sources, parse_sources
from tests.conftest import assert_close_to_ort, force_plan, run_ort
from tests.models.test_zoo import export
from tests.models.zoo import make_zoo
from kiln.trt.vocab import layer_type, parameter_type

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("zoo")
    out = {}
    for name in ("mobilenetv3", "inception", "unet"):
        x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3))
        out[name] = (export(make_zoo(name), x, d / f"{name}.onnx", "legacy"), x.numpy())
    return out


@pytest.mark.parametrize("source", ["onednn", "torch", "torch-onednn", "kiln", "codegen", "onnxruntime",
                                    "openvino"])
@pytest.mark.parametrize("name", ["mobilenetv3", "inception", "unet"])
def test_each_source_forced_alone_is_correct(models, name, source):
    if source not in available_sources():
        pytest.skip(f"tactic source {source} is not available here")
    proto, x = models[name]
    engine = kiln.build(proto, tactic_sources=frozenset({source}))
    used = {l.source for l in engine.plan.layers} - {""}   # built-in Reformat copies have no source
    assert used <= {source, "torch"}, used          # torch's reference kernels back what a source cannot run
    pointwise = any(l.op_type == "PointWise" for l in engine.plan.layers)
    if source in ("onednn", "torch-onednn", "kiln", "onnxruntime") or (source == "codegen" and pointwise):
        assert source in used                       # (OpenVINO runs only whole graphs, when they win the timing)
    feeds = {engine.input_names[0]: x}
    assert_close_to_ort(engine.run(feeds)[engine.output_names[0]], run_ort(proto, feeds)[0])


def test_autotuned_build_logs_timing_table_and_stays_correct(models, caplog):
    proto, x = models["mobilenetv3"]
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    engine = kiln.build(proto, avg_timing=2, min_timing=1)
    text = caplog.text
    for line in ("=============== Computing costs for", "--------------- Timing Runner:", "Tactic Name: ",
                 ">>>>>>>>>>>>>>> Chose Runner Type:", "Reason: "):
        assert line in text, line
    feeds = {engine.input_names[0]: x}
    assert_close_to_ort(engine.run(feeds)[engine.output_names[0]], run_ort(proto, feeds)[0])
    assert engine.plan.build_info["tactic_sources_available"] == sorted(available_sources())


def test_warm_timing_cache_skips_timing_and_repeats_choices(models, tmp_path):
    proto, _ = models["inception"]
    cache = tmp_path / "timing.json"
    cold = kiln.build(proto, timing_cache=str(cache), avg_timing=2, min_timing=1)
    assert cold.plan.build_info["timing_cache"]["misses"] > 0
    doc = json.loads(cache.read_text())
    assert doc["kind"] == "kiln-timing-cache" and doc["version"] == 1 and doc["entries"]
    warm = kiln.build(proto, timing_cache=str(cache), avg_timing=2, min_timing=1)
    assert warm.plan.build_info["timing_cache"]["misses"] == 0
    assert [(l.name, l.tactic_name) for l in warm.plan.layers] == [(l.name, l.tactic_name) for l in cold.plan.layers]


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"kind": "something-else"}', "not a kiln timing cache"),
    ('{"kind": "kiln-timing-cache", "version": 99, "entries": {}, "devices": {}}', "version 99"),
    ('{"kind": "kiln-timing-cache", "version": 1, "entries": {"d": {"s": {"t": "fast"}}}, "devices": {}}', "malformed"),
])
def test_bad_timing_cache_is_a_clear_error(models, tmp_path, content, message):
    cache = tmp_path / "timing.json"
    cache.write_text(content)
    with pytest.raises(kiln.Error, match=message):
        kiln.build(models["mobilenetv3"][0], timing_cache=str(cache))
    assert cache.read_text() == content   # a bad cache is reported, never overwritten


def test_parse_sources_follows_trtexec_spelling():
    everything = available_sources()
    assert parse_sources(None) == everything
    assert parse_sources("-onnxruntime") == everything - {"onnxruntime"}
    assert parse_sources("torch") == {"torch"}
    assert parse_sources("-TORCH-ONEDNN,+onnxruntime") == (everything - {"torch-onednn"}) | {"onnxruntime"}
    with pytest.raises(kiln.Error, match="unknown tactic source 'cudnn'"):
        parse_sources("+cudnn")


def test_disabling_the_optimization_level_takes_first_kernels_without_timing(models, caplog):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    engine = kiln.build(models["inception"][0], autotune=False)
    assert "Computing costs" not in caplog.text
    convs = [l for l in engine.plan.layers if parameter_type(l) == "Convolution"]
    pointwise = [l for l in convs if tuple(l.attrs["kernel_shape"]) == (1, 1) and not any(l.attrs["pads"])]
    # the registry's first candidate: kiln's GEMM for unpadded 1x1 convolutions (with a C compiler), else oneDNN's
    # primitive (with oneDNN's C API), else oneDNN through torch
    first_onednn = "onednn.conv2d_primitive" if onednn_prim.available() else "onednn.conv2d_nhwc_prepacked"
    first_1x1 = "kiln.conv2d_1x1_gemm_nhwc" if codegen.available() else first_onednn
    assert pointwise and len(pointwise) < len(convs)
    assert all(l.tactic_name == first_1x1 for l in pointwise)
    assert all(l.tactic_name == first_onednn for l in convs if l not in pointwise)


def test_region_layer_info_names_only_vs_detailed(models, monkeypatch, tmp_path):
    force_plan(monkeypatch, "onnxruntime")   # the whole graph as one region, whatever this machine times fastest
    proto, x = models["inception"]
    engine = kiln.build(proto, avg_timing=1, min_timing=1)
    regions_ = [l for l in engine.plan.layers if l.inner]
    assert len(regions_) == 1 and regions_[0].name.startswith("{ForeignNode[") and regions_[0].name.endswith("]}")
    names = engine.layer_info("layer_names_only")["Layers"]
    assert regions_[0].name in names
    detailed = engine.layer_info("detailed")["Layers"]
    inner_names = [l.name for l in regions_[0].inner]
    assert [d["Name"] for d in detailed if d["Name"] in inner_names] == inner_names
    conv = next(d for d in detailed if d.get("ParameterType") == "Convolution")
    assert conv["LayerType"] == "OnnxRuntimeConvolution" and conv["TacticName"] == "onnxruntime.region"
    assert conv["Metadata"].startswith("[ONNX Layer: ")
    feeds = {engine.input_names[0]: x}
    assert_close_to_ort(engine.run(feeds)[engine.output_names[0]], run_ort(proto, feeds)[0])
    engine.save(tmp_path / "r.kiln")
    again = kiln.load(tmp_path / "r.kiln")
    np.testing.assert_array_equal(again.run(feeds)[engine.output_names[0]], engine.run(feeds)[engine.output_names[0]])


def test_deterministic_build_replays_the_cache_and_refuses_to_measure(models, tmp_path):
    proto, _ = models["unet"]
    cache = tmp_path / "timing.json"
    with pytest.raises(kiln.Error, match="--deterministic needs an existing timing cache"):
        kiln.build(proto, timing_cache=str(cache), deterministic=True)
    first = kiln.build(proto, timing_cache=str(cache), avg_timing=1, min_timing=1)
    again = kiln.build(proto, timing_cache=str(cache), deterministic=True)
    assert [(l.name, l.tactic_name) for l in again.plan.layers] == [(l.name, l.tactic_name) for l in first.plan.layers]
    other, _ = models["mobilenetv3"]
    with pytest.raises(kiln.Error, match="has no timing of"):
        kiln.build(other, timing_cache=str(cache), deterministic=True)


def test_openvino_plan_is_correct_when_installed(models, monkeypatch):
    pytest.importorskip("openvino")
    from kiln.tactics.costs import CostPolicy

    proto, x = models["mobilenetv3"]
    never_onnxruntime = CostPolicy(plan_margin=-10.0)   # never fall back to onnxruntime: keep the fastest of the rest
    engine = kiln.build(proto, tactic_sources=frozenset({"openvino", "torch-onednn", "torch"}), avg_timing=1,
                        min_timing=1, costs=never_onnxruntime)
    feeds = {engine.input_names[0]: x}
    assert_close_to_ort(engine.run(feeds)[engine.output_names[0]], run_ort(proto, feeds)[0])
    regions_ = [l for l in engine.plan.layers if l.inner]
    if regions_:   # OpenVINO won the timing: its region and inner layers say so
        assert layer_type(regions_[0]) == "OpenVINO" and regions_[0].tactic_name == "openvino.region"
        assert all(layer_type(i).startswith("OpenVINO") for i in regions_[0].inner)


def test_everything_works_without_openvino(models, monkeypatch):
    from kiln.tactics import openvino_source

    monkeypatch.setattr(openvino_source, "available", lambda: False)
    assert "openvino" not in available_sources()
    with pytest.raises(kiln.Error, match="not available"):
        parse_sources("+openvino")
    proto, x = models["unet"]
    engine = kiln.build(proto, avg_timing=1, min_timing=1)
    assert "openvino" not in engine.plan.build_info["tactic_sources_available"]
    feeds = {engine.input_names[0]: x}
    assert_close_to_ort(engine.run(feeds)[engine.output_names[0]], run_ort(proto, feeds)[0])


def test_an_openvino_engine_loaded_without_openvino_runs_its_region_on_onnxruntime(models, monkeypatch, caplog,
                                                                                    tmp_path):
    pytest.importorskip("openvino")
    from kiln.tactics import openvino_source, onnxruntime_source

    proto, x = models["inception"]
    with pytest.MonkeyPatch.context() as mp:
        force_plan(mp, "openvino")
        kiln.build(proto, avg_timing=1, min_timing=1).save(tmp_path / "ov.kiln")
    monkeypatch.setattr(openvino_source, "available", lambda: False)
    caplog.set_level(logging.WARNING, logger="kiln.runtime")
    engine = kiln.load(tmp_path / "ov.kiln")
    assert [l.tactic_name for l in engine.plan.layers if l.inner] == ["openvino.region"]
    feeds = {engine.input_names[0]: x}
    assert_close_to_ort(engine.run(feeds)[engine.output_names[0]], run_ort(proto, feeds)[0])
    assert "was built for OpenVINO, which is not installed here: onnxruntime runs the same region" in caplog.text
    monkeypatch.setattr(onnxruntime_source, "available", lambda: False)   # neither library: torch's kernels
    assert_close_to_ort(kiln.load(tmp_path / "ov.kiln").run(feeds)[engine.output_names[0]], run_ort(proto, feeds)[0])
    assert "OpenVINO is not available here for openvino.region" in caplog.text


def test_onnxruntime_layers_and_regions_loaded_without_onnxruntime_run_on_torch(models, monkeypatch, caplog, tmp_path):
    from kiln.tactics import onnxruntime_source

    proto, x = models["inception"]
    with pytest.MonkeyPatch.context() as mp:
        force_plan(mp, "onnxruntime")
        kiln.build(proto, avg_timing=1, min_timing=1).save(tmp_path / "region.kiln")
    kiln.build(proto, tactic_sources=frozenset({"onnxruntime"}), autotune=False).save(tmp_path / "layers.kiln")
    monkeypatch.setattr(onnxruntime_source, "available", lambda: False)
    caplog.set_level(logging.WARNING, logger="kiln.runtime")
    feeds = {kiln.load(tmp_path / "region.kiln").input_names[0]: x}
    for name, tactic in (("region", "onnxruntime.region"), ("layers", "onnxruntime.layer")):
        engine = kiln.load(tmp_path / f"{name}.kiln")
        assert tactic in {l.tactic_name for l in engine.plan.layers}
        assert_close_to_ort(engine.run(feeds)[engine.output_names[0]], run_ort(proto, feeds)[0])
        assert f"onnxruntime is not available here for {tactic}" in caplog.text


def test_a_plan_with_wrong_outputs_or_a_failing_library_is_left_out(models, monkeypatch, caplog):
    import kiln.runtime.prepare as prepare

    def broken_region(model, external, input_names, output_names, spinning=False):
        return lambda xs: [torch.zeros(1)] * len(output_names)

    monkeypatch.setattr(prepare, "region_kernel", broken_region)
    caplog.set_level(logging.WARNING, logger="kiln.build")
    proto, x = models["inception"]
    engine = kiln.build(proto, tactic_sources=frozenset({"onnxruntime", "torch-onednn", "torch"}), avg_timing=1,
                        min_timing=1)
    assert "plan's outputs differ from the original model in onnxruntime" in caplog.text
    assert not any(l.inner for l in engine.plan.layers)
    feeds = {engine.input_names[0]: x}
    assert_close_to_ort(engine.run(feeds)[engine.output_names[0]], run_ort(proto, feeds)[0])


def test_region_profile_follows_the_layer_info_split(models, monkeypatch):
    from kiln.runtime.profiler import LayerProfiler
    from kiln.trt.profile import profile_json

    force_plan(monkeypatch, "onnxruntime")
    proto, x = models["inception"]
    engine = kiln.build(proto, avg_timing=1, min_timing=1)
    region = next(l for l in engine.plan.layers if l.inner)
    prof = LayerProfiler()
    ctx = engine.create_execution_context()
    for _ in range(3):
        ctx.execute({engine.input_names[0]: x}, prof)
        prof.end_inference()
    prof.finish()
    names_only = [r["name"] for r in json.loads(profile_json(prof, "layer_names_only"))[1:]]
    assert region.name in names_only
    detailed = json.loads(profile_json(prof, "detailed"))
    assert detailed[0] == {"count": 3}
    inner = {l.name for l in region.inner}
    convs = [r for r in detailed[1:] if r["name"] in inner and "Conv" in r["name"]]
    assert convs and region.name not in [r["name"] for r in detailed[1:]]
    assert all(r["timeMs"] > 0 for r in convs)


def test_kiln_plan_that_disagrees_with_onnxruntime_is_left_out(models, monkeypatch, caplog):
    """The ground truth is the original model in onnxruntime, not kiln's own kernels."""
    from kiln.tactics.onednn_conv import OneDnnConvTactic
    from kiln.tactics.onnxruntime_source import OnnxRuntimeLayerTactic
    from kiln.tactics.reference import ReferenceTactic
    from kiln.tactics.shuffle_c import PermuteCopyTactic

    # every per-layer kernel is off
    for cls in (ReferenceTactic, OneDnnConvTactic, OnnxRuntimeLayerTactic, PermuteCopyTactic):
        def broken_prepare(self, layer, _prepare=cls.prepare):
            kernel = _prepare(self, layer)
            return lambda xs: [y * 0.5 if y.is_floating_point() else y for y in kernel(xs)]
        monkeypatch.setattr(cls, "prepare", broken_prepare)
    caplog.set_level(logging.WARNING, logger="kiln.build")
    proto, x = models["inception"]
    engine = kiln.build(proto, avg_timing=1, min_timing=1)
    assert "The kiln plan's outputs differ from the original model in onnxruntime" in caplog.text
    assert any(l.inner for l in engine.plan.layers)
    feeds = {engine.input_names[0]: x}
    assert_close_to_ort(engine.run(feeds)[engine.output_names[0]], run_ort(proto, feeds)[0])


def test_openvino_compiled_model_cache_for_loaded_engines(models, tmp_path, monkeypatch):
    """The build compiles its chosen OpenVINO region once through OpenVINO's model cache (keyed by the region's
    content), so even the engine's first load imports the compiled blob; KILN_CACHE_DIR=off turns it off."""
    pytest.importorskip("openvino")
    import kiln.tactics.openvino_source as ovs

    monkeypatch.setattr(ovs, "CACHE_MIN_BYTES", 0)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    force_plan(monkeypatch, "openvino")   # torch's kernels may time within the margin of this tiny model's region
    proto, x = models["mobilenetv3"]
    engine = kiln.build(proto, tactic_sources=frozenset({"openvino"}), avg_timing=1, min_timing=1)
    assert engine.plan.layers[0].tactic_name == "openvino.region"
    folder = tmp_path / "cache" / "openvino"
    regions = sorted(folder.glob("region-*.onnx"))
    assert len(regions) == 1   # the chosen region only
    blobs = {p: p.stat().st_mtime_ns for p in folder.iterdir() if p.suffix != ".onnx"}
    assert blobs, "OpenVINO wrote no compiled blob"
    engine.save(tmp_path / "e.kiln")
    feeds = {engine.input_names[0]: x}
    first = kiln.load(tmp_path / "e.kiln").run(feeds)
    second = kiln.load(tmp_path / "e.kiln").run(feeds)
    assert sorted(folder.glob("region-*.onnx")) == regions   # the loads found the build's entry
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir() if p.suffix != ".onnx"} == blobs
    np.testing.assert_array_equal(first[engine.output_names[0]], second[engine.output_names[0]])
    assert_close_to_ort(second[engine.output_names[0]], run_ort(proto, feeds)[0])
    monkeypatch.setenv("KILN_CACHE_DIR", "off")
    assert ovs.compiled_model_cache() is None


@pytest.mark.parametrize("region_ms, region_wins", [(9.95, False), (9.8, True)])
def test_a_library_region_must_clearly_beat_kilns_own_plan(models, monkeypatch, caplog, region_ms, region_wins):
    """Within the cost policy's own_plan_margin (1%) of kiln's own plan a whole-graph region is a tie under timing
    noise, and kiln's own plan is kept: its layers stay visible in layer info and profiles."""
    import kiln.planning.race as race

    monkeypatch.setattr(race, "measure_plans", lambda candidates, *a, **k: {
        name: 10.0 if name in race.OWN_PLANS else region_ms for name in candidates})
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    proto, x = models["inception"]
    engine = kiln.build(proto, tactic_sources=frozenset({"onnxruntime", "torch-onednn", "torch"}), avg_timing=1,
                        min_timing=1)
    assert any(l.inner for l in engine.plan.layers) == region_wins
    assert ("of kiln's own (10 ms): keeping kiln's own" in caplog.text) != region_wins
    feeds = {engine.input_names[0]: x}
    assert_close_to_ort(engine.run(feeds)[engine.output_names[0]], run_ort(proto, feeds)[0])


def test_whole_plan_blocks_never_follow_another_library_at_a_round_boundary():
    from kiln.planning.race import _block_order

    names = ["kiln", "kiln-direct", "onnxruntime", "openvino"]
    rounds = [_block_order(names, r) for r in range(4)]
    assert rounds[0] == names and rounds[1] == names[::-1] and rounds[2] == names
    for before, after in zip(rounds, rounds[1:]):
        assert before[-1] == after[0]   # the first block of a round follows its own plan's block


def fake_race(monkeypatch, plan_ms):
    """Whole plans on a fake clock: `plan_ms(name, round)` is a run's time. Returns (measure(names) -> times,
    the tuner, the rounds each plan ran in)."""
    import kiln.planning.race as race
    from kiln.ir import Graph
    from kiln.tactics.autotune import Autotuner, TimingOptions
    from kiln.tactics.clock import FakeClock
    from kiln.tactics.timing_cache import TimingCache

    clock, state, calls = FakeClock(), {"round": 0}, {}
    time_round = race.time_round

    def spy(runners, names, round_index, tuner):
        state["round"] = round_index
        return time_round(runners, names, round_index, tuner)

    def runner(layers, descs, weights, opset, inputs, keep):
        def run():
            calls.setdefault(layers[0], set()).add(state["round"])
            clock.advance(plan_ms(layers[0], state["round"]))
            return {}
        return run
    monkeypatch.setattr(race, "time_round", spy)
    monkeypatch.setattr(race, "plan_runner", runner)
    monkeypatch.setattr(race, "plan_signature", lambda layers: layers[0])
    monkeypatch.setattr(race, "WARMUP_MS", 0.0)
    tuner = Autotuner(TimingCache({"device": "test"}), TimingOptions(avg_timing=4, min_timing=1), clock=clock)

    def measure(names):
        return race.measure_plans({name: ([name], {}) for name in names}, {}, Graph(), tuner)
    return measure, tuner, calls


def test_a_whole_plan_counts_its_fastest_round_so_a_burst_does_not_decide(monkeypatch):
    """Two plans on a fake clock: "bursty" runs 5 ms except in rounds 1 and 2 (30 ms, machine noise), "steady"
    10 ms throughout. A median over all samples calls bursty 17.5 ms and keeps steady; its fastest round says 5 ms."""
    import kiln.planning.race as race

    def plan_ms(name, round_index):
        return 10.0 if name == "steady" else 30.0 if round_index in (1, 2) else 5.0
    measure, _, calls = fake_race(monkeypatch, plan_ms)
    assert measure(["steady", "bursty"]) == pytest.approx({"bursty": 5.0, "steady": 10.0})
    assert calls["bursty"] == set(range(race.PLAN_ROUNDS))   # timed through its bursts to the last round


def test_a_burst_over_one_first_block_does_not_drop_the_fastest_plan(monkeypatch):
    """"region" runs 5 ms but its first block is hit by noise (30 ms, 6x "own"'s 10 ms, far past the prune ratio);
    pruning after the first round would drop it and keep "own". Judged on its fastest of two rounds, it stays in
    and wins; "own" and "slow" (10 and 20 ms every round) are then far behind it and dropped after two rounds."""
    import kiln.planning.race as race

    def plan_ms(name, round_index):
        return {"own": 10.0, "slow": 20.0}.get(name, 30.0 if round_index == 0 else 5.0)
    measure, tuner, calls = fake_race(monkeypatch, plan_ms)
    times = measure(["own", "region", "slow"])
    assert times == pytest.approx({"own": 10.0, "region": 5.0, "slow": 20.0})
    assert calls["region"] == set(range(race.PLAN_ROUNDS))
    assert calls["own"] == calls["slow"] == set(range(race.PRUNE_AFTER_ROUNDS))
    assert race.pick_fastest(times, tuner) == "region"


def test_a_close_race_is_timed_again_before_it_is_decided(monkeypatch):
    """"region" runs 9 ms, but the host is busier during its first four rounds (10.4 ms) than during "own"'s
    (10 ms every round): on those rounds kiln's own plan would be kept. The two are within CONFIRM_WITHIN, so both
    run CONFIRM_ROUNDS more rounds, where region's 9 ms beats own by more than the own-plan margin."""
    import kiln.planning.race as race

    def plan_ms(name, round_index):
        return 10.0 if name == "own" else 10.4 if round_index < race.PLAN_ROUNDS else 9.0
    measure, tuner, calls = fake_race(monkeypatch, plan_ms)
    times = measure(["own", "region"])
    assert times == pytest.approx({"own": 10.0, "region": 9.0})
    assert calls["own"] == calls["region"] == set(range(race.PLAN_ROUNDS + race.CONFIRM_ROUNDS))
    assert race.pick_fastest(times, tuner) == "region"


def test_a_clear_race_is_not_timed_again(monkeypatch):
    """Plans 10 and 11.2 ms: further apart than CONFIRM_WITHIN, closer than the prune ratio. PLAN_ROUNDS decide."""
    import kiln.planning.race as race

    measure, _, calls = fake_race(monkeypatch, lambda name, round_index: 10.0 if name == "own" else 11.2)
    assert measure(["own", "region"]) == pytest.approx({"own": 10.0, "region": 11.2})
    assert calls["own"] == calls["region"] == set(range(race.PLAN_ROUNDS))
