"""ONNX backend conformance: onnx's own node test cases (built in memory by onnx 1.23.2's
`onnx.backend.test`) run by `BackendTest`'s test functions through `kiln.backend`, for every op kiln implements.

A case belongs to the op its single-node form tests; its `_expanded` (function body) forms count too.
EXCLUDED.md names every such case that is expected to fail, and why: each must fail with a `kiln.Error`
(strict xfail; under a "Deliberate difference" heading, with differing outputs), so a fixed case, or one that
starts computing wrong numbers instead of refusing, fails the suite.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest

import kiln
from kiln.frontend.contrib import STANDARD_UNFOLDED
from kiln.ops import OPS

ONNX_VERSION = "1.23.2"
EXCLUDED_MD = Path(__file__).with_name("EXCLUDED.md")
EXPANDED = re.compile(r"_expanded(_ver\d+)?$")
DIFFERS = "Deliberate difference"   # EXCLUDED.md heading: the case runs, and kiln's outputs differ on purpose

if onnx.__version__ != ONNX_VERSION:
    pytest.skip(f"the node cases and EXCLUDED.md are those of onnx=={ONNX_VERSION}, not {onnx.__version__}",
                allow_module_level=True)


def read_exclusions(path: Path) -> dict[str, str]:
    """EXCLUDED.md: `## reason` headings, each followed by `- test_name` lines."""
    reasons: dict[str, str] = {}
    reason = ""
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            reason = line[3:].strip()
        elif line.startswith("- test_"):
            reasons[line[2:].split()[0]] = reason
    return reasons


def supported_cases() -> dict[str, str]:
    """Node case name -> the default-domain op it tests, for the ops kiln implements (or unfolds at import)."""
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():   # building the cases overflows some casts on purpose
        warnings.simplefilter("ignore")
        cases = load_model_tests(kind="node")
    tested = {c.name: c.model.graph.node[0].op_type for c in cases
              if len(c.model.graph.node) == 1 and c.model.graph.node[0].domain in ("", "ai.onnx")}
    ops = {c.name: tested.get(EXPANDED.sub("", c.name)) for c in cases}
    return {name: op for name, op in ops.items() if op in OPS or op in STANDARD_UNFOLDED}


def backend_tests(names: list[str]) -> dict[str, Callable[[object], None]]:
    """onnx's own test function (prepare, run, compare at the case's rtol/atol) per case, on CPU."""
    from onnx.backend.test import BackendTest

    from kiln.backend import KilnBackend

    node_tests = BackendTest(KilnBackend, __name__).test_cases["OnnxBackendNodeModelTest"]
    return {name: getattr(node_tests, f"{name}_cpu") for name in names}


CASES = supported_cases()
EXCLUDED = read_exclusions(EXCLUDED_MD)
RUN = backend_tests(sorted(CASES))


def _case(name: str):
    if name not in EXCLUDED:
        return pytest.param(name, id=name)
    reason = EXCLUDED[name]
    raises = AssertionError if reason.startswith(DIFFERS) else kiln.Error
    return pytest.param(name, marks=pytest.mark.xfail(reason=reason, raises=raises, strict=True), id=name)


@pytest.mark.parametrize("name", [_case(n) for n in sorted(CASES)])
def test_node(name: str) -> None:
    RUN[name](None)


def test_exclusions_name_supported_cases() -> None:
    stale = sorted(set(EXCLUDED) - set(CASES))
    assert not stale, f"EXCLUDED.md names cases that are not node cases of a kiln op: {stale}"


def test_detailed_layer_info_describes_every_node_case() -> None:
    """Every node case kiln builds (as a whole model, inputs at run time) gets detailed layer info whose layers all
    carry a ParameterType: parameter builders once failed on attributes a model may leave out (QLinearConv's
    kernel_shape) and on unfused Reshape layers."""
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = {c.name: c.model for c in load_model_tests(kind="node") if c.name in CASES}
    built = 0
    for name in sorted(models):
        try:
            engine = kiln.build(models[name], autotune=False)
        except kiln.Error:   # needs build-time values (shapes, axes) from its inputs: the backend freezes those
            continue
        layers = engine.layer_info("detailed")["Layers"]
        assert all("Name" in layer and ("ParameterType" in layer or layer["LayerType"] == "NoOp") for layer in layers), \
            name   # TensorRT's NoOp layers (a Reformat that copies nothing) carry none either
        built += 1
    assert built >= 300, built
