"""Pointwise fusions on IR graphs: SiLU after a convolution or product becomes Swish (SwishFusion); chains of
elementwise ops become one PointWise layer carrying a small program (PointWiseFusion)."""
from __future__ import annotations

import numpy as np

from kiln.passes.pointwise import fuse_pointwise, fuse_swish
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

X = (1, 2, 3, 3)


def conv(b: IRBuilder, x, out: str = "c"):
    return b.node("Conv", [x, b.const(f"{out}.w", np.ones((2, 2, 1, 1)))], out, X, name="conv")


# ---------------------------------------------------------------- SwishFusion
def test_silu_after_a_convolution_or_product_becomes_swish():
    b = IRBuilder()
    x, v = b.input("x", X), b.input("v", (2, 3))
    c = conv(b, x)
    y1 = b.node("Mul", [c, b.node("Sigmoid", [c], "s1", X, name="sig")], "y1", X, name="mul")
    m = b.node("MatMul", [v, b.const("w", np.ones((3, 4)))], "m", (2, 4), name="mm")
    y2 = b.node("Mul", [b.node("Sigmoid", [m], "s2", (2, 4), name="sig2"), m], "y2", (2, 4), name="mul2")
    g = b.graph(y1, y2)

    run = run_pass(g, "SwishFusion", fuse_swish)

    assert str(g) == expected("""
        graph g(%x: float32[1x2x3x3], %v: float32[2x3]):
          %c: float32[1x2x3x3] = Conv(%x, const %c.w)  # conv
          %y1: float32[1x2x3x3] = Swish(%c) alpha=1.0  # sig + mul
          %m: float32[2x4] = MatMul(%v, const %w)  # mm
          %y2: float32[2x4] = Swish(%m) alpha=1.0  # sig2 + mul2
          return %y1, %y2
        """)
    assert (run.stat.matches, run.stat.rejections) == (2, 0)


def test_silu_stays_when_the_product_is_read_elsewhere_or_there_is_no_product():
    b = IRBuilder()
    x = b.input("x", X)
    c = conv(b, x)
    y1 = b.node("Mul", [c, b.node("Sigmoid", [c], "s1", X, name="sig")], "y1", X, name="mul")
    y2 = b.node("Mul", [x, b.node("Sigmoid", [x], "s2", X, name="sig2")], "y2", X, name="mul2")
    g = b.graph(y1, y2, c)
    run = run_pass_unchanged(g, "SwishFusion", fuse_swish)
    assert run.not_fusing == ["SwishFusion: Not fusing sig with mul: conv's output 'c' is also read elsewhere: its "
                              "activation cannot be absorbed"]   # sig2 reads an input: no line, PointWise takes it


# ---------------------------------------------------------------- PointWiseFusion
def test_elementwise_chain_becomes_one_pointwise_program():
    b = IRBuilder()
    x, z = b.input("x", (2, 3)), b.input("z", (2, 3))
    e = b.node("Exp", [x], "e", (2, 3), name="exp")
    a = b.node("Add", [e, z], "a", (2, 3), name="add")
    y = b.node("Log", [a], "y", (2, 3), name="log")
    s = b.node("Softmax", [y], "s", (2, 3), name="softmax", axis=-1)
    g = b.graph(s)

    run = run_pass(g, "PointWiseFusion", fuse_pointwise)

    assert str(g) == expected("""
        graph g(%x: float32[2x3], %z: float32[2x3]):
          %y: float32[2x3] = kiln.PointWise(%x, %z) program=[{'op': 'Exp', 'attrs': {}, 'args': ['x0']}, {'op': 'Add', 'attrs': {}, 'args': ['t0', 'x1']}, {'op': 'Log', 'attrs': {}, 'args': ['t1']}]  # PWN(exp, add, log)
          %s: float32[2x3] = Softmax(%y) axis=-1  # softmax
          return %s
        """)
    assert (run.stat.matches, run.stat.rejections) == (2, 0)
    assert g.nodes[0].origin == ("exp", "add", "log")


