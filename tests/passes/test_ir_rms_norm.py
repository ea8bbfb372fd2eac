"""RMSNormFusion on IR graphs: T5's and LLaMA's RMSNorm (square, mean, +eps, sqrt, then x divided by it or times
its reciprocal, [*gamma]) becomes one RMSNormalization; near misses say why they did not fuse."""
from __future__ import annotations

import numpy as np
import pytest

from kiln.passes.normalization import fuse_rms_norm
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

EPS = 2.0 ** -16   # exactly representable in float32, so the epsilon attribute prints exactly


def decomposed(b: IRBuilder, x, form: str, axes=(-1,), square="Pow"):
    """x's RMSNorm over its last axis, the normalization written as `form`: "div" x / s, "reciprocal"
    x * Reciprocal(s) (the dynamo exporter's rsqrt), "one_over" x * Div(1, s) (the legacy exporter's T5). Node
    names are their output names: p v e s [r] n."""
    shape, reduced = x.shape, x.shape[:-1] + (1,)
    p = b.node("Pow", [x, b.const("two", 2.0)], "p", shape) if square == "Pow" else b.node("Mul", [x, x], "p", shape)
    v = b.node("ReduceMean", [p], "v", reduced, axes=list(axes))
    e = b.node("Add", [v, b.const("eps", EPS)], "e", reduced)
    s = b.node("Sqrt", [e], "s", reduced)
    if form == "div":
        return b.node("Div", [x, s], "n", shape)
    r = b.node("Reciprocal", [s], "r", reduced) if form == "reciprocal" else \
        b.node("Div", [b.const("one", 1.0), s], "r", reduced)
    return b.node("Mul", [r, x] if form == "reciprocal" else [x, r], "n", shape)


@pytest.mark.parametrize("form, names", [("div", "p + v + e + s + n"), ("reciprocal", "p + v + e + s + r + n"),
                                         ("one_over", "p + v + e + s + r + n")])
def test_each_form_with_gamma_is_one_layer(form, names):
    b = IRBuilder()
    x = b.input("x", (2, 4))
    n = decomposed(b, x, form)
    y = b.node("Mul", [b.const("gamma", [1.0, 2.0, 3.0, 4.0]), n], "y", (2, 4))
    g = b.graph(b.node("Relu", [y], "out", (2, 4)))

    run = run_pass(g, "RMSNormFusion", fuse_rms_norm)

    assert str(g) == expected(f"""
        graph g(%x: float32[2x4]):
          %y: float32[2x4] = RMSNormalization(%x, const %{names} + y.scale) axis=1 epsilon=1.52587890625e-05  # {names} + y
          %out: float32[2x4] = Relu(%y)  # out
          return %out
        """)
    assert (run.stat.matches, run.stat.rejections) == (1, 0)
    assert "RMSNormFusion: Fusing p with y" in run.lines
    np.testing.assert_array_equal(g.values[f"{names} + y.scale"].const, np.array([1, 2, 3, 4], np.float32))


def test_the_mul_square_without_gamma_gets_a_unit_scale():
    b = IRBuilder()
    x = b.input("x", (3, 4))
    g = b.graph(b.node("Relu", [decomposed(b, x, "div", square="Mul")], "out", (3, 4)))

    run = run_pass(g, "RMSNormFusion", fuse_rms_norm)

    assert run.stat.matches == 1
    assert [n.op_type for n in g.nodes] == ["RMSNormalization", "Relu"]
    np.testing.assert_array_equal(g.values["p + v + e + s + n.scale"].const, np.ones(4, np.float32))


def test_a_mean_over_a_leading_axis_does_not_fuse():
    b = IRBuilder()
    x = b.input("x", (2, 4))
    g = b.graph(decomposed(b, x, "reciprocal", axes=(0,)))
    run = run_pass_unchanged(g, "RMSNormFusion", fuse_rms_norm)
    assert run.not_fusing == ["RMSNormFusion: Not fusing p with n: the mean of squares is not over trailing axes ([0])"]


def test_an_intermediate_read_elsewhere_does_not_fuse():
    b = IRBuilder()
    x = b.input("x", (2, 4))
    n = decomposed(b, x, "div")
    g = b.graph(n, n.producer.inputs[1])   # the root mean square is a graph output too
    run = run_pass_unchanged(g, "RMSNormFusion", fuse_rms_norm)
    assert run.not_fusing == ["RMSNormFusion: Not fusing p with n: an intermediate value is also used outside the "
                              "pattern"]
