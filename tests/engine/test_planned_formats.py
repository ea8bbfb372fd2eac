"""Every 4-D tensor the plan records as channel-major (NHWC) is laid out so at run time: layer info reports that
format, and kiln's C kernels read raw pointers. torch.cat of a row-major and a channel-major input is
row-major; the YOLOv8 neck concatenates exactly such inputs (a channel Slice and a convolution's output)."""
from __future__ import annotations

import pytest
import torch

import kiln
from kiln.tactics.base import MEMORY_ORDER
from kiln.tactics.reformat import is_noop_reformat
from kiln.tactics.views import row_step
from tests.models import detectors


@pytest.mark.parametrize("autotune", [False, True])
def test_channel_major_tensors_are_laid_out_as_the_plan_says(autotune, tmp_path):
    model = detectors.make("yolov8")
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    engine = kiln.build(detectors.export(model, x, tmp_path / "yolo.onnx", "legacy"), autotune=autotune,
                        avg_timing=1, min_timing=1, tactic_sources=frozenset({"torch-onednn", "kiln", "codegen", "torch"}))
    claims = {t.name: t for layer in engine.plan.layers for t in layer.outputs}
    checked, wrong, slices = [], [], []
    context = engine.create_execution_context()
    into_concat = {s.outputs[0] for s in context.interpreter.steps if s.into_concat is not None}

    def observe(name, tensor):
        desc = claims.get(name)
        if desc is None or desc.format != "hwc" or tensor.dim() != 4 or is_noop_reformat(tuple(tensor.shape)):
            return
        checked.append(name)
        if name in into_concat:   # written into a Concat's output: channel-major, pixels as wide as the Concat's
            slices.append(name)
            if row_step(tensor, MEMORY_ORDER["hwc"], 3) is None:
                wrong.append((name, tuple(tensor.stride())))
        elif not tensor.is_contiguous(memory_format=torch.channels_last):
            wrong.append((name, tuple(tensor.stride())))
    context.execute({"images": x.numpy()}, observe=observe)
    concats = [n for n in checked if "Concat" in n]
    assert len(checked) > 50 and concats and slices, (len(checked), concats, slices)
    assert wrong == []
