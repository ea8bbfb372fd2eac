"""RotaryFusion on IR graphs: HF's rotate_half embedding (two Slices or one Split, Neg, Concat, Mul, Mul, Add)
becomes one kiln.RotaryEmbedding; and the reasons when it does not."""
from __future__ import annotations

import numpy as np

from kiln.passes.rotary import fuse_rotary
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

X = (1, 2, 5, 8)   # [B, H, S, D]
TABLE = (1, 1, 5, 8)


def ints(b: IRBuilder, name: str, values) -> object:
    return b.const(name, values, np.int64)


def rotary(b: IRBuilder, *, split=False, swap=False, table=TABLE, first_end=4, reader=False):
    """q * cos + rotate_half(q) * sin on q [1, 2, 5, 8]; `swap` writes each Mul and the Add the other way round;
    `reader`: the second half is also a graph output."""
    q = b.input("q", X)
    cos, sin = b.input("cos", table), b.input("sin", table)
    if split:
        x1, x2 = b.multi("Split", [q, ints(b, "sizes", [4, 4])], [("x1", X[:3] + (4,)), ("x2", X[:3] + (4,))],
                         name="split", axis=-1)
    else:
        x1 = b.node("Slice", [q, ints(b, "s0", [0]), ints(b, "e0", [first_end]), ints(b, "a0", [-1])], "x1",
                    X[:3] + (first_end,), name="slice")
        x2 = b.node("Slice", [q, ints(b, "s1", [4]), ints(b, "e1", [np.iinfo(np.int64).max]), ints(b, "a1", [3])],
                    "x2", X[:3] + (4,), name="slice_1")
    neg = b.node("Neg", [x2], "neg", X[:3] + (4,))
    rot = b.node("Concat", [neg, x1], "rot", X, axis=-1)
    qc = b.node("Mul", [cos, q] if swap else [q, cos], "qc", X)
    rs = b.node("Mul", [sin, rot] if swap else [rot, sin], "rs", X)
    out = b.node("Add", [rs, qc] if swap else [qc, rs], "out", X)
    return (out, x2) if reader else (out,)


def test_the_slice_form_becomes_one_layer():
    b = IRBuilder()
    g = b.graph(*rotary(b))
    run = run_pass(g, "RotaryFusion", fuse_rotary)
    assert str(g) == expected("""
        graph g(%q: float32[1x2x5x8], %cos: float32[1x1x5x8], %sin: float32[1x1x5x8]):
          %out: float32[1x2x5x8] = kiln.RotaryEmbedding(%q, %cos, %sin)  # slice + slice_1 + neg + rot + qc + rs + out
          return %out
        """)
    assert (run.stat.matches, run.not_fusing) == (6, [])   # one "Fusing" line per absorbed node


def test_the_split_form_with_operands_either_way_round():
    b = IRBuilder()
    g = b.graph(*rotary(b, split=True, swap=True, table=(5, 8)))
    run_pass(g, "RotaryFusion", fuse_rotary)
    assert [(n.op_type, [v.name for v in n.inputs]) for n in g.nodes] == [("RotaryEmbedding", ["q", "cos", "sin"])]
    assert g.nodes[0].origin == ("split", "neg", "rot", "qc", "rs", "out")


def test_what_is_not_rotate_half_is_left_with_the_reason():
    b = IRBuilder()
    g = b.graph(*rotary(b, reader=True))
    run = run_pass_unchanged(g, "RotaryFusion", fuse_rotary)
    assert run.not_fusing == ["RotaryFusion: Not fusing rot with RotaryEmbedding: a half of x is read outside it"]

    b = IRBuilder()
    g = b.graph(*rotary(b, table=(1, 1, 5, 1)))   # a table one wide: not cos/sin of the rotation
    run = run_pass_unchanged(g, "RotaryFusion", fuse_rotary)
    assert run.not_fusing == ["RotaryFusion: Not fusing rot with RotaryEmbedding: cos and sin do not broadcast to x, "
                              "D wide"]

    b = IRBuilder()
    g = b.graph(*rotary(b, first_end=3))   # halves that are not halves: an ordinary Concat, nothing said
    run = run_pass_unchanged(g, "RotaryFusion", fuse_rotary)
    assert run.not_fusing == []
