"""ShuffleMatMulSwap on IR graphs: a Shuffle keeping a product's rows whole moves above it (so an Add or activation
can join the product) or below it (into the Shuffle there), with its reshapes rewritten for the other row width."""
from __future__ import annotations

import numpy as np

from kiln.passes.shuffle_swap import move_shuffles_across_products
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

NAME = "ShuffleMatMulSwap"


def weights(b: IRBuilder, k=4, n=5):
    return b.const("w", np.ones((k, n))), b.const("bias", np.ones(n))


def test_rows_rise_into_the_shuffle_above_and_the_residual_add_meets_the_product():
    """Attention output [B, S, K] -> [S*B, K] -> out_proj -> [S, B, N] -> [B, S, N] -> + residual."""
    b = IRBuilder()
    a, r = b.input("a", (2, 3, 4)), b.input("r", (2, 3, 5))
    x = b.shuffle(a, "x", (6, 4), [{"transpose": [1, 0, 2]}, {"reshape": [6, 4]}])
    mm = b.node("MatMul", [x, *weights(b)], "mm", (6, 5))
    back = b.shuffle(mm, "back", (2, 3, 5), [{"reshape": [3, 2, 5]}, {"transpose": [1, 0, 2]}])
    g = b.graph(b.node("Add", [back, r], "y", (2, 3, 5)))

    run = run_pass(g, NAME, move_shuffles_across_products)

    assert str(g) == expected("""
        graph g(%a: float32[2x3x4], %r: float32[2x3x5]):
          %x: float32[2x3x4] = kiln.Shuffle(%a) steps=[{'transpose': [1, 0, 2]}, {'reshape': [3, 2, 4]}, {'transpose': [1, 0, 2]}]  # x + back
          %back: float32[2x3x5] = MatMul(%x, const %w, const %bias)  # mm
          %y: float32[2x3x5] = Add(%back, %r)  # y
          return %y
        """)
    assert "ShuffleMatMulSwap: Moving back above mm" in run.lines
    assert (run.stat.matches, run.stat.rejections) == (2, 0)


def test_without_a_shuffle_above_the_moved_one_is_placed_before_the_product():
    b = IRBuilder()
    x = b.input("x", (6, 4), dyn_dims=(0,))
    mm = b.node("MatMul", [x, b.const("w", np.ones((4, 5)))], "mm", (6, 5), dyn_dims=(0,))
    rows = b.shuffle(mm, "rows", (2, 3, 5), [{"reshape": [-1, 3, 5]}], dyn_dims=(0,))
    g = b.graph(b.node("Relu", [rows], "y", (2, 3, 5), dyn_dims=(0,)))

    run_pass(g, NAME, move_shuffles_across_products)

    assert str(g) == expected("""
        graph g(%x: float32[-1x4]):
          %x_rows: float32[-1x3x4] = kiln.Shuffle(%x) steps=[{'reshape': [-1, 3, 4]}]  # rows
          %rows: float32[-1x3x5] = MatMul(%x_rows, const %w)  # mm
          %y: float32[-1x3x5] = Relu(%rows)  # y
          return %y
        """)


def test_rows_sink_into_the_shuffle_below():
    """nn.MultiheadAttention's in_proj at batch 1: [1, S, K] -> [S, 1, K] (a reshape) -> MatMul -> head split."""
    b = IRBuilder()
    x = b.input("x", (1, 6, 4))
    above = b.shuffle(x, "above", (6, 1, 4), [{"reshape": [6, 1, 4]}])
    mm = b.node("MatMul", [above, *weights(b)], "mm", (6, 1, 5))
    g = b.graph(b.shuffle(mm, "below", (5, 6, 1), [{"transpose": [2, 0, 1]}]))

    run = run_pass(g, NAME, move_shuffles_across_products)

    assert str(g) == expected("""
        graph g(%x: float32[1x6x4]):
          %mm: float32[1x6x5] = MatMul(%x, const %w, const %bias)  # mm
          %below: float32[5x6x1] = kiln.Shuffle(%mm) steps=[{'reshape': [6, 1, 5]}, {'transpose': [2, 0, 1]}]  # above + below
          return %below
        """)
    assert "ShuffleMatMulSwap: Moving above above mm" in run.lines


