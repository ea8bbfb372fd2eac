"""The accuracy budget (--accuracy): a plan with reduced-precision layers is checked against onnxruntime's FP32
outputs; when it misses, the fewest, most sensitive layers are kept in FP32 (reason "accuracy budget"); an
impossible budget or a bad spec is a clear error, from Python and from the CLI (exit 2, no engine written)."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln.planning.accuracy import AccuracyBudget
from kiln.tactics.onednn_conv import bf16_available
from tests.conftest import cosine, init, make_model, rand, run_ort
from tests.precision.emulated_bf16 import bf16_kernels  # noqa: F401  (fixture: native or emulated BF16)

needs_bf16 = pytest.mark.skipif(not bf16_available(), reason="this CPU has no native BF16 arithmetic (AVX512-BF16 "
                                "or AMX): no layer runs in a reduced precision, so there is no budget to meet")


def two_branch() -> onnx.ModelProto:
    """y = x1 @ Wa + x2 @ Wb with Wa 10^4 times larger: the big branch's BF16 error is nearly all of y's. The sum
    is fused into the later product ("small + sum", its residual: kiln.passes.gemm)."""
    h, vi = helper.make_node, helper.make_tensor_value_info
    nodes = [h("MatMul", ["x1", "wa"], ["a"], name="big"), h("MatMul", ["x2", "wb"], ["b"], name="small"),
             h("Add", ["a", "b"], ["y"], name="sum")]
    inits = [init("wa", rand((64, 64), 1) * 100), init("wb", rand((64, 64), 2) * 0.01)]
    return make_model(nodes, [vi("x1", TensorProto.FLOAT, [8, 64]), vi("x2", TensorProto.FLOAT, [8, 64])],
                      [vi("y", TensorProto.FLOAT, [8, 64])], inits)


def relative_l2(engine, model) -> float:
    rng = np.random.default_rng(7)
    feeds = {n: rng.standard_normal((8, 64)).astype(np.float32) for n in ("x1", "x2")}
    got, want = engine.run(feeds)["y"].astype(np.float64), run_ort(model, feeds)[0].astype(np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_a_tight_budget_keeps_only_the_sensitive_layer_in_fp32(caplog, bf16_kernels):
    caplog.set_level(logging.INFO, logger="kiln.build")
    model = two_branch()
    loose = kiln.build(model, bf16=True, precision_constraints="prefer", accuracy="l2:0.01", autotune=False)
    assert {l.name: l.precision for l in loose.plan.layers if l.op_type == "MatMul"} == {"big": "BF16",
                                                                                         "small + sum": "BF16"}
    assert 5e-4 < relative_l2(loose, model) < 0.01
    tight = kiln.build(model, bf16=True, precision_constraints="prefer", accuracy="l2:0.0005", autotune=False)
    layers = {l.name: l for l in tight.plan.layers}
    assert (layers["big"].precision, layers["small + sum"].precision) == ("FP32", "BF16")
    assert layers["big"].requested_precision == "BF16" and layers["big"].precision_reason.startswith("accuracy budget")
    assert relative_l2(tight, model) < 5e-4
    assert "Accuracy budget l2:0.0005 (checked as l2:0.0004): 1 of 2 reduced-precision layers kept in FP32" \
        in caplog.text
    info = {l["Name"]: l for l in tight.layer_info()["Layers"]}
    assert info["big"]["GrantedPrecision"] == "FP32" and "accuracy budget" in info["big"]["PrecisionReason"]


def reduced_count(bf16_kernels: str, products: int, sums: int = 1) -> int:
    """The layers a BF16 plan reduces: the products, and the sums too where BF16 is native (the emulation stands in
    for the products only)."""
    return products + (sums if bf16_kernels == "native" else 0)


def test_without_onnxruntime_the_all_fp32_plan_is_the_reference(bf16_kernels, monkeypatch):
    """Where onnxruntime is missing the budget scores against kiln's plan with every layer in FP32 (that one
    lowering also serves the ranking): the same layer is kept, and the result still matches onnxruntime."""
    import kiln.builder.budget as budget

    monkeypatch.setattr(budget, "onnxruntime_reference", lambda proto: None)
    model = two_branch()
    engine = kiln.build(model, bf16=True, precision_constraints="prefer", accuracy="l2:0.0005", autotune=False)
    assert {l.name: l.precision for l in engine.plan.layers if l.op_type == "MatMul"} == {"big": "FP32",
                                                                                          "small + sum": "BF16"}
    assert relative_l2(engine, model) < 5e-4


def test_the_budget_is_judged_on_calib_data_when_given(caplog, bf16_kernels, tmp_path):
    """On data where the big branch's input is zero, only the small branch's BF16 error counts: the budget keeps
    `small` in FP32 instead of `big` (as random inputs would), and no random-input warning is logged."""
    caplog.set_level(logging.INFO, logger="kiln.build")
    rng = np.random.default_rng(3)
    data = tmp_path / "data.npz"
    np.savez(data, x1=np.zeros((16, 64), np.float32), x2=rng.standard_normal((16, 64)).astype(np.float32))
    engine = kiln.build(two_branch(), bf16=True, precision_constraints="prefer", accuracy="l2:0.0005",
                        autotune=False, calibration=str(data))
    assert {l.name: l.precision for l in engine.plan.layers if l.op_type == "MatMul"} == {"big": "BF16",
                                                                                          "small + sum": "FP32"}
    assert "inputs the accuracy budget is checked on" in caplog.text and "random inputs" not in caplog.text
    with pytest.raises(kiln.ModelError, match=r"without --int8 \(or --bf16/--fp16/--best"):
        kiln.build(two_branch(), autotune=False, calibration=str(data))


def test_random_inputs_hold_a_fifth_of_the_budget_in_reserve(caplog, bf16_kernels, tmp_path):
    """Random inputs are not the user's data: without --calib the plan must meet the budget with 20% of the allowed
    error to spare. The BF16 plan scores l2 0.0029 on either: under l2:0.0033 random inputs hold it to 0.00264 and
    keep `big` in FP32; --calib data hold it to the budget itself, and nothing is kept."""
    caplog.set_level(logging.INFO, logger="kiln.build")
    engine = kiln.build(two_branch(), bf16=True, precision_constraints="prefer", accuracy="l2:0.0033", autotune=False)
    assert {l.name: l.precision for l in engine.plan.layers if l.op_type == "MatMul"} == {"big": "FP32",
                                                                                          "small + sum": "BF16"}
    assert "Accuracy budget checked on random inputs as l2:0.00264, 20% of its error in reserve" in caplog.text
    assert engine.plan.build_info["accuracy_budget"]["budget"] == "l2:0.0033"
    assert engine.plan.build_info["accuracy_budget"]["checked_as"] == "l2:0.00264"
    rng = np.random.default_rng(5)
    data = tmp_path / "data.npz"
    np.savez(data, **{n: rng.standard_normal((16, 64)).astype(np.float32) for n in ("x1", "x2")})
    engine = kiln.build(two_branch(), bf16=True, precision_constraints="prefer", accuracy="l2:0.0033",
                        autotune=False, calibration=str(data))
    assert {l.name: l.precision for l in engine.plan.layers if l.op_type == "MatMul"} == {"big": "BF16",
                                                                                          "small + sum": "BF16"}
    assert engine.plan.build_info["accuracy_budget"]["checked_as"] == "l2:0.0033"


def test_the_reserve_scales_the_allowed_error():
    assert AccuracyBudget("cos", 0.999, reserve=0.2).limit() == pytest.approx(0.9992)
    assert AccuracyBudget("l2", 0.0005, reserve=0.2).limit() == pytest.approx(0.0004)
    assert AccuracyBudget("cos", 1.5, reserve=0.2).checked_text() == "cos:1.5"   # unreachable stays as stated
    assert AccuracyBudget("cos", 0.999, reserve=0.2).words() == "cos:0.999 (checked as cos:0.9992)"
    assert AccuracyBudget("linf", 0.01).words() == "linf:0.01"


def test_every_budget_batch_must_meet_the_budget(bf16_kernels, tmp_path):
    """Two calibration batches, one where only the small branch's error counts and one where the big branch's
    does: each must meet the budget, so both products are kept in FP32 (the first batch alone keeps `small` only,
    as the test above shows)."""
    rng = np.random.default_rng(3)
    x1 = np.concatenate([np.zeros((8, 64)), rng.standard_normal((8, 64))]).astype(np.float32)
    data = tmp_path / "data.npz"
    np.savez(data, x1=x1, x2=rng.standard_normal((16, 64)).astype(np.float32))
    engine = kiln.build(two_branch(), bf16=True, precision_constraints="prefer", accuracy="l2:0.0005",
                        autotune=False, calibration=str(data))
    assert {l.name: l.precision for l in engine.plan.layers if l.op_type == "MatMul"} == {"big": "FP32",
                                                                                          "small + sum": "FP32"}
    for batch in (slice(0, 8), slice(8, 16)):
        feeds = {"x1": x1[batch], "x2": np.load(data)["x2"][batch]}
        got, want = engine.run(feeds)["y"].astype(np.float64), run_ort(two_branch(), feeds)[0].astype(np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-4


def test_the_default_budget_with_bf16_is_cosine_0_999(caplog, bf16_kernels):
    caplog.set_level(logging.INFO, logger="kiln.build")
    kiln.build(two_branch(), bf16=True, precision_constraints="prefer", autotune=False)
    assert "Accuracy budget cos:0.999 (checked as cos:0.9992) met: cos 0.99" in caplog.text
    caplog.clear()
    kiln.build(two_branch(), bf16=True, precision_constraints="prefer", autotune=False, accuracy="off")
    assert "Accuracy budget" not in caplog.text


def test_an_impossible_budget_and_obey_are_clear_errors(bf16_kernels):
    with pytest.raises(kiln.ModelError, match=r"the accuracy budget cos:1\.5 cannot be met even with every layer in "
                                              r"FP32 \(cos 1(\.0+)?\d* against the FP32 reference\): relax it"):
        kiln.build(two_branch(), bf16=True, precision_constraints="prefer", accuracy="cos:1.5", autotune=False)
    with pytest.raises(kiln.ModelError, match=r"misses the accuracy budget l2:0\.0005 .* --precision-constraints "
                                              r"obey forbids keeping layers in FP32"):
        kiln.build(two_branch(), layer_precisions={"big": "BF16", "small": "BF16"}, precision_constraints="obey",
                   accuracy="l2:0.0005", autotune=False)


@pytest.mark.parametrize("spec", ["cos", "cosine:0.9", "l2:-1", "linf:x", "l1:nan"])
def test_a_bad_budget_spec_fails_before_any_work(spec):
    with pytest.raises(kiln.ModelError, match=rf"bad accuracy budget '{spec}': expected METRIC:THRESHOLD"):
        kiln.build(two_branch(), bf16=True, accuracy=spec)


def test_the_cli_exits_2_and_writes_no_engine_for_a_bad_or_impossible_budget(tmp_path):
    path, out = tmp_path / "m.onnx", tmp_path / "m.kiln"
    onnx.save(two_branch(), path)
    cases = [["--accuracy", "cos"]] + ([["--accuracy", "cos:1.5"]] if bf16_available() else [])
    for extra in cases:
        done = subprocess.run([sys.executable, "-m", "kiln.cli.main", "build", str(path), "-o", str(out), "--bf16",
                               "--precision-constraints", "prefer", "--builder-optimization-level", "0", *extra],
                              capture_output=True, text=True)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "accuracy budget" in done.stderr and not out.exists()


def test_the_metrics_score_what_they_say():
    import torch

    want, got = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 3.0, 4.4])
    assert AccuracyBudget.parse("linf:0.5").score(got, want) == pytest.approx(0.4)
    assert AccuracyBudget.parse("l1:0.1").score(got, want) == pytest.approx(0.1 / 2.5)
    assert AccuracyBudget.parse("l2:0.1").score(got, want) == pytest.approx(0.4 / float(want.norm()))
    assert AccuracyBudget.parse("l0:0.3", atol=0.0, rtol=0.05).score(got, want) == pytest.approx(0.25)
    cos = AccuracyBudget.parse("cos:0.999")
    assert cos.met(cos.score(want, want)) and not cos.met(cos.score(-want, want))


@needs_bf16
def test_debug_precision_names_the_onnx_nodes_to_keep_in_fp32(tmp_path):
    from kiln.tools.debug_precision import debug_precision

    report = debug_precision(two_branch(), bf16=True, precision_constraints="prefer", accuracy="l2:0.0005",
                             autotune=False)
    assert report.keep_fp32_nodes == ("big",) and (report.budget, report.checked_as) == ("l2:0.0005", "l2:0.0004")
    assert [(v.layer, v.keep_fp32, v.granted) for v in report.verdicts] == [("big", True, "FP32"),
                                                                            ("small + sum", False, "BF16")]
    assert report.score_final <= 0.0005 < report.score_all_reduced
    path, out = tmp_path / "m.onnx", tmp_path / "report.json"
    onnx.save(two_branch(), path)
    done = subprocess.run([sys.executable, "-m", "kiln.cli.main", "debug", "precision", str(path), "--bf16",
                           "--accuracy", "l2:0.0005", "--precision-constraints", "prefer",
                           "--builder-optimization-level", "0", "--json", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.endswith("1 ONNX node(s) must stay in FP32:"))
    assert lines[at + 1] == "big"
    doc = json.loads(out.read_text())
    assert (doc["kind"], doc["version"], doc["keep_fp32_onnx_nodes"]) == ("kiln-debug-precision", 1, ["big"])
    assert (doc["budget"], doc["checked_as"]) == ("l2:0.0005", "l2:0.0004")   # random inputs: a fifth in reserve
    assert "Budget l2:0.0005 (checked as l2:0.0004): all reduced" in done.stdout + done.stderr
    assert {l["layer"]: l["keep_fp32"] for l in doc["layers"]} == {"big": True, "small + sum": False}
    alone = {l["layer"]: l["score_alone_reduced"] for l in doc["layers"]}
    # alone in BF16, the big branch costs what the whole plan did; the small one with the sum (its FP32 residual
    # and FP32 output, neither rounded) next to nothing
    assert alone["big"] == pytest.approx(report.score_all_reduced, rel=0.2) and alone["small + sum"] < 1e-5
    assert all(l["score_alone_fp32"] is None for l in doc["layers"])


def test_debug_precision_with_int8_and_bf16_searches_the_bf16_layers_without_calibration(bf16_kernels):
    """trtexec's habit --int8 --fp16: without --calib no layer gets INT8, each falls back to BF16, and the search
    has BF16 layers to choose from (with --int8 alone it is an error: nothing to choose)."""
    from kiln.tools.debug_precision import debug_precision

    report = debug_precision(two_branch(), int8=True, bf16=True, precision_constraints="prefer",
                             accuracy="l2:0.0005", autotune=False)
    assert report.keep_fp32_nodes == ("big",)
    assert [(v.layer, v.granted) for v in report.verdicts] == [("big", "FP32"), ("small + sum", "BF16")]
    with pytest.raises(kiln.ModelError, match="--int8 needs calibration data"):
        debug_precision(two_branch(), int8=True, autotune=False)


def test_debug_precision_answers_when_an_external_region_wins_the_race(monkeypatch, bf16_kernels):
    """The whole-plan race may replace kiln's plan by one OpenVINO or onnxruntime region (ResNet-18 did, and
    `kiln debug precision` failed with a KeyError on the first layer): the answer comes from kiln's plan as the
    budget left it, recorded in the build info."""
    import dataclasses

    import kiln.tools.debug_precision as tool

    build = kiln.build

    def region_wins(model, **options):
        engine = build(model, **options)
        only = dataclasses.replace(engine.plan.layers[0], name="{ForeignNode[big...sum]}", origin=("big", "small"))
        engine.plan = dataclasses.replace(engine.plan, layers=(only,))
        return engine
    monkeypatch.setattr(kiln, "build", region_wins)
    report = tool.debug_precision(two_branch(), bf16=True, precision_constraints="prefer", accuracy="l2:0.0005",
                                  autotune=False)
    assert report.keep_fp32_nodes == ("big",)
    assert [(v.layer, v.onnx_nodes, v.keep_fp32, v.granted) for v in report.verdicts] == [
        ("big", ("big",), True, "FP32"), ("small + sum", ("small", "sum"), False, "BF16")]


def test_debug_precision_without_a_reduced_precision_layer_says_why(tmp_path, monkeypatch, capsys):
    from kiln import hardware
    from kiln.cli.main import main

    isa = hardware.cpu_isa() - {"avx512_fp16"}
    monkeypatch.setattr(hardware, "cpu_isa", lambda: isa)   # a CPU without FP16 arithmetic: no layer gets FP16
    path = tmp_path / "m.onnx"
    onnx.save(two_branch(), path)
    assert main(["debug", "precision", str(path), "--fp16", "--builder-optimization-level", "0"]) == 2
    assert "no layer was granted a reduced precision, so there is nothing to search" in capsys.readouterr().err


def test_budget_inputs_draw_token_ids_within_the_embedding_and_masks_as_ones():
    """Zeros as token ids (and masks) judged a BERT by one embedding row: ids come from the table's range."""
    from kiln.planning.accuracy import random_input
    from tests.passes.ir_builder import IRBuilder

    b = IRBuilder()
    ids, mask = b.input("ids", (2, 16), np.int64), b.input("mask", (2, 16), np.int64)
    emb = b.node("Gather", [b.const("table", np.zeros((30, 8))), ids], "emb", (2, 16, 8), dtype=np.float32, axis=0)
    g = b.graph(emb, b.node("Cast", [mask], "m", (2, 16), dtype=np.float32, to=1))
    drawn = random_input(g.values["ids"])
    assert drawn.dtype.is_floating_point is False and int(drawn.min()) >= 0 and int(drawn.max()) < 30
    assert len(set(drawn.flatten().tolist())) > 5                    # not a constant
    assert random_input(g.values["mask"]).eq(1).all()
    # the budget's batches differ by seed, each reproducible
    assert torch.equal(random_input(g.values["ids"], 1), random_input(g.values["ids"], 1))
    assert not torch.equal(random_input(g.values["ids"], 1), drawn)
    x = b.input("x", (4, 8), np.float32)
    assert torch.equal(random_input(x, 2), random_input(x, 2)) and not torch.equal(random_input(x, 2), random_input(x))


