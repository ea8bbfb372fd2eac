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
    doc = json.loads(r.stdout)
    assert set(doc) == {"schema", "ranked_by", "findings", "causes"} and doc["schema"] == 2
    assert doc["ranked_by"] == "severity"
    hit = [f for f in doc["findings"] if f["rule_id"] == "INT8_FLOAT_OUTPUT"]
    assert hit and hit[0]["layer"] == "(Unnamed Layer* 1) [Convolution]"
    assert "QuantizeLinear" in hit[0]["mitigation"] and set(hit[0]) == {"rule_id", "layer", "severity", "hazard",
                                                                        "mitigation", "affected"}
    cause = next(c for c in doc["causes"] if c["cause_id"] == "INT8_FLOAT_OUTPUT")
    assert set(cause) == {"cause_id", "severity", "summary", "example", "mitigation", "layers", "rule_ids",
                          "num_findings", "time_ms", "time_percent"}
    assert cause["layers"] == ["(Unnamed Layer* 1) [Convolution]"] and cause["time_ms"] is None


MOBILENET = FIXTURES / "mobilenet.qat.onnx.engine.graph.json"
MOBILENET_PROFILE = FIXTURES / "mobilenet.qat.onnx.engine.profile.json"


def _messages(stdout: str) -> list[str]:
    return [line.split("] [I] ", 1)[1] for line in stdout.splitlines()]


def test_lint_groups_mobilenet_by_cause_costliest_first():
    r = kiln_cli("lint", str(MOBILENET), "--profile", str(MOBILENET_PROFILE))
    assert r.returncode == 0, r.stderr
    lines = _messages(r.stdout)
    assert lines[0].endswith("64 findings from 8 causes, by time at stake (--all lists every finding)")
    heads = [line for line in lines if line.startswith("#")]
    assert len(heads) == 8 and len(lines) < 45
    assert heads[0] == "#1 [warning] INT8_FLOAT_OUTPUT: 31 layers, 46 findings, 0.242 ms at stake (51.4%)"
    assert heads[-1] == "#8 [warning] TINY_LAYERS: engine-wide, 1 finding"
    layers_of_top = lines[lines.index(heads[1]) - 1]
    assert layers_of_top.startswith("    layers: features.2.conv.2.weight + QuantizeLinear_90 + Conv_94; "
                                    "QuantizeLinear_98; ")
    assert "    15 of 18 layers also under #1" in lines


def test_lint_all_and_json_keep_every_finding():
    r = kiln_cli("lint", str(MOBILENET), "--all")
    assert r.returncode == 0, r.stderr
    lines = _messages(r.stdout)
    assert len(lines) == 62 and lines[0].startswith("[warning] INT8_FLOAT_OUTPUT features.2.conv.2.weight")
    doc = json.loads(kiln_cli("lint", str(MOBILENET), "--profile", str(MOBILENET_PROFILE), "--json").stdout)
    assert len(doc["findings"]) == 64 == sum(c["num_findings"] for c in doc["causes"])
    assert doc["ranked_by"] == "time_ms" and doc["causes"][0]["cause_id"] == "INT8_FLOAT_OUTPUT"
    time_share = next(f for f in doc["findings"] if f["rule_id"] == "REFORMAT_TIME_SHARE")
    assert len(time_share["affected"]) == 18 and time_share["layer"] is None


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
    concats = doc["concatenations"]
    assert concats["eliminated"] == ["/model/taskhead22/Concat_10", "/model/taskhead22/Concat_4"]
    assert concats["kept"] == [] and len(concats["retargeted"]) == 4
    assert concats["copied"] == [{"tensor": "/model/taskhead22/Div_1_output_0",
                                  "into": "/model/taskhead22/Concat_10_output_0", "reason": "of stomping hazard"}]
    text = kiln_cli("log", str(FIXTURES / "yolov8_qdq_trt8.4_verbose.excerpt.log"))
    assert "concatenations eliminated: 2, kept whole: 0; inputs written in place: 4, copied: 1" in text.stdout


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
