"""kiln's GEMM for MatMul/Gemm by a constant matrix (kiln.tactics.matmul_c): matches onnxruntime in engines
forced onto it (3-D activations, bias, ReLU, Gemm's transB, rows that vary with a dynamic profile) and leaves
layers it cannot run, GELU among them, to other kernels."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln.tactics import codegen
from kiln.tactics.base import LayerView
from kiln.tactics.matmul_c import MATMUL_TACTIC, MatMulGemmTactic
from tests.conftest import assert_close_to_ort, init, make_model, rand, run_ort

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")


def projection_model(seq: int | str = 9):
    """MatMul + bias + Relu on [2, seq, 40] -> [2, seq, 70], then Gemm(transB) on the flattened first token."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["mb"]),
             helper.make_node("Relu", ["mb"], ["h"]),
             helper.make_node("Gather", ["h", "zero"], ["first"], axis=1),
             helper.make_node("Gemm", ["first", "w2", "b2"], ["y"], transB=1)]
    inits = [init("w", rand((40, 70), 1) * 0.2), init("b", rand((70,), 2)), init("zero", np.array(0, np.int64)),
             init("w2", rand((33, 70), 3) * 0.2), init("b2", rand((33,), 4))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, seq, 40])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 33])], inits)


def test_engine_forced_onto_kiln_gemm_matches_onnxruntime():
    model = projection_model()
    engine = kiln.build(model, tactic_sources=frozenset({"kiln"}), autotune=False)
    linear = [l for l in engine.plan.layers if l.op_type in ("MatMul", "Gemm")]
    assert [l.tactic_name for l in linear] == [MATMUL_TACTIC] * 2, [l.name for l in linear]
    assert linear[0].attrs["activation"]["op"] == "Relu"   # fused into the GEMM's store
    feeds = {"x": rand((2, 9, 40), 5)}
    assert_close_to_ort(engine.run(feeds)["y"], run_ort(model, feeds)[0])


def test_rows_follow_a_dynamic_profile():
    model = projection_model("seq")
    engine = kiln.build(model, tactic_sources=frozenset({"kiln"}), autotune=False,
                        profiles=[{"x": ((2, 1, 40), (2, 8, 40), (2, 20, 40))}])
    assert any(l.tactic_name == MATMUL_TACTIC for l in engine.plan.layers)
    for seq in (1, 8, 20):
        feeds = {"x": rand((2, seq, 40), seq)}
        assert_close_to_ort(engine.run(feeds)["y"], run_ort(model, feeds)[0])


def view(op="MatMul", x=(2, 5, 8), w=None, dynamic=((0, 1),), activation=None, **attrs):
    w = torch.randn(8, 6) if w is None else w
    if activation:
        attrs["activation"] = {"op": activation, "attrs": {}}
    return LayerView(op, "", attrs, (x, tuple(w.shape)), ("float32", "float32"), {1: w}, input_dynamic=dynamic)


@pytest.mark.parametrize("layer", [
    view(activation="Elu"),                           # oneDNN fuses elu; kiln's store does not
    view(dynamic=((2,),)),                            # the reduced axis varies
    view(x=(5, 8), op="Gemm", transA=1),
    view(w=torch.randn(2, 8, 6)),                     # a batched weight
    view(w=torch.randn(8, 6).double()),
], ids=["elu", "dynamic-k", "transA", "3d-weight", "float64"])
def test_declines_what_it_cannot_run(layer):
    assert not MatMulGemmTactic().supports(layer)
    assert MatMulGemmTactic().supports(view(activation="Relu"))


@pytest.mark.skipif(not __import__("kiln.hardware", fromlist=["has_any"]).has_any(("avx2",)),
                    reason="this CPU has no AVX2")
@pytest.mark.parametrize("n,act", [(7, "Relu"), (16, "Relu"), (21, "Gelu"), (70, "Gelu-tanh")])
def test_the_avx2_build_of_the_gemm_tile_matches_this_cpus(n, act, monkeypatch, tmp_path):
    """gemm.c compiled for AVX2 alone (-march=x86-64-v3, as on a Zen 3: 16 registers of 8 floats, where the
    AVX-512 tile's 64-byte vectors spilled and ran 65x slower) computes what this CPU's build computes, bias,
    the activation and partial panels (a panel's first half only, exactly one half, both, several) included."""
    from kiln import native
    from tests.tactics.avx2 import avx2_build

    avx2 = avx2_build("gemm", tmp_path)
    w, bias = torch.from_numpy(rand((40, n), 5)), torch.from_numpy(rand((n,), 6))
    spec = {"op": act.split("-")[0], "attrs": {"approximate": "tanh"} if act.endswith("tanh") else {}}
    layer = LayerView("MatMul", "", {"activation": spec}, ((2, 13, 40), (40, n), (n,)), ("float32",) * 3,
                      {1: w, 2: bias}, ("float32",))
    assert MatMulGemmTactic().supports(layer)
    x = torch.from_numpy(rand((2, 13, 40), 7))
    here = MatMulGemmTactic().prepare(layer)([x, None, None])[0]
    y = x @ w + bias
    want = torch.relu(y) if act == "Relu" else torch.nn.functional.gelu(y, approximate=spec["attrs"].get(
        "approximate", "none"))
    torch.testing.assert_close(here, want, rtol=1e-5, atol=1e-5)
    built = native.library
    monkeypatch.setattr(native, "library", lambda name, generated="": avx2 if name == "gemm" else built(name, generated))
    torch.testing.assert_close(MatMulGemmTactic().prepare(layer)([x, None, None])[0], here, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", ["none", "tanh"])
def test_gelu_in_the_store_is_zero_far_below_and_x_far_above(form):
    """Past the rational approximations' bounds erf and tanh are exactly +-1: GELU of -1000 is 0, not x * 1e-7."""
    w = torch.eye(16)
    layer = view(x=(1, 8, 16), w=w, dynamic=((),))
    layer.attrs["activation"] = {"op": "Gelu", "attrs": {"approximate": form}}
    x = torch.linspace(-1000.0, 1000.0, 128).reshape(1, 8, 16)
    got = MatMulGemmTactic().prepare(layer)([x, None])[0]
    want = torch.nn.functional.gelu(x.double(), approximate=form).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[x < -10].abs().max() == 0 and torch.equal(got[x > 10], x[x > 10])