def test_an_operand_shared_by_two_steps_is_one_program_input_and_clip_bounds_stay_constants():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    e = b.node("Exp", [x], "e", (2, 3), name="exp")
    m = b.node("Mul", [e, x], "m", (2, 3), name="mul")
    y = b.node("Clip", [m, b.const("lo", 0.0), b.const("hi", 6.0)], "y", (2, 3), name="clip")
    g = b.graph(y)

    run = run_pass(g, "PointWiseFusion", fuse_pointwise)

    assert str(g) == expected("""
        graph g(%x: float32[2x3]):
          %y: float32[2x3] = kiln.PointWise(%x) program=[{'op': 'Exp', 'attrs': {}, 'args': ['x0']}, {'op': 'Mul', 'attrs': {}, 'args': ['t0', 'x0']}, {'op': 'Clip', 'attrs': {}, 'args': ['t1', {'const': 0.0}, {'const': 6.0}]}]  # PWN(exp, mul, clip)
          return %y
        """)
    assert run.stat.matches == 2


def test_a_value_read_by_two_elementwise_ops_ends_the_chain():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    e = b.node("Exp", [x], "e", (2, 3), name="exp")
    n = b.node("Neg", [e], "n", (2, 3), name="neg")
    a = b.node("Abs", [e], "a", (2, 3), name="abs")
    g = b.graph(n, a)
    run = run_pass_unchanged(g, "PointWiseFusion", fuse_pointwise)
    assert run.not_fusing == ["PointWiseFusion: Not fusing exp with neg: exp's output 'e' has 2 consumers",
                              "PointWiseFusion: Not fusing exp with abs: exp's output 'e' has 2 consumers"]
    assert (run.stat.matches, run.stat.rejections) == (0, 2)


def test_a_value_read_twice_by_one_chain_joins_it_once_the_chain_is_one_program():
    """GELU's x / sqrt 2 -> Erf -> + 1 -> * x: Exp's output is read by Div and by the last Mul. Once Div..Mul are one
    PointWise, that is Exp's only reader, and Exp joins it on the next sweep (no "not fusing" line is left)."""
    b = IRBuilder()
    x = b.input("x", (2, 3))
    e = b.node("Exp", [x], "e", (2, 3), name="exp")
    d = b.node("Div", [e, b.const("sqrt2", 2 ** 0.5)], "d", (2, 3), name="div")
    a = b.node("Add", [b.node("Erf", [d], "f", (2, 3), name="erf"), b.const("one", 1.0)], "a", (2, 3), name="add")
    g = b.graph(b.node("Mul", [e, a], "y", (2, 3), name="mul"))

    run = run_pass(g, "PointWiseFusion", fuse_pointwise)

    (node,) = g.nodes
    assert node.name == "PWN(exp, div, erf, add, mul)" and [v.name for v in node.inputs] == ["x", "sqrt2", "one"]
    assert [(step["op"], step["args"]) for step in node.attrs["program"]] == [
        ("Exp", ["x0"]), ("Div", ["t0", "x1"]), ("Erf", ["t1"]), ("Add", ["t2", "x2"]), ("Mul", ["t0", "t3"])]
    assert (run.stat.matches, run.stat.rejections) == (4, 0) and run.not_fusing == []


def test_a_value_one_step_reads_twice_joins_that_step():
    """tanh-GELU's cube: Mul(e, e) reads Exp's output twice, then two more steps read it: one program, one input."""
    b = IRBuilder()
    x = b.input("x", (2, 3))
    e = b.node("Exp", [x], "e", (2, 3), name="exp")
    cube = b.node("Mul", [b.node("Mul", [e, e], "sq", (2, 3), name="square"), e], "cube", (2, 3), name="cube")
    t = b.node("Tanh", [cube], "t", (2, 3), name="tanh")
    g = b.graph(b.node("Mul", [e, t], "y", (2, 3), name="mul"))

    run = run_pass(g, "PointWiseFusion", fuse_pointwise)

    (node,) = g.nodes
    assert node.name == "PWN(exp, square, cube, tanh, mul)" and [v.name for v in node.inputs] == ["x"]
    assert [(step["op"], step["args"]) for step in node.attrs["program"]] == [
        ("Exp", ["x0"]), ("Mul", ["t0", "t0"]), ("Mul", ["t1", "t0"]), ("Tanh", ["t2"]), ("Mul", ["t0", "t3"])]
    assert run.not_fusing == []
