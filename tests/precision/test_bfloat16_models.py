"""bfloat16 models (torch modules exported after `.to(torch.bfloat16)`, by both exporters) build weakly typed, as
float16 ones do: FP32 layers inside, the model's bfloat16 inputs and outputs kept as ml_dtypes' bfloat16 arrays.
onnxruntime cannot be the reference (its CPU provider has no bfloat16 MatMul/Conv, its Python API takes no
bfloat16 arrays): the reference is torch in float32 on the same bf16-rounded weights and input."""
from __future__ import annotations

import logging
import warnings

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from torch import nn

import kiln
from kiln.errors import ModelError
from tests.cli.test_cli import kiln_cli
from tests.conftest import cosine

BF16 = np.dtype(ml_dtypes.bfloat16)


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))


@pytest.fixture(scope="module", params=["legacy", "dynamo"])
def exported(request, tmp_path_factory):
    """(path, bfloat16 input, torch's float32 output on the bf16 weights) for one exporter."""
    torch.manual_seed(0)
    model = SmallNet().eval().to(torch.bfloat16)
    x = torch.randn(1, 3, 12, 12).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("bf16") / f"net_{request.param}.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), input_names=["x"], output_names=["y"],
                          dynamo=request.param == "dynamo", **({} if request.param == "dynamo" else {"opset_version": 17}))
        want = model.float()(x.float()).numpy()
    return path, x.view(torch.int16).numpy().view(BF16), want


def test_a_bfloat16_export_builds_weakly_typed_and_keeps_its_types(exported, caplog):
    path, x, want = exported
    proto = onnx.load(str(path))
    assert proto.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    with caplog.at_level(logging.INFO, logger="kiln"):
        engine = kiln.build(str(path), autotune=False)
    assert "The model stores bfloat16: built weakly typed" in caplog.text
    assert [t.dtype for t in engine.plan.inputs] == ["bfloat16"] and [t.dtype for t in engine.plan.outputs] == ["bfloat16"]
    assert {l.precision for l in engine.plan.layers} == {"FP32"}   # no flag: no reduced precision inside
    assert engine.plan.layers[0].name == "x to FP32"
    y = engine.run({"x": x})["y"]
    assert y.dtype == BF16 and y.shape == want.shape
    # FP32 inside; the one rounding is the output's to bfloat16 (8 bits of mantissa)
    np.testing.assert_allclose(y.astype(np.float32), want, rtol=2 ** -8, atol=1e-3)


def test_float_feeds_convert_to_the_bfloat16_input_and_random_inputs_are_bfloat16(exported):
    path, x, _ = exported
    engine = kiln.build(str(path))   # every source, timed: external libraries leave the bfloat16 Casts to kiln
    as_bf16 = engine.run({"x": x})["y"]
    np.testing.assert_array_equal(engine.run({"x": x.astype(np.float32)})["y"], as_bf16)
    feeds = engine.random_inputs()
    assert feeds["x"].dtype == BF16 and engine.run(feeds)["y"].dtype == BF16
    with pytest.raises(kiln.InputError, match="dtype int64 cannot be used for the engine's bfloat16"):
        engine.run({"x": np.zeros(x.shape, np.int64)})


def test_bf16_flag_keeps_the_accuracy_budget_on_a_bfloat16_model(exported):
    path, x, want = exported
    engine = kiln.build(str(path), bf16=True, tactic_sources="-openvino,-onnxruntime")
    products = [l for l in engine.plan.layers if l.op_type in ("Conv", "MatMul", "Gemm")]
    assert len(products) == 2 and all(l.requested_precision == "BF16" for l in products), engine.plan.layers
    assert cosine(engine.run({"x": x})["y"].astype(np.float32), want) > 0.999


def test_strongly_typed_bfloat16_is_refused_with_the_way_out(exported, tmp_path):
    path, _, _ = exported
    with pytest.raises(ModelError, match="stores bfloat16: kiln builds it weakly typed only"):
        kiln.build(str(path), strongly_typed=True)
    out = tmp_path / "m.kiln"
    done = kiln_cli("build", str(path), "-o", str(out), "--strongly-typed")
    assert done.returncode == 2 and "drop --strongly-typed" in done.stderr and not out.exists()


def test_serving_and_triton_name_bfloat16():
    from kiln.serve.datatypes import numpy_dtype, oip_datatype
    from kiln.tools.triton_export import TRITON_DATA_TYPES

    assert oip_datatype("bfloat16") == "BF16" and numpy_dtype("BF16", "input 'x'") == BF16
    assert TRITON_DATA_TYPES["bfloat16"] == "TYPE_BF16"