@pytest.mark.parametrize("passing, want", [
    ({1} | set(range(5, 11)), 1),        # not monotonic: a bisection from the middle settles on 5
    (set(range(6, 11)), 6),              # monotonic: the smallest passing count
    ({10}, 10),                          # only every layer kept
    (set(), None)])                      # not even every layer
def test_the_search_finds_the_fewest_kept_layers_from_below(passing, want):
    """Scores near the budget are not monotonic in the number of layers kept (re-lowering moves bf16 storage
    around them): the search doubles from one kept layer before it bisects, so a small set that meets the budget
    is found, and each count is tried once."""
    from kiln.planning.accuracy import fewest_that_pass

    tried = []

    def attempt(k):
        tried.append(k)
        return k in passing, f"plan keeping {k}"
    found = fewest_that_pass(10, attempt)
    assert found == (None if want is None else (want, f"plan keeping {want}"))
    assert len(tried) == len(set(tried))


def plus_small_branches(nodes: list, head: str, inits: list, n: int, scale: float) -> onnx.ModelProto:
    """y = `head` (what `nodes` compute from input x) + sum of `n` small branches x_i @ W_i (inputs of their own, so
    they do not merge)."""
    h, vi = helper.make_node, helper.make_tensor_value_info
    for i in range(n):
        nodes.append(h("MatMul", [f"x{i}", f"w{i}"], [f"s{i}"], name=f"small{i}"))
        inits.append(init(f"w{i}", rand((64, 64), 10 + i) * scale))
    nodes.append(h("Sum", [head] + [f"s{i}" for i in range(n)], ["y"], name="sum"))
    inputs = [vi(name, TensorProto.FLOAT, [8, 64]) for name in ["x"] + [f"x{i}" for i in range(n)]]
    return make_model(nodes, inputs, [vi("y", TensorProto.FLOAT, [8, 64])], inits)


