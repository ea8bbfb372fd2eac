"""Calibration for implicit INT8: data loading, ranges via onnxruntime, minmax/percentile/entropy scales, Q/DQ
insertion that onnxruntime runs close to float, and the JSON calibration cache with its validation."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import kiln
from kiln.preprocess import calibration as cal
from tests.conftest import cosine, rand
from tests.precision.models import conv_net


def ort_run(model, feeds, basic: bool = False) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    if basic:   # Q/DQ executed as written (no fusion into integer kernels)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def batches(n: int = 6) -> list[dict[str, np.ndarray]]:
    return [{"x": rand((1, 3, 16, 16), 100 + i)} for i in range(n)]


# ---------------------------------------------------------------- scales

def test_minmax_is_max_abs_over_127():
    scales = cal.compute_scales({"t": np.array([-7.0, 3.0, 5.0, -0.5])}, "minmax")
    assert scales == {"t": pytest.approx(7.0 / 127)}


def test_percentile_reads_the_histogram_to_within_one_bin():
    x = np.arange(-1000, 1001, dtype=np.float64)
    for p in (50, 99, 99.9):
        t = cal.compute_scales({"t": x}, "percentile", percentile=p)["t"] * 127
        assert abs(t - np.percentile(np.abs(x), p)) <= 1000 / cal.BINS + 1e-9
    assert cal.compute_scales({"t": x}, "percentile", percentile=100)["t"] * 127 == pytest.approx(1000)


def test_entropy_clips_a_heavy_tail_between_p99_and_max():
    x = np.random.default_rng(0).standard_t(3, 200_000)
    t = cal.compute_scales({"t": x}, "entropy")["t"] * 127
    a = np.abs(x)
    assert np.percentile(a, 99) < t < 0.5 * a.max()


def test_entropy_keeps_nearly_the_whole_range_of_a_uniform_sample():
    x = np.random.default_rng(1).uniform(-2, 2, 100_000)
    assert cal.compute_scales({"t": x}, "entropy")["t"] * 127 > 0.95 * np.abs(x).max()


def test_entropy_does_not_collapse_on_a_sparse_histogram_away_from_zero():
    x = np.random.default_rng(2).uniform(1.0, 2.0, 64)   # no mass near 0: KL is trivially 0 at the minimum
    t = cal.compute_scales({"t": x}, "entropy")["t"] * 127
    assert t >= np.median(x)


def test_scale_edge_cases():
    assert cal.compute_scales({"z": np.zeros(10)}, "entropy")["z"] == pytest.approx(cal.MIN_THRESHOLD / 127)
    with pytest.raises(kiln.InputError, match="unknown calibration method 'kl'"):
        cal.compute_scales({"t": np.ones(3)}, "kl")
    with pytest.raises(kiln.InputError, match="percentile 0"):
        cal.compute_scales({"t": np.ones(3)}, "percentile", percentile=0)


def test_collect_ranges_through_onnxruntime():
    model, data = conv_net(), batches(4)
    names = cal.quantizable_activations(model)
    assert names == ["x", "r1", "r2", "f", "m"]   # conv, conv, the pool's input (conv2 then writes INT8), fc, head
    stats = cal.collect_ranges(model, data, names)
    assert stats["x"].amax == pytest.approx(max(float(np.abs(b["x"]).max()) for b in data))
    assert stats["x"].count == 4 * 3 * 16 * 16 and int(stats["x"].hist.sum()) == stats["x"].count
    assert stats["r1"].hist.shape == (cal.BINS,) and stats["r1"].amax > 0
    with pytest.raises(kiln.ModelError, match="nowhere"):
        cal.collect_ranges(model, data, ["nowhere"])


# ---------------------------------------------------------------- Q/DQ

@pytest.fixture(scope="module")
def calibrated():
    model = conv_net(relu2=False)
    stats = cal.collect_ranges(model, batches(), cal.quantizable_activations(model))
    return model, stats


def count(model, op: str) -> int:
    return sum(n.op_type == op for n in model.graph.node)


@pytest.mark.parametrize("method", cal.METHODS)
def test_qdq_model_runs_in_onnxruntime_close_to_float(calibrated, method):
    model, stats = calibrated
    q = cal.quantize_with_qdq(model, cal.compute_scales(stats, method))
    onnx.checker.check_model(q)
    assert count(q, "QuantizeLinear") == 5 and count(q, "DequantizeLinear") == 9   # 5 activations + 4 weights
    x = {"x": rand((1, 3, 16, 16), 999)}
    ref = ort_run(model, x)
    assert cosine(ort_run(q, x, basic=True), ref) >= 0.999
    assert cosine(ort_run(q, x), ref) >= 0.99   # with onnxruntime's integer kernels


def test_qdq_weights_are_int8_per_output_channel(calibrated):
    model, stats = calibrated
    q = cal.quantize_with_qdq(model, cal.compute_scales(stats))
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    assert not {"w1", "w2", "fc_w", "g_w"} & set(inits)   # the float weights are gone
    axes = {n.input[0]: next((a.i for a in n.attribute if a.name == "axis"), None)
            for n in q.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    assert axes == {"w1_int8": 0, "w2_int8": 0, "fc_w_int8": 1, "g_w_int8": 0}   # g_w: Gemm with transB=1
    assert inits["w2_int8"].dtype == np.int8 and inits["w2_int8_scale"].shape == (16,)
    assert inits["fc_w_int8_scale"].shape == (10,) and inits["g_w_int8_scale"].shape == (6,)
    assert not inits["w1_int8_zero_point"].any() and inits["x_q_zero_point"].dtype == np.int8
    w1 = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w1"))
    assert inits["w1_int8_scale"] == pytest.approx(np.abs(w1).reshape(8, -1).max(1) / 127)
    assert np.abs(inits["w1_int8"]).max() == 127


def test_qdq_per_tensor_and_partial_scales(calibrated):
    model, stats = calibrated
    scales = cal.compute_scales(stats)
    per_tensor = cal.quantize_with_qdq(model, scales, weight_per_channel=False)
    assert all(numpy_helper.to_array(t).ndim == 0 for t in per_tensor.graph.initializer if t.name.endswith("_scale"))
    only_first = cal.quantize_with_qdq(model, {"x": scales["x"]})   # other layers stay float
    assert count(only_first, "QuantizeLinear") == 1 and count(only_first, "DequantizeLinear") == 2
    assert {"w2", "fc_w", "g_w"} <= {t.name for t in only_first.graph.initializer}
    assert cosine(ort_run(only_first, {"x": batches(1)[0]["x"]}), ort_run(model, batches(1)[0])) > 0.999
    old = onnx.ModelProto()
    old.CopyFrom(model)
    old.opset_import[0].version = 11
    with pytest.raises(kiln.ModelError, match="opset >= 13"):
        cal.quantize_with_qdq(old, scales)


# ---------------------------------------------------------------- cache

def test_cache_round_trip(tmp_path):
    path = tmp_path / "calib.json"
    cal.save_cache(path, {"x": 0.02, "r1": 1e-3}, "entropy")
    doc = json.loads(path.read_text())
    assert doc == {"kind": "kiln-calibration-cache", "version": 1, "method": "entropy",
                   "scales": {"r1": 1e-3, "x": 0.02}}
    assert cal.load_cache(path) == cal.CalibrationCache("entropy", {"x": 0.02, "r1": 1e-3})
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("text, message", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "not a calibration cache"),
    ('{"kind": "tensorrt", "version": 1, "method": "entropy", "scales": {}}', "not a calibration cache"),
    ('{"kind": "kiln-calibration-cache", "version": 2, "method": "entropy", "scales": {}}', "version 2"),
    ('{"kind": "kiln-calibration-cache", "version": "1", "method": "entropy", "scales": {}}', "version '1'"),
    ('{"kind": "kiln-calibration-cache", "version": 1, "method": 3, "scales": {}}', "method"),
    ('{"kind": "kiln-calibration-cache", "version": 1, "method": "minmax", "scales": [0.1]}', "scales"),
    ('{"kind": "kiln-calibration-cache", "version": 1, "method": "minmax", "scales": {"x": "0.1"}}', "'x'"),
    ('{"kind": "kiln-calibration-cache", "version": 1, "method": "minmax", "scales": {"x": -0.1}}', "positive"),
    ('{"kind": "kiln-calibration-cache", "version": 1, "method": "minmax", "scales": {"x": true}}', "'x'"),
    ('{"kind": "kiln-calibration-cache", "version": 1, "method": "minmax", "scales": {"x": NaN}}', "finite"),
])
def test_malformed_cache_names_the_file(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(kiln.Error, match=message) as info:
        cal.load_cache(path)
    assert str(path) in str(info.value)


def test_unreadable_cache_and_bad_scales_on_save(tmp_path):
    with pytest.raises(kiln.Error, match="missing.json"):
        cal.load_cache(tmp_path / "missing.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(kiln.Error, match="bin.json"):
        cal.load_cache(tmp_path / "bin.json")
    with pytest.raises(kiln.Error, match="out.json"):
        cal.save_cache(tmp_path / "out.json", {"x": 0.0}, "minmax")
    assert not (tmp_path / "out.json").exists()


# ---------------------------------------------------------------- data

def test_data_from_a_folder(tmp_path):
    for i in range(3):
        np.savez(tmp_path / f"batch{i}.npz", x=rand((2, 3, 16, 16), i))
    data = cal.load_calibration_data(tmp_path, ["x"])
    assert len(data) == 3 and data[1]["x"].shape == (2, 3, 16, 16)
    np.testing.assert_array_equal(data[2]["x"], rand((2, 3, 16, 16), 2))


def test_data_from_one_npz(tmp_path):
    np.savez(tmp_path / "calib.npz", x=rand((4, 3, 16, 16)), mask=np.ones((4, 5), np.int64))
    data = cal.load_calibration_data(tmp_path / "calib.npz", ["x", "mask"])
    assert len(data) == 4 and data[0]["x"].shape == (1, 3, 16, 16) and data[3]["mask"].shape == (1, 5)
    np.savez(tmp_path / "stack.npz", x=rand((5, 1, 3, 16, 16)))   # rank + 1: a stack of whole inputs
    stacked = cal.load_calibration_data(tmp_path / "stack.npz", ["x"], {"x": 4})
    assert len(stacked) == 5 and stacked[4]["x"].shape == (1, 3, 16, 16)


def test_one_npz_splits_into_batches_of_the_models_static_batch(tmp_path):
    """A model taking x as [8, 64] reads an [16, 64] array as two batches of 8 (not 16 rows of 1, which the model
    cannot take); a row count that is not a multiple of 8 is a clear error naming the array and the batch."""
    np.savez(tmp_path / "calib.npz", x=rand((16, 64)), ids=np.arange(32).reshape(16, 2))
    data = cal.load_calibration_data(tmp_path / "calib.npz", ["x", "ids"], {"x": 2, "ids": 2}, {"x": 8, "ids": 8})
    assert len(data) == 2 and data[1]["x"].shape == (8, 64) and data[1]["ids"][0, 0] == 16
    np.savez(tmp_path / "odd.npz", x=rand((12, 64)), ids=np.zeros((12, 2), np.int64))
    with pytest.raises(kiln.InputError, match=r"odd\.npz: array 'x' has 12 rows .* takes batches of 8"):
        cal.load_calibration_data(tmp_path / "odd.npz", ["x", "ids"], {"x": 2, "ids": 2}, {"x": 8, "ids": 8})


def test_data_errors_name_the_file_and_the_inputs(tmp_path):
    np.savez(tmp_path / "calib.npz", image=rand((2, 3, 16, 16)))
    with pytest.raises(kiln.InputError, match=r"calib\.npz.*missing \['x'\], unknown \['image'\]"):
        cal.load_calibration_data(tmp_path / "calib.npz", ["x"])
    with pytest.raises(kiln.InputError, match="no such calibration data"):
        cal.load_calibration_data(tmp_path / "absent.npz", ["x"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(kiln.InputError, match="no .npz files"):
        cal.load_calibration_data(tmp_path / "empty", ["x"])
    np.savez(tmp_path / "ragged.npz", a=np.zeros((2, 3)), b=np.zeros((3, 3)))
    with pytest.raises(kiln.InputError, match="same number of batches"):
        cal.load_calibration_data(tmp_path / "ragged.npz", ["a", "b"])
    np.savez(tmp_path / "pickled.npz", x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(kiln.InputError, match="pickled.npz"):
        cal.load_calibration_data(tmp_path / "pickled.npz", ["x"])
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(kiln.InputError, match="junk.npz"):
        cal.load_calibration_data(tmp_path / "junk.npz", ["x"])


def test_calibrate_from_data_writes_a_cache_that_reproduces_the_scales(tmp_path):
    model = conv_net()
    np.savez(tmp_path / "calib.npz", x=np.concatenate([b["x"] for b in batches(3)]))
    scales = cal.calibrate(model, tmp_path / "calib.npz", "entropy", cache=tmp_path / "calib.json")
    assert set(scales) == {"x", "r1", "r2", "f", "m"} and all(s > 0 for s in scales.values())
    assert cal.load_cache(tmp_path / "calib.json").method == "entropy"
    assert cal.calibrate(model, tmp_path / "calib.json") == pytest.approx(scales)
