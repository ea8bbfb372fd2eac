"""Matrix-product fusions on IR graphs: a constant bias Add becomes the MatMul/Gemm third input
(MatMulAddFusion), a residual Add of an activation its fourth (MatMulEltwiseSumFusion), an activation after it
becomes its `activation` attribute (GemmActFusion), a Gemm between Reshapes that flatten and restore the leading
axes becomes a MatMul (GemmToMatMul)."""
from __future__ import annotations

import numpy as np

from kiln.passes.conv import fuse_gemm_activation
from kiln.passes.gemm import fuse_matmul_bias, fuse_matmul_residual, gemm_between_reshapes
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged


def weight(b: IRBuilder, name: str):
    return b.const(name, np.ones((3, 4)))


# ---------------------------------------------------------------- MatMulAddFusion
def test_constant_bias_add_folds_into_matmul_and_gemm():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    m = b.node("MatMul", [x, weight(b, "w1")], "m", (2, 4), name="mm")
    y1 = b.node("Add", [b.const("bias1", np.zeros(4)), m], "y1", (2, 4), name="add1")   # bias on the left
    m2 = b.node("Gemm", [x, weight(b, "w2")], "m2", (2, 4), name="gemm")
    y2 = b.node("Add", [m2, b.const("bias2", np.zeros((1, 4)))], "y2", (2, 4), name="add2")
    g = b.graph(y1, y2)

    run = run_pass(g, "MatMulAddFusion", fuse_matmul_bias)

    assert str(g) == expected("""
        graph g(%x: float32[2x3]):
          %y1: float32[2x4] = MatMul(%x, const %w1, const %bias1)  # mm + add1
          %y2: float32[2x4] = Gemm(%x, const %w2, const %bias2)  # gemm + add2
          return %y1, %y2
        """)
    assert (run.stat.matches, run.stat.rejections) == (2, 0)
    assert "MatMulAddFusion: Fusing mm with add1" in run.lines


def test_computed_full_and_second_biases_do_not_fold():
    b = IRBuilder()
    x, r = b.input("x", (2, 3)), b.input("r", (2, 4))
    y1 = b.node("Add", [b.node("MatMul", [x, weight(b, "w1")], "m1", (2, 4), name="mm1"), r], "y1", (2, 4),
                name="add1")
    y2 = b.node("Add", [b.node("MatMul", [x, weight(b, "w2")], "m2", (2, 4), name="mm2"),
                        b.const("full", np.zeros((2, 4)))], "y2", (2, 4), name="add2")
    m3 = b.node("MatMul", [x, weight(b, "w3"), b.const("bias3", np.zeros(4))], "m3", (2, 4), name="mm3")
    y3 = b.node("Add", [m3, b.const("bias3b", np.zeros(4))], "y3", (2, 4), name="add3")
    g = b.graph(y1, y2, y3)
    run = run_pass_unchanged(g, "MatMulAddFusion", fuse_matmul_bias)
    assert run.not_fusing == [
        "MatMulAddFusion: Not fusing mm1 with add1: the other operand is not a constant bias",
        "MatMulAddFusion: Not fusing mm2 with add2: bias shape [2, 4] does not broadcast along the last axis only",
        "MatMulAddFusion: Not fusing mm3 with add3: mm3 already has a bias"]
    assert (run.stat.matches, run.stat.rejections) == (0, 3)


# ---------------------------------------------------------------- MatMulEltwiseSumFusion
def test_pre_ln_residual_sums_become_the_products_fourth_input():
    """x1 = x + proj(x), x2 = x1 + Gemm(x1): each sum joins its linear layer (a MatMul without a bias gets an empty
    bias slot); the residual stream read twice is the operand, never the product."""
    b = IRBuilder()
    x = b.input("x", (2, 3))
    w3 = b.const("w3", np.ones((3, 3)))
    proj = b.node("MatMul", [x, w3, b.const("bias", np.zeros(3))], "p", (2, 3), name="proj + bias")
    x1 = b.node("Add", [x, proj], "x1", (2, 3), name="add1")
    x2 = b.node("Add", [b.node("Gemm", [x1, w3], "q", (2, 3), name="gemm"), x1], "x2", (2, 3), name="add2")
    g = b.graph(x2)

    run = run_pass(g, "MatMulEltwiseSumFusion", fuse_matmul_residual)

    assert str(g) == expected("""
        graph g(%x: float32[2x3]):
          %x1: float32[2x3] = MatMul(%x, const %w3, const %bias, %x)  # proj + bias + add1
          %x2: float32[2x3] = Gemm(%x1, const %w3, None, %x1)  # gemm + add2
          return %x2
        """)
    assert (run.stat.matches, run.stat.rejections) == (2, 0)
    assert "MatMulEltwiseSumFusion: Fusing gemm with add2" in run.lines