def many_branches(n: int = 16) -> onnx.ModelProto:
    """y = x @ Wbig + n small branches: only the big branch's BF16 error matters."""
    nodes = [helper.make_node("MatMul", ["x", "wbig"], ["big_out"], name="big")]
    return plus_small_branches(nodes, "big_out", [init("wbig", rand((64, 64), 1) * 100)], n, 0.01)


def offset_branch(n: int = 8) -> onnx.ModelProto:
    """y = (relu(x @ W + 300) - 300) + n small products: the first product's fused output sits near 300, where
    bf16 keeps about one unit, so its harm is the rounding of the tensor it writes, not its arithmetic."""
    h = helper.make_node
    nodes = [h("MatMul", ["x", "w"], ["a"], name="proj"), h("Add", ["a", "offset"], ["b"], name="shift"),
             h("Relu", ["b"], ["c"], name="act"), h("Sub", ["c", "offset"], ["d"], name="back")]
    inits = [init("w", rand((64, 64), 1) * 0.1), init("offset", np.full((64,), 300.0, np.float32))]
    return plus_small_branches(nodes, "d", inits, n, 0.1)


def test_a_layer_whose_harm_is_the_tensor_it_writes_is_ranked_first(caplog, bf16_kernels):
    """Each layer is ranked by the harm it does alone in BF16, its stored output's rounding included. Swapping just
    its kernel for an FP32 one (the ranking before) keeps the bf16 tensor it writes, so `proj` looked harmless and
    every layer had to be re-lowered alone to find it."""
    caplog.set_level(logging.INFO, logger="kiln.build")
    model = offset_branch()
    engine = kiln.build(model, bf16=True, precision_constraints="prefer", accuracy="cos:0.9999", autotune=False)
    kept = [l.name for l in engine.plan.layers if l.precision_reason.startswith("accuracy budget")]
    assert kept == ["proj + shift + act"]
    # where BF16 is emulated only the products are reduced: the FP32 Sub after proj keeps its tensor FP32, so the
    # harm of a bf16 tensor is not there to rank, and the search measures each layer instead
    assert ("measuring each layer re-lowered" not in caplog.text) == (bf16_kernels == "native")
    rng = np.random.default_rng(11)
    feeds = {i.name: rng.standard_normal((8, 64)).astype(np.float32) for i in model.graph.input}
    assert cosine(engine.run(feeds)["y"], run_ort(model, feeds)[0]) > 0.9999


