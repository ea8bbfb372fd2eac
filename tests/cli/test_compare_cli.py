"""`kiln compare MODEL ENGINE`: exit 0 when outputs match, 1 when they exceed tolerance (the first diverging
layer named), 2 on unreadable files (the path named); --json writes the report schema."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

import kiln
from kiln.cli.main import main
from kiln.tools.compare import REPORT_KIND
from tests.precision.models import conv_net, perturbed


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("compare")
    model = conv_net()
    onnx.save(model, d / "m.onnx")
    onnx.save(perturbed(model, "w2"), d / "other.onnx")
    kiln.build(model, autotune=False).save(d / "m.kiln")
    np.savez(d / "in.npz", x=np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32))
    return d


def test_matching_engine_exits_0_with_a_table(files, capsys):
    assert main(["compare", str(files / "m.onnx"), str(files / "m.kiln"), "--inputs", str(files / "in.npz")]) == 0
    out = capsys.readouterr().out
    assert "Max rel err" in out and "Cosine" in out and "pass" in out and "PASSED" in out
    assert f"Inputs: {files / 'in.npz'}" in out


def test_layerwise_json_report(files, tmp_path, capsys):
    report = tmp_path / "report.json"
    rc = main(["compare", str(files / "m.onnx"), str(files / "m.kiln"), "--layerwise", "--json", str(report)])
    assert rc == 0 and "every compared tensor is within tolerance" in capsys.readouterr().out
    doc = json.loads(report.read_text())
    assert set(doc) == {"kind", "version", "model", "engine", "inputs", "rtol", "atol", "passed", "outputs",
                        "layerwise", "layers", "skipped", "first_divergence"}
    assert doc["kind"] == REPORT_KIND and doc["passed"] is True and doc["first_divergence"] is None
    assert [t["name"] for t in doc["layers"]] == ["r1", "r2", "g", "f", "m", "y"]
    assert set(doc["outputs"][0]) == {"name", "layer", "onnx_node", "shape", "dtype", "max_abs_err",
                                      "mean_abs_err", "max_rel_err", "cosine", "argmax_agreement", "passed", "note"}


def test_diverging_model_exits_1_and_names_the_first_layer(files, tmp_path, capsys):
    report = tmp_path / "report.json"
    rc = main(["compare", str(files / "other.onnx"), str(files / "m.kiln"), "--layerwise", "--json", str(report)])
    out = capsys.readouterr().out
    assert rc == 1 and "First divergence: layer 'conv2 + relu2' (tensor 'r2', ONNX node 'relu2')" in out
    assert "FAILED: output(s) ['y'] exceed the tolerance" in out
    assert json.loads(report.read_text())["first_divergence"]["layer"] == "conv2 + relu2"
    assert main(["compare", str(files / "other.onnx"), str(files / "m.kiln"), "--rtol", "10"]) == 0


@pytest.mark.parametrize("which", ["model", "engine", "inputs"])
def test_missing_file_exits_2_naming_it(files, tmp_path, capsys, which):
    args = {"model": str(files / "m.onnx"), "engine": str(files / "m.kiln")}
    missing = str(tmp_path / f"missing-{which}")
    extra = []
    if which == "inputs":
        extra = ["--inputs", missing]
    else:
        args[which] = missing
    assert main(["compare", args["model"], args["engine"], *extra]) == 2
    assert missing in capsys.readouterr().err


def test_command_line_exit_codes(files, tmp_path):
    def kiln_cli(*args):
        return subprocess.run([sys.executable, "-m", "kiln", "compare", *args], capture_output=True, text=True,
                              timeout=120, check=False)

    assert kiln_cli(str(files / "other.onnx"), str(files / "m.kiln")).returncode == 1
    bad = kiln_cli(str(files / "m.onnx"), str(tmp_path / "nope.kiln"))
    assert bad.returncode == 2 and str(tmp_path / "nope.kiln") in bad.stderr
