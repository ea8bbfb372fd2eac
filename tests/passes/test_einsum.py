"""EinsumToMatMul end to end: Einsum products (attention scores and context, Keras/TF dense layers with 3-D kernels,
outer products, broadcast batches, implicit outputs, "...") run as MatMuls and match onnxruntime; a Keras
MultiHeadAttention block written in Einsums (as tf2onnx exports TF BERTs) fuses as torch's export does, into the
merged QKV product, one Attention layer and the output product, and runs them in BF16 on kiln's kernels."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from kiln import hardware, native
from kiln.tactics.gemm_bf16 import BF16_DOT_ISA
from tests.conftest import assert_close_to_ort, cosine, init, make_model, rand, run_ort

KILN_ONLY = "-openvino,-onnxruntime"

EQUATIONS = [  # equation, operand shapes
    ("bhqd,bhkd->bhqk", [(1, 2, 4, 8), (1, 2, 6, 8)]),
    ("bhqk,bhkd->bhqd", [(1, 2, 4, 6), (1, 2, 6, 8)]),
    ("bsd,hd->bsh", [(2, 4, 8), (6, 8)]),
    ("abcd,cde->abe", [(2, 3, 4, 5), (4, 5, 6)]),
    ("ij,jk", [(3, 4), (4, 5)]),
    ("i,j->ij", [(3,), (4,)]),
    ("i,i->", [(5,), (5,)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (2, 5, 4, 6)]),
    ("bmk,bkn->bnm", [(1, 3, 4), (3, 4, 5)]),
    ("xyk,kz->zyx", [(2, 3, 4), (4, 5)]),
    ("bk,bkn->bn", [(2, 3), (2, 3, 4)]),
    ("bnft,bfnh->btnh", [(2, 3, 6, 4), (2, 6, 3, 5)]),
]


def einsum_model(equation: str, shapes: list[tuple[int, ...]]):
    names = [f"x{i}" for i in range(len(shapes))]
    node = helper.make_node("Einsum", names, ["y"], name="einsum", equation=equation)
    return make_model([node], [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(names, shapes)],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]), names


@pytest.mark.parametrize("equation, shapes", EQUATIONS, ids=[e for e, _ in EQUATIONS])
def test_einsum_products_run_as_matmuls_and_match_onnxruntime(equation, shapes):
    model, names = einsum_model(equation, shapes)
    feeds = {n: rand(s, seed=i) for i, (n, s) in enumerate(zip(names, shapes))}
    engine = kiln.build(model, tactic_sources=KILN_ONLY, avg_timing=1, min_timing=1)
    ops = [layer.op_type for layer in engine.plan.layers]
    assert "MatMul" in ops and "Einsum" not in ops
    assert_close_to_ort(engine.run(feeds)["y"], run_ort(model, feeds)[0], rel=1e-5)


def test_a_dynamic_batch_runs_at_every_size_of_its_profile():
    model, _ = einsum_model("btd,dh->bth", [("batch", 5, 8), (8, 6)])
    engine = kiln.build(model, tactic_sources=KILN_ONLY, avg_timing=1, min_timing=1,
                        profiles=[{"x0": ((1, 5, 8), (2, 5, 8), (4, 5, 8))}])
    assert "Einsum" not in [layer.op_type for layer in engine.plan.layers]
    for batch in (1, 3, 4):
        feeds = {"x0": rand((batch, 5, 8), seed=batch), "x1": rand((8, 6), seed=9)}
        assert_close_to_ort(engine.run(feeds)["y"], run_ort(model, feeds)[0], rel=1e-5)


def keras_attention(seq: int = 16, dim: int = 32, heads: int = 4):
    """Keras MultiHeadAttention + residual + LayerNorm: dense layers as einsum("abc,cde->abde") + b[heads, size],
    the query scaled, scores einsum("aecd,abcd->acbe", key, query), context einsum("acbe,aecd->abcd"), output
    einsum("abcd,cde->abe") + b."""
    size, h = dim // heads, helper.make_node
    nodes = []
    for p in "qkv":
        nodes += [h("Einsum", ["x", f"w{p}"], [f"{p}0"], name=f"{p}_dense", equation="abc,cde->abde"),
                  h("Add", [f"{p}0", f"b{p}"], [f"{p}1"], name=f"{p}_bias")]
    nodes += [h("Mul", ["q1", "scale"], ["qs"], name="q_scale"),
              h("Einsum", ["k1", "qs"], ["scores"], name="scores", equation="aecd,abcd->acbe"),
              h("Softmax", ["scores"], ["probs"], name="softmax", axis=-1),
              h("Einsum", ["probs", "v1"], ["ctx"], name="context", equation="acbe,aecd->abcd"),
              h("Einsum", ["ctx", "wo"], ["o0"], name="o_dense", equation="abcd,cde->abe"),
              h("Add", ["o0", "bo"], ["o1"], name="o_bias"), h("Add", ["o1", "x"], ["res"], name="residual"),
              h("LayerNormalization", ["res", "gamma", "beta"], ["y"], name="ln", axis=-1)]
    inits = [init(f"w{p}", rand((dim, heads, size), seed=i) * 0.2) for i, p in enumerate("qkv")]
    inits += [init(f"b{p}", rand((heads, size), seed=10 + i) * 0.1) for i, p in enumerate("qkv")]
    inits += [init("wo", rand((heads, size, dim), seed=20) * 0.2), init("bo", rand((dim,), seed=21) * 0.1),
              init("scale", np.float32(size ** -0.5)), init("gamma", rand((dim,), seed=22, positive=True)),
              init("beta", rand((dim,), seed=23) * 0.1)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, dim])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, dim])], inits)


FUSED_NAMES = ["q_dense + q_bias || k_dense + k_bias || v_dense + v_bias",
               "q_scale + scores + softmax + context", "o_dense + o_bias", "residual + ln"]


def test_a_keras_attention_block_fuses_as_torchs_export_does():
    model = keras_attention()
    feeds = {"x": rand((1, 16, 32), seed=5)}
    engine = kiln.build(model, tactic_sources=KILN_ONLY, avg_timing=1, min_timing=1)
    assert [layer.name for layer in engine.plan.layers] == FUSED_NAMES
    assert [layer.op_type for layer in engine.plan.layers] == ["MatMul", "Attention", "MatMul",
                                                              "SkipLayerNormalization"]
    assert_close_to_ort(engine.run(feeds)["y"], run_ort(model, feeds)[0])


@pytest.mark.skipif(not (hardware.has_any(BF16_DOT_ISA) and native.available()),
                    reason="this CPU has no AVX512-BF16 (vdpbf16ps) or there is no C compiler: kiln's BF16 kernels "
                    "are not offered here")
def test_the_keras_attention_block_runs_in_bf16_on_kilns_kernels():
    model = keras_attention()
    feeds = {"x": rand((1, 16, 32), seed=5)}
    # oneDNN (through torch and kiln's own primitives) and torch left out: which of theirs and kiln's BF16 kernels
    # is faster is the timing's call (under make test's load oneDNN won the merged Q/K/V once, the primitive the
    # output projection once), not what this test is about
    engine = kiln.build(model, bf16=True, tactic_sources=KILN_ONLY + ",-torch-onednn,-torch,-onednn",
                        precision_constraints="prefer", accuracy="off", avg_timing=1, min_timing=1)
    granted = {layer.name: (layer.precision, layer.tactic_name) for layer in engine.plan.layers}
    for name in FUSED_NAMES[:3]:
        assert granted[name][0] == "BF16" and granted[name][1].startswith("kiln."), (name, granted[name])
    assert cosine(engine.run(feeds)["y"], run_ort(model, feeds)[0]) > 0.999