def rank_big_last(monkeypatch) -> None:
    """The harm-alone ranking misled on purpose: the big branch ranked least harmful (l2 with only it reduced:
    lower is better, so the lowest ranks last)."""
    from kiln.planning import accuracy

    real = accuracy.reduced_alone

    def misleading(*args):
        scores = real(*args)
        return {name: (min(scores.values()) / 2 if name == "big" else score) for name, score in scores.items()}
    monkeypatch.setattr(accuracy, "reduced_alone", misleading)


def test_when_the_harm_alone_misleads_each_layer_is_measured_relowered(caplog, bf16_kernels, monkeypatch):
    """Reduced precision's harm is not additive, so the layers that hurt most alone may not be the ones whose
    return to FP32 helps most. Here the misranking is forced: the big branch ranked least harmful. The search then
    needs every layer, so kiln measures each layer re-lowered alone in FP32 and keeps just the big one."""
    rank_big_last(monkeypatch)
    caplog.set_level(logging.INFO, logger="kiln.build")
    engine = kiln.build(many_branches(), bf16=True, precision_constraints="prefer", accuracy="l2:0.0005",
                        autotune=False)
    kept = [l.name for l in engine.plan.layers if l.precision_reason.startswith("accuracy budget")]
    assert kept == ["big"]
    assert "measuring each layer re-lowered alone in FP32" in caplog.text
    kept = f"1 of {reduced_count(bf16_kernels, 17)} reduced-precision layers kept in FP32"
    assert f"Accuracy budget l2:0.0005 (checked as l2:0.0004): {kept}" in caplog.text


