"""GeluFusion on IR graphs: GELU's erf form and the tanh form in the arrangements exporters write (torch's x·x·x,
HF/GPT-2's Pow(x, 3) with 0.5·x first, TensorFlow's 0.5·(1 + tanh)·x) become one Gelu op; near misses stay, with
the reason."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.passes.gelu import fuse_gelu
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

SQRT2 = 2.0 ** 0.5
C = float(np.sqrt(2.0 / np.pi))


def test_erf_gelu_in_both_exporter_orders_becomes_gelu():
    b = IRBuilder()
    x, u = b.input("x", (2, 4)), b.input("u", (2, 4))
    # x * (1 + erf(x / √2)) * 0.5  (torch.onnx, legacy exporter)
    e = b.node("Erf", [b.node("Div", [x, b.const("sqrt2", SQRT2)], "div", (2, 4))], "erf", (2, 4))
    a = b.node("Add", [e, b.const("one", 1.0)], "add", (2, 4))
    y1 = b.node("Mul", [b.node("Mul", [x, a], "mul", (2, 4)), b.const("half", 0.5)], "y1", (2, 4))
    # (0.5 * u) * (1 + erf(u * 1/√2))
    e2 = b.node("Erf", [b.node("Mul", [u, b.const("rsqrt2", 1 / SQRT2)], "mul2", (2, 4))], "erf2", (2, 4))
    a2 = b.node("Add", [b.const("one2", 1.0), e2], "add2", (2, 4))
    h2 = b.node("Mul", [u, b.const("half2", 0.5)], "half_u", (2, 4))
    y2 = b.node("Mul", [h2, a2], "y2", (2, 4))
    g = b.graph(y1, y2)

    run = run_pass(g, "GeluFusion", fuse_gelu)

    assert str(g) == expected("""
        graph g(%x: float32[2x4], %u: float32[2x4]):
          %y1: float32[2x4] = Gelu(%x)  # div + erf + add + mul + y1
          %y2: float32[2x4] = Gelu(%u)  # mul2 + erf2 + add2 + half_u + y2
          return %y1, %y2
        """)
    assert run.stat.matches == 8   # one "Fusing" line per absorbed node
    assert run.stat.rejections == 0


def test_erf_without_the_plus_one_or_the_half_stays():
    b = IRBuilder()
    x, u = b.input("x", (2, 4)), b.input("u", (2, 4))
    e = b.node("Erf", [b.node("Div", [x, b.const("sqrt2", SQRT2)], "div", (2, 4))], "erf", (2, 4))
    y1 = b.node("Mul", [e, b.const("two", 2.0)], "y1", (2, 4))
    e2 = b.node("Erf", [b.node("Div", [u, b.const("sqrt2b", SQRT2)], "div2", (2, 4))], "erf2", (2, 4))
    a2 = b.node("Add", [e2, b.const("one", 1.0)], "add2", (2, 4))
    y2 = b.node("Mul", [u, a2], "y2", (2, 4))   # no 0.5
    g = b.graph(y1, y2)
    run = run_pass_unchanged(g, "GeluFusion", fuse_gelu)
    assert run.not_fusing == ["GeluFusion: Not fusing erf with Gelu: it is not followed by +1",
                              "GeluFusion: Not fusing erf2 with Gelu: the product with x and 0.5 is not there"]
    assert (run.stat.matches, run.stat.rejections) == (0, 2)


def tanh_gelu(b: IRBuilder, x, form: str, c: float = C, cube: float = 0.044715):
    """The tanh form as `form` arranges it; returns its output and the Tanh's."""
    s = (2, 4)
    if form == "torch":      # x * (1 + tanh(c * (x + 0.044715 * (x * x * x)))) * 0.5
        x3 = b.node("Mul", [x, b.node("Mul", [x, x], "x2", s, name="sq")], "x3", s, name="cube")
    else:                    # Pow(x, 3)
        x3 = b.node("Pow", [x, b.const("three", 3.0)], "x3", s, name="cube")
    inner = b.node("Add", [x, b.node("Mul", [b.const("k", cube), x3], "kx3", s, name="kmul")], "in", s, name="inner")
    t = b.node("Tanh", [b.node("Mul", [inner, b.const("c", c)], "arg", s, name="scale")], "t", s, name="tanh")
    one = b.node("Add", [b.const("one", 1.0), t], "t1", s, name="plus1")
    if form == "torch":
        return b.node("Mul", [b.node("Mul", [x, one], "xt", s, name="times_x"), b.const("half", 0.5)], "y", s,
                      name="half"), t
    if form == "hf":         # (0.5 * x) * (1 + tanh(...))
        return b.node("Mul", [b.node("Mul", [b.const("half", 0.5), x], "hx", s, name="half_x"), one], "y", s,
                      name="times"), t
    half = b.node("Mul", [one, b.const("half", 0.5)], "h", s, name="half")   # tensorflow: 0.5 * (1 + tanh) * x
    return b.node("Mul", [x, half], "y", s, name="times_x"), t


