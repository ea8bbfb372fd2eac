"""A linear layer with a fused residual (input 3, kiln.passes.gemm.fuse_matmul_residual): every MatMul/Gemm tactic
computes x·W + bias + residual [-> activation] as its formula says (FP32 exactly to rounding, BF16 with bf16
operands), the in-place variants write over the residual's buffer, a residual of another shape is declined, and a
pre-LN block built on kiln's own kernels and on every source matches onnxruntime."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln import hardware, native
from kiln.tactics.base import LayerView
from kiln.tactics.gemm_amx import MatMulGemmAmxTactic
from kiln.tactics.gemm_bf16 import BF16_DOT_ISA, MatMulGemmBf16Tactic
from kiln.tactics.matmul_c import MatMulGemmTactic
from kiln.tactics.onednn_conv import bf16_available
from kiln.tactics.onednn_linear import OneDnnBf16LinearTactic, OneDnnLinearTactic
from kiln.tactics.onnxruntime_source import OnnxRuntimeLayerTactic
from kiln.tactics.reference import ReferenceTactic
from tests.conftest import assert_close_to_ort, init, make_model, rand, run_ort
from tests.tactics.amx import amx_kernels, emulated_amx_libraries  # noqa: F401  (fixtures)

K, N = 40, 70   # odd panels: a full and a partial 32-column panel after the first


def residual_view(op: str = "MatMul", x_shape=(2, 9, K), dtypes=("float32",) * 3, activation=None) -> LayerView:
    """MatMul/Gemm(x, W, bias, residual) with [activation]; `dtypes`: the input's, the residual's and the output's
    storage."""
    g = torch.Generator().manual_seed(31)
    w, bias = torch.randn(K, N, generator=g) * 0.2, torch.randn(N, generator=g)
    out = (*x_shape[:-1], N)
    attrs = {"activation": {"op": activation, "attrs": {}}} if activation else {}
    return LayerView(op, "", attrs, (x_shape, (K, N), (N,), out), (dtypes[0], "float32", "float32", dtypes[1]),
                     {1: w, 2: bias}, (dtypes[2],), 17, ((),) * 4)


def formula(view: LayerView, x: torch.Tensor, r: torch.Tensor, bf16_operands: bool) -> torch.Tensor:
    w = view.const_inputs[1]
    if bf16_operands:
        x, w = x.bfloat16().float(), w.bfloat16().float()
    y = x.float() @ w + view.const_inputs[2] + r.float()
    return torch.relu(y) if view.attrs.get("activation") else y


FP32_TACTICS = [OneDnnLinearTactic(), MatMulGemmTactic(), ReferenceTactic(), OnnxRuntimeLayerTactic()]
BF16_TACTICS = [OneDnnBf16LinearTactic(), MatMulGemmBf16Tactic(), MatMulGemmAmxTactic()]


def reduced(tactic) -> bool:
    """Whether the tactic computes in BF16 (its operands rounded to bf16)."""
    return "BF16" in getattr(tactic, "reduced_precisions", ())


def usable(tactic, request) -> None:
    """Skip (with the reason) a tactic this machine cannot run; AMX runs emulated where the CPU lacks it."""
    if tactic.source in ("kiln", "codegen") and not native.available():
        pytest.skip("no C compiler: kiln's own kernels are not built")
    if reduced(tactic) and not (hardware.has_any(BF16_DOT_ISA) and bf16_available()):
        pytest.skip("this CPU has no AVX512-BF16: the BF16 linear kernels are not offered")
    if isinstance(tactic, MatMulGemmAmxTactic):
        request.getfixturevalue("amx_kernels")


@pytest.mark.parametrize("tactic", FP32_TACTICS + BF16_TACTICS, ids=lambda t: t.name)
@pytest.mark.parametrize("op,x_shape,activation", [("MatMul", (2, 9, K), None), ("MatMul", (5, K), "Relu"),
                                                   ("Gemm", (7, K), None)])
def test_residual_is_added_after_the_bias_and_before_the_activation(tactic, op, x_shape, activation, request):
    usable(tactic, request)
    view = residual_view(op, x_shape, activation=activation)
    assert tactic.supports(view)
    g = torch.Generator().manual_seed(32)
    x, r = torch.randn(x_shape, generator=g), torch.randn((*x_shape[:-1], N), generator=g)
    got = tactic.prepare(view)([x, None, None, r])[0]
    tolerance = dict(rtol=1e-2, atol=2e-2) if reduced(tactic) else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.float(), formula(view, x, r, reduced(tactic)), **tolerance)


@pytest.mark.parametrize("tactic,stored", [(MatMulGemmTactic(), "float32"), (MatMulGemmBf16Tactic(), "float32"),
                                           (MatMulGemmBf16Tactic(), "bfloat16"), (MatMulGemmAmxTactic(), "bfloat16")],
                         ids=lambda v: getattr(v, "name", v))
def test_kiln_gemm_writes_over_a_dead_residual_of_its_output_type(tactic, stored, request):
    """The donation variant (kiln.runtime.donation) stores each row where the residual's was, after reading it: the
    formula's values (bf16-stored inputs and residual read as stored), and bit for bit the ordinary variant's."""
    usable(tactic, request)
    assert tactic.supports(residual_view(x_shape=(3, 11, K)))   # chosen on FP32; the plan's storage comes after
    view = residual_view(x_shape=(3, 11, K), dtypes=(stored,) * 3)
    g = torch.Generator().manual_seed(33)
    as_stored = torch.bfloat16 if stored == "bfloat16" else torch.float32
    x, r = (torch.randn(shape, generator=g).to(as_stored) for shape in ((3, 11, K), (3, 11, N)))
    kernel = tactic.prepare(view)
    index, into = kernel.into_input
    want = kernel([x, None, None, r.clone()])[0]
    buffer = r.clone()
    got = into([x, None, None, buffer])[0]
    assert index == 3 and got.data_ptr() == buffer.data_ptr() and got.dtype == as_stored
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)
    torch.testing.assert_close(got.float(), formula(view, x.float(), r.float(), reduced(tactic)), rtol=1e-2, atol=3e-2)


@pytest.mark.parametrize("tactic", [OneDnnLinearTactic(), MatMulGemmTactic()], ids=lambda t: t.name)
def test_a_residual_of_another_shape_is_declined(tactic, request):
    usable(tactic, request)
    view = residual_view()
    broadcast = LayerView(view.op_type, "", {}, view.input_shapes[:3] + ((1, 1, N),), view.input_dtypes,
                          view.const_inputs, view.output_dtypes, 17, ((),) * 4)
    assert not tactic.supports(broadcast)
    assert tactic.supports(view)


def pre_ln_block(seq: int | str = 12, hidden: int = 48):
    """x + W2·Relu(W1·LN(x) + b1) + b2, then + W3·x (no bias): the pre-LN residual sums of ViT/GPT-2 blocks."""
    nodes = [helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], axis=-1, name="ln"),
             helper.make_node("MatMul", ["n", "w1"], ["h0"], name="fc1"),
             helper.make_node("Add", ["h0", "b1"], ["h1"], name="fc1_bias"),
             helper.make_node("Relu", ["h1"], ["h"], name="relu"),
             helper.make_node("MatMul", ["h", "w2"], ["p0"], name="fc2"),
             helper.make_node("Add", ["p0", "b2"], ["p"], name="fc2_bias"),
             helper.make_node("Add", ["x", "p"], ["x1"], name="residual1"),
             helper.make_node("MatMul", ["x1", "w3"], ["q"], name="proj"),
             helper.make_node("Add", ["q", "x1"], ["y"], name="residual2")]
    inits = [init("gamma", 1 + 0.1 * rand((hidden,), 1)), init("beta", 0.1 * rand((hidden,), 2)),
             init("w1", 0.2 * rand((hidden, 4 * hidden), 3)), init("b1", rand((4 * hidden,), 4)),
             init("w2", 0.1 * rand((4 * hidden, hidden), 5)), init("b2", rand((hidden,), 6)),
             init("w3", 0.2 * rand((hidden, hidden), 7))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, hidden])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, hidden])], inits)


@pytest.mark.parametrize("sources", [None, "-openvino,-onnxruntime"], ids=["every-source", "own-kernels"])
def test_pre_ln_block_fuses_both_sums_and_matches_onnxruntime(sources):
    """On every source a region may win the race: its inner layers are the same and its ONNX adds the residuals."""
    model = pre_ln_block()
    engine = kiln.build(model, tactic_sources=sources)
    names = [inner.name for l in engine.plan.layers for inner in (l.inner or (l,)) if l.op_type != "Reformat"]
    assert names == ["ln", "fc1 + fc1_bias + relu", "fc2 + fc2_bias + residual1", "proj + residual2"], names
    feeds = {"x": rand((1, 12, 48), 8)}
    assert_close_to_ort(engine.run(feeds)["y"], run_ort(model, feeds)[0])


def test_pre_ln_block_with_a_dynamic_length_runs_every_profile_shape():
    model = pre_ln_block("seq")
    engine = kiln.build(model, tactic_sources="-openvino,-onnxruntime",
                        profiles=[{"x": ((1, 1, 48), (1, 16, 48), (1, 40, 48))}])
    assert [l.name for l in engine.plan.layers if "residual" in l.name] == ["fc2 + fc2_bias + residual1", "proj + residual2"]
    for seq in (1, 16, 40):
        feeds = {"x": rand((1, seq, 48), seq)}
        assert_close_to_ort(engine.run(feeds)["y"], run_ort(model, feeds)[0])


def broadcast_at_run_time(query_batch: int | str, residual_batch: int | str):
    """y = q·W + r where one of q and r has a dynamic batch and the other batch 1: the sum broadcasts at run time."""
    nodes = [helper.make_node("MatMul", ["q", "w"], ["m"], name="proj"),
             helper.make_node("Add", ["m", "r"], ["y"], name="add")]
    return make_model(nodes, [helper.make_tensor_value_info("q", TensorProto.FLOAT, [query_batch, 4, 48]),
                              helper.make_tensor_value_info("r", TensorProto.FLOAT, [residual_batch, 4, 48])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4, 48])],
                      [init("w", 0.2 * rand((48, 48), 9))])


@pytest.mark.parametrize("query_batch,residual_batch", [(1, "B"), ("B", 1)])
def test_a_sum_that_broadcasts_at_run_time_is_not_fused(query_batch, residual_batch):
    """Equal shapes at the profile's opt point are not enough: with one operand's batch dynamic and the other's 1,
    the Add stays a layer of its own (fused, the product returned the wrong shape or read past the residual)."""
    model = broadcast_at_run_time(query_batch, residual_batch)
    one, many = (1, 4, 48), (3, 4, 48)
    profile = {name: (one, one, many) if batch == "B" else (one, one, one)
               for name, batch in (("q", query_batch), ("r", residual_batch))}
    engine = kiln.build(model, tactic_sources="-openvino,-onnxruntime", profiles=[profile])
    assert [l.name for l in engine.plan.layers] == ["proj", "add"]
    feeds = {"q": rand(many if query_batch == "B" else one, 10), "r": rand(many if residual_batch == "B" else one, 11)}
    got, want = engine.run(feeds)["y"], run_ort(model, feeds)[0]
    assert got.shape == want.shape == many
    assert_close_to_ort(got, want)
