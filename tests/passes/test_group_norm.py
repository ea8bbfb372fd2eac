"""GroupNormFusion and NormActFusion on real exports: torch's nn.GroupNorm + nn.SiLU, as both exporters write it
(InstanceNormalization between Reshapes, then Mul, Add, Sigmoid, Mul), is one GroupNormalization layer with the
SiLU inside, matching onnxruntime on kiln's kernels and inside an onnxruntime region (written back at the model's
opset: an older opset than 21 gets the decomposed form); ONNX's own GroupNormalization-21 takes the SiLU too."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln.tactics import codegen
from tests.conftest import assert_close_to_ort, force_plan, init, make_model, rand, run_ort
from tests.models.nets import export

KILN = "kiln,codegen,torch-onednn"


class Block(torch.nn.Module):
    """A diffusion U-Net resnet block's head: Conv, GroupNorm(4, 16), SiLU, Conv."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.Conv2d(16, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(4, 16)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.conv2(torch.nn.functional.silu(self.norm(self.conv1(x))))


@pytest.fixture(scope="module", params=["legacy", "dynamo"])
def block(request, tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("gn") / f"block_{request.param}.onnx"
    x = torch.randn(1, 8, 12, 12)
    export(Block().eval(), x, path, request.param)
    return onnx.load(str(path)), {"input": x.numpy() * 2 + 1}


def _norms(engine):
    return [layer for layer in engine.plan.layers if layer.op_type in ("GroupNormalization", "InstanceNormalization")]


@pytest.mark.skipif(not codegen.available(), reason="no C compiler")
def test_group_norm_and_silu_are_one_layer_on_kilns_kernels(block):
    model, feeds = block
    engine = kiln.build(model, tactic_sources=KILN, avg_timing=1, min_timing=1)
    (norm,) = _norms(engine)
    assert norm.op_type == "GroupNormalization" and norm.attrs["num_groups"] == 4
    assert norm.attrs["activation"]["op"] == "Swish" and norm.tactic_name in ("kiln.groupnorm_rows",
                                                                            "kiln.groupnorm_nhwc")
    assert [layer.op_type for layer in engine.plan.layers if layer.op_type != "Reformat"] == \
        ["Conv", "GroupNormalization", "Conv"]
    assert_close_to_ort(engine.run(feeds)["output"], run_ort(model, feeds)[0])


def test_an_onnxruntime_region_runs_the_fused_layer_at_the_models_opset(block, monkeypatch):
    model, feeds = block
    force_plan(monkeypatch, "onnxruntime")
    engine = kiln.build(model, tactic_sources={"onnxruntime"}, avg_timing=1, min_timing=1)
    (region,) = [layer for layer in engine.plan.layers if layer.inner]
    assert "GroupNormalization" in {layer.op_type for layer in region.inner}
    assert_close_to_ort(engine.run(feeds)["output"], run_ort(model, feeds)[0])


def onnx_group_norm_silu(opset: int) -> onnx.ModelProto:
    """ONNX's GroupNormalization (opset 21: per-channel scale), then Sigmoid and Mul."""
    nodes = [helper.make_node("GroupNormalization", ["x", "s", "b"], ["n"], name="gn", num_groups=4, epsilon=1e-5),
             helper.make_node("Sigmoid", ["n"], ["g"], name="sig"), helper.make_node("Mul", ["n", "g"], ["y"],
                                                                                     name="mul")]
    inits = [init("s", rand((16,), seed=1)), init("b", rand((16,), seed=2))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16, 6, 6])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, opset=opset)


@pytest.mark.skipif(not codegen.available(), reason="no C compiler")
def test_onnx_group_normalization_takes_the_silu():
    model = onnx_group_norm_silu(21)
    engine = kiln.build(model, tactic_sources=KILN, avg_timing=1, min_timing=1)
    assert [(layer.name, layer.attrs["activation"]["op"]) for layer in engine.plan.layers
            if layer.op_type != "Reformat"] == [("gn + sig + mul", "Swish")]
    x = rand((2, 16, 6, 6), seed=3) * 2
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])
    assert np.isfinite(engine.run({"x": x * 1e3})["y"]).all()   # SiLU's exponent does not overflow


def test_an_onnxruntime_region_writes_group_normalization_21_as_it_is(monkeypatch):
    model = onnx_group_norm_silu(21)
    force_plan(monkeypatch, "onnxruntime")
    engine = kiln.build(model, tactic_sources={"onnxruntime"}, avg_timing=1, min_timing=1)
    (region,) = [layer for layer in engine.plan.layers if layer.inner]
    assert [layer.op_type for layer in region.inner] == ["GroupNormalization"]
    x = rand((2, 16, 6, 6), seed=4)
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])
