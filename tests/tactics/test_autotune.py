"""The autotuner's choice rule: a later-listed (less fused, generic or external) tactic must beat an earlier one
by the cost policy's preference margin, an external library's single layer pays the thread-pool hand-over, and a
tactic counts its fastest measurement round. Timings come from a fake clock that fake kernels advance: no sleeps."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kiln.errors import ModelError
from kiln.tactics.autotune import Autotuner, TimingOptions, layer_signature
from kiln.tactics.base import LINEAR, LayerView
from kiln.tactics.clock import FakeClock
from kiln.tactics.costs import DEFAULT_COSTS, CostPolicy
from kiln.tactics.storage import StorageGuess
from kiln.tactics.timing_cache import TimingCache

HANDOVER_MS = DEFAULT_COSTS.handover_ms


class FakeTactic:
    def __init__(self, name: str, source: str):
        self.name, self.source = name, source

    def supports(self, layer):
        return True

    def input_formats(self, layer):
        return [LINEAR]

    def output_format(self, layer, formats):
        return LINEAR

    def prepare(self, layer):
        raise AssertionError("timings come from the cache in these tests")


VIEW = LayerView("Relu", "", {}, ((1, 8),), ("float32",), {}, ("float32",), 17, ((),))


def choose(timings: dict[str, float], sources: dict[str, str], costs: CostPolicy = DEFAULT_COSTS):
    tuner = Autotuner(TimingCache({"device": "test"}), costs=costs)
    tuner._measure = lambda *args: dict(timings)
    tactics = [FakeTactic(name, sources.get(name, "torch")) for name in timings]
    return tuner.choose("layer", VIEW, tactics, [LINEAR], {})


@pytest.mark.parametrize("later_ms, winner", [(0.97, "fused"), (0.90, "unfused"), (1.2, "fused")])
def test_a_later_tactic_must_beat_an_earlier_one_by_the_margin(later_ms, winner):
    assert DEFAULT_COSTS.preference_margin == 0.05
    assert choose({"fused": 1.0, "unfused": later_ms}, {}).tactic.name == winner


def test_the_margin_comes_from_the_cost_policy():
    assert choose({"fused": 1.0, "unfused": 0.90}, {}, CostPolicy(preference_margin=0.2)).tactic.name == "fused"
    assert choose({"fused": 1.0, "unfused": 0.97}, {}, CostPolicy(preference_margin=0.0)).tactic.name == "unfused"


def test_every_cost_says_why():
    explained = DEFAULT_COSTS.explain()
    assert {name for name, _, _ in explained} == {"preference_margin", "handover_ms", "pool_switch_ms", "mix_margin",
                                                  "plan_margin", "own_plan_margin", "prune_ratio"}
    assert all(len(reason) > 40 for _, _, reason in explained)


def test_margin_is_measured_against_the_current_best():
    # c is 8% faster than a but only 3% faster than b, which already replaced a
    choice = choose({"a": 1.0, "b": 0.94, "c": 0.92}, {})
    assert choice.tactic.name == "b" and choice.kernel_ms == 0.94


def test_an_external_single_layer_pays_the_thread_pool_handover(caplog):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    gain = HANDOVER_MS["onnxruntime"] / 2   # faster alone, slower once the hand-over is counted
    choice = choose({"torch.reference": 0.3, "onnxruntime.layer": 0.3 - gain}, {"onnxruntime.layer": "onnxruntime"})
    assert choice.tactic.name == "torch.reference"
    assert "thread-pool hand-over 0.1 ms (onnxruntime)" in caplog.text
    choice = choose({"torch.reference": 1.0, "onnxruntime.layer": 0.5}, {"onnxruntime.layer": "onnxruntime"})
    assert choice.tactic.name == "onnxruntime.layer" and choice.overhead_ms == pytest.approx(HANDOVER_MS["onnxruntime"])
    assert "must be 5% faster" in caplog.text


class CountingTactic(FakeTactic):
    """A real kernel that counts its calls and records whether its input was in the evictor's wake."""

    def __init__(self, name):
        super().__init__(name, "torch")
        self.calls = 0

    def prepare(self, layer):
        def run(xs):
            self.calls += 1
            return [xs[0]]
        return run


def test_cold_timing_evicts_before_every_run_and_is_cached_apart_from_hot(monkeypatch):
    from kiln.tactics import autotune

    monkeypatch.setattr(autotune, "last_level_cache_bytes", lambda: 1 << 20)
    cache = TimingCache({"device": "test"})
    hot, cold = CountingTactic("hot"), CountingTactic("cold")
    Autotuner(cache).choose("layer", VIEW, [hot], [LINEAR], {})
    tuner = Autotuner(cache, cold_weights=True)
    assert tuner.evictor.buffer.numel() * 4 == (1 << 20) * 3 // 2
    fills = []
    monkeypatch.setattr(tuner.evictor.buffer, "fill_", lambda v: fills.append(v))
    tuner.choose("layer", VIEW, [cold], [LINEAR], {})
    timed = tuner.options.min_timing * tuner.options.avg_timing
    assert cold.calls == 1 + timed and len(fills) == timed   # one untimed first call, then evict before each
    # same layer, same cache: the hot entry did not answer the cold tuner, and each is found again by its kind
    again_hot, again_cold = CountingTactic("hot"), CountingTactic("cold")
    Autotuner(cache).choose("layer", VIEW, [again_hot], [LINEAR], {})
    Autotuner(cache, cold_weights=True).choose("layer", VIEW, [again_cold], [LINEAR], {})
    assert again_hot.calls == 0 and again_cold.calls == 0


