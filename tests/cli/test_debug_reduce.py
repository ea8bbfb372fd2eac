"""kiln debug reduce: delta debugging a model to the smallest subgraph for which a check command still fails, with
real check commands (a script that looks for a node, and `kiln build` refusing an operator)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.errors import ModelError
from kiln.tools.reduce import Check, reduce_model

FIND_BAD = """import sys, onnx
m = onnx.load(sys.argv[1])
sys.exit(1 if any(n.name == "bad" for n in m.graph.node) else 0)
"""


def kiln_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def _save(tmp_path: Path, nodes, inputs, outputs, name="model.onnx") -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    path = tmp_path / name
    onnx.save(model, path)
    return path


def branchy_model(tmp_path: Path, batch: int | str = 2) -> Path:
    """x -> Relu -> Sigmoid -> Reshape "bad" (shape from a Constant node) -> Relu -> Transpose -> y, and Relu -> Abs
    -> z on the side."""
    nodes = [helper.make_node("Relu", ["x"], ["r1"], name="relu1"),
             helper.make_node("Sigmoid", ["r1"], ["s1"], name="sigmoid"),
             helper.make_node("Constant", [], ["shape"], name="shape",
                              value=helper.make_tensor("v", TensorProto.INT64, [2], [3, -1])),
             helper.make_node("Reshape", ["s1", "shape"], ["b"], name="bad"),
             helper.make_node("Relu", ["b"], ["r2"], name="relu2"),
             helper.make_node("Transpose", ["r2"], ["y"], name="transpose", perm=[1, 0]),
             helper.make_node("Abs", ["r1"], ["z"], name="abs")]
    return _save(tmp_path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 6])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3] if batch == 2 else ["M", 3]),
                  helper.make_tensor_value_info("z", TensorProto.FLOAT, [batch, 6])])


@pytest.fixture()
def find_bad(tmp_path) -> str:
    script = tmp_path / "find bad.py"                      # a space: the path must survive shlex quoting
    script.write_text(FIND_BAD)
    return f"{sys.executable} '{script}' {{model}}"


def test_reduces_to_the_failing_node_and_the_constant_it_needs(tmp_path, find_bad):
    result = reduce_model(branchy_model(tmp_path), Check(find_bad))
    assert result.nodes == ("shape (Constant)", "bad (Reshape)") and result.original_node_count == 7
    graph = result.model.graph
    onnx.checker.check_model(result.model)
    assert [(vi.name, [d.dim_value for d in vi.type.tensor_type.shape.dim]) for vi in graph.input] == [("s1", [2, 6])]
    assert [vi.name for vi in graph.output] == ["b"] and graph.output[0].type.tensor_type.elem_type == 1
    ort = pytest.importorskip("onnxruntime")
    s1 = np.arange(12, dtype=np.float32).reshape(2, 6)
    [b] = ort.InferenceSession(result.model.SerializeToString()).run(None, {"s1": s1})
    np.testing.assert_array_equal(b, s1.reshape(3, 4))


def test_dynamic_batch_takes_the_cut_shape_from_onnxruntime(tmp_path, find_bad):
    pytest.importorskip("onnxruntime")
    result = reduce_model(branchy_model(tmp_path, batch="N"), Check(find_bad))
    assert result.nodes == ("shape (Constant)", "bad (Reshape)")
    [cut] = result.model.graph.input
    assert cut.name == "s1" and [d.dim_value for d in cut.type.tensor_type.shape.dim] == [1, 6]


def test_check_semantics(tmp_path):
    model = tmp_path / "it's a model.onnx"
    model.write_bytes(b"")
    exit_1 = f"{sys.executable} -c \"import sys; print('boom: ' + sys.argv[1]); sys.exit(1)\" {{model}}"
    assert Check(exit_1).fails(str(model))
    assert Check(exit_1, fail_regex=r"boom: .*it's a model\.onnx").fails(str(model))
    assert not Check(exit_1, fail_regex="something else").fails(str(model))
    assert not Check(f"{sys.executable} -c pass").fails(str(model))
    assert Check(f"test -f {{model}} && {exit_1}", shell=True).fails(str(model))
    assert not Check(f"test -f {{model}}.missing || true", shell=True).fails(str(model))
    with pytest.raises(ModelError, match="cannot be started"):
        Check("/nonexistent/checker {model}").fails(str(model))


def test_cli_reduces_a_kiln_build_failure_to_the_unsupported_op(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Sigmoid", ["a"], ["b"], name="sigmoid"),
             helper.make_node("Tan", ["b"], ["c"], name="tan"),
             helper.make_node("Neg", ["c"], ["y"], name="neg")]
    model = _save(tmp_path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])])
    check = f"{sys.executable} -m kiln build {{model}} -o {tmp_path / 'candidate.kiln'}"
    r = kiln_cli("debug", "reduce", str(model), "--check", check, "--fail-regex", "unsupported operator",
                 "-o", "small.onnx", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "tan (Tan)" and "from 4 to 1 node(s)" in r.stdout
    assert "Inputs: b; outputs: c" in r.stdout
    reduced = onnx.load(tmp_path / "small.onnx")
    assert [n.op_type for n in reduced.graph.node] == ["Tan"]


def test_cli_check_that_passes_on_the_full_model_exits_2(tmp_path):
    model = branchy_model(tmp_path)
    r = kiln_cli("debug", "reduce", str(model), "--check", f"{sys.executable} -c pass", cwd=tmp_path)
    assert r.returncode == 2 and f"the check passes on {model}: nothing to reduce" in r.stderr, r.stderr
    assert not (tmp_path / "reduced.onnx").exists()
