"""Shuffle fusions on IR graphs: data-movement ops become kiln Shuffle layers and consecutive ones merge
(ShuffleShuffleFusion); a Shuffle that moves nothing is erased (ShuffleErasure)."""
from __future__ import annotations

import numpy as np

from kiln.passes.shuffle import erase_noop_shuffles, fuse_shuffles
from tests.passes.ir_builder import IRBuilder, expected, run_pass


# ---------------------------------------------------------------- ShuffleShuffleFusion
def test_consecutive_transposes_compose_and_reshapes_merge():
    b = IRBuilder()
    x, v = b.input("x", (2, 3, 4)), b.input("v", (2, 3, 4), dyn_dims=(0,))
    t1 = b.node("Transpose", [x], "t1", (2, 4, 3), perm=[0, 2, 1])
    t2 = b.node("Transpose", [t1], "t2", (4, 2, 3), perm=[1, 0, 2])
    r1 = b.node("Reshape", [v, b.const("s1", [0, 12], np.int64)], "r1", (2, 12), dyn_dims=(0,))
    r2 = b.node("Flatten", [r1], "r2", (24, 1), dyn_dims=(0,), axis=2)
    g = b.graph(t2, r2)

    run = run_pass(g, "ShuffleShuffleFusion", fuse_shuffles)

    assert str(g) == expected("""
        graph g(%x: float32[2x3x4], %v: float32[-1x3x4]):
          %t2: float32[4x2x3] = kiln.Shuffle(%x) steps=[{'transpose': [2, 0, 1]}]  # t1 + t2
          %r2: float32[-1x1] = kiln.Shuffle(%v) steps=[{'reshape': [-1, 1]}]  # r1 + r2
          return %t2, %r2
        """)
    assert (run.stat.matches, run.stat.rejections) == (2, 0)
    assert "s1" not in g.values   # the reshape target is a step now, not an input


def test_transposes_that_cancel_leave_an_empty_shuffle():
    b = IRBuilder()
    x = b.input("x", (2, 3, 4))
    t1 = b.node("Transpose", [x], "t1", (2, 4, 3), perm=[0, 2, 1])
    t2 = b.node("Transpose", [t1], "t2", (2, 3, 4), perm=[0, 2, 1])
    g = b.graph(b.node("Relu", [t2], "y", (2, 3, 4)))

    run_pass(g, "ShuffleShuffleFusion", fuse_shuffles)

    assert str(g) == expected("""
        graph g(%x: float32[2x3x4]):
          %t2: float32[2x3x4] = kiln.Shuffle(%x) steps=[]  # t1 + t2
          %y: float32[2x3x4] = Relu(%t2)  # y
          return %y
        """)


def test_a_shuffle_read_twice_is_not_merged_and_an_unwritable_reshape_stays():
    b = IRBuilder()
    x, v = b.input("x", (2, 3, 4)), b.input("v", (2, 3, 4), dyn_dims=(0, 2))
    s2 = b.input("s2", (2,), np.int64)   # a target computed at run time: only the shapes say what it does
    a = b.node("Reshape", [x, b.const("s", [6, 4], np.int64)], "a", (6, 4), name="r1")
    t1 = b.node("Transpose", [a], "t1", (4, 6), perm=[1, 0])
    t2 = b.node("Transpose", [a], "t2", (4, 6), perm=[1, 0])
    r = b.node("Reshape", [v, s2], "r", (6, 4), dyn_dims=(0, 1))
    g = b.graph(t1, t2, r)

    run = run_pass(g, "ShuffleShuffleFusion", fuse_shuffles)

    assert str(g) == expected("""
        graph g(%x: float32[2x3x4], %v: float32[-1x3x-1], %s2: int64[2]):
          %a: float32[6x4] = kiln.Shuffle(%x) steps=[{'reshape': [6, 4]}]  # r1
          %t1: float32[4x6] = kiln.Shuffle(%a) steps=[{'transpose': [1, 0]}]  # t1
          %t2: float32[4x6] = kiln.Shuffle(%a) steps=[{'transpose': [1, 0]}]  # t2
          %r: float32[-1x-1] = Reshape(%v, %s2)  # r
          return %t1, %t2, %r
        """)
    assert run.not_fusing == ["ShuffleShuffleFusion: Not fusing r1 with t1: r1's output 'a' has 2 consumers",
                              "ShuffleShuffleFusion: Not fusing r1 with t2: r1's output 'a' has 2 consumers"]
    assert (run.stat.matches, run.stat.rejections) == (0, 2)
    assert "ShuffleShuffleFusion: keeping r as Reshape: its output shape -1x-1 cannot be written as one reshape " \
           "target" in run.lines


