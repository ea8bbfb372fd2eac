"""An engine built with kiln's C kernels, loaded where no C compiler is (another machine): every such layer runs on
torch's reference kernel instead, with one warning per kernel, and the outputs still match onnxruntime."""
from __future__ import annotations

import logging

import pytest
import torch

import kiln
from kiln import native
from kiln.runtime import prepare
from kiln.tactics import codegen
from tests.conftest import assert_close_to_ort, rand, run_ort
from tests.native.helpers import hide_compiler
from tests.tactics.test_codegen import swish_model
from tests.tactics.test_layernorm_c import layernorm_model
from tests.tactics.test_matmul_c import projection_model

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler to build the engines with")


def test_engines_with_c_kernels_run_on_a_machine_without_a_compiler(tmp_path, monkeypatch, caplog):
    from tests.models import detectors
    from tests.tactics.forced import build_forced_onto

    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    detector = build_forced_onto(detectors.make("yolov8").eval(), x, tmp_path)   # writes model.onnx, model.kiln
    cases = [(str(tmp_path / "model.onnx"), tmp_path / "model.kiln", {detector.input_names[0]: x.numpy()})]
    for name, model, feeds, sources in [("ln", layernorm_model((1, 16, 32), -1, True, True),
                                         {"x": rand((1, 16, 32), 1), "r": rand((1, 16, 32), 2)}, {"kiln"}),
                                        ("mm", projection_model(), {"x": rand((2, 9, 40), 3)}, {"kiln"}),
                                        ("pw", swish_model(), {"x": rand((2, 128, 64), 4)}, {"codegen", "torch"})]:
        kiln.build(model, tactic_sources=frozenset(sources), autotune=False).save(tmp_path / f"{name}.kiln")
        cases.append((model, tmp_path / f"{name}.kiln", feeds))
    built_with = {l.tactic_name for _, path, _ in cases for l in kiln.load(path).plan.layers}
    c_kernels = {"kiln.conv2d_1x1_gemm_nhwc", "kiln.conv2d_direct_gemm_nhwc", "kiln.resize_nearest_nhwc",
                 "kiln.pool2d_nhwc", "kiln.layernorm_rows", "kiln.matmul_gemm", "codegen.pointwise_c_simd"}
    assert c_kernels <= built_with, c_kernels - built_with

    hide_compiler(monkeypatch)
    prepare._warn_missing.cache_clear()   # warned once per kernel and process
    caplog.set_level(logging.WARNING, logger="kiln.runtime")
    try:
        for model, path, feeds in cases:
            engine = kiln.load(path)
            assert_close_to_ort(engine.run(feeds)[engine.output_names[0]], run_ort(model, feeds)[0])
    finally:
        native.reset()
    for tactic in c_kernels:
        assert f"a C compiler (cc) is not available here for {tactic}" in caplog.text, tactic
