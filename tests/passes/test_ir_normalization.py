"""LayerNormFusion on IR graphs: the decomposed LayerNorm exporters write (mean, centre, square, mean, +eps,
sqrt, divide, [*gamma], [+beta]) becomes one LayerNormalization; near misses say why they did not fuse."""
from __future__ import annotations

import numpy as np

from kiln.passes.normalization import fuse_layer_norm
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

EPS = 2.0 ** -16   # exactly representable in float32, so the epsilon attribute prints exactly


def decomposed(b: IRBuilder, x, var_axes=(-1,), eps=None, square="Pow"):
    """The centred value `d` and the normalized output `n` of x's LayerNorm over its last axis (node names are
    their output names: m d p v e s n)."""
    shape, reduced = x.shape, x.shape[:-1] + (1,)
    m = b.node("ReduceMean", [x], "m", reduced, axes=[-1])
    d = b.node("Sub", [x, m], "d", shape)
    p = b.node("Pow", [d, b.const("two", 2.0)], "p", shape) if square == "Pow" else b.node("Mul", [d, d], "p", shape)
    v = b.node("ReduceMean", [p], "v", reduced, axes=list(var_axes))
    e = b.node("Add", [v, eps if eps is not None else b.const("eps", EPS)], "e", reduced)
    s = b.node("Sqrt", [e], "s", reduced)
    return d, b.node("Div", [d, s], "n", shape)


def test_decomposed_layer_norm_with_gamma_and_beta_is_one_layer():
    b = IRBuilder()
    x = b.input("x", (2, 4))
    _, n = decomposed(b, x)
    gm = b.node("Mul", [n, b.const("gamma", [1.0, 2.0, 3.0, 4.0])], "gm", (2, 4))
    y = b.node("Add", [b.const("beta", [0.5, 0.0, 0.0, -0.5]), gm], "y", (2, 4))
    g = b.graph(b.node("Relu", [y], "r", (2, 4)))

    run = run_pass(g, "LayerNormFusion", fuse_layer_norm)

    assert str(g) == expected("""
        graph g(%x: float32[2x4]):
          %y: float32[2x4] = LayerNormalization(%x, const %m + d + p + v + e + s + n + gm + y.scale, const %m + d + p + v + e + s + n + gm + y.bias) axis=1 epsilon=1.52587890625e-05  # m + d + p + v + e + s + n + gm + y
          %r: float32[2x4] = Relu(%y)  # r
          return %r
        """)
    assert (run.stat.matches, run.stat.rejections) == (1, 0)
    assert "LayerNormFusion: Fusing m with y" in run.lines
    name = "m + d + p + v + e + s + n + gm + y"
    np.testing.assert_array_equal(g.values[f"{name}.scale"].const, np.array([1, 2, 3, 4], np.float32))
    np.testing.assert_array_equal(g.values[f"{name}.bias"].const, np.array([0.5, 0, 0, -0.5], np.float32))


def test_layer_norm_squared_by_mul_without_affine_gets_unit_scale_and_zero_bias():
    b = IRBuilder()
    x = b.input("x", (3, 4))
    _, n = decomposed(b, x, square="Mul")
    g = b.graph(b.node("Relu", [n], "r", (3, 4)))

    run = run_pass(g, "LayerNormFusion", fuse_layer_norm)

    assert str(g) == expected("""
        graph g(%x: float32[3x4]):
          %n: float32[3x4] = LayerNormalization(%x, const %m + d + p + v + e + s + n.scale, const %m + d + p + v + e + s + n.bias) axis=1 epsilon=1.52587890625e-05  # m + d + p + v + e + s + n
          %r: float32[3x4] = Relu(%n)  # r
          return %r
        """)
    assert run.stat.matches == 1
    np.testing.assert_array_equal(g.values["m + d + p + v + e + s + n.scale"].const, np.ones(4, np.float32))
    np.testing.assert_array_equal(g.values["m + d + p + v + e + s + n.bias"].const, np.zeros(4, np.float32))


def test_variance_over_other_axes_does_not_fuse():
    b = IRBuilder()
    x = b.input("x", (2, 4))
    _, n = decomposed(b, x, var_axes=(0,))
    g = b.graph(n)
    run = run_pass_unchanged(g, "LayerNormFusion", fuse_layer_norm)
    assert run.not_fusing == ["LayerNormFusion: Not fusing d with n: reductions are not over the same trailing axes "
                              "([1] vs [0])"]
    assert (run.stat.matches, run.stat.rejections) == (0, 1)


def test_centred_value_read_outside_the_pattern_does_not_fuse():
    b = IRBuilder()
    x = b.input("x", (2, 4))
    d, n = decomposed(b, x)
    g = b.graph(n, d)

    run = run_pass(g, "LayerNormFusion", fuse_layer_norm)

    assert len(g.nodes) == 7
    assert run.not_fusing == ["LayerNormFusion: Not fusing d with n: an intermediate value is also used outside "
                              "the pattern"]


def test_computed_epsilon_does_not_fuse():
    b = IRBuilder()
    x, eps = b.input("x", (2, 4)), b.input("eps_in", (1,))
    _, n = decomposed(b, x, eps=eps)
    g = b.graph(n)

    run = run_pass(g, "LayerNormFusion", fuse_layer_norm)

    assert len(g.nodes) == 7
    assert run.not_fusing == ["LayerNormFusion: Not fusing d with n: epsilon is not a constant scalar"]


def test_tensorflows_batch_normalization_form_is_one_layer():
    # a = gamma / sqrt(var + eps); y = x * a + (beta - mean * a)   (tf.nn.batch_normalization, tf2onnx)
    b = IRBuilder()
    x = b.input("x", (2, 4))
    reduced = (2, 1)
    m = b.node("ReduceMean", [x], "m", reduced, axes=[-1])
    d = b.node("Sub", [x, m], "d", (2, 4))
    v = b.node("ReduceMean", [b.node("Mul", [d, d], "p", (2, 4))], "v", reduced, axes=[-1])
    s = b.node("Sqrt", [b.node("Add", [v, b.const("eps", EPS)], "e", reduced)], "s", reduced)
    a = b.node("Mul", [b.node("Reciprocal", [s], "r", reduced), b.const("gamma", [1.0, 2.0, 3.0, 4.0])], "a", (2, 4))
    xa, ma = b.node("Mul", [x, a], "xa", (2, 4)), b.node("Mul", [m, a], "ma", (2, 4))
    shift = b.node("Sub", [b.const("beta", [0.5, 0.0, 0.0, -0.5]), ma], "shift", (2, 4))
    g = b.graph(b.node("Add", [xa, shift], "y", (2, 4)))

    run = run_pass(g, "LayerNormFusion", fuse_layer_norm)

    name = "m + d + p + v + e + s + r + a + xa + ma + shift + y"
    assert str(g) == expected(f"""
        graph g(%x: float32[2x4]):
          %y: float32[2x4] = LayerNormalization(%x, const %{name}.scale, const %{name}.bias) axis=1 epsilon=1.52587890625e-05  # {name}
          return %y
        """)
    assert "LayerNormFusion: Fusing m with y" in run.lines
    np.testing.assert_array_equal(g.values[f"{name}.scale"].const, np.array([1, 2, 3, 4], np.float32))
    np.testing.assert_array_equal(g.values[f"{name}.bias"].const, np.array([0.5, 0, 0, -0.5], np.float32))
