"""Transformer fusions on IR graphs: Q/K/V projections sharing an input (MatMulHorizontalMerge),
softmax(Q·Kᵀ·s + mask)·V with its data movement (AttentionFusion) and LayerNorm of a residual sum
(SkipLayerNormFusion); and the reasons near misses give."""
from __future__ import annotations

import numpy as np

from kiln.passes.attention import fuse_attention, fuse_skip_layer_norm, merge_matmuls
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged


# ---------------------------------------------------------------- MatMulHorizontalMerge
def test_projections_of_one_input_merge_into_one_matmul_and_a_split():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    q = b.node("MatMul", [x, b.const("wq", np.full((3, 4), 1.0))], "q", (2, 4))
    k = b.node("MatMul", [x, b.const("wk", np.full((3, 4), 2.0))], "k", (2, 4))
    v = b.node("MatMul", [x, b.const("wv", np.full((3, 2), 3.0))], "v", (2, 2))
    r = b.node("Relu", [x], "r", (2, 3))
    g = b.graph(q, k, v, r)

    run = run_pass(g, "MatMulHorizontalMerge", merge_matmuls)

    assert str(g) == expected("""
        graph g(%x: float32[2x3]):
          %q_merged: float32[2x10] = MatMul(%x, const %merged_weight)  # q || k || v
          %q: float32[2x4], %k: float32[2x4], %v: float32[2x2] = Split(%q_merged, const %merged_split) axis=-1  # q || k || v [Split]
          %r: float32[2x3] = Relu(%x)  # r
          return %q, %k, %v, %r
        """)
    assert run.stat.matches == 2
    np.testing.assert_array_equal(g.values["merged_weight"].const[0], [1, 1, 1, 1, 2, 2, 2, 2, 3, 3])
    np.testing.assert_array_equal(g.values["merged_split"].const, [4, 4, 2])


def test_merged_projections_of_a_dynamic_input_keep_its_probe_shape():
    b = IRBuilder()
    x = b.input("x", (2, 3), dyn_dims=(0,), probe=(7, 3))
    q = b.node("MatMul", [x, b.const("wq", np.full((3, 4), 1.0))], "q", (2, 4), dyn_dims=(0,), probe=(7, 4))
    k = b.node("MatMul", [x, b.const("wk", np.full((3, 2), 2.0))], "k", (2, 2), dyn_dims=(0,), probe=(7, 2))
    g = b.graph(q, k)

    run_pass(g, "MatMulHorizontalMerge", merge_matmuls)

    merged = g.values["q_merged"]
    assert (merged.shape, merged.dyn_dims, merged.probe_shape) == ((2, 6), (0,), (7, 6))


# ---------------------------------------------------------------- AttentionFusion
Q, KT, SCORES = (1, 2, 4, 8), (1, 2, 8, 4), (1, 2, 4, 4)


def test_two_masks_of_different_ranks_are_summed_with_their_dynamic_axes_aligned_from_the_right():
    """A padding mask [B, 1, 1, S] plus a position bias [S, S] (T5-style), S dynamic: one Add before the layer whose
    output's dynamic axes are 0, 2 and 3 (the bias's axes 0 and 1 are the sum's 2 and 3) and whose probe shape is
    the broadcast of theirs."""
    b = IRBuilder()
    q, kt, v = (b.input(n, s, dyn_dims=(2,) if n != "kt" else (3,)) for n, s in (("q", Q), ("kt", KT), ("v", Q)))
    pad = b.input("pad", (1, 1, 1, 4), dyn_dims=(0, 3), probe=(3, 1, 1, 9))
    bias = b.input("bias", (4, 4), dyn_dims=(0, 1), probe=(9, 9))
    s = b.node("MatMul", [q, kt], "qk", SCORES, dyn_dims=(2, 3), probe=(1, 2, 9, 9))
    s = b.node("Add", [s, pad], "padded", SCORES, dyn_dims=(0, 2, 3), probe=(3, 2, 9, 9))
    s = b.node("Add", [s, bias], "biased", SCORES, dyn_dims=(0, 2, 3), probe=(3, 2, 9, 9))
    p = b.node("Softmax", [s], "probs", SCORES, axis=-1, dyn_dims=(0, 2, 3), probe=(3, 2, 9, 9))
    g = b.graph(b.node("MatMul", [p, v], "out", Q, dyn_dims=(0, 2), probe=(3, 2, 9, 8)))

    run = run_pass(g, "AttentionFusion", fuse_attention)

    assert [n.op_type for n in g.nodes] == ["Add", "Attention"] and run.stat.matches == 1
    mask = g.nodes[0].outputs[0]
    assert g.nodes[1].inputs[3] is mask and {i.name for i in g.nodes[0].inputs} == {"pad", "bias"}
    assert (mask.shape, mask.dyn_dims, mask.probe_shape) == ((1, 1, 4, 4), (0, 2, 3), (3, 1, 9, 9))