class BurstyTactic(FakeTactic):
    """Takes `burst_ms` on the fake clock on every call of its first `burst_rounds` rounds (noise from the
    machine), then `steady_ms`. A hot-cache round is one warm-up call and `avg_timing` timed ones."""

    def __init__(self, name, clock, steady_ms, burst_ms=0.0, burst_rounds=0, avg_timing=2):
        super().__init__(name, "torch")
        self.clock, self.steady_ms, self.burst_ms = clock, steady_ms, burst_ms
        self.burst_calls = burst_rounds * (1 + avg_timing)
        self.calls = 0

    def prepare(self, layer):
        def run(xs):
            self.calls += 1
            timed_call = self.calls - 1   # the first call is untimed
            self.clock.advance(self.burst_ms if 0 < timed_call <= self.burst_calls else self.steady_ms)
            return [xs[0]]
        return run


def test_a_tactic_is_timed_by_its_fastest_round_so_a_burst_of_noise_does_not_decide():
    from kiln.tactics.autotune import TimingOptions, robust_ms

    assert robust_ms([2.24, 2.3, 1.3]) == 1.3
    # two of three rounds hit by a 20 ms burst: a median would call the bursty tactic 20 ms and pick the other
    clock = FakeClock()
    bursty = BurstyTactic("bursty", clock, steady_ms=1.0, burst_ms=20.0, burst_rounds=2)
    steady = BurstyTactic("steady", clock, steady_ms=5.0)
    tuner = Autotuner(TimingCache({"device": "test"}), TimingOptions(avg_timing=2, min_timing=3), clock=clock)
    choice = tuner.choose("layer", VIEW, [steady, bursty], [LINEAR], {})
    assert bursty.calls == steady.calls == 1 + 3 * (1 + 2)
    assert choice.tactic.name == "bursty" and choice.timings_ms == pytest.approx({"bursty": 1.0, "steady": 5.0})


class DonatingTactic(FakeTactic):
    """Takes 20 ms writing a fresh output, 0.1 ms in its in-place variant (`into_input` over input 0)."""

    def __init__(self, name, clock):
        super().__init__(name, "kiln")
        self.clock = clock
        self.calls = {"fresh": 0, "in place": 0}

    def prepare(self, layer):
        def variant(kind, ms):
            def run(xs):
                self.calls[kind] += 1
                self.clock.advance(ms)
                return [xs[0]]
            return run
        run = variant("fresh", 20.0)
        run.into_input = (0, variant("in place", 0.1))
        return run


def test_a_kernel_that_writes_over_a_dying_input_is_timed_doing_so():
    from kiln.tactics.autotune import TimingOptions

    clock = FakeClock()
    cache, options = TimingCache({"device": "test"}), TimingOptions(avg_timing=2, min_timing=2)
    kept, dying = DonatingTactic("donor", clock), DonatingTactic("donor", clock)
    other = BurstyTactic("other", clock, steady_ms=5.0)
    # one untimed call, then 2 rounds of a warm-up and 2 timed calls: 7 calls of the variant the plan runs
    # the input lives on after this layer: the fresh-output kernel is what runs, and it loses
    choice = Autotuner(cache, options, clock=clock).choose("layer", VIEW, [kept, other], [LINEAR], {})
    assert kept.calls == {"fresh": 7, "in place": 0} and choice.tactic.name == "other"
    # the layer reads its input last: the plan donates the buffer, so the in-place kernel is timed, and wins
    choice = Autotuner(cache, options, clock=clock).choose("layer", VIEW, [dying, other], [LINEAR], {},
                                                         frozenset({0}))
    assert dying.calls == {"fresh": 0, "in place": 7}
    assert choice.timings_ms == pytest.approx({"donor": 0.1, "other": 5.0})
    assert choice.tactic.name == "donor"


def test_last_level_cache_size_is_the_largest_sysfs_cache(tmp_path):
    from kiln.tactics.autotune import last_level_cache_bytes

    for index, size in [("index0", "48K"), ("index2", "1024K"), ("index3", "8M"), ("index4", "junk")]:
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 8 << 20
    assert last_level_cache_bytes(tmp_path / "missing") == 32 << 20   # unreadable: a common L3 size


class StorageTactic(FakeTactic):
    """Takes `ms` on the fake clock per call; records the dtypes it was prepared for and called with."""

    def __init__(self, name, clock, ms, bf16_io=False):
        super().__init__(name, "kiln")
        self.clock, self.ms, self.seen = clock, ms, set()
        if bf16_io:
            self.reduced_precisions, self.bf16_inputs, self.writes_bf16 = frozenset({"BF16"}), frozenset({0}), True

    def prepare(self, layer):
        def run(xs):
            self.seen.add((xs[0].dtype, layer.output_dtypes[0]))
            self.clock.advance(self.ms)
            return [xs[0]]
        return run


