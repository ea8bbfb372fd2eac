"""Every inspector command on the TensorRT 10 and TensorRT 11 forms of the same engine reports the same layers,
precisions and I/O; kiln's own exports with --layer-info-schema 11; bad TensorRT 11 files exit 2 naming the file
and the field."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.cli.main import main
from tests.conftest import make_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PAIRS = [("resnet18_trt10_detailed", "resnet18_trt11_detailed"),
         ("resnet18_trt10_names_only", "resnet18_trt11_names_only"),
         ("conv_dynamic_int8_fp32out_trt8", "conv_dynamic_int8_fp32out_trt11")]
TRT11_ONLY = ("io_tensors", "engine_metadata")


def fixture(name: str) -> str:
    return str(FIXTURES / f"{name}.layers.json")


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def cli_json(capsys, *args: str):
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("a,b", PAIRS)
def test_inspect_json_is_the_same_for_both_schemas(capsys, a, b):
    doc10, doc11 = cli_json(capsys, "inspect", fixture(a), "--json"), cli_json(capsys, "inspect", fixture(b), "--json")
    assert {k: v for k, v in doc11.items() if k not in TRT11_ONLY} == doc10
    assert [t["name"] for t in doc11["io_tensors"]] == doc10["bindings"]


def test_inspect_table_shows_trt11_io_tensors(capsys):
    code, out, _ = cli(capsys, "inspect", fixture("resnet18_trt11_detailed"))
    assert code == 0
    assert "Input: data FP32 1x3x224x224 (profile 0: 1x3x224x224 .. 1x3x224x224 .. 1x3x224x224)" in out
    assert "Output: resnetv15_dense0_fwd FP32 1x1000" in out and "Precisions: FP32: 2, INT8: 23" in out


@pytest.mark.parametrize("a,b", PAIRS)
def test_lint_findings_are_the_same_for_both_schemas(capsys, a, b):
    findings = cli_json(capsys, "lint", fixture(b), "--json")
    assert findings == cli_json(capsys, "lint", fixture(a), "--json")
    if a.startswith("conv_dynamic"):   # the real finding survives the schema change
        assert any(f["rule_id"] == "INT8_FLOAT_OUTPUT" for f in findings["findings"])


@pytest.mark.parametrize("a,b", PAIRS)
def test_diff_of_the_two_schemas_finds_no_difference(capsys, a, b):
    doc = cli_json(capsys, "diff", fixture(a), fixture(b), "--json")
    assert doc["changes"] == [] and doc["only_a"] == [] and doc["only_b"] == []
    assert doc["layer_count_a"] == doc["layer_count_b"] == len(doc["pairs"]) > 0
    code, out, _ = cli(capsys, "diff", fixture(a), fixture(b))
    assert code == 0 and "No layer differences found." in out


@pytest.mark.parametrize("a,b", PAIRS[:2])
def test_draw_and_report_are_the_same_for_both_schemas(capsys, tmp_path, a, b):
    for name in (a, b):
        assert cli(capsys, "draw", fixture(name), "-o", str(tmp_path / f"{name}.dot"))[0] == 0
        assert cli(capsys, "report", fixture(name), "-o", str(tmp_path / f"{name}.html"), "--title", "t")[0] == 0
    assert (tmp_path / f"{a}.dot").read_text() == (tmp_path / f"{b}.dot").read_text()
    assert (tmp_path / f"{a}.html").read_text() == (tmp_path / f"{b}.html").read_text()


def _edited(tmp_path, edit) -> str:
    doc = json.loads((FIXTURES / "resnet18_trt11_detailed.layers.json").read_text())
    edit(doc)
    path = tmp_path / "bad11.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("command", ["inspect", "lint", "draw", "report"])
def test_bad_trt11_files_exit_2_naming_file_and_field(capsys, tmp_path, command):
    out = ["-o", str(tmp_path / ("x.dot" if command == "draw" else "x.html"))] if command in ("draw", "report") else []
    path = _edited(tmp_path, lambda d: d["I/O Tensors"][0].pop("Name"))
    code, _, err = cli(capsys, command, path, *out)
    assert code == 2 and f"{path}: \"I/O Tensors\" entry #0 has no \"Name\"" in err
    path = _edited(tmp_path, lambda d: d["I/O Tensors"][1].update(DataType="Float128"))
    code, _, err = cli(capsys, command, path, *out)
    assert code == 2 and f"{path}: I/O tensor 'resnetv15_dense0_fwd': unknown \"DataType\" 'Float128'" in err


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c"], ["y"], name="sig")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w])
    path = tmp_path_factory.mktemp("trt11") / "small.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def test_every_command_that_writes_layer_info_takes_the_schema(capsys, tmp_path, small_model):
    engine, l10, l11 = tmp_path / "e.kiln", tmp_path / "l10.json", tmp_path / "l11.json"
    code, _, err = cli(capsys, "build", str(small_model), "-o", str(engine), "--export-layer-info", str(l11),
                       "--layer-info-schema", "11", "--builder-optimization-level", "0")
    assert code == 0, err
    doc11 = json.loads(l11.read_text())
    assert "I/O Tensors" in doc11 and "Bindings" not in doc11 and doc11["ProfilingVerbosity"] == "DETAILED"
    code, out, err = cli(capsys, "inspect", str(engine), "--layer-info", "detailed", "--layer-info-schema", "11")
    assert code == 0 and json.loads(out) == doc11, err
    t11 = tmp_path / "t11.json"
    code, _, err = cli(capsys, "trtexec", f"--loadEngine={engine}", f"--exportLayerInfo={t11}", "--layerInfoSchema=11",
                       "--skipInference")
    assert code == 0 and json.loads(t11.read_text()) == doc11, err
    code, out, err = cli(capsys, "inspect", str(engine), "--layer-info", "detailed")   # 10 stays the default
    assert code == 0 and "Bindings" in json.loads(out), err
    l10.write_text(out)
    doc_a, doc_b = cli_json(capsys, "inspect", str(l10), "--json"), cli_json(capsys, "inspect", str(l11), "--json")
    assert {k: v for k, v in doc_b.items() if k not in TRT11_ONLY} == doc_a
    assert doc_b["io_tensors"][0]["profiles"] == [{"min": [1, 3, 8, 8], "opt": [1, 3, 8, 8], "max": [1, 3, 8, 8],
                                                   "format": "Row major linear FP32"}]
    assert cli_json(capsys, "diff", str(l10), str(l11), "--json")["changes"] == []
    assert cli_json(capsys, "lint", str(l10), "--json") == cli_json(capsys, "lint", str(l11), "--json")