@pytest.mark.parametrize("trim_s", [0, 60])
def test_the_exact_ranking_stops_at_its_time_limit(caplog, bf16_kernels, monkeypatch, trim_s):
    """Re-lowering every layer of a large model could take minutes: past EXACT_RANKING_S the layers not yet measured
    keep their harm-alone rank (here none is measured, so the misled search keeps every small branch before the big
    one). Trying each kept layer back in reduced precision then returns the small ones, within TRIM_S."""
    from kiln.planning import accuracy

    rank_big_last(monkeypatch)
    monkeypatch.setattr(accuracy, "EXACT_RANKING_S", 0)
    monkeypatch.setattr(accuracy, "TRIM_S", trim_s)
    caplog.set_level(logging.INFO, logger="kiln.build")
    engine = kiln.build(many_branches(), bf16=True, precision_constraints="prefer", accuracy="l2:0.0005",
                        autotune=False)
    measured = f"0 of {reduced_count(bf16_kernels, 17)} layers measured re-lowered within 0 s"
    assert f"Accuracy budget: {measured}" in caplog.text
    kept = [l.name for l in engine.plan.layers if l.precision_reason.startswith("accuracy budget")]
    if trim_s:
        assert kept == ["big"] and relative_l2_of(engine) < 5e-4
        assert "the budget holds with 16 of the search's layers back in reduced precision" in caplog.text
    else:   # correct but not the fewest
        assert kept == ["big"] + [f"small{i}" for i in range(16)] and relative_l2_of(engine) < 5e-4
        assert "trying kept layers back in reduced precision stopped after 0 s" in caplog.text


