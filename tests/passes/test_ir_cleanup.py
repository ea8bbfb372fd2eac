"""Clean-up passes on IR graphs: dead layers go, Identity/Dropout/same-type Cast forward their input, constant
subgraphs fold, and what must stay stays (with the note saying why)."""
from __future__ import annotations

import numpy as np

from kiln.passes.cleanup import fold_constants, remove_dead_layers, remove_identities
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged


# ---------------------------------------------------------------- DeadLayerRemoval
def test_layers_that_reach_no_output_are_removed():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    y = b.node("Relu", [x], "y", (2, 3))
    n = b.node("Neg", [x], "n", (2, 3))
    b.node("Exp", [n], "e", (2, 3))
    g = b.graph(y)

    run = run_pass(g, "DeadLayerRemoval", remove_dead_layers)

    assert str(g) == expected("""
        graph g(%x: float32[2x3]):
          %y: float32[2x3] = Relu(%x)  # y
          return %y
        """)
    assert (run.stat.matches, run.stat.layers_before, run.stat.layers_after) == (2, 3, 1)
    assert "Removing e" in run.lines and "Removing n" in run.lines
    assert set(g.values) == {"x", "y"}   # the manager pruned the dead values


def test_a_layer_feeding_an_output_through_another_is_kept():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    r = b.node("Relu", [x], "r", (2, 3))
    y = b.node("Neg", [r], "y", (2, 3))
    g = b.graph(y, r)
    before = str(g)

    run = run_pass(g, "DeadLayerRemoval", remove_dead_layers)

    assert str(g) == before and run.stat.matches == 0


# ---------------------------------------------------------------- IdentityRemoval
def test_identity_dropout_and_same_type_cast_forward_their_input():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    a = b.node("Identity", [x], "a", (2, 3))
    r = b.node("Relu", [a], "r", (2, 3))
    d = b.node("Dropout", [r], "d", (2, 3))
    c = b.node("Cast", [d], "c", (2, 3), to=1)
    y = b.node("Neg", [c], "y", (2, 3))
    g = b.graph(y)

    run = run_pass(g, "IdentityRemoval", remove_identities)

    assert str(g) == expected("""
        graph g(%x: float32[2x3]):
          %r: float32[2x3] = Relu(%x)  # r
          %y: float32[2x3] = Neg(%r)  # y
          return %y
        """)
    assert run.stat.matches == 3
    assert [line for line in run.lines if line.startswith("Removing")] == ["Removing a", "Removing d", "Removing c"]


def test_identity_into_an_output_keeps_the_output_name():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    r = b.node("Relu", [x], "r", (2, 3))
    y = b.node("Identity", [r], "y", (2, 3))
    z = b.node("Neg", [r], "z", (2, 3))
    g = b.graph(y, z)

    run = run_pass(g, "IdentityRemoval", remove_identities)

    assert str(g) == expected("""
        graph g(%x: float32[2x3]):
          %y: float32[2x3] = Relu(%x)  # r
          %z: float32[2x3] = Neg(%y)  # z
          return %y, %z
        """)
    assert run.stat.matches == 1


def test_identity_copying_an_input_to_an_output_is_kept():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    y = b.node("Identity", [x], "y", (2, 3))
    g = b.graph(y)
    before = str(g)

    run = run_pass(g, "IdentityRemoval", remove_identities)

    assert str(g) == before and run.stat.matches == 0
    assert "IdentityRemoval: keeping y: it copies one graph binding to another" in run.lines


def test_dropout_whose_mask_is_read_and_a_converting_cast_are_kept():
    b = IRBuilder()
    x = b.input("x", (2, 3))
    d, mask = b.multi("Dropout", [x], [("d", (2, 3)), ("mask", (2, 3))], name="drop")
    mask.dtype = np.dtype(bool)
    h = b.node("Cast", [d], "h", (2, 3), dtype=np.float16, to=10)
    y = b.node("Where", [mask, h, h], "y", (2, 3), dtype=np.float16)
    g = b.graph(y)
    before = str(g)

    run = run_pass(g, "IdentityRemoval", remove_identities)

    assert str(g) == before == expected("""
        graph g(%x: float32[2x3]):
          %d: float32[2x3], %mask: bool[2x3] = Dropout(%x)  # drop
          %h: float16[2x3] = Cast(%d) to=10  # h
          %y: float16[2x3] = Where(%mask, %h, %h)  # y
          return %y
        """)
    assert run.stat.matches == 0
    assert "IdentityRemoval: keeping drop: its mask output is used" in run.lines


# ---------------------------------------------------------------- ConstantFolding
def test_constant_arithmetic_and_static_shapes_fold():
    b = IRBuilder()
    x = b.input("x", (2,))
    s = b.node("Add", [b.const("a", [1.0, 2.0]), b.const("b", [3.0, 4.0])], "s", (2,))
    y = b.node("Mul", [x, s], "y", (2,))
    shape = b.node("Shape", [x], "shape", (1,), dtype=np.int64)
    z = b.node("Reshape", [y, shape], "z", (2,))
    g = b.graph(z)

    run = run_pass(g, "ConstantFolding", fold_constants, folds_constants=True)   # tiny constants

    assert str(g) == expected("""
        graph g(%x: float32[2]):
          %y: float32[2] = Mul(%x, const %s)  # y
          %z: float32[2] = Reshape(%y, const %shape)  # z
          return %z
        """)
    assert run.stat.matches == 2
    np.testing.assert_array_equal(g.values["s"].const, np.array([4.0, 6.0], np.float32))
    assert g.values["s"].const.dtype == np.float32
    np.testing.assert_array_equal(g.values["shape"].const, np.array([2], np.int64))