def test_shuffles_that_split_rows_or_products_of_two_activations_stay():
    b = IRBuilder()
    x, y, r = b.input("x", (6, 4)), b.input("y", (4, 5)), b.input("r", (2, 3, 5))
    mm = b.node("MatMul", [x, b.const("w", np.ones((4, 5)))], "mm", (6, 5))
    cols = b.shuffle(mm, "cols", (5, 6), [{"transpose": [1, 0]}])
    flat = b.shuffle(b.node("MatMul", [x, y], "xy", (6, 5)), "flat", (2, 3, 5), [{"reshape": [2, 3, 5]}])
    g = b.graph(b.node("Relu", [cols], "z", (5, 6)), b.node("Add", [flat, r], "s", (2, 3, 5)))

    run = run_pass_unchanged(g, NAME, move_shuffles_across_products)

    assert run.not_fusing == ["ShuffleMatMulSwap: Not fusing mm with cols: cols does not keep the product's rows whole",
                              "ShuffleMatMulSwap: Not fusing xy with flat: the product is not rows times a constant "
                              "matrix"]


def test_a_shuffle_above_read_twice_or_a_reshape_of_the_width_does_not_sink():
    b = IRBuilder()
    x = b.input("x", (2, 3, 4))
    w = b.const("w", np.ones((4, 5)))
    twice = b.shuffle(x, "twice", (6, 4), [{"reshape": [6, 4]}])
    below1 = b.shuffle(b.node("MatMul", [twice, w], "m1", (6, 5)), "below1", (5, 6), [{"transpose": [1, 0]}])
    halves = b.shuffle(x, "halves", (2, 3, 2, 2), [{"reshape": [2, 3, 2, 2]}])
    w2 = b.const("w2", np.ones((2, 5)))
    below2 = b.shuffle(b.node("MatMul", [halves, w2], "m2", (2, 3, 2, 5)), "below2", (12, 5), [{"reshape": [12, 5]}])
    g = b.graph(below1, twice, below2)

    run = run_pass_unchanged(g, NAME, move_shuffles_across_products)

    assert run.stat.matches == 0


def test_a_bias_of_higher_rank_or_a_scalar_keeps_the_shuffle_where_it_is():
    """MatMul -> + b[1, 1, N] -> reshape [5, N]: below the shuffle the bias would give the sum its own rank back; a
    scalar bias (a one-column product's) is no row either."""
    b = IRBuilder()
    x, y = b.input("x", (1, 5, 8)), b.input("y", (2, 3, 8))
    ranked = b.node("MatMul", [x, b.const("w", np.ones((8, 6))), b.const("b3", np.ones((1, 1, 6)))], "ranked",
                    (1, 5, 6))
    flat = b.shuffle(ranked, "flat", (5, 6), [{"reshape": [5, 6]}])
    column = b.node("MatMul", [y, b.const("w1", np.ones((8, 1))), b.const("half", 0.5)], "column", (2, 3, 1))
    rows = b.shuffle(column, "rows", (3, 2, 1), [{"reshape": [3, 2, 1]}])
    g = b.graph(b.node("Add", [flat, b.input("r", (5, 6))], "sum", (5, 6)), b.node("Relu", [rows], "z", (3, 2, 1)))

    run = run_pass_unchanged(g, NAME, move_shuffles_across_products)

    assert run.not_fusing == ["ShuffleMatMulSwap: Not fusing ranked with flat: the product's bias is not a constant row",
                              "ShuffleMatMulSwap: Not fusing column with rows: the product's bias is not a constant row"]


def test_a_shuffle_read_by_anything_but_an_add_or_activation_stays():
    b = IRBuilder()
    mm = b.node("MatMul", [b.input("x", (6, 4)), b.const("w", np.ones((4, 5)))], "mm", (6, 5))
    flat = b.shuffle(mm, "flat", (2, 3, 5), [{"reshape": [2, 3, 5]}])
    g = b.graph(b.node("Softmax", [flat], "s", (2, 3, 5), axis=-1))

    assert run_pass_unchanged(g, NAME, move_shuffles_across_products).stat.matches == 0
