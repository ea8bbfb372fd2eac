"""The accuracy budget for implicit INT8 (--int8 --calib --accuracy): a conv whose input has a huge outlier
channel is destroyed by per-tensor s8 activations; the budget keeps exactly that ONNX node unquantized (FP32,
reason "accuracy budget"), judged against onnxruntime FP32, and `kiln debug precision --int8` names it."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import numpy as np
import onnx
import pytest

import kiln
from kiln.planning.accuracy import AccuracyBudget
from kiln.planning.int8_budget import Scored, fewest_kept_fp32
from kiln.preprocess import calibration as cal
from tests.conftest import cosine, run_ort
from tests.precision.models import outlier_conv_net

CALIB = dict(int8=True, calibration_method="minmax", autotune=False)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """(model path, calibration data path) for outlier_conv_net."""
    folder = tmp_path_factory.mktemp("int8_budget")
    model, data = folder / "m.onnx", folder / "calib.npz"
    onnx.save(outlier_conv_net(), model)
    np.savez(data, x=np.random.default_rng(0).standard_normal([8, 1, 3, 16, 16]).astype(np.float32))
    return model, data


def fresh_cosine(engine) -> float:
    """Cosine to onnxruntime FP32 on inputs the calibration never saw."""
    x = np.random.default_rng(42).standard_normal([4, 1, 3, 16, 16]).astype(np.float32)
    got = np.concatenate([engine.run({"x": b})["y"] for b in x])
    want = np.concatenate([run_ort(outlier_conv_net(), {"x": b})[0] for b in x])
    return cosine(got, want)


def layer_of(engine, node: str):
    return next(l for l in engine.plan.layers if node in l.origin)


def test_the_budget_keeps_exactly_the_hostile_conv_in_fp32(hostile, caplog):
    model, data = hostile
    caplog.set_level(logging.INFO, logger="kiln.build")
    plain = kiln.build(str(model), calibration=str(data), **CALIB)
    assert layer_of(plain, "conv2").precision == "INT8" and "accuracy_budget" not in plain.plan.build_info
    assert fresh_cosine(plain) < 0.98          # per-tensor s8 on conv2's input destroys the other channels
    caplog.clear()
    engine = kiln.build(str(model), calibration=str(data), accuracy="cos:0.999", **CALIB)
    kept = layer_of(engine, "conv2")
    assert (kept.op_type, kept.precision, kept.requested_precision) == ("Conv", "FP32", "INT8")
    assert kept.precision_reason == "accuracy budget: kept in FP32 so the plan meets it"
    assert {n: layer_of(engine, n).precision for n in ("conv1", "fc", "head")} == dict.fromkeys(
        ("conv1", "fc", "head"), "INT8")
    assert fresh_cosine(engine) >= 0.999
    report = engine.plan.build_info["accuracy_budget"]
    assert (report["precision"], report["budget"], report["kept_fp32_nodes"], report["kept_fp32_layers"]) == \
        ("INT8", "cos:0.999", ["conv2"], [kept.name])
    assert report["quantized_nodes"] == ["conv1", "conv2", "fc", "head"]
    assert report["score_before"] < 0.999 <= report["score_after"]
    assert max(report["sensitivity"], key=report["sensitivity"].get) == "conv2"
    assert "Accuracy budget cos:0.999: 1 of 4 INT8-calibrated nodes kept in FP32 (cos 0.9" in caplog.text
    assert caplog.text.endswith(": conv2\n") or ": conv2\n" in caplog.text
    info = {l["Name"]: l for l in engine.layer_info()["Layers"]}
    assert info[kept.name]["GrantedPrecision"] == "FP32" and "accuracy budget" in info[kept.name]["PrecisionReason"]


def test_a_met_budget_changes_nothing(hostile):
    model, data = hostile
    engine = kiln.build(str(model), calibration=str(data), accuracy="cos:0.9", **CALIB)
    assert layer_of(engine, "conv2").precision == "INT8"
    report = engine.plan.build_info["accuracy_budget"]
    assert report["kept_fp32_nodes"] == [] and report["score_before"] == report["score_after"] >= 0.9


def test_exclusion_leaves_the_node_unquantized():
    model = outlier_conv_net()
    batches = [{"x": np.random.default_rng(i).standard_normal([1, 3, 16, 16]).astype(np.float32)} for i in range(4)]
    scales = cal.compute_scales(cal.collect_ranges(model, batches, cal.quantizable_activations(model)), "minmax")
    assert cal.quantizable_nodes(model, scales) == ["conv1", "conv2", "fc", "head"]
    q = cal.quantize_with_qdq(model, scales, exclude=frozenset({"conv2"}))
    nodes = {n.name: n for n in q.graph.node}
    assert list(nodes["conv2"].input) == ["r1", "w2", "b2"]                    # raw input, float weights
    assert "w2" in {t.name for t in q.graph.initializer}
    assert nodes["conv1"].input[0] == "x_q_dequantized" and nodes["fc"].input[1] == "fc_w_int8_dequantized"
    x = {"x": np.random.default_rng(3).standard_normal([1, 3, 16, 16]).astype(np.float32)}
    want = run_ort(model, x)[0]
    assert cosine(run_ort(q, x)[0], want) > 0.999 > cosine(run_ort(cal.quantize_with_qdq(model, scales), x)[0], want)
    with pytest.raises(kiln.ModelError, match=r"nodes to keep in FP32 \['nope'\] are not nodes of the model"):
        cal.quantize_with_qdq(model, scales, exclude=frozenset({"nope"}))


def test_the_search_keeps_the_fewest_most_sensitive_nodes():
    """A fake plan whose cosine loses each quantized node's own error: a and b must go, c may stay."""
    errors = {"a": 0.05, "b": 0.03, "c": 0.001, "d": 0.002}
    tried = []

    def trial(excluded):
        tried.append(excluded)
        return Scored(excluded, 1 - sum(e for n, e in errors.items() if n not in excluded), None)
    budget = AccuracyBudget.parse("cos:0.99")
    best, kept, sensitivity = fewest_kept_fp32(list(errors), trial, budget, trial(frozenset()))
    assert kept == ("a", "b") and best.excluded == {"a", "b"} and sensitivity["a"] == pytest.approx(0.967)
    assert len(tried) <= 2 + len(errors) + 3           # none and all kept, one per node, then the bisection
    with pytest.raises(kiln.ModelError, match=r"cos:1\.5 cannot be met even with every layer in FP32"):
        fewest_kept_fp32(list(errors), trial, AccuracyBudget.parse("cos:1.5"), trial(frozenset()))


