"""The kiln CLI as a user runs it: exit codes, files written (and not written), trtexec-schema exports."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.tactics import onednn_prim
from tests.conftest import make_model

FIXTURES = Path(__file__).parent.parent / "fixtures"


def cnn_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((8 * 4 * 4, 5)).astype(np.float32), "fc_w"),
             numpy_helper.from_array(np.array([1, -1], np.int64), "shape")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Reshape", ["p", "shape"], ["f"], name="flatten"),
             helper.make_node("MatMul", ["f", "fc_w"], ["y"], name="fc")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])], inits)


def kiln_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    onnx.save(cnn_model(), d / "m.onnx")
    r = kiln_cli("build", str(d / "m.onnx"), "-o", str(d / "m.kiln"), "--verbose", "--builder-optimization-level", "0",
                 "--export-layer-info", str(d / "layers.json"))
    assert r.returncode == 0, r.stderr
    return d, r


def test_build_writes_engine_and_logs_passes(built):
    d, r = built
    assert (d / "m.kiln").is_file()
    for line in ("Original: 5 layers", "After dead-layer removal: 5 layers", "ConvReluFusion: Fusing conv with relu",
                 "Graph construction and optimization completed in", "Total Activation Memory:"):
        assert line in r.stdout, line


def test_detailed_layer_info_uses_trtexec_keys(built):
    d, _ = built
    info = json.loads((d / "layers.json").read_text())
    assert set(info) == {"Layers", "Bindings", "TacticSources"} and info["Bindings"] == ["x", "y"]
    first_onednn = "onednn" if onednn_prim.available() else "torch-onednn"   # the first candidates: untimed
    assert "torch" in info["TacticSources"]["Available"] and first_onednn in info["TacticSources"]["Used"]
    conv = next(l for l in info["Layers"] if l.get("ParameterType") == "Convolution")
    trt = json.loads((FIXTURES / "resnet18_trt10_detailed.layers.json").read_text())
    trt_conv = next(l for l in trt["Layers"] if l.get("ParameterType") == "Convolution")
    assert set(trt_conv) <= set(conv), set(trt_conv) - set(conv)
    assert conv["Name"] == "conv + relu" and conv["Activation"] == "RELU" and conv["HasReLU"] == 1
    assert conv["Metadata"] == "[ONNX Layer: conv]\u001e[ONNX Layer: relu]"
    assert conv["Weights"] == {"Type": "Float", "Count": 216} and conv["Bias"] == {"Type": "Float", "Count": 8}
    assert conv["TacticValue"].startswith("0x") and len(conv["TacticValue"]) == 18
    pool = next(l for l in info["Layers"] if l.get("ParameterType") == "Pooling")
    trt_pool = next(l for l in trt["Layers"] if l.get("ParameterType") == "Pooling")
    assert set(trt_pool) <= set(pool)
    assert pool["PoolingType"] == "MAX" and pool["WindowSize"] == [2, 2]
    for layer in info["Layers"]:
        for t in layer["Inputs"] + layer["Outputs"]:
            assert set(t) == {"Name", "Location", "Dimensions", "Format/Datatype"}
            assert t["Format/Datatype"] in ("Row major linear FP32", "Channel major FP32 format")
    reformat = info["Layers"][0]
    assert reformat["Name"] == "Reformatting CopyNode for Input Tensor 0 to conv + relu"
    assert reformat["LayerType"] == "Reformat" and reformat["Origin"] == "REFORMAT"


def test_names_only_and_none_verbosity(built):
    d, _ = built
    for verbosity, expect in (("layer_names_only", str), ("none", None)):
        r = kiln_cli("inspect", str(d / "m.kiln"), "--layer-info", verbosity)
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        assert info["Bindings"] == ["x", "y"]
        if expect is None:
            assert info["Layers"] == []
        else:
            assert info["Layers"] and all(isinstance(n, str) for n in info["Layers"])
    trt = json.loads((FIXTURES / "resnet18_trt10_names_only.layers.json").read_text())
    assert set(trt) <= set(info)   # trtexec's keys, plus kiln's TacticSources where layers are listed


def test_run_exports_profile_and_times_in_trtexec_schema(built):
    d, _ = built
    r = kiln_cli("run", str(d / "m.kiln"), "--iterations", "5", "--warmup", "1", "--export-profile",
                 str(d / "p.json"), "--export-times", str(d / "t.json"), "--dump-profile",
                 "--export-output", str(d / "out.npz"))
    assert r.returncode == 0, r.stderr
    assert "=== Performance summary ===" in r.stdout and "Throughput:" in r.stdout
    assert "Latency: min = " in r.stdout and "percentile(99%)" in r.stdout
    assert "Time(ms)     Avg.(ms)   Median(ms)   Time(%)   Layer" in r.stdout
    prof = json.loads((d / "p.json").read_text())
    assert prof[0] == {"count": 5}
    for rec in prof[1:]:
        assert list(rec) == ["name", "timeMs", "averageMs", "medianMs", "percentage"]
    assert abs(sum(r["percentage"] for r in prof[1:]) - 100) < 0.1
    times = json.loads((d / "t.json").read_text())
    assert len(times) == 5
    assert list(times[0]) == ["startEnqMs", "endEnqMs", "startH2dMs", "endH2dMs", "startComputeMs", "endComputeMs",
                              "startD2hMs", "endD2hMs", "h2dMs", "computeMs", "d2hMs", "latencyMs"]
    with np.load(d / "out.npz") as out:
        assert out["y"].shape == (1, 5)


def test_inspect_json_summary(built):
    d, _ = built
    r = kiln_cli("inspect", str(d / "m.kiln"), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["num_layers"] == len(s["layers"]) and s["activation_memory_bytes"] > 0
    assert s["activation_memory_bytes"] <= s["activation_memory_unshared_bytes"]


def test_trtexec_flags(built, tmp_path):
    d, _ = built
    r = kiln_cli("trtexec", f"--onnx={d / 'm.onnx'}", f"--saveEngine={tmp_path / 'e.kiln'}",
                 f"--exportLayerInfo={tmp_path / 'l.json'}", f"--exportProfile={tmp_path / 'p.json'}",
                 "--profilingVerbosity=layer_names_only", "--iterations=3", "--warmUp=0", "--duration=0",
                 "--dumpLayerInfo", "--percentile=90,99", "--builderOptimizationLevel=0")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "e.kiln").is_file()
    assert all(isinstance(n, str) for n in json.loads((tmp_path / "l.json").read_text())["Layers"])
    assert "Layer Information:" in r.stdout and "Name: conv + relu, LayerType: OneDnnConvolution" in r.stdout
    assert "&&&& PASSED" in r.stdout


@pytest.mark.parametrize("spelling", ["space", "equals"])
def test_tactic_sources_edit_the_default_set_in_either_spelling(built, tmp_path, spelling):
    """`--tactic-sources -onnxruntime,-openvino` (a value starting with '-') and trtexec's `--tacticSources=...`."""
    d, _ = built
    spec = "-onnxruntime,-openvino,-kiln"
    flag = ["--tactic-sources", spec] if spelling == "space" else [f"--tactic-sources={spec}"]
    r = kiln_cli("build", str(d / "m.onnx"), "-o", str(tmp_path / "e.kiln"), *flag, "--avg-timing", "1",
                 "--min-timing", "1", "--export-layer-info", str(tmp_path / "l.json"))
    assert r.returncode == 0, r.stderr
    sources = json.loads((tmp_path / "l.json").read_text())["TacticSources"]
    assert not {"onnxruntime", "openvino", "kiln"} & set(sources["Enabled"])
    assert "torch" in sources["Enabled"] and set(sources["Used"]) <= set(sources["Enabled"])
    r = kiln_cli("trtexec", f"--onnx={d / 'm.onnx'}", f"--saveEngine={tmp_path / 't.kiln'}", "--tacticSources",
                 "-onnxruntime,+torch", "--iterations=1", "--warmUp=0", "--duration=0")
    assert r.returncode == 0, r.stderr