def test_sums_no_linear_kernel_can_add_are_left_with_the_reason():
    b = IRBuilder()
    x, y = b.input("x", (2, 3)), b.input("y", (3, 3))
    scores = b.node("MatMul", [x, y], "s", (2, 3), name="scores")
    out1 = b.node("Add", [scores, x], "o1", (2, 3), name="add1")
    act = b.node("MatMul", [x, weight(b, "w")], "a", (2, 4), name="mm_act", activation={"op": "Relu", "attrs": {}})
    out2 = b.node("Add", [act, b.input("r", (2, 4))], "o2", (2, 4), name="add2")
    wide = b.node("MatMul", [x, weight(b, "w2")], "m", (2, 4), name="mm_wide")
    out3 = b.node("Add", [wide, b.input("row", (1, 4))], "o3", (2, 4), name="add3")
    g = b.graph(out1, out2, out3)
    run = run_pass_unchanged(g, "MatMulEltwiseSumFusion", fuse_matmul_residual)
    assert run.not_fusing == [
        "MatMulEltwiseSumFusion: Not fusing scores with add1: scores multiplies two activations (kiln adds residuals "
        "only in linear layers' kernels)",
        "MatMulEltwiseSumFusion: Not fusing mm_act with add2: mm_act already applies an activation before the sum",
        "MatMulEltwiseSumFusion: Not fusing mm_wide with add3: shapes differ ([1, 4] vs [2, 4]): broadcasting sum is "
        "not fusable"]


# ---------------------------------------------------------------- GemmActFusion
def test_activation_after_a_product_becomes_its_activation():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    m = b.node("MatMul", [x, weight(b, "w1"), b.const("bias", np.zeros(4))], "m", (2, 4), name="mm + add")
    y1 = b.node("Gelu", [m], "y1", (2, 4), name="gelu")
    y2 = b.node("Relu", [b.node("Gemm", [x, weight(b, "w2")], "m2", (2, 4), name="gemm", alpha=2.0)], "y2", (2, 4),
                name="relu")
    g = b.graph(y1, y2)

    run = run_pass(g, "GemmActFusion", fuse_gemm_activation)

    assert str(g) == expected("""
        graph g(%x: float32[2x3]):
          %y1: float32[2x4] = MatMul(%x, const %w1, const %bias) activation={'op': 'Gelu', 'attrs': {}}  # mm + add + gelu
          %y2: float32[2x4] = Gemm(%x, const %w2) activation={'op': 'Relu', 'attrs': {}} alpha=2.0  # gemm + relu
          return %y1, %y2
        """)
    assert (run.stat.matches, run.stat.rejections) == (2, 0)
    assert g.nodes[0].origin == ("mm + add", "gelu")


def test_activation_does_not_fuse_into_a_product_read_twice():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    m = b.node("MatMul", [x, weight(b, "w")], "m", (2, 4), name="mm")
    y = b.node("Relu", [m], "y", (2, 4), name="relu")
    z = b.node("Neg", [m], "z", (2, 4), name="neg")
    g = b.graph(y, z)
    run = run_pass_unchanged(g, "GemmActFusion", fuse_gemm_activation)
    assert run.not_fusing == ["GemmActFusion: Not fusing mm with relu: mm's output 'm' has 2 consumers"]


# ---------------------------------------------------------------- GemmToMatMul
def flattened_gemm(b: IRBuilder, x, tag: str, restore=(2, 5, 4), **gemm_attrs):
    flat = b.node("Reshape", [x, b.const(f"{tag}_flat", [10, 3], np.int64)], f"{tag}_flat_out", (10, 3),
                  name=f"{tag}_in")
    w = b.const(f"{tag}_w", np.arange(12.0).reshape((4, 3) if gemm_attrs.get("transB") else (3, 4)))
    y = b.node("Gemm", [flat, w, b.const(f"{tag}_c", np.zeros(4))], f"{tag}_y", (10, 4), name=f"{tag}_gemm",
               **gemm_attrs)
    return b.node("Reshape", [y, b.const(f"{tag}_back", list(restore), np.int64)], f"{tag}_out", restore,
                  name=f"{tag}_out_reshape")


