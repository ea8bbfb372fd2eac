"""onnxruntime and OpenVINO are optional extras: with both hidden, `import kiln`, `kiln build` and `kiln run` work
(outputs checked against numpy), while `kiln compare` and `kiln build --int8 --calib DATA` exit 2 with the install
hint and no traceback; no kiln module imports either library at module level."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import optional
from kiln.errors import MissingDependencyError

PACKAGE = Path(kiln.__file__).parent
OPTIONAL_MODULES = ("onnxruntime", "openvino")
HIDE = "import sys; sys.modules.update(onnxruntime=None, openvino=None); "   # `import onnxruntime` now fails
CLI = HIDE + "from kiln.cli.main import main; sys.exit(main())"
HINT = "needs onnxruntime, which is not installed here; install it with: pip install 'kiln[onnxruntime]'"

RNG = np.random.default_rng(7)
WEIGHT = RNG.standard_normal((4, 3)).astype(np.float32)
BIAS = RNG.standard_normal(3).astype(np.float32)


def tiny_model() -> onnx.ModelProto:
    """y = Relu(x @ W + b), x: 2x4."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"], name="matmul"),
         helper.make_node("Add", ["xw", "b"], ["xwb"], name="add"),
         helper.make_node("Relu", ["xwb"], ["y"], name="relu")],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(WEIGHT, "w"), numpy_helper.from_array(BIAS, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def numpy_reference(x: np.ndarray) -> np.ndarray:
    return np.maximum(x @ WEIGHT + BIAS, 0)


def run_python(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter (scripts starting with HIDE cannot import onnxruntime or OpenVINO)."""
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The tiny model, inputs, calibration data, and an engine built with both libraries hidden."""
    d = tmp_path_factory.mktemp("optional")
    onnx.save(tiny_model(), d / "tiny.onnx")
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    np.savez(d / "in.npz", x=x)
    np.savez(d / "calib.npz", x=RNG.standard_normal((8, 2, 4)).astype(np.float32))
    done = run_python(CLI, "build", str(d / "tiny.onnx"), "-o", str(d / "tiny.kiln"))
    assert done.returncode == 0, done.stdout + done.stderr
    return d, x


def test_import_kiln_works_and_reports_both_libraries_missing():
    done = run_python(HIDE + "import kiln; from kiln import optional; from kiln.tactics.registry import available_sources; "
                         "print(optional.available('onnxruntime'), optional.available('openvino'), "
                         "sorted({'onnxruntime', 'openvino'} & available_sources()))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "[]"]


def test_build_and_run_without_onnxruntime_match_numpy(built):
    d, x = built
    done = run_python(CLI, "run", str(d / "tiny.kiln"), "--inputs", str(d / "in.npz"), "--export-output",
                  str(d / "out.npz"), "--iterations", "1", "--warmup", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    with np.load(d / "out.npz", allow_pickle=False) as out:
        np.testing.assert_allclose(out["y"], numpy_reference(x), rtol=1e-5, atol=1e-6)


def test_compare_without_onnxruntime_exits_2_with_the_install_hint(built):
    d, _ = built
    done = run_python(CLI, "compare", str(d / "tiny.onnx"), str(d / "tiny.kiln"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"kiln compare {HINT}" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_calibrated_build_without_onnxruntime_exits_2_with_the_install_hint(built):
    d, _ = built
    out = d / "int8.kiln"
    done = run_python(CLI, "build", str(d / "tiny.onnx"), "-o", str(out), "--int8", "--calib", str(d / "calib.npz"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"INT8 calibration from data (--int8 --calib DATA) {HINT}" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert not out.exists()


def test_calibrated_build_from_python_raises_the_error(built):
    d, _ = built
    done = run_python(HIDE + "import kiln\ntry:\n    kiln.build(sys.argv[1], int8=True, calibration=sys.argv[2])\n"
                         "except kiln.Error as exc:\n    print(type(exc).__name__, exc.module_name, '|', exc)",
                  str(d / "tiny.onnx"), str(d / "calib.npz"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("MissingDependencyError onnxruntime | INT8 calibration from data")
    assert HINT in done.stdout


def test_a_calibration_cache_needs_no_onnxruntime(built):
    d, x = built
    from kiln.preprocess.calibration import save_cache

    save_cache(d / "cache.json", {"x": float(np.abs(x).max()) / 127}, "minmax")
    done = run_python(CLI, "build", str(d / "tiny.onnx"), "-o", str(d / "cached.kiln"), "--int8", "--calib",
                  str(d / "cache.json"), "--builder-optimization-level", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    engine = kiln.load(d / "cached.kiln")
    assert any(layer.precision == "INT8" for layer in engine.plan.layers), [l.precision for l in engine.plan.layers]
    got, want = engine.run({"x": x})["y"], numpy_reference(x)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()   # int8 rounding of x, not a different function


def test_require_names_the_purpose_and_the_extra(monkeypatch):
    optional.available.cache_clear()
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    try:
        assert optional.available("onnxruntime") is False
        with pytest.raises(MissingDependencyError) as info:
            optional.require("onnxruntime", "kiln compare")
    finally:
        optional.available.cache_clear()
    assert str(info.value) == ("kiln compare needs onnxruntime, which is not installed here; "
                               "install it with: pip install 'kiln[onnxruntime]'")
    assert info.value.exit_code == 2 and info.value.module_name == "onnxruntime"


def test_require_reports_an_install_that_fails_to_import(monkeypatch):
    def broken():
        raise ImportError("libonnxruntime.so: cannot open shared object file")

    dependency = optional.OPTIONAL_DEPENDENCIES["openvino"]
    monkeypatch.setitem(optional.OPTIONAL_DEPENDENCIES, "openvino",
                        optional.OptionalDependency(dependency.module_name, dependency.extra, broken))
    with pytest.raises(MissingDependencyError, match=r"^the openvino.region tactic needs openvino, which is installed "
                                                     r"but fails to import \(libonnxruntime.so: cannot open shared "
                                                     r"object file\); reinstall it with: pip install "
                                                     r"--force-reinstall 'openvino'$"):
        optional.require("openvino", "the openvino.region tactic")


def test_only_known_optional_dependencies_are_imported():
    with pytest.raises(ValueError, match=r"'pickle' is not one of kiln's optional dependencies"):
        optional.require("pickle", "anything")


def module_level_imports(tree: ast.Module):
    """Import statements that run when the module is imported: outside every function body."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            yield node, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            yield node, [node.module or ""]
        pending.extend(ast.iter_child_nodes(node))


def test_no_kiln_module_imports_onnxruntime_or_openvino_at_module_level():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node, names in module_level_imports(tree):
            found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {n}" for n in names
                      if n.split(".")[0] in OPTIONAL_MODULES]
    assert not found, found


def test_importing_every_kiln_module_loads_neither_library():
    done = run_python("import importlib, pkgutil, sys, kiln\n"   # both libraries importable here: nothing may load them
                  "for m in pkgutil.walk_packages(kiln.__path__, 'kiln.'):\n"
                  "    if m.name != 'kiln.__main__':\n        importlib.import_module(m.name)\n"
                  "print(sorted(n for n in sys.modules if n.split('.')[0] in ('onnxruntime', 'openvino')))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_openvino_imported_through_kiln_sends_no_telemetry_and_writes_nothing_home(tmp_path):
    """On a machine without OpenVINO's consent file, `import openvino` counts as consent: it writes ~/intel and
    forks a process off a thread to send an event (a fork that once left `kiln build` waiting at exit forever).
    Imported through kiln, telemetry is declined and the home folder is left alone."""
    pytest.importorskip("openvino")
    probe = ("from kiln import optional; optional.require('openvino', 'a test'); import openvino_telemetry as t; "
             "print(t.Telemetry().consent)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(PACKAGE.parent)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "False" and not list(tmp_path.iterdir())
