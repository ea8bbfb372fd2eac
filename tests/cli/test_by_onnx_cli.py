"""`kiln diff A B --by onnx` and `kiln inspect FILE --by onnx` as a user runs them: kiln against TensorRT (a kiln
engine of a ResNet-18 whose ONNX nodes carry the names of the TensorRT 10 fixture's model), kiln against kiln
(two Q/DQ placements, each with a profile from `kiln run --export-profile`), the JSON file, the table, the errors."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.cli.main import main
from tests.conftest import init, make_model, rand
from tests.inspect.test_by_onnx import residual_block

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TRT_DETAILED = FIXTURES / "resnet18_trt10_detailed.layers.json"
P = "resnetv15_"


def gluon_resnet18(widths=(8, 16, 32, 64)):
    """ResNet-18 v1.5 as the Gluon model zoo exports it (the node names of the TensorRT fixture's model), narrow and
    at 32x32 so it builds in a moment."""
    nodes, inits, seed = [], [], [0]

    def conv_bn(x, stage, i, cin, cout, k, stride, bn_i=None):
        seed[0] += 1
        conv, bn = f"{P}{stage}conv{i}_fwd", f"{P}{stage}batchnorm{i if bn_i is None else bn_i}_fwd"
        inits.extend([init(f"{conv}_weight", rand((cout, cin, k, k), seed[0]) * 0.2)] +
                     [init(f"{bn}_{p}", rand((cout,), seed[0] + j, positive=p in ("gamma", "var")))
                      for j, p in enumerate(("gamma", "beta", "mean", "var"))])
        nodes.append(helper.make_node("Conv", [x, f"{conv}_weight"], [conv], name=conv, kernel_shape=[k, k],
                                      strides=[stride] * 2, pads=[k // 2] * 4))
        nodes.append(helper.make_node("BatchNormalization", [conv] + [f"{bn}_{p}" for p in
                                      ("gamma", "beta", "mean", "var")], [bn], name=bn))
        return bn

    def relu(x, name):
        nodes.append(helper.make_node("Relu", [x], [name], name=name))
        return name

    def add_relu(a, b, stage, i):
        plus, act = f"{P}{stage}_plus{i}", f"{P}{stage}activation{i}"
        nodes.append(helper.make_node("Add", [a, b], [plus], name=plus))
        return relu(plus, act)

    x = relu(conv_bn("data", "", 0, 3, widths[0], 7, 2), f"{P}relu0_fwd")
    nodes.append(helper.make_node("MaxPool", [x], [f"{P}pool0_fwd"], name=f"{P}pool0_fwd", kernel_shape=[3, 3],
                                  strides=[2, 2], pads=[1] * 4))
    x, cin = f"{P}pool0_fwd", widths[0]
    for s, cout in enumerate(widths, 1):
        st = f"stage{s}_"
        if s == 1:
            y = relu(conv_bn(x, st, 0, cin, cout, 3, 1), f"{P}{st}relu0_fwd")
            x = add_relu(conv_bn(y, st, 1, cout, cout, 3, 1), x, st, 0)
            y = relu(conv_bn(x, st, 2, cout, cout, 3, 1), f"{P}{st}relu1_fwd")
            x = add_relu(conv_bn(y, st, 3, cout, cout, 3, 1), x, st, 1)
        else:
            y = relu(conv_bn(x, st, 0, cin, cout, 3, 2), f"{P}{st}relu0_fwd")
            body = conv_bn(y, st, 1, cout, cout, 3, 1)
            x = add_relu(conv_bn(x, st, 2, cin, cout, 1, 2), body, st, 0)
            y = relu(conv_bn(x, st, 3, cout, cout, 3, 1), f"{P}{st}relu1_fwd")
            x = add_relu(conv_bn(y, st, 4, cout, cout, 3, 1), x, st, 1)
        cin = cout
    nodes += [helper.make_node("GlobalAveragePool", [x], [f"{P}pool1_fwd"], name=f"{P}pool1_fwd"),
              helper.make_node("Flatten", [f"{P}pool1_fwd"], [f"{P}flatten0"], name=f"{P}flatten0"),
              helper.make_node("Gemm", [f"{P}flatten0", "dense_w", "dense_b"], [f"{P}dense0_fwd"],
                               name=f"{P}dense0_fwd", transB=1)]
    inits += [init("dense_w", rand((10, cin), 99) * 0.1), init("dense_b", rand((10,), 98))]
    return make_model(nodes, [helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 3, 32, 32])],
                      [helper.make_tensor_value_info(f"{P}dense0_fwd", TensorProto.FLOAT, [1, 10])], inits)


def build_and_profile(model, folder: Path, name: str) -> tuple[Path, Path, Path]:
    onnx.save(model, folder / f"{name}.onnx")
    engine, prof = folder / f"{name}.kiln", folder / f"{name}.profile.json"
    assert main(["build", str(folder / f"{name}.onnx"), "-o", str(engine), "--builder-optimization-level", "0"]) == 0
    assert main(["run", str(engine), "--iterations", "3", "--export-profile", str(prof)]) == 0
    return folder / f"{name}.onnx", engine, prof


def profile_total(path: Path) -> float:
    return sum(r["averageMs"] for r in json.loads(path.read_text()) if "averageMs" in r)


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    return build_and_profile(gluon_resnet18(), tmp_path_factory.mktemp("byonnx"), "resnet18")


def test_kiln_against_tensorrt_by_onnx_node(resnet, tmp_path):
    model, engine, prof = resnet
    out = tmp_path / "nodes.json"
    assert main(["diff", str(TRT_DETAILED), str(engine), "--by", "onnx", "--profile-b", str(prof),
                 "--model", str(model), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["onnx_node"]: r for r in doc["nodes"]}
    trt_nodes = {o for layer in json.loads(TRT_DETAILED.read_text())["Layers"]
                 for o in [m.removeprefix("[ONNX Layer: ").removesuffix("]") for m in layer["Metadata"].split("\x1e")]
                 if o}
    assert len(trt_nodes) == 68 and all(rows[n]["a"] and rows[n]["b"] for n in trt_nodes)
    add = rows[f"{P}stage3__plus0"]
    assert add["a"]["layer"] == f"{P}stage3_conv2_fwd + {P}stage3_batchnorm2_fwd + {P}stage3__plus0 + " \
                                f"{P}stage3_activation0" and add["a"]["precision"] == "INT8"
    assert add["b"]["precision"] == "FP32" and f"{P}stage3__plus0" in add["b"]["layer"]
    assert all(set(r["a"]) >= {"layer", "precision", "time_ms"} for r in doc["nodes"] if r["a"])
    assert sum(r["b"]["time_ms"] for r in doc["nodes"] if r["b"]) == pytest.approx(profile_total(prof), rel=1e-6)
    conv = rows[f"{P}stage4_conv4_fwd"]["b"]        # FLOPs from --model: the conv takes most of its fused layer
    assert conv["split"] == "flops" and conv["share"] > 0.9
    assert rows[f"{P}flatten0"]["a"] == {} and rows[f"{P}flatten0"]["b"]["layer"]   # TensorRT made it a NoOp


def test_qdq_placements_kiln_against_kiln_with_kiln_profiles(tmp_path, capsys):
    ra = build_and_profile(residual_block(True), tmp_path, "residual_aware")
    plain = build_and_profile(residual_block(False), tmp_path, "plain")
    capsys.readouterr()
    assert main(["diff", str(ra[1]), str(plain[1]), "--by", "onnx", "--profile-a", str(ra[2]), "--profile-b",
                 str(plain[2]), "--model", str(ra[0]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["onnx_node"]: r for r in doc["nodes"]}
    assert (rows["relu1"]["a"]["precision"], rows["relu1"]["b"]["precision"]) == ("INT8", "FP32")
    assert rows["c2_Q"]["b"] == {} and rows["c2_Q"]["a"]["layer"] == "conv2 + c2_Q + add + relu2 + r_Q"
    deltas = [abs(r["delta_ms"]) for r in doc["nodes"]]
    assert deltas == sorted(deltas, reverse=True)
    for side, (_, _, prof) in (("a", ra), ("b", plain)):
        assert sum(r[side]["time_ms"] for r in doc["nodes"] if r[side]) == pytest.approx(profile_total(prof), rel=1e-6)
    assert main(["inspect", str(plain[1]), "--by", "onnx", "--profile", str(plain[2])]) == 0
    table = capsys.readouterr().out
    assert "ONNX node" in table and "conv2 + add + relu2 + r_Q" in table and "split evenly" in table


def test_by_onnx_errors_exit_2(tmp_path, capsys):
    assert main(["diff", str(TRT_DETAILED), str(TRT_DETAILED), "--by", "onnx", "--model",
                 str(tmp_path / "missing.onnx")]) == 2
    assert f"{tmp_path / 'missing.onnx'}: no such file; hint: pass the ONNX model" in capsys.readouterr().err
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    assert main(["inspect", str(TRT_DETAILED), "--by", "onnx", "--model", str(tmp_path / "bad.onnx")]) == 2
    assert "bad.onnx: not a readable ONNX model" in capsys.readouterr().err
    assert main(["diff", str(TRT_DETAILED), str(TRT_DETAILED), "--model", str(tmp_path / "bad.onnx")]) == 2
    assert "--model is used with --by onnx only" in capsys.readouterr().err
