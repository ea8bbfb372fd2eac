"""RMSNorm on real exports (T5's form, x * rsqrt(mean(x^2) + eps) * weight, both exporters): one
RMSNormalization layer on kiln's C rows kernel, equal to onnxruntime in FP32, granted BF16 under --bf16; the
kernel against the float64 formula; and a region handing it to onnxruntime at the model's opset."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch

import kiln
from kiln.tactics.base import LayerView
from kiln.tactics.layernorm_c import LayerNormBf16Tactic, LayerNormTactic
from kiln.tactics.onednn_conv import bf16_available
from tests.conftest import assert_close_to_ort, cosine, force_plan, run_ort

needs_bf16 = pytest.mark.skipif(not bf16_available(), reason="no native BF16 here: kiln's BF16 rows kernel is not "
                                "offered")


class RMSNorm(torch.nn.Module):   # T5LayerNorm / LlamaRMSNorm
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.rand(width) + 0.5), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(16, 32), RMSNorm(32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def export(tmp_path, dynamo: bool) -> onnx.ModelProto:
    torch.manual_seed(0)
    path = tmp_path / "block.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Block().eval(), (torch.randn(2, 5, 16),), str(path), dynamo=dynamo, input_names=["x"],
                          **({} if dynamo else {"opset_version": 17}))
    return onnx.load(str(path))


def feeds():
    return {"x": np.random.default_rng(1).standard_normal((2, 5, 16)).astype(np.float32) * 3}


@pytest.mark.parametrize("dynamo", [False, True])
def test_rms_norm_is_one_layer_on_the_rows_kernel(tmp_path, dynamo):
    model = export(tmp_path, dynamo)
    engine = kiln.build(model, tactic_sources={"kiln", "torch-onednn"})
    norms = [l for l in engine.layer_info()["Layers"] if l["LayerType"] == "Normalization"]
    assert len(norms) == 1 and norms[0]["TacticName"] == "kiln.layernorm_rows"
    assert [l.op_type for l in engine.plan.layers if l.op_type.endswith("Normalization")] == ["RMSNormalization"]
    assert_close_to_ort(engine.run(feeds())[engine.output_names[0]], run_ort(model, feeds())[0])


@needs_bf16
def test_rms_norm_is_granted_bf16(tmp_path):
    model = export(tmp_path, dynamo=True)
    engine = kiln.build(model, bf16=True, tactic_sources="-openvino,-onnxruntime", precision_constraints="prefer",
                        accuracy="off")
    (norm,) = [l for l in engine.plan.layers if l.op_type == "RMSNormalization"]
    assert (norm.tactic_name, norm.precision) == ("kiln.layernorm_rows_bf16", "BF16")
    got, want = engine.run(feeds())[engine.output_names[0]], run_ort(model, feeds())[0]
    assert cosine(got, want) > 0.9999


def _view(rows: int, n: int, gamma: torch.Tensor, in_dtype="float32", out_dtype="float32") -> LayerView:
    return LayerView("RMSNormalization", "", {"axis": -1, "epsilon": 1e-6}, ((rows, n), (n,)), (in_dtype, "float32"),
                     {1: gamma}, (out_dtype,))


def _formula(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * gamma.double()


def test_the_kernel_matches_the_formula():
    torch.manual_seed(2)
    x, gamma = torch.randn(7, 300) * 5 + 1, torch.rand(300) + 0.5
    y = LayerNormTactic().prepare(_view(7, 300, gamma))([x, None])[0]
    torch.testing.assert_close(y.double(), _formula(x, gamma), rtol=1e-5, atol=1e-5)


@needs_bf16
def test_the_bf16_kernel_reads_and_writes_bf16():
    torch.manual_seed(3)
    x, gamma = torch.randn(4, 96).bfloat16(), torch.rand(96) + 0.5
    y = LayerNormBf16Tactic().prepare(_view(4, 96, gamma, "bfloat16", "bfloat16"))([x, None])[0]
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), _formula(x.float(), gamma), rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("opset", [17, 18])
def test_a_region_runs_it_at_the_models_opset(tmp_path, monkeypatch, opset):
    """onnxruntime's region gets RMSNormalization as the graph it came from (it is an opset-23 op; ReduceMean takes
    its axes as an attribute before opset 18, as an input from 18)."""
    model = export(tmp_path, dynamo=False)
    model = onnx.version_converter.convert_version(model, opset) if opset != 17 else model
    force_plan(monkeypatch, "onnxruntime")
    engine = kiln.build(model, tactic_sources={"onnxruntime"}, avg_timing=1, min_timing=1)
    (region,) = [layer for layer in engine.plan.layers if layer.inner]
    assert "RMSNormalization" in {layer.op_type for layer in region.inner}
    assert_close_to_ort(engine.run(feeds())[engine.output_names[0]], run_ort(model, feeds())[0])
