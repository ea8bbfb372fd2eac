"""YOLOv8n-shaped detector (C2f, SPPF, nearest upsample + concat neck, DFL head with in-graph anchors) and a
YOLOv5-style anchor head on the same backbone, from both torch exporters, built by kiln and compared with
onnxruntime on the same ONNX file (1e-4 relative)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import kiln
from tests.conftest import assert_close_to_ort, run_ort
from tests.models import detectors


# A dynamo export of these takes about 5 s on CPU; the yolov5 one runs with KILN_SLOW_TESTS=1.
slow = pytest.mark.skipif(not os.environ.get("KILN_SLOW_TESTS"), reason="slow: set KILN_SLOW_TESTS=1")
CASES = [pytest.param(name, exporter, id=f"{name}-{exporter}",
                      marks=[slow] if (name, exporter) == ("yolov5", "dynamo") else [])
         for name in sorted(detectors.MODELS) for exporter in ("legacy", "dynamo")]


@pytest.mark.parametrize("name,exporter", CASES)
def test_detector_matches_onnxruntime(name, exporter, tmp_path):
    model = detectors.make(name)
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    proto = detectors.export(model, x, tmp_path / f"{name}.onnx", exporter)
    engine = kiln.build(proto, autotune=False)
    feeds = {"images": x.numpy()}
    out = engine.run(feeds)
    (want,) = run_ort(proto, feeds)
    got = out["output0"]
    assert got.shape == ((1, 84, 84) if name == "yolov8" else (1, 252, 85))
    assert_close_to_ort(got, want)
    kinds = {layer.op_type for layer in engine.plan.layers}
    assert "BatchNormalization" not in kinds and "Identity" not in kinds, kinds   # every BN follows a conv


def test_dynamic_batch_and_resolution_detector_through_one_engine(tmp_path):
    """Dynamic batch, height and width (anchors are computed from the feature-map shapes at run time): kiln's
    kernels and the tuned plan (an external-library region with symbolic dimensions) both match onnxruntime."""
    import warnings

    import onnx
    import torch

    path = tmp_path / "yolo_dynamic.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(detectors.make("yolov8"), (torch.rand(2, 3, 64, 64),), str(path), input_names=["images"],
                          output_names=["out"], dynamic_axes={"images": {0: "b", 2: "h", 3: "w"}}, dynamo=False,
                          opset_version=17)
    proto = onnx.load(str(path))
    profile = {"images": ((1, 3, 32, 32), (2, 3, 64, 64), (3, 3, 96, 128))}
    for autotune in (False, True):
        engine = kiln.build(proto, profiles=[profile], autotune=autotune, avg_timing=1, min_timing=1)
        for shape in [(1, 3, 32, 32), (3, 3, 96, 128), (2, 3, 64, 96)]:
            x = np.random.default_rng(0).random(shape).astype(np.float32)
            assert_close_to_ort(engine.run({"images": x})["out"], run_ort(proto, {"images": x})[0])
