"""kiln's own oneDNN matmul primitives for linear layers (source "onednn"): every Gemm form and a batched MatMul with
bias and GELU on the source alone against onnxruntime, FP32 and BF16, through save and load; a residual summed
in place with the activation after it; BF16 against the formula on bf16-rounded operands for every mix of stored
types; another row count getting a primitive of its own."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln.native import external
from kiln.ops.nn import apply_activation
from kiln.tactics import onednn_prim
from kiln.tactics.base import LayerView
from kiln.tactics.onednn_conv import bf16_available
from kiln.tactics.onednn_prim_linear import PrimitiveBf16LinearTactic, PrimitiveLinearTactic
from tests.conftest import assert_close_to_ort, cosine, run_ort
from tests.tactics.test_onednn_linear import _gemm_model, _matmul_model

pytestmark = pytest.mark.skipif(not onednn_prim.available(), reason="oneDNN's C API is not installed here (pip "
                                f"install {external.ONEDNN_WHEELS})")
needs_bf16 = pytest.mark.skipif(not bf16_available(), reason="this CPU has no native BF16 (AVX512-BF16 or AMX): "
                                "oneDNN's BF16 matmul is not offered")


@pytest.mark.parametrize("trans_b, bias_shape", [(1, (40,)), (0, (40,)), (1, (1, 40)), (0, None)])
def test_gemm_forms_on_the_onednn_source_alone_match_onnxruntime(trans_b, bias_shape):
    model = _gemm_model(trans_b, bias_shape)
    engine = kiln.build(model, tactic_sources="onednn")
    assert [(l.tactic_name, l.source) for l in engine.plan.layers] == [("onednn.linear_primitive", "onednn")]
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    assert_close_to_ort(engine.run({"x": x})["y"], run_ort(model, {"x": x})[0])


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=needs_bf16)], ids=["fp32", "bf16"])
def test_a_batched_matmul_with_bias_and_gelu_matches_onnxruntime_and_reloads(tmp_path, bf16):
    model = _matmul_model()
    engine = kiln.build(model, tactic_sources="onednn", bf16=bf16, precision_constraints="prefer" if bf16 else "none")
    name = "onednn.linear_primitive_bf16" if bf16 else "onednn.linear_primitive"
    assert [(l.tactic_name, l.precision) for l in engine.plan.layers] == [(name, "BF16" if bf16 else "FP32")]
    x = np.random.default_rng(2).standard_normal((2, 7, 48)).astype(np.float32)
    got, want = engine.run({"x": x})["y"], run_ort(model, {"x": x})[0]
    if bf16:   # 48-term dot products of bf16-rounded operands
        assert cosine(got, want) >= 0.9999 and np.abs(got - want).max() < 0.1
    else:
        assert_close_to_ort(got, want)
    engine.save(tmp_path / "mm.kiln")
    np.testing.assert_array_equal(kiln.load(tmp_path / "mm.kiln").run({"x": x})["y"], got)


def linear_view(x_shape, k, n, activation=None, residual=False, dtypes=("float32",) * 3, seed=0) -> LayerView:
    """A MatMul by a constant [k, n] matrix with a bias; `dtypes`: how the plan stores its input, residual, output."""
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(k, n, generator=g) * 0.2, torch.randn(n, generator=g)
    shapes, ins = [tuple(x_shape), (k, n), (n,)], [dtypes[0], "float32", "float32"]
    if residual:
        shapes.append((*x_shape[:-1], n))
        ins.append(dtypes[1])
    attrs = {"activation": activation} if activation else {}
    return LayerView("MatMul", "", attrs, tuple(shapes), tuple(ins), {1: w, 2: b}, (dtypes[2],), 17,
                     tuple(() for _ in shapes))


def formula(view: LayerView, x, r=None, rounded=False) -> torch.Tensor:
    x, w = x.float(), view.const_inputs[1]
    if rounded:
        x, w = x.bfloat16().float(), w.bfloat16().float()
    y = x @ w + view.const_inputs[2]
    return apply_activation(view.attrs.get("activation"), y if r is None else y + r.float())


def test_a_residual_is_summed_in_place_before_the_activation():
    view = linear_view((2, 5, 48), 48, 40, activation={"op": "Sigmoid"}, residual=True)
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(2, 5, 48, generator=g), torch.randn(2, 5, 40, generator=g)
    kernel = PrimitiveLinearTactic().prepare(view)
    want = formula(view, x, r)
    index, into = kernel.into_input
    accum = r.clone()
    got = into([x, None, None, accum])[0]
    assert index == 3 and got.data_ptr() == accum.data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    live = r.clone()
    torch.testing.assert_close(kernel([x, None, None, r])[0], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(r, live)   # the plain call sums into a copy: the live residual is left alone


def test_another_row_count_gets_a_primitive_of_its_own():
    view = linear_view((2, 7, 48), 48, 40, activation={"op": "Gelu", "attrs": {}})
    kernel = PrimitiveLinearTactic().prepare(view)   # made for 14 rows at load
    x = torch.randn(3, 7, 48, generator=torch.Generator().manual_seed(4))
    got = kernel([x, None, None])[0]
    assert got.shape == (3, 7, 40) and got.is_contiguous()
    torch.testing.assert_close(got, formula(view, x), rtol=1e-5, atol=1e-5)


@needs_bf16
@pytest.mark.parametrize("dtypes", [("float32",) * 3, ("bfloat16",) * 3, ("bfloat16", "float32", "bfloat16"),
                                    ("float32", "bfloat16", "float32"), ("bfloat16", "bfloat16", "float32")],
                         ids=lambda d: "-".join(t[0] for t in d))   # x, residual, output: f(loat32) or b(float16)
def test_bf16_computes_on_rounded_operands_for_every_mix_of_stored_types(dtypes):
    """The residual (±1000 + noise) is added in FP32 whether summed or read from its own buffer."""
    view = linear_view((9, 48), 48, 40, activation={"op": "Relu"}, residual=True, dtypes=dtypes, seed=5)
    g = torch.Generator().manual_seed(6)
    x, r = torch.randn(9, 48, generator=g), torch.randn(9, 40, generator=g)
    r = r + 1000 * r.sign()
    x, r = (x.bfloat16() if dtypes[0] == "bfloat16" else x), (r.bfloat16() if dtypes[1] == "bfloat16" else r)
    got = PrimitiveBf16LinearTactic().prepare(view)([x, None, None, r])[0]
    assert got.dtype == (torch.bfloat16 if dtypes[2] == "bfloat16" else torch.float32)
    tol = dict(rtol=1 / 128, atol=1e-3) if dtypes[2] == "bfloat16" else dict(rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(got.float(), formula(view, x, r, rounded=True), **tol)