def test_unknown_tactic_source_exits_2_and_leaves_no_engine(built, tmp_path):
    d, _ = built
    r = kiln_cli("build", str(d / "m.onnx"), "-o", str(tmp_path / "e.kiln"), "--tactic-sources", "-cudnn")
    assert r.returncode == 2 and "unknown tactic source 'cudnn'" in r.stderr and "onnxruntime" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_unsupported_op_exits_2_and_leaves_no_engine(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("NonZero", ["c"], ["y"], name="weird_node")]
    w = numpy_helper.from_array(np.ones((2, 3, 1, 1), np.float32), "w")
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                       [helper.make_tensor_value_info("y", TensorProto.INT64, None)], [w])
    onnx.save(model, tmp_path / "bad.onnx")
    r = kiln_cli("build", str(tmp_path / "bad.onnx"), "-o", str(tmp_path / "bad.kiln"))
    assert r.returncode == 2
    assert "weird_node" in r.stderr and "NonZero" in r.stderr and "ai.onnx" in r.stderr and "opset 17" in r.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "bad.onnx"]


def test_run_with_wrong_input_name_exits_2(built, tmp_path):
    d, _ = built
    np.savez(tmp_path / "in.npz", nope=np.zeros((1, 3, 8, 8), np.float32))
    r = kiln_cli("run", str(d / "m.kiln"), "--inputs", str(tmp_path / "in.npz"))
    assert r.returncode == 2 and "nope" in r.stderr and "'x'" in r.stderr


def test_loading_a_corrupt_engine_exits_2(tmp_path):
    (tmp_path / "junk.kiln").write_bytes(b"not an engine at all")
    r = kiln_cli("inspect", str(tmp_path / "junk.kiln"))
    assert r.returncode == 2 and "not a kiln engine" in r.stderr