def test_scaled_masked_softmax_attention_is_one_layer():
    b = IRBuilder()
    q, kt, v, mask = b.input("q", Q), b.input("kt", KT), b.input("v", Q), b.input("mask", (1, 1, 4, 4))
    s = b.node("MatMul", [q, kt], "qk", SCORES)
    s = b.node("Mul", [s, b.const("scale", 0.125)], "scaled", SCORES)
    s = b.node("Add", [s, mask], "masked", SCORES)
    p = b.node("Softmax", [s], "probs", SCORES, axis=-1)
    g = b.graph(b.node("MatMul", [p, v], "out", Q))

    run = run_pass(g, "AttentionFusion", fuse_attention)

    assert str(g) == expected("""
        graph g(%q: float32[1x2x4x8], %kt: float32[1x2x8x4], %v: float32[1x2x4x8], %mask: float32[1x1x4x4]):
          %out: float32[1x2x4x8] = kiln.Attention(%q, %kt, %v, %mask) k_steps=[] nan_to_zero=False out_steps=[] q_steps=[] scale=0.125 v_steps=[]  # qk + scaled + masked + probs + out
          return %out
        """)
    assert (run.stat.matches, run.stat.rejections) == (1, 0)


def test_attention_absorbs_head_shuffles_and_a_scaled_query():
    b = IRBuilder()
    heads = {"transpose": [0, 2, 1, 3]}
    q_in, kt, v = b.input("q_in", (1, 4, 2, 8)), b.input("kt", KT), b.input("v", Q)
    q = b.node("Shuffle", [q_in], "q", Q, domain="kiln", steps=[heads])
    q = b.node("Div", [q, b.const("two", 2.0)], "q_scaled", Q)
    p = b.node("Softmax", [b.node("MatMul", [q, kt], "qk", SCORES)], "probs", SCORES, axis=3)
    o = b.node("MatMul", [p, v], "pv", Q)
    g = b.graph(b.node("Shuffle", [o], "out", (1, 4, 2, 8), domain="kiln", steps=[heads]))

    run = run_pass(g, "AttentionFusion", fuse_attention)

    assert str(g) == expected("""
        graph g(%q_in: float32[1x4x2x8], %kt: float32[1x2x8x4], %v: float32[1x2x4x8]):
          %out: float32[1x4x2x8] = kiln.Attention(%q_in, %kt, %v) k_steps=[] nan_to_zero=False out_steps=[{'transpose': [0, 2, 1, 3]}] q_steps=[{'transpose': [0, 2, 1, 3]}] scale=0.5 v_steps=[]  # q + q_scaled + qk + probs + pv + out
          return %out
        """)
    assert run.stat.matches == 1


def test_a_query_scaled_before_its_head_shuffles_joins_the_scale_and_the_shuffles_merge_into_the_steps():
    # Keras/tf2onnx: reshape to heads, scale, transpose (the scalar commutes with the data movement)
    b = IRBuilder()
    split_heads, heads = {"reshape": [1, 4, 2, 8]}, {"transpose": [0, 2, 1, 3]}
    q_in, kt, v = b.input("q_in", (1, 4, 16)), b.input("kt", KT), b.input("v", Q)
    q = b.node("Shuffle", [q_in], "q_heads", (1, 4, 2, 8), domain="kiln", steps=[split_heads])
    q = b.node("Mul", [q, b.const("eighth", 0.125)], "q_scaled", (1, 4, 2, 8))
    q = b.node("Shuffle", [q], "q", Q, domain="kiln", steps=[heads])
    p = b.node("Softmax", [b.node("MatMul", [q, kt], "qk", SCORES)], "probs", SCORES, axis=-1)
    g = b.graph(b.node("MatMul", [p, v], "pv", Q))

    run = run_pass(g, "AttentionFusion", fuse_attention)

    assert str(g) == expected("""
        graph g(%q_in: float32[1x4x16], %kt: float32[1x2x8x4], %v: float32[1x2x4x8]):
          %pv: float32[1x2x4x8] = kiln.Attention(%q_in, %kt, %v) k_steps=[] nan_to_zero=False out_steps=[] q_steps=[{'reshape': [1, 4, 2, 8]}, {'transpose': [0, 2, 1, 3]}] scale=0.125 v_steps=[]  # q_heads + q_scaled + q + qk + probs + pv
          return %pv
        """)
    assert run.stat.matches == 1


