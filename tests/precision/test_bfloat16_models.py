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
        legacy = {} if request.param == "dynamo" else {"opset_version": 17}
        torch.onnx.export(model, (x,), str(path), input_names=["x"], output_names=["y"],
                          dynamo=request.param == "dynamo", **legacy)
        want = model.float()(x.float()).numpy()
    return path, x.view(torch.int16).numpy().view(BF16), want


def test_a_bfloat16_export_builds_weakly_typed_and_keeps_its_types(exported, caplog):
    path, x, want = exported
    proto = onnx.load(str(path))
    assert proto.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    with caplog.at_level(logging.INFO, logger="kiln"):
        engine = kiln.build(str(path), autotune=False)
    assert "The model stores bfloat16: built weakly typed" in caplog.text
    assert [t.dtype for t in (*engine.plan.inputs, *engine.plan.outputs)] == ["bfloat16", "bfloat16"]
    assert {l.precision for l in engine.plan.layers} == {"FP32"}   # no flag: no reduced precision inside
    assert engine.plan.layers[0].name == "x to FP32"
    y = engine.run({"x": x})["y"]
    assert y.dtype == BF16 and y.shape == want.shape
    # FP32 inside; the one rounding is the output's to bfloat16 (8 bits of mantissa)
    np.testing.assert_allclose(y.astype(np.float32), want, rtol=2 ** -8, atol=1e-3)


def test_float_feeds_convert_to_the_bfloat16_input_and_random_inputs_are_bfloat16(exported, tmp_path):
    path, x, _ = exported
    engine = kiln.build(str(path))   # every source, timed: external libraries leave the bfloat16 Casts to kiln
    between = x.astype(np.float32) * np.float32(1 + 2 ** -10)   # not on bfloat16's grid: rounded to it on entry
    assert not np.array_equal(between.astype(BF16).astype(np.float32), between)
    np.testing.assert_array_equal(engine.run({"x": between})["y"], engine.run({"x": between.astype(BF16)})["y"])
    np.savez(tmp_path / "in.npz", x=x)   # stored as raw 2-byte values: loads back as |V2
    with np.load(tmp_path / "in.npz") as saved:
        assert saved["x"].dtype.kind == "V"
        np.testing.assert_array_equal(engine.run({"x": saved["x"]})["y"], engine.run({"x": x})["y"])
    feeds = engine.random_inputs()
    assert feeds["x"].dtype == BF16 and engine.run(feeds)["y"].dtype == BF16
    with pytest.raises(kiln.InputError, match="dtype int64 cannot be used for the engine's bfloat16"):
        engine.run({"x": np.zeros(x.shape, np.int64)})


def test_bf16_flag_keeps_the_accuracy_budget_on_a_bfloat16_model(exported, tmp_path):
    path, x, want = exported
    np.savez(tmp_path / "data.npz", x=x)   # the budget's inputs, stored as raw 2-byte values
    engine = kiln.build(str(path), bf16=True, tactic_sources="-openvino,-onnxruntime", calib=str(tmp_path / "data.npz"))
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


def test_tools_that_run_onnxruntime_refuse_a_bfloat16_model_by_name(exported, tmp_path):
    path, _, _ = exported
    engine_path = tmp_path / "m.kiln"
    assert kiln_cli("build", str(path), "-o", str(engine_path)).returncode == 0
    done = kiln_cli("compare", str(path), str(engine_path))
    assert done.returncode == 2 and "onnxruntime cannot run the model" in done.stderr and "bfloat16" in done.stderr
    assert "Traceback" not in done.stderr
    np.savez(tmp_path / "calib.npz", x=np.zeros((1, 3, 12, 12), np.float32))
    quantized = tmp_path / "q.kiln"
    done = kiln_cli("build", str(path), "-o", str(quantized), "--int8", "--calib", str(tmp_path / "calib.npz"))
    assert done.returncode == 2 and "calibrate the model's float32 export" in done.stderr and not quantized.exists()
    done = kiln_cli("export", "triton", str(engine_path), "-o", str(tmp_path / "repo"))
    assert done.returncode != 0 and "bfloat16 has no Triton counterpart" in done.stderr


def test_serving_names_bfloat16():
    from kiln.serve.datatypes import numpy_dtype, oip_datatype

    assert oip_datatype("bfloat16") == "BF16" and numpy_dtype("BF16", "input 'x'") == BF16


def test_two_plans_a_bfloat16_rounding_step_apart_agree():
    """Plans are checked against each other where onnxruntime cannot run the model: their bfloat16 outputs may
    differ by one rounding step per element, far above the FP32 tolerance at BERT's hidden-state size."""
    from kiln.planning.race import _agree

    exact = torch.randn(128, 768, generator=torch.Generator().manual_seed(0)) * 3
    a, b = exact.to(torch.bfloat16), (exact * (1 + 2 ** -12)).to(torch.bfloat16)
    assert not torch.equal(a, b) and _agree([a], [b])
    assert not _agree([a.float()], [b.float()])   # the same values as FP32 outputs: outside 1e-3 of the largest
    wrong = a.clone()
    wrong[0, 0] += 0.05 * float(exact.abs().max())
    assert not _agree([wrong], [b])


def test_bfloat16_arrays_cross_into_torch_and_back_bit_for_bit():
    from kiln.ops.dtypes import tensor_from_numpy, tensor_to_numpy

    a = np.array([1.5, -0.0078125, np.inf, 3.0e38], dtype=BF16)
    t = tensor_from_numpy(a)
    assert t.dtype == torch.bfloat16 and torch.equal(t.view(torch.int16), torch.from_numpy(a.view(np.int16)))
    assert torch.equal(t.float(), torch.from_numpy(a.astype(np.float32)))   # torch's widening and ml_dtypes' agree
    back = tensor_to_numpy(t)
    assert back.dtype == BF16 and np.array_equal(back.view(np.int16), a.view(np.int16))
    assert tensor_from_numpy(np.ones(3, np.float32)).dtype == torch.float32


def test_first_nonfinite_names_a_bfloat16_input_holding_nan(exported):
    path, x, _ = exported
    engine = kiln.build(str(path), autotune=False)
    bad = x.copy()
    bad[0, 0, 0, 1], bad[0, 1, 2, 2] = np.nan, np.inf
    assert engine.first_nonfinite({"x": bad}) == ("(input)", "x", 1, 1)
    assert engine.first_nonfinite({"x": x}) is None


def test_budget_inputs_for_a_bfloat16_input_are_seeded_normals():
    from kiln.planning.accuracy import random_input
    from tests.passes.ir_builder import IRBuilder

    x = IRBuilder().input("x", (4, 8), BF16)
    drawn = random_input(x, 2)
    assert drawn.dtype == torch.bfloat16 and not torch.equal(drawn, random_input(x, 3))
    assert torch.equal(drawn, torch.randn((4, 8), generator=torch.Generator().manual_seed(2)).bfloat16())
