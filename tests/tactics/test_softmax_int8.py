"""kiln's INT8 Softmax (QSoftmax: DequantizeLinear -> Softmax -> QuantizeLinear, kiln.tactics.softmax_c) against the
formula in float64 for each pair of INT8 types, odd row lengths and two threads; a quantized attention's
probabilities against onnxruntime's unfused ops; the layers it declines."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.tactics import codegen
from kiln.tactics.base import LayerView
from kiln.tactics.softmax_c import QSOFTMAX_TACTIC, QuantizedSoftmaxTactic
from tests.conftest import assert_int8_layer_matches_onnxruntime, make_model, torch_threads, \
    unfused_onnxruntime
from tests.tactics.amx import built_with, quantize_path  # noqa: F401  (fixtures)
from tests.tactics.test_qgemm_c import RANGES, TORCH, rand_q

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")

TACTIC = QuantizedSoftmaxTactic()


def qsoftmax(shape, x_dtype, y_dtype, x_scale=0.07, x_zp=3, y_scale=1 / 255, y_zp=None, axis=-1, dynamic=()):
    y_zp = RANGES[y_dtype][0] if y_zp is None else y_zp   # probabilities from the type's lowest value up
    quant = {"x_scale": x_scale, "x_zero_point": x_zp, "x_dtype": x_dtype, "y_scale": y_scale,
             "y_zero_point": y_zp, "y_dtype": y_dtype}
    return LayerView("QSoftmax", "kiln", {"axis": axis, "quant": quant}, (tuple(shape),), (x_dtype,), {}, (y_dtype,),
                     17, (dynamic,))


def formula(x: torch.Tensor, view: LayerView) -> torch.Tensor:
    """Dequantize, softmax and quantize (half to even, saturated) in float64."""
    q = view.attrs["quant"]
    p = torch.softmax((x.double() - q["x_zero_point"]) * q["x_scale"], dim=-1)
    lo, hi = RANGES[q["y_dtype"]]
    return (torch.round(p / q["y_scale"]) + q["y_zero_point"]).clamp(lo, hi).to(torch.int32)


@pytest.mark.parametrize("x_dtype,y_dtype", [("uint8", "uint8"), ("int8", "int8"), ("uint8", "int8"),
                                             ("int8", "uint8")])
@pytest.mark.parametrize("shape,threads", [((3, 5, 77), 1), ((2, 12, 128), 2), ((4, 1), 1)])
def test_the_kernel_quantizes_the_softmax_of_the_dequantized_row(x_dtype, y_dtype, shape, threads):
    view = qsoftmax(shape, x_dtype, y_dtype)
    assert TACTIC.supports(view)
    x = rand_q(shape, x_dtype, torch.Generator().manual_seed(1))
    with torch_threads(threads):
        y = TACTIC.prepare(view)([x])[0]
    want = formula(x, view)
    assert y.dtype == TORCH[y_dtype] and y.shape == x.shape
    diff = (y.to(torch.int32) - want).abs()
    assert diff.max() <= 1 and (diff == 0).double().mean() >= 0.99   # float32 inside: a rare value a step off
    if shape[-1] > 1:
        assert len(torch.unique(want)) > 20
    else:
        assert torch.equal(y.to(torch.int32), want)   # a row of one: probability 1 exactly


def attention_probabilities_model():
    h = helper.make_node
    nodes = [h("DequantizeLinear", ["x", "x_s", "x_z"], ["xf"]), h("Softmax", ["xf"], ["p"], axis=-1, name="sm"),
             h("QuantizeLinear", ["p", "y_s", "y_z"], ["y"], name="sm_q")]
    inits = [numpy_helper.from_array(np.float32(0.0831), "x_s"), numpy_helper.from_array(np.uint8(128), "x_z"),
             numpy_helper.from_array(np.float32(1 / 255), "y_s"), numpy_helper.from_array(np.int8(-128), "y_z")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 12, 64, 64])],
                      [helper.make_tensor_value_info("y", TensorProto.INT8, [1, 12, 64, 64])], inits)


def test_quantized_probabilities_are_one_int8_layer_matching_onnxruntime():
    x = {"x": np.random.default_rng(2).integers(0, 256, (1, 12, 64, 64)).astype(np.uint8)}
    layer = ("sm + sm_q", "QSoftmax", QSOFTMAX_TACTIC)
    assert_int8_layer_matches_onnxruntime(attention_probabilities_model(), x, layer, np.int8, exact=0.99, spread=20)


def test_ties_round_to_even_and_the_top_saturates(quantize_path):
    """Two equal inputs: p = 0.5 exactly, 0.5 / 1.0 rounds to 0 (half to even, not away); probabilities past the
    output range saturate at its top, exactly."""
    view = qsoftmax((5, 2), "uint8", "uint8", y_scale=1.0, y_zp=0)
    x = torch.full((5, 2), 7, dtype=torch.uint8)
    assert torch.equal(TACTIC.prepare(view)([x])[0], torch.zeros((5, 2), dtype=torch.uint8))
    for y_dtype, y_scale, y_zp in (("uint8", 1 / 1024, 0), ("int8", 1 / 512, -128)):
        view = qsoftmax((3, 40), "int8", y_dtype, x_scale=0.5, y_scale=y_scale, y_zp=y_zp)
        x = torch.randint(-128, 128, (3, 40), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
        y, want = TACTIC.prepare(view)([x])[0].to(torch.int32), formula(x, view)
        top = want == RANGES[y_dtype][1]
        assert top.any() and torch.equal(y[top], want[top]) and (y - want).abs().max() <= 1


def test_rows_are_read_per_call_and_long_ones_computed_too():
    """A sequence length that varies per call (the row read from the input, not the plan) and rows longer than
    the kernel keeps on its stack (4096: computed on torch's kernels, the same formula)."""
    view = qsoftmax((2, 16), "int8", "uint8", x_scale=0.02, y_scale=1e-4, dynamic=(1,))
    assert TACTIC.supports(view)
    run = TACTIC.prepare(view)
    for n in (16, 33, 5000):
        x = torch.randint(-128, 128, (2, n), dtype=torch.int8, generator=torch.Generator().manual_seed(n))
        y, want = run([x])[0], formula(x, view)
        assert y.shape == (2, n) and (y.to(torch.int32) - want).abs().max() <= 1 and len(torch.unique(want)) > 5
    assert run([torch.zeros((0, 7), dtype=torch.int8)])[0].shape == (0, 7)


def test_declines_what_it_cannot_compute():
    assert TACTIC.supports(qsoftmax((2, 4096), "uint8", "uint8"))
    cases = {"another axis": qsoftmax((2, 8, 4), "uint8", "uint8", axis=1),
             "a 16-bit type": qsoftmax((2, 16), "uint16", "uint8"),
             "a 16-bit output": qsoftmax((2, 16), "uint8", "int16", y_zp=0),
             "a plain Softmax": LayerView("Softmax", "", {"axis": -1}, ((2, 16),), ("float32",), {}, ("float32",))}
    for name, view in cases.items():
        assert not TACTIC.supports(view), name


def test_an_onnxruntime_region_runs_it_as_the_three_onnx_ops(monkeypatch):
    from tests.conftest import force_plan

    model = attention_probabilities_model()
    force_plan(monkeypatch, "onnxruntime")
    engine = kiln.build(model, avg_timing=1, min_timing=1)
    [region] = engine.plan.layers
    assert region.op_type == "Region" and [l.op_type for l in region.inner] == ["QSoftmax"]
    x = {"x": np.random.default_rng(3).integers(0, 256, (1, 12, 64, 64)).astype(np.uint8)}
    assert np.abs(engine.run(x)["y"].astype(np.int32) - unfused_onnxruntime(model, x)).max() <= 1
