"""EinsumToMatMul on IR graphs: two-operand Einsums that are matrix products become Transpose/Reshape → MatMul →
Reshape/Transpose (identity steps not written, the operands swapped where that moves less data, a bias Add moved
before the column split); the equations it declines say why. End-to-end checks against onnxruntime are in
tests/passes/test_einsum.py."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.passes.einsum import lower_einsum, parse_equation
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged


def test_attention_scores_become_a_transposed_key_and_a_matmul():
    b = IRBuilder()
    q, k = b.input("q", (1, 2, 4, 8)), b.input("k", (1, 2, 6, 8))
    g = b.graph(b.node("Einsum", [q, k], "scores", (1, 2, 4, 6), equation="bhqd,bhkd->bhqk"))

    run = run_pass(g, "EinsumToMatMul", lower_einsum)

    assert str(g) == expected("""
        graph g(%q: float32[1x2x4x8], %k: float32[1x2x6x8]):
          %k_t: float32[1x2x8x6] = Transpose(%k) perm=[0, 1, 3, 2]  # scores [Transpose B]
          %scores: float32[1x2x4x6] = MatMul(%q, %k_t)  # scores
          return %scores
        """)
    assert "EinsumToMatMul: Lowering scores to Transpose -> MatMul" in run.lines
    assert (run.stat.matches, run.stat.rejections) == (1, 0)


def test_a_keras_dense_layer_keeps_its_dynamic_batch_and_its_bias_moves_before_the_split():
    b = IRBuilder()
    x = b.input("x", (1, 5, 16), dyn_dims=(0,))
    dense = b.node("Einsum", [x, b.const("w", np.ones((16, 2, 8)))], "dense", (1, 5, 2, 8), dyn_dims=(0,),
                   equation="abc,cde->abde")
    g = b.graph(b.node("Add", [dense, b.const("bias", np.arange(16).reshape(2, 8))], "biased", (1, 5, 2, 8),
                       dyn_dims=(0,)))

    run_pass(g, "EinsumToMatMul", lower_einsum)

    assert str(g) == expected("""
        graph g(%x: float32[-1x5x16]):
          %w_r: float32[16x16] = Reshape(const %w, const %w_r_shape)  # dense [Reshape B]
          %dense_matmul: float32[-1x5x16] = MatMul(%x, %w_r)  # dense
          %dense_matmul_biased: float32[-1x5x16] = Add(%dense_matmul, const %bias_flat)  # biased
          %biased: float32[-1x5x2x8] = Reshape(%dense_matmul_biased, const %dense_matmul_r_shape)  # dense [Reshape]
          return %biased
        """)
    assert g.values["dense_matmul_r_shape"].const.tolist() == [0, 5, 2, 8]   # the dynamic batch copied
    assert g.values["bias_flat"].const.tolist() == list(range(16))


def test_keys_times_queries_swap_so_that_the_scores_need_no_transpose():
    # Keras MultiHeadAttention: einsum("aecd,abcd->acbe", key, query)
    b = IRBuilder()
    k, q = b.input("k", (1, 6, 2, 8)), b.input("q", (1, 4, 2, 8))
    g = b.graph(b.node("Einsum", [k, q], "scores", (1, 2, 4, 6), equation="aecd,abcd->acbe"))

    run_pass(g, "EinsumToMatMul", lower_einsum)

    assert str(g) == expected("""
        graph g(%k: float32[1x6x2x8], %q: float32[1x4x2x8]):
          %q_t: float32[1x2x4x8] = Transpose(%q) perm=[0, 2, 1, 3]  # scores [Transpose A]
          %k_t: float32[1x2x8x6] = Transpose(%k) perm=[0, 2, 3, 1]  # scores [Transpose B]
          %scores: float32[1x2x4x6] = MatMul(%q_t, %k_t)  # scores
          return %scores
        """)


def test_batch_axes_stay_apart_and_extra_row_axes_broadcast_against_the_second_operand():
    b = IRBuilder()
    x, y = b.input("x", (2, 3, 4, 5)), b.input("y", (2, 5, 6))
    g = b.graph(b.node("Einsum", [x, y], "out", (2, 3, 4, 6), equation="bxmk,bkn->bxmn"))

    run_pass(g, "EinsumToMatMul", lower_einsum)

    assert str(g) == expected("""
        graph g(%x: float32[2x3x4x5], %y: float32[2x5x6]):
          %y_r: float32[2x1x5x6] = Reshape(%y, const %y_r_shape)  # out [Reshape B]
          %out: float32[2x3x4x6] = MatMul(%x, %y_r)  # out
          return %out
        """)


def test_equations_that_are_not_one_matrix_product_say_why():
    b = IRBuilder()
    sq, x, y = b.input("sq", (3, 3)), b.input("x", (2, 3)), b.input("y", (4, 3))
    ix = b.input("ix", (2, 3), dtype=np.int64)
    dyn = b.input("dyn", (3, 4, 5), dyn_dims=(0, 2))
    outs = [b.node("Einsum", [sq], "diag", (3,), equation="ii->i"),
            b.node("Einsum", [x, sq, y], "chain", (2, 4), equation="ij,jk,lk->il"),
            b.node("Einsum", [x, y], "rowsum", (2,), equation="ij,kj->i"),
            b.node("Einsum", [sq, sq], "trace_product", (3,), equation="ij,jj->i"),
            b.node("Einsum", [ix, ix], "ints", (2, 2), equation="ij,kj->ik"),
            b.node("Einsum", [b.input("a", (2, 3, 4), dyn_dims=(1,)), dyn], "merge", (2, 5), dyn_dims=(1,),
                   equation="ijk,jkl->il"),
            b.node("Einsum", [x, b.input("dyn2", (3, 4, 5), dyn_dims=(1, 2))], "split", (2, 4, 5), dyn_dims=(1, 2),
                   equation="ij,jkl->ikl"),
            b.node("Einsum", [x, dyn], "mixed", (2, 4, 5), dyn_dims=(2,), equation="ij,jkl->ikl")]
    g = b.graph(*outs)
    run = run_pass_unchanged(g, "EinsumToMatMul", lower_einsum)
    assert run.not_fusing == [
        "EinsumToMatMul: Not fusing diag with MatMul: it has 1 operand; only a product of two is a MatMul",
        "EinsumToMatMul: Not fusing chain with MatMul: it has 3 operands; only a product of two is a MatMul",
        "EinsumToMatMul: Not fusing rowsum with MatMul: a letter is summed within one operand alone",
        "EinsumToMatMul: Not fusing trace_product with MatMul: a letter repeats within one term (a diagonal)",
        "EinsumToMatMul: Not fusing ints with MatMul: its operands are not floating point",
        "EinsumToMatMul: Not fusing merge with MatMul: merging an operand's axes would need two inferred (-1) dynamic "
        "axes in one reshape",
        "EinsumToMatMul: Not fusing split with MatMul: splitting the product's columns would need two inferred (-1) "
        "dynamic axes",
        "EinsumToMatMul: Not fusing mixed with MatMul: the summed axis 'j' is dynamic in one operand only"]


@pytest.mark.parametrize("equation, ranks, spelled", [
    ("ij,jk", [2, 2], (["ij", "jk"], "ik")),                       # implicit output: letters seen once, sorted
    ("ba,ac", [2, 2], (["ba", "ac"], "bc")),
    ("...ij,...jk->...ik", [4, 3], (["abij", "bjk"], "abik")),    # "..." aligned from the right
    ("...ij,jk", [3, 2], (["aij", "jk"], "aik")),                  # implicit output: "..." first
    ("i j , j k -> i k", [2, 2], (["ij", "jk"], "ik")),
])
def test_equations_are_spelled_out_as_onnx_reads_them(equation, ranks, spelled):
    assert parse_equation(equation, ranks) == spelled


def test_an_equation_that_does_not_fit_its_operands_is_named():
    assert parse_equation("ij,jk->ik", [2, 3]) == "'jk' does not match an operand of rank 3"
    assert parse_equation("ij->i", [2, 2]) == "the equation names 1 operands, the node has 2"
