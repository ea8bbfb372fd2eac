"""The inspector commands as a user runs them on real TensorRT artifacts: JSON shapes, exit codes, hints."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).parent.parent / "fixtures"


def kiln_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=120)


def test_inspect_json_on_trt_layer_info():
    r = kiln_cli("inspect", str(FIXTURES / "resnet18_trt10_detailed.layers.json"), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["format"] == "trtexec-json" and doc["num_layers"] == 25 == len(doc["layers"])
    assert doc["layer_types"]["CaskConvolution"] == 20 and doc["precisions"] == {"INT8": 23, "FP32": 2}
    assert doc["bindings"] == ["data", "resnetv15_dense0_fwd"]


def test_inspect_with_profile_reports_total(tmp_path):
    names = json.loads((FIXTURES / "resnet18_trt10_names_only.layers.json").read_text())["Layers"]
    lines = ["[", '  { "count" : 10 }'] + [f', {{ "name" : {json.dumps(n)}, "timeMs" : 1, "averageMs" : 0.1, '
                                           f'"medianMs" : 0.1, "percentage" : 4 }}' for n in names] + ["]"]
    (tmp_path / "p.json").write_text("\n".join(lines))
    r = kiln_cli("inspect", str(FIXTURES / "resnet18_trt10_detailed.layers.json"), "--profile", str(tmp_path / "p.json"),
                 "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert abs(doc["total_average_ms"] - 2.5) < 1e-9 and doc["layers"][0]["average_ms"] == 0.1


def test_lint_json_names_the_missing_output_scale():
    r = kiln_cli("lint", str(FIXTURES / "conv_dynamic_int8_fp32out_trt8.layers.json"), "--json")
    assert r.returncode == 0, r.stderr
    findings = json.loads(r.stdout)
    assert isinstance(findings, list)
    hit = [f for f in findings if f["rule_id"] == "INT8_FLOAT_OUTPUT"]
    assert hit and hit[0]["layer"] == "(Unnamed Layer* 1) [Convolution]"
    assert "QuantizeLinear" in hit[0]["mitigation"] and set(hit[0]) == {"rule_id", "layer", "severity", "hazard",
                                                                        "mitigation"}


def test_diff_json_explains_verbosity():
    r = kiln_cli("diff", str(FIXTURES / "bert_fp16_trt10.10_names_only.oneline.log"),
                 str(FIXTURES / "bert_fp16_trt10.10_detailed.oneline.log"), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verbosity_only"] is True and any("verbosity, not the engine" in s for s in doc["explanation"])


def test_log_json_pass_counts():
    r = kiln_cli("log", str(FIXTURES / "yolov8_qdq_trt8.4_verbose.excerpt.log"), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["layer_trajectory"][0] == ["Original", 755] and doc["pass_counts"]["ConvReluFusion"] == 3
    assert doc["engine_layers"] == 3


def test_bad_artifacts_exit_2_with_a_hint(tmp_path):
    (tmp_path / "junk.json").write_bytes(b"\x00\x01garbage")
    (tmp_path / "half.json").write_text('{"Layers": [{"Name": "x"')
    for cmd in ("inspect", "lint"):
        for name in ("junk.json", "half.json"):
            r = kiln_cli(cmd, str(tmp_path / name))
            assert r.returncode == 2, (cmd, name, r.stdout)
            assert "hint" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = kiln_cli("log", str(tmp_path / "junk.json"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