def test_bf16_io_kernels_are_timed_on_bf16_and_the_others_pay_the_conversions(caplog):
    clock = FakeClock()

    def race(guess):
        bf16, fp32 = StorageTactic("bf16", clock, 1.0, bf16_io=True), StorageTactic("fp32", clock, 0.8)
        tuner = Autotuner(TimingCache({"device": "test"}), TimingOptions(avg_timing=1, min_timing=1), clock=clock)
        tuner.convert_ms = lambda shape, dtype: 0.1   # one pass, either way
        with caplog.at_level(logging.DEBUG, logger="kiln.build"):
            choice = tuner.choose("layer", VIEW, [bf16, fp32], [LINEAR], {}, precision="BF16", stored=guess)
        return choice, bf16.seen | fp32.seen

    # its neighbours store FP32: both kernels run on FP32 tensors and the faster one wins
    choice, seen = race(StorageGuess())
    assert seen == {(torch.float32, "float32")}
    assert choice.tactic.name == "fp32" and choice.overhead_ms == 0
    # its producer writes bf16 and its readers read bf16: the BF16 kernel reads and writes bf16 as it will in the
    # plan; the FP32 kernel pays a pass widening its input and one rounding its output, and loses
    choice, seen = race(StorageGuess(frozenset({0}), (1, 8)))
    assert seen == {(torch.bfloat16, "bfloat16"), (torch.float32, "float32")}
    assert choice.tactic.name == "bf16" and choice.timings_ms == pytest.approx({"bf16": 1.0, "fp32": 0.8})
    assert "+ bf16/FP32 conversions 0.2 ms" in caplog.text
    # only the input arrives in bf16: one conversion leaves the FP32 kernel ahead (0.9 ms against 1.0)
    choice, _ = race(StorageGuess(frozenset({0})))
    assert choice.tactic.name == "fp32" and choice.overhead_ms == pytest.approx(0.1)


class FailingTactic(FakeTactic):
    """Refused by its library here: at prepare, or at its first call."""

    def __init__(self, name, when):
        super().__init__(name, "torch-onednn")
        self.when = when

    def prepare(self, layer):
        if self.when == "prepare":
            raise RuntimeError("mkldnn_reorder_conv2d_weight: fp16 path needs the cpu support avx512_fp16")

        def run(xs):
            raise RuntimeError("could not create a primitive")
        return run


@pytest.mark.parametrize("when", ["prepare", "first call"])
def test_a_tactic_that_fails_here_is_skipped_with_a_warning_and_not_cached(when, caplog):
    clock, cache = FakeClock(), TimingCache({"device": "test"})
    tactics = [FailingTactic("fp16", when), BurstyTactic("fp32", clock, steady_ms=5.0)]
    with caplog.at_level(logging.WARNING, logger="kiln.build"):
        choice = Autotuner(cache, TimingOptions(avg_timing=1, min_timing=1), clock=clock).choose(
            "conv", VIEW, tactics, [LINEAR], {})
    assert choice.tactic.name == "fp32" and choice.timings_ms["fp16"] == float("inf")
    assert "Skipping tactic fp16 for layer 'conv': it failed here (" in caplog.text
    assert cache.get(layer_signature(VIEW, [LINEAR]), "fp16") is None   # tried again next build


def test_a_layer_whose_every_tactic_fails_is_a_model_error():
    with pytest.raises(ModelError, match="every tactic for layer 'conv' failed on this CPU"):
        Autotuner(TimingCache({"device": "test"}), TimingOptions(avg_timing=1, min_timing=1)).choose(
            "conv", VIEW, [FailingTactic("fp16", "prepare")], [LINEAR], {})


@pytest.mark.parametrize("cache_mib, cold", [(64, False), (32, True), (8, True)])
def test_weights_filling_half_the_last_level_cache_are_timed_cold(cache_mib, cold, monkeypatch):
    """16 MiB and a byte of weights: hot against a 64 MiB cache, cold against 32 MiB (activations, the other cores
    and replacement share it: a 24.4 MiB INT8 ResNet-50 ran its layers in the plan as cold timing predicted) and
    against 8 MiB."""
    from kiln.builder import build
    from kiln.builder.options import BuildOptions
    from tests.passes.ir_builder import IRBuilder

    b = IRBuilder()
    x = b.input("x", (1, (4 << 20) + 1))
    w = b.const("w", np.ones((4 << 20) + 1, dtype=np.float32))
    g = b.graph(b.node("Add", [x, w], "y", (1, (4 << 20) + 1)))
    monkeypatch.setattr(build, "last_level_cache_bytes", lambda: cache_mib << 20)
    cache = TimingCache({"device": "test"})
    assert (build.autotuner(g, cache, BuildOptions()).evictor is not None) == cold
    assert build.autotuner(g, cache, BuildOptions(autotune=False)) is None