def test_kept_layers_go_back_to_reduced_precision_costliest_first(monkeypatch):
    """The search kept three layers; the budget holds with `needed` and either of the others, not with `needed`
    alone. Trying the costliest first returns the 2 ms layer and keeps the 0.1 ms one."""
    from types import SimpleNamespace

    from kiln.planning import accuracy
    from kiln.precision.policy import PrecisionDecision

    names = ["needed", "cheap", "costly"]
    lowered = SimpleNamespace(precisions={n: PrecisionDecision("BF16", "BF16") for n in names},
                              timed_ms={"needed": 1.0, "cheap": 0.1, "costly": 2.0})

    def relower(decisions):   # a "plan" is the set of layers it keeps in FP32
        return frozenset(n for n, d in decisions.items() if d.granted == "FP32")
    tried = []

    def evaluate(g, kept_fp32, budget, batches, references):
        tried.append(sorted(kept_fp32))
        return 0.9995 if "needed" in kept_fp32 and kept_fp32 & {"cheap", "costly"} else 0.99
    monkeypatch.setattr(accuracy, "evaluate", evaluate)
    kept, (plan, score) = accuracy.trimmed(None, lowered, relower, AccuracyBudget.parse("cos:0.999"), [], [],
                                           names, ("search's plan", 0.9997))
    assert kept == ["needed", "cheap"] and plan == {"needed", "cheap"} and score == 0.9995
    assert tried == [["cheap", "needed"], ["cheap"], ["needed"]]


def relative_l2_of(engine) -> float:
    rng = np.random.default_rng(7)
    model = many_branches()
    feeds = {i.name: rng.standard_normal((8, 64)).astype(np.float32) for i in model.graph.input}
    got, want = engine.run(feeds)["y"].astype(np.float64), run_ort(model, feeds)[0].astype(np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))