def test_values_times_transposed_probabilities_is_attention_with_v_and_the_output_transposed():
    # latent-diffusion VAE: bmm(v, softmax(q·k·s).permute(0, 2, 1)) on [B, C, HW] maps
    b = IRBuilder()
    swap = {"transpose": [0, 2, 1]}
    q, k, v = b.input("q", (1, 6, 4)), b.input("k", (1, 4, 6)), b.input("v", (1, 4, 6))
    w = b.node("Mul", [b.node("MatMul", [q, k], "qk", (1, 6, 6)), b.const("s", 0.5)], "scaled", (1, 6, 6))
    p = b.node("Softmax", [w], "probs", (1, 6, 6), axis=2)
    pt = b.node("Shuffle", [p], "probs_t", (1, 6, 6), domain="kiln", steps=[swap])
    g = b.graph(b.node("MatMul", [v, pt], "out", (1, 4, 6)))

    run = run_pass(g, "AttentionFusion", fuse_attention)

    assert str(g) == expected("""
        graph g(%q: float32[1x6x4], %k: float32[1x4x6], %v: float32[1x4x6]):
          %out: float32[1x4x6] = kiln.Attention(%q, %k, %v) k_steps=[] nan_to_zero=False out_steps=[{'transpose': [0, 2, 1]}] q_steps=[] scale=0.5 v_steps=[{'transpose': [0, 2, 1]}]  # qk + scaled + probs + probs_t + out
          return %out
        """)
    assert run.stat.matches == 1


def packed_heads_attention(b: IRBuilder, extra_reader: bool = False, indices=(0, 1, 2)):
    """nn.MultiheadAttention's export: in_proj [S, B, 3D] unflattened and transposed to [3, S, B, D] (one
    Shuffle), Q, K and V each a Gather of it (a scalar index drops the axis), then split into heads."""
    x = b.input("x", (5, 1, 24))
    packed = b.node("Shuffle", [x], "packed", (3, 5, 1, 8), domain="kiln",
                    steps=[{"reshape": [5, 1, 3, 8]}, {"transpose": [2, 0, 1, 3]}])
    picked = []
    for i, at in enumerate(indices):
        shape = (1,) * np.ndim(at) + (5, 1, 8)
        picked.append(b.node("Gather", [packed, b.const(f"at{i}", at, np.int64)], f"g{i}", shape, axis=0))
        if np.ndim(at):   # the kept axis reshaped away, as an exporter would
            picked[-1] = b.node("Shuffle", [picked[-1]], f"g{i}_drop", (5, 1, 8), domain="kiln",
                                steps=[{"reshape": [5, 1, 8]}])
    heads = [{"reshape": [5, 2, 4]}, {"transpose": [1, 0, 2]}]
    q, v = (b.node("Shuffle", [picked[i]], n, (2, 5, 4), domain="kiln", steps=heads) for i, n in ((0, "q"), (2, "v")))
    kt = b.node("Shuffle", [picked[1]], "kt", (2, 4, 5), domain="kiln",
                steps=[{"reshape": [5, 2, 4]}, {"transpose": [1, 2, 0]}])
    p = b.node("Softmax", [b.node("MatMul", [q, kt], "qk", (2, 5, 5))], "probs", (2, 5, 5), axis=-1)
    out = b.node("MatMul", [p, v], "pv", (2, 5, 4))
    return b.graph(out, b.node("Relu", [picked[2]], "also_v", (5, 1, 8))) if extra_reader else b.graph(out)


def test_heads_gathered_from_one_packed_projection_are_read_through_slices():
    g = packed_heads_attention(IRBuilder())

    run = run_pass(g, "AttentionFusion", fuse_attention)

    packed = "{'reshape': [5, 1, 3, 8]}, {'transpose': [2, 0, 1, 3]}"
    heads, keys = "{'reshape': [5, 2, 4]}, {'transpose': [1, 0, 2]}", "{'reshape': [5, 2, 4]}, {'transpose': [1, 2, 0]}"
    # the picked axis moved last and reshaped away with ONNX's 0s: right for any dynamic axis
    pick = "{{'slice': [0, {0}, {1}]}}, {{'transpose': [1, 2, 3, 0]}}, {{'reshape': [0, 0, 0]}}"
    assert str(g) == expected(f"""
        graph g(%x: float32[5x1x24]):
          %pv: float32[2x5x4] = kiln.Attention(%x, %x, %x) k_steps=[{packed}, {pick.format(1, 2)}, {keys}] nan_to_zero=False out_steps=[] q_steps=[{packed}, {pick.format(0, 1)}, {heads}] scale=1.0 v_steps=[{packed}, {pick.format(2, 3)}, {heads}]  # packed + g0 + g1 + g2 + q + v + kt + qk + probs + pv
          return %pv
        """)
    assert run.stat.matches == 1


