"""A small network forced onto some tactic sources, checked against onnxruntime and after a save/load."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

import kiln
from tests.conftest import assert_close_to_ort, run_ort
from tests.models.nets import export


def build_forced_onto(model: nn.Module, x: torch.Tensor, folder, sources=frozenset({"kiln"}), autotune: bool = True):
    """Export `model` (every BatchNorm's statistics randomized first), build it with only `sources` (with
    `autotune=False` each layer takes the first registered tactic that supports it, whatever times faster here),
    check its output against onnxruntime and that a saved engine loads to the same output; return the engine."""
    with torch.no_grad():
        for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    path = folder / "model.onnx"
    export(model, x, path)
    engine = kiln.build(str(path), tactic_sources=frozenset(sources), avg_timing=1, min_timing=1, autotune=autotune)
    feeds = {engine.input_names[0]: x.numpy()}
    got = engine.run(feeds)[engine.output_names[0]]
    assert_close_to_ort(got, run_ort(str(path), feeds)[0])
    engine.save(folder / "model.kiln")
    np.testing.assert_array_equal(kiln.load(folder / "model.kiln").run(feeds)[engine.output_names[0]], got)
    return engine