def test_dynamic_shapes_int8_weights_outputs_and_huge_constants_do_not_fold():
    b = IRBuilder()
    x = b.input("x", (4, 8), dyn_dims=(0,))
    shape = b.node("Shape", [x], "shape", (2,), dtype=np.int64)
    flat = b.node("Reshape", [x, shape], "flat", (4, 8), dyn_dims=(0,))
    w_q = b.const("w_q", np.ones((8, 2)), np.int8)
    w = b.node("DequantizeLinear", [w_q, b.const("w_scale", 0.5)], "w", (8, 2), dtype=np.float32)
    y = b.node("MatMul", [flat, w], "y", (4, 2), dyn_dims=(0,))
    big = b.node("Expand", [b.const("one", 1.0), b.const("big_shape", [4096, 4097], np.int64)], "big", (4096, 4097))
    z = b.node("Add", [b.const("c1", 1.0), b.const("c2", 2.0)], "z", ())
    g = b.graph(y, big, z)
    before = str(g)

    run = run_pass(g, "ConstantFolding", fold_constants)   # nothing folds, so torch never runs

    assert str(g) == before == expected("""
        graph g(%x: float32[-1x8]):
          %shape: int64[2] = Shape(%x)  # shape
          %flat: float32[-1x8] = Reshape(%x, %shape)  # flat
          %w: float32[8x2] = DequantizeLinear(const %w_q, const %w_scale)  # w
          %y: float32[-1x2] = MatMul(%flat, %w)  # y
          %big: float32[4096x4097] = Expand(const %one, const %big_shape)  # big
          %z: float32[scalar] = Add(const %c1, const %c2)  # z
          return %y, %big, %z
        """)
    assert run.stat.matches == 0
    assert "ConstantFolding: not folding big: output too large" in run.lines


def test_a_quantize_linear_of_a_kept_int8_weight_folds_to_an_int8_constant():
    """quantize_static's Q(DQ(w)) where an exporter's Identity shared one weight between layers (torch's
    deduplicated parameters): each copy is a constant, requantized at build time as QuantizeLinear would (ties
    half to even at scale 2, saturation at 1/8); the DQ the first layer reads stays for the Q/DQ fusions."""
    codes = np.array([-128, -6, -2, 2, 6, 10, 14, 127] * 2).reshape(8, 2)
    b = IRBuilder()
    x = b.input("x", (4, 8))
    w = b.node("DequantizeLinear", [b.const("w_q", codes, np.int8), b.const("w_scale", 0.5)], "w", (8, 2),
               dtype=np.float32)
    products = [b.node("MatMul", [x, w], "y", (4, 2))]
    for name, scale in (("c", 2.0), ("d", 0.125)):
        copy = b.node("QuantizeLinear", [w, b.const(f"{name}_scale", scale), b.const(f"{name}_zero", 3, np.int8)],
                      name, (8, 2), dtype=np.int8)
        params = [b.const(f"{name}_scale2", scale), b.const(f"{name}_zero2", 3, np.int8)]
        read = b.node("DequantizeLinear", [copy, *params], f"{name}f", (8, 2), dtype=np.float32)
        products.append(b.node("MatMul", [x, read], f"{name}y", (4, 2)))
    g = b.graph(*products)

    run = run_pass(g, "ConstantFolding", fold_constants, folds_constants=True)

    assert str(g) == expected("""
        graph g(%x: float32[4x8]):
          %w: float32[8x2] = DequantizeLinear(const %w_q, const %w_scale)  # w
          %y: float32[4x2] = MatMul(%x, %w)  # y
          %cf: float32[8x2] = DequantizeLinear(const %c, const %c_scale2, const %c_zero2)  # cf
          %cy: float32[4x2] = MatMul(%x, %cf)  # cy
          %df: float32[8x2] = DequantizeLinear(const %d, const %d_scale2, const %d_zero2)  # df
          %dy: float32[4x2] = MatMul(%x, %df)  # dy
          return %y, %cy, %dy
        """)
    assert run.stat.matches == 2
    ties = np.array([-32, -2, 0, 0, 2, 2, 4, 32] * 2).reshape(8, 2) + 3   # -1.5 -> -2, -0.5 -> 0, 2.5 -> 2, ...
    np.testing.assert_array_equal(g.values["c"].const, ties.astype(np.int8))
    np.testing.assert_array_equal(g.values["d"].const, np.clip(codes * 4 + 3, -128, 127).astype(np.int8))
    assert g.values["d"].const.min() == -128 and g.values["d"].const.max() == 127


def test_a_quantize_linear_with_a_computed_scale_does_not_fold():
    """The Q of a kept DQ(INT8 constant) folds only where its own scale is a constant too."""
    b = IRBuilder()
    x, scale = b.input("x", (4, 8)), b.input("scale", ())
    w = b.node("DequantizeLinear", [b.const("w_q", np.ones((8, 2)), np.int8), b.const("w_scale", 0.5)], "w", (8, 2),
               dtype=np.float32)
    copy = b.node("QuantizeLinear", [w, scale], "c", (8, 2), dtype=np.uint8)
    read = b.node("DequantizeLinear", [copy, scale], "cf", (8, 2), dtype=np.float32)
    g = b.graph(b.node("MatMul", [x, read], "z", (4, 2)))
    run_pass_unchanged(g, "ConstantFolding", fold_constants)
