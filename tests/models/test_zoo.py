"""CNN patterns from other model families, from both torch exporters, against onnxruntime (1e-4 relative)."""
from __future__ import annotations

import warnings

import onnx
import pytest
import torch

import kiln
from tests.conftest import assert_close_to_ort, run_ort
from tests.models.zoo import ZOO, make_zoo


def export(model, x, path, exporter: str) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(model, (x,), str(path), dynamo=True, verbose=False)
        else:
            torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=17, do_constant_folding=False)
    proto = onnx.load(str(path))
    if proto.ir_version > 10:
        proto.ir_version = 10
    return proto


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_matches_onnxruntime(name, exporter, tmp_path):
    model = make_zoo(name)
    x = torch.randn(1, 3, 32, 32)
    proto = export(model, x, tmp_path / f"{name}.onnx", exporter)
    engine = kiln.build(proto)
    feeds = {engine.input_names[0]: x.numpy()}
    out = engine.run(feeds)
    ref = run_ort(proto, feeds)
    for got, want in zip(out.values(), ref):
        assert_close_to_ort(got, want)
    kinds = {l.op_type for l in engine.plan.layers}
    assert "BatchNormalization" not in kinds or name == "densenet", kinds   # pre-activation BN cannot fold into a conv
    assert "Identity" not in kinds and "Dropout" not in kinds