def test_debug_precision_int8_prints_the_onnx_node(hostile, tmp_path):
    model, data = hostile
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "kiln.cli.main", "debug", "precision", str(model), "--int8",
                           "--calib", str(data), "--calib-method", "minmax", "--builder-optimization-level", "0",
                           "--json", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.endswith("1 ONNX node(s) must stay in FP32:"))
    assert lines[at + 1] == "conv2" and lines[at + 2].endswith(f"Report written to {out}")
    doc = json.loads(out.read_text())
    assert (doc["budget"], doc["keep_fp32_onnx_nodes"]) == ("cos:0.999", ["conv2"])   # the default for --int8
    assert [(l["onnx_nodes"], l["keep_fp32"], l["granted"]) for l in doc["layers"]] == [
        (["conv2"], True, "FP32"), (["conv1"], False, "INT8"), (["fc"], False, "INT8"), (["head"], False, "INT8")]


def test_impossible_budget_and_uncalibrated_int8_exit_2(hostile, tmp_path):
    model, data = hostile
    engine = tmp_path / "m.kiln"
    done = subprocess.run([sys.executable, "-m", "kiln.cli.main", "build", str(model), "-o", str(engine), "--int8",
                           "--calib", str(data), "--accuracy", "cos:1.5", "--builder-optimization-level", "0"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr and not engine.exists()
    assert "the accuracy budget cos:1.5 cannot be met even with every layer in FP32" in done.stderr
    done = subprocess.run([sys.executable, "-m", "kiln.cli.main", "debug", "precision", str(model), "--int8",
                           "--builder-optimization-level", "0"], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "the model's own Q/DQ nodes, which fix each layer's precision, so there is nothing to choose" in done.stderr