def test_a_gemm_between_flattening_reshapes_becomes_a_matmul():
    """onnxruntime's MatMulAddFusion writes Reshape -> Gemm -> Reshape into the models it saves."""
    b = IRBuilder()
    x = b.input("x", (2, 5, 3))
    g = b.graph(flattened_gemm(b, x, "a", transB=1), flattened_gemm(b, x, "b", restore=(5, 2, 4)),
                flattened_gemm(b, x, "c", alpha=0.5))

    run = run_pass(g, "GemmToMatMul", gemm_between_reshapes)

    assert str(g).splitlines()[1] == "  %a_out: float32[2x5x4] = MatMul(%x, const %a_w_transposed, const %a_c)  " \
        "# a_in + a_gemm + a_out_reshape"
    np.testing.assert_array_equal(g.values["a_w_transposed"].const, np.arange(12.0).reshape(4, 3).T)
    assert run.not_fusing == [
        "GemmToMatMul: Not fusing b_in with b_gemm: the second Reshape does not restore the leading axes",
        "GemmToMatMul: Not fusing c_in with c_gemm: the Gemm has transA, alpha or beta"]
    assert (run.stat.matches, run.stat.rejections) == (2, 2)   # one fusion line per Reshape taken in


def test_a_restore_that_swaps_two_dynamic_axes_is_not_a_restore():
    """[B, S, K] -> [B * S, K] -> Gemm -> [S, B, N] (a target computed at run time): at the opt point B = S = 2 it
    looks like the leading axes restored; the probe point (B = 8, S = 3) says otherwise."""
    b = IRBuilder()
    x = b.input("x", (2, 2, 3), dyn_dims=(0, 1), probe=(8, 3, 3))
    flat = b.node("Reshape", [x, b.const("flat", [-1, 3], np.int64)], "flat_out", (4, 3), dyn_dims=(0,),
                  probe=(24, 3), name="flat")
    y = b.node("Gemm", [flat, b.const("w", np.ones((3, 4)))], "y", (4, 4), dyn_dims=(0,), probe=(24, 4), name="gemm")
    back = b.node("Reshape", [y, b.input("target", (3,), np.int64)], "back", (2, 2, 4), dyn_dims=(0, 1),
                  probe=(3, 8, 4), name="back")
    g = b.graph(back)
    run = run_pass_unchanged(g, "GemmToMatMul", gemm_between_reshapes)
    assert run.not_fusing == [
        "GemmToMatMul: Not fusing flat with gemm: the second Reshape does not restore the leading axes"]


def test_a_gemm_after_a_reshape_merging_heads_becomes_a_matmul_on_the_rows():
    """GPT-2's attention output [1, S, H, D] -> [S, H*D] -> Gemm (c_proj) -> [1, S, N]: the first Reshape stays,
    retargeted to [1, S, H*D], and the product becomes a MatMul writing [1, S, N]; with a dynamic axis it is left,
    as the retargeted shape could not be written for every input shape."""
    b = IRBuilder()
    heads = b.input("heads", (1, 4, 2, 3))
    flat = b.node("Reshape", [heads, b.const("flat", [4, 6], np.int64)], "flat_out", (4, 6), name="merge_heads")
    y = b.node("Gemm", [flat, b.const("w", np.ones((6, 5))), b.const("c", np.zeros(5))], "y", (4, 5), name="proj")
    out = b.node("Reshape", [y, b.const("back", [1, 4, 5], np.int64)], "out", (1, 4, 5), name="restore")
    dyn = b.input("dyn", (1, 4, 2, 3), dyn_dims=(1,))
    flat2 = b.node("Reshape", [dyn, b.const("flat2", [-1, 6], np.int64)], "flat2_out", (4, 6), dyn_dims=(0,),
                   name="merge_dyn")
    y2 = b.node("Gemm", [flat2, b.const("w2", np.ones((6, 5)))], "y2", (4, 5), dyn_dims=(0,), name="proj_dyn")
    out2 = b.node("Reshape", [y2, b.const("back2", [1, -1, 5], np.int64)], "out2", (1, 4, 5), dyn_dims=(1,),
                  name="restore_dyn")
    g = b.graph(out, out2)

    run = run_pass(g, "GemmToMatMul", gemm_between_reshapes)

    lines = str(g).splitlines()
    assert lines[1] == "  %flat_out: float32[1x4x6] = Reshape(%heads, const %merge_heads_rows)  # merge_heads"
    assert lines[2] == "  %out: float32[1x4x5] = MatMul(%flat_out, const %w, const %c)  # proj + restore"
    np.testing.assert_array_equal(g.values["merge_heads_rows"].const, [1, 4, 6])
    assert run.not_fusing == ["GemmToMatMul: Not fusing merge_dyn with proj_dyn: the first Reshape does not flatten "
                              "the leading axes of a 3-D or larger tensor"]