@pytest.mark.parametrize("form", ["torch", "hf", "tensorflow"])
def test_tanh_gelu_in_each_exporters_arrangement_becomes_gelu_tanh(form):
    b = IRBuilder()
    x = b.input("x", (2, 4))
    g = b.graph(tanh_gelu(b, x, form)[0])

    run = run_pass(g, "GeluFusion", fuse_gelu)

    origin = {"torch": "sq + cube + kmul + inner + scale + tanh + plus1 + times_x + half",
              "hf": "cube + kmul + inner + scale + tanh + plus1 + half_x + times",
              "tensorflow": "cube + kmul + inner + scale + tanh + plus1 + half + times_x"}[form]
    assert str(g) == expected(f"""
        graph g(%x: float32[2x4]):
          %y: float32[2x4] = Gelu(%x) approximate='tanh'  # {origin}
          return %y
        """)
    assert (run.stat.matches, run.stat.rejections) == (origin.count(" + "), 0)


def test_tanh_near_misses_stay_with_the_reason():
    b = IRBuilder()
    x, u, v = b.input("x", (2, 4)), b.input("u", (2, 4)), b.input("v", (2, 4))
    y1 = tanh_gelu(b, x, "hf", cube=0.5)[0]                       # not GELU's constant
    y2 = b.node("Tanh", [b.node("Mul", [u, b.const("k2", 2.0)], "u2", (2, 4))], "y2", (2, 4), name="plain_tanh")
    w3 = b.node("Pow", [v, b.const("three_v", 3.0)], "v3", (2, 4), name="cube_v")
    y3 = b.node("Tanh", [b.node("Add", [w3, u], "vu", (2, 4), name="mixed")], "y3", (2, 4), name="mixed_tanh")
    g = b.graph(y1, y2, y3)
    run = run_pass_unchanged(g, "GeluFusion", fuse_gelu)
    assert run.not_fusing == [
        "GeluFusion: Not fusing tanh with Gelu: the arithmetic around it is not "
        "0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))",
        "GeluFusion: Not fusing plain_tanh with Gelu: the arithmetic around it is not "
        "0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))",
        "GeluFusion: Not fusing mixed_tanh with Gelu: its input is not scalar arithmetic on one tensor"]


def test_a_tanh_gelu_whose_inner_value_is_read_elsewhere_stays():
    b = IRBuilder()
    x = b.input("x", (2, 4))
    g = b.graph(*tanh_gelu(b, x, "torch"))
    run = run_pass_unchanged(g, "GeluFusion", fuse_gelu)
    assert run.not_fusing == ["GeluFusion: Not fusing tanh with Gelu: a value computed inside it is read outside it"]


def test_integer_exponents_match_and_a_broadcasting_constant_does_not():
    """Pow(x, int64 3) is the same cube; a one-element constant of higher rank would change the output's shape."""
    b = IRBuilder()
    x, u = b.input("x", (2, 4)), b.input("u", (2, 4))
    s = (2, 4)
    x3 = b.node("Pow", [x, b.const("three", 3, np.int64)], "x3", s, name="cube")
    inner = b.node("Add", [x, b.node("Mul", [x3, b.const("k", 0.044715)], "kx3", s, name="kmul")], "in", s,
                   name="inner")
    t = b.node("Tanh", [b.node("Mul", [inner, b.const("c", C)], "arg", s, name="scale")], "t", s, name="tanh")
    y1 = b.node("Mul", [b.node("Mul", [x, b.const("half", 0.5)], "hx", s, name="half_x"),
                        b.node("Add", [t, b.const("one", 1.0)], "t1", s, name="plus1")], "y1", s, name="times")
    u3 = b.node("Mul", [u, b.node("Mul", [u, u], "u2", s, name="usq")], "u3", s, name="ucube")
    inner2 = b.node("Add", [u, b.node("Mul", [u3, b.const("k2", 0.044715)], "ku3", s, name="kmul2")], "in2", s,
                    name="inner2")
    t2 = b.node("Tanh", [b.node("Mul", [inner2, b.const("c2", C)], "arg2", s, name="scale2")], "t2", s, name="tanh2")
    one3 = b.const("one3", np.ones((1, 1, 1)))   # one element, rank 3: the sum is [1, 2, 4]
    y2 = b.node("Mul", [b.node("Mul", [u, b.const("half2", 0.5)], "hu", s, name="half_u"),
                        b.node("Add", [t2, one3], "t21", (1, 2, 4), name="plus1_3d")], "y2", (1, 2, 4), name="times2")
    g = b.graph(y1, y2)
    run = run_pass(g, "GeluFusion", fuse_gelu)
    assert str(g).splitlines()[1].startswith("  %y1: float32[2x4] = Gelu(%x) approximate='tanh'")
    assert run.not_fusing == ["GeluFusion: Not fusing tanh2 with Gelu: a constant broadcasts it to another shape"]