def test_a_negative_or_one_element_vector_index_picks_the_same_slice_and_a_deeper_one_is_declined():
    g = packed_heads_attention(IRBuilder(), indices=(0, [1], -1))
    run_pass(g, "AttentionFusion", fuse_attention)
    (attention,) = [n for n in g.nodes if n.op_type == "Attention"]
    assert attention.inputs[0].name == "x" and "Gather" not in [n.op_type for n in g.nodes]
    assert attention.attrs["k_steps"][2:4] == [{"slice": [0, 1, 2]}, {"reshape": [5, 1, 8]}]   # the axis kept
    assert attention.attrs["v_steps"][2] == {"slice": [0, 2, 3]}
    g = packed_heads_attention(IRBuilder(), indices=(0, [[1]], 2))   # output [1, 1, 5, 1, 8]: not one slice
    run_pass(g, "AttentionFusion", fuse_attention)
    assert [n.op_type for n in g.nodes].count("Gather") == 3


def test_a_gathered_head_read_elsewhere_keeps_the_gathers():
    g = packed_heads_attention(IRBuilder(), extra_reader=True)
    run_pass(g, "AttentionFusion", fuse_attention)
    attention = next(n for n in g.nodes if n.op_type == "Attention")
    assert [n.op_type for n in g.nodes].count("Gather") == 3 and attention.inputs[2].name == "g2"
    assert not any("slice" in step for key in ("q_steps", "k_steps", "v_steps") for step in attention.attrs[key])


def test_softmax_over_another_axis_or_not_multiplied_by_v_is_not_attention():
    b = IRBuilder()
    q, kt, v = b.input("q", Q), b.input("kt", KT), b.input("v", Q)
    p1 = b.node("Softmax", [b.node("MatMul", [q, kt], "qk1", SCORES)], "sm1", SCORES, axis=1)
    o1 = b.node("MatMul", [p1, v], "pv1", Q)
    p2 = b.node("Softmax", [b.node("MatMul", [q, kt], "qk2", SCORES)], "sm2", SCORES, axis=-1)
    g = b.graph(o1, p2)
    run = run_pass_unchanged(g, "AttentionFusion", fuse_attention)
    assert run.not_fusing == ["AttentionFusion: Not fusing sm1 with pv1: softmax is not over the last axis",
                              "AttentionFusion: Not fusing sm2 with its consumers: its output is not multiplied by V"]
    assert (run.stat.matches, run.stat.rejections) == (0, 2)


# ---------------------------------------------------------------- SkipLayerNormFusion
def layer_norm(b: IRBuilder, s, out: str = "y"):
    return b.node("LayerNormalization", [s, b.const(f"{out}.gamma", np.ones(4)), b.const(f"{out}.beta", np.zeros(4))],
                  out, (2, 4), name=f"ln_{out}", axis=-1, epsilon=1e-05)


def test_layer_norm_of_a_residual_sum_becomes_skip_layer_norm():
    b = IRBuilder()
    x, r = b.input("x", (2, 4)), b.input("r", (2, 4))
    g = b.graph(layer_norm(b, b.node("Add", [x, r], "s", (2, 4), name="add")))

    run = run_pass(g, "SkipLayerNormFusion", fuse_skip_layer_norm)

    assert str(g) == expected("""
        graph g(%x: float32[2x4], %r: float32[2x4]):
          %y: float32[2x4] = kiln.SkipLayerNormalization(%x, %r, const %y.gamma, const %y.beta) axis=-1 epsilon=1e-05  # add + ln_y
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (1, 0)


def test_bias_sums_and_sums_read_elsewhere_stay_separate():
    b = IRBuilder()
    x, r = b.input("x", (2, 4)), b.input("r", (2, 4))
    y1 = layer_norm(b, b.node("Add", [x, b.const("bias", np.ones(4))], "s1", (2, 4), name="add1"), "y1")
    s2 = b.node("Add", [x, r], "s2", (2, 4), name="add2")
    y2 = layer_norm(b, s2, "y2")
    g = b.graph(y1, y2, s2)
    run = run_pass_unchanged(g, "SkipLayerNormFusion", fuse_skip_layer_norm)
    assert run.not_fusing == [
        "SkipLayerNormFusion: Not fusing add1 with ln_y1: the sum is not of two same-shape activations (a residual)",
        "SkipLayerNormFusion: Not fusing add2 with ln_y2: the sum 's2' is also read elsewhere"]
