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


def rotary(b: IRBuilder, *, split=False, swap=False, table=TABLE, first_end=4, reader=False, table_dyn=(),
           sizes=None, bounds=(4, 4), other_x=False, outputs=()):
    """q * cos + rotate_half(q) * sin on q [1, 2, 5, 8]; `swap` writes each Mul and the Add the other way round;
    `reader`: the second half is also a graph output; `table_dyn`: the tables' dynamic axes; `sizes`: the Split's
    sizes (a constant [4, 4] unless given); `bounds`: the second Slice's start and the first's end; `other_x`: the
    second half sliced from another tensor; `outputs`: names of inner values also returned."""
    q = b.input("q", X)
    k = b.input("k", X) if other_x else q
    cos, sin = b.input("cos", table, dyn_dims=table_dyn), b.input("sin", table, dyn_dims=table_dyn)
    if split:
        sizes = sizes or ints(b, "sizes", [4, 4])
        widths = [int(w) for w in sizes.const] if sizes.is_const else [4, 4]
        x1, x2 = b.multi("Split", [q, sizes], [("x1", X[:3] + (widths[0],)), ("x2", X[:3] + (widths[1],))],
                         name="split", axis=-1)
    else:
        x1 = b.node("Slice", [q, ints(b, "s0", [0]), ints(b, "e0", [bounds[1] if first_end == 4 else first_end]),
                              ints(b, "a0", [-1])], "x1", X[:3] + (first_end,), name="slice")
        x2 = b.node("Slice", [k, ints(b, "s1", [bounds[0]]), ints(b, "e1", [np.iinfo(np.int64).max]),
                              ints(b, "a1", [3])], "x2", X[:3] + (4,), name="slice_1")
    neg = b.node("Neg", [x2], "neg", x2.shape)
    rot = b.node("Concat", [neg, x1], "rot", X, axis=-1)
    qc = b.node("Mul", [cos, q] if swap else [q, cos], "qc", X)
    rs = b.node("Mul", [sin, rot] if swap else [rot, sin], "rs", X)
    out = b.node("Add", [rs, qc] if swap else [qc, rs], "out", X)
    inner = {"neg": neg, "qc": qc}
    return (out, x2) if reader else (out, *(inner[name] for name in outputs))


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


def test_shapes_that_agree_only_at_the_opt_point_and_computed_sizes_are_left():
    """Tables with a dynamic batch (1 at the opt point) would broadcast x [1, ...] to [B, ...]: not fused. A Split
    whose sizes are computed at run time is not taken for two halves."""
    b = IRBuilder()
    g = b.graph(*rotary(b, table_dyn=(0,)))
    run = run_pass_unchanged(g, "RotaryFusion", fuse_rotary)
    assert run.not_fusing == ["RotaryFusion: Not fusing rot with RotaryEmbedding: cos and sin do not broadcast to x, "
                              "D wide"]

    b = IRBuilder()
    g = b.graph(*rotary(b, split=True, sizes=b.input("sizes", (2,), dtype=np.int64)))
    assert run_pass_unchanged(g, "RotaryFusion", fuse_rotary).not_fusing == []


def test_negative_slice_bounds_are_the_halves():
    b = IRBuilder()
    g = b.graph(*rotary(b, bounds=(-4, -4)))   # x[..., :-4] and x[..., -4:]
    run_pass(g, "RotaryFusion", fuse_rotary)
    assert [n.op_type for n in g.nodes] == ["RotaryEmbedding"]


def test_inner_values_read_elsewhere_are_not_fused():
    b = IRBuilder()
    g = b.graph(*rotary(b, outputs=("neg",)))
    assert run_pass_unchanged(g, "RotaryFusion", fuse_rotary).not_fusing == [
        "RotaryFusion: Not fusing rot with RotaryEmbedding: rotate_half(x) is not multiplied by sin alone"]
    b = IRBuilder()
    g = b.graph(*rotary(b, outputs=("qc",)))
    assert run_pass_unchanged(g, "RotaryFusion", fuse_rotary).not_fusing == [
        "RotaryFusion: Not fusing rot with RotaryEmbedding: rotate_half(x) * sin is not added to x * cos computed "
        "for it alone"]


def test_unequal_halves_and_halves_of_two_tensors_are_no_rotation():
    b = IRBuilder()
    g = b.graph(*rotary(b, split=True, sizes=ints(b, "sizes", [3, 5])))
    assert run_pass_unchanged(g, "RotaryFusion", fuse_rotary).not_fusing == []
    b = IRBuilder()
    g = b.graph(*rotary(b, other_x=True))
    assert run_pass_unchanged(g, "RotaryFusion", fuse_rotary).not_fusing == []