def test_a_transpose_moving_only_static_size_1_axes_is_a_reshape():
    """[1, S, D] -> [S, 1, D] keeps the data where it is (nn.MultiheadAttention's batch-first transpose at batch 1);
    an axis that is 1 only at the opt point (dynamic), or a swap of two larger axes, still moves."""
    b = IRBuilder()
    x, d, s = b.input("x", (1, 5, 8)), b.input("d", (1, 5, 8), dyn_dims=(0,)), b.input("s", (2, 1, 3, 1))
    unit = b.node("Transpose", [x], "unit", (5, 1, 8), perm=[1, 0, 2])
    dyn = b.node("Transpose", [d], "dyn", (5, 1, 8), dyn_dims=(1,), perm=[1, 0, 2])
    ones = b.node("Transpose", [s], "ones", (1, 2, 1, 3), perm=[1, 0, 3, 2])
    cross = b.node("Transpose", [s], "cross", (3, 1, 2, 1), perm=[2, 1, 0, 3])
    e, f = b.input("e", (1, 8, 4), dyn_dims=(1,)), b.input("f", (1, 8, 8), dyn_dims=(1, 2))
    moved = b.node("Transpose", [e], "moved", (8, 1, 4), dyn_dims=(0,), perm=[1, 0, 2])
    two = b.node("Transpose", [f], "two", (8, 8, 1), dyn_dims=(0, 1), perm=[1, 2, 0])
    g = b.graph(unit, dyn, ones, cross, moved, two)

    run_pass(g, "ShuffleShuffleFusion", fuse_shuffles)

    assert str(g) == expected("""
        graph g(%x: float32[1x5x8], %d: float32[-1x5x8], %s: float32[2x1x3x1], %e: float32[1x-1x4], %f: float32[1x-1x-1]):
          %unit: float32[5x1x8] = kiln.Shuffle(%x) steps=[{'reshape': [5, 1, 8]}]  # unit
          %dyn: float32[5x-1x8] = kiln.Shuffle(%d) steps=[{'transpose': [1, 0, 2]}]  # dyn
          %ones: float32[1x2x1x3] = kiln.Shuffle(%s) steps=[{'reshape': [1, 2, 1, 3]}]  # ones
          %cross: float32[3x1x2x1] = kiln.Shuffle(%s) steps=[{'transpose': [2, 1, 0, 3]}]  # cross
          %moved: float32[-1x1x4] = kiln.Shuffle(%e) steps=[{'reshape': [-1, 1, 4]}]  # moved
          %two: float32[-1x-1x1] = kiln.Shuffle(%f) steps=[{'transpose': [1, 2, 0]}]  # two
          return %unit, %dyn, %ones, %cross, %moved, %two
        """)   # two dynamic axes that move: one reshape cannot say which is which (equal at the opt point)


def test_a_reshape_target_copies_an_axis_only_where_the_opt_and_probe_points_agree():
    """A target computed at run time is written from the shapes: [b, t, d] -> [b * t, d] at the opt point b = 2,
    t = 1 looks like a copied batch, but the probe point (b = 8, t = 3) says 24 against 8, so the axis is inferred;
    where both points agree ([b, t, d] -> [b, t, 2, 4]) the axes are copied. A constant target is taken as written:
    it says what the shapes can only guess."""
    b = IRBuilder()
    x = b.input("x", (2, 1, 8), dyn_dims=(0, 1), probe=(8, 3, 8))
    computed = b.input("target", (2,), np.int64)
    rows = b.node("Reshape", [x, computed], "rows", (2, 8), dyn_dims=(0,), probe=(24, 8))
    heads = b.node("Reshape", [x, computed], "heads", (2, 1, 2, 4), dyn_dims=(0, 1), probe=(8, 3, 2, 4))
    y = b.input("y", (2, 1, 8), dyn_dims=(0, 1))   # the builder's default probe: [5, 3, 8], and [5, 8] below
    const = b.node("Reshape", [y, b.const("flat", [-1, 8], np.int64)], "const", (2, 8), dyn_dims=(0,))
    g = b.graph(rows, heads, const)

    run_pass(g, "ShuffleShuffleFusion", fuse_shuffles)

    steps = {n.name: n.attrs["steps"] for n in g.nodes}
    assert steps == {"rows": [{"reshape": [-1, 8]}], "heads": [{"reshape": [0, 0, 2, 4]}],
                     "const": [{"reshape": [-1, 8]}]}


# ---------------------------------------------------------------- ShuffleErasure
def test_shuffles_that_move_nothing_are_erased():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    s1 = b.shuffle(x, "s1", (2, 3), [{"reshape": [2, 3]}])
    s2 = b.shuffle(s1, "s2", (2, 3), [{"transpose": [1, 0]}, {"transpose": [1, 0]}])
    g = b.graph(b.node("Relu", [s2], "y", (2, 3)))

    run = run_pass(g, "ShuffleErasure", erase_noop_shuffles)

    assert str(g) == expected("""
        graph g(%x: float32[2x3]):
          %y: float32[2x3] = Relu(%x)  # y
          return %y
        """)
    assert run.stat.matches == 2 and "Removing s1" in run.lines


def test_transposes_outputs_and_constants_are_not_erased():
    b = IRBuilder()
    x = b.input("x", (3, 3))
    t = b.shuffle(x, "t", (3, 3), [{"transpose": [1, 0]}])
    s = b.shuffle(t, "s", (3, 3), [{"reshape": [3, 3]}])
    c = b.shuffle(b.const("c", np.ones((3, 3))), "cs", (3, 3), [{"reshape": [3, 3]}])
    g = b.graph(s, b.node("Add", [t, c], "y", (3, 3)))
    before = str(g)

    run = run_pass(g, "ShuffleErasure", erase_noop_shuffles)

    assert str(g) == before and run.stat.matches == 0
