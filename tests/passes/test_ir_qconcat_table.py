"""QConcatTableFusion on IR graphs: the requantizations before an INT8 Concat (PointWise chains reading one INT8
tensor and one-value constants, read only by the Concat) join it as tables on its inputs; others stay."""
from __future__ import annotations

import numpy as np
import torch

from kiln.ops import lookup
from kiln.passes.qconcat_table import fuse_concat_tables
from tests.passes.ir_builder import IRBuilder, run_pass, run_pass_unchanged
from tests.passes.test_ir_qproduct_table import chain

NAME = "QConcatTableFusion"
SHAPE = (2, 4, 4)
# test_ir_qproduct_table's chain: DQ at (0.5, 10), Neg, Q at (0.25, 0) to int8
WANT = np.clip(np.rint(-(np.arange(256) - 10) * 0.5 / 0.25), -128, 127).astype(np.int8).view(np.uint8).tolist()


def test_requantizations_before_an_int8_concat_become_its_input_tables():
    b = IRBuilder()
    x1, x2, x3 = b.input("x1", SHAPE, np.uint8), b.input("x2", SHAPE, np.int8), b.input("x3", SHAPE, np.int8)
    cat = b.node("Concat", [x2, x3, chain(b, x1, "r1", "one")], "cat", (2, 12, 4), dtype=np.int8, name="cat", axis=1)
    g = b.graph(cat)

    run = run_pass(g, NAME, fuse_concat_tables, folds_constants=True)

    (layer,) = g.nodes
    assert (layer.op_type, layer.domain, layer.name) == ("QConcat", "kiln", "PWN(one) + cat")
    assert [v.name for v in layer.inputs] == ["x2", "x3", "x1"] and layer.outputs[0].name == "cat"
    assert layer.attrs == {"axis": 1, "in_tables": [None, None, {"bytes": WANT, "dtype": "int8"}]}
    assert layer.origin == ("PWN(one)", "cat")
    assert (run.stat.matches, run.stat.layers_before, run.stat.layers_after) == (1, 2, 1)

    xs = [torch.randint(-128, 128, SHAPE, dtype=torch.int8), torch.randint(-128, 128, SHAPE, dtype=torch.int8),
          torch.randint(0, 256, SHAPE, dtype=torch.uint8)]
    mapped = torch.tensor(WANT, dtype=torch.uint8)[xs[2].long()].view(torch.int8)
    got = lookup("QConcat", "kiln").impl(layer.attrs, xs)[0]   # the reference op: the tables, then the Concat
    assert torch.equal(got, torch.cat([xs[0], xs[1], mapped], 1))


def test_chains_the_concat_cannot_take_stay():
    """A chain another layer reads too, one reading two tensors, one that broadcasts, one of another type than the
    Concat's, and a Concat of floats keep their layers."""
    b = IRBuilder()
    x1, x2, f = b.input("x1", SHAPE, np.uint8), b.input("x2", SHAPE, np.uint8), b.input("f", SHAPE)
    shared = chain(b, x1, "shared", "shared")
    also = b.node("Relu", [shared], "also", SHAPE, dtype=np.int8, name="also")
    two = b.node("PointWise", [x1, x2], "two", SHAPE, domain="kiln", dtype=np.int8, name="PWN(two)",
                 program=[{"op": "Add", "attrs": {}, "args": ["x0", "x1"]}])
    wide = chain(b, b.input("row", (2, 1, 4), np.uint8), "wide", "wide")       # [2, 1, 4] -> [2, 4, 4]
    unsigned = b.node("PointWise", [x2], "unsigned", SHAPE, domain="kiln", dtype=np.uint8, name="PWN(unsigned)",
                      program=[{"op": "Neg", "attrs": {}, "args": ["x0"]}])
    cat = b.node("Concat", [shared, two, wide, unsigned], "cat", (2, 16, 4), dtype=np.int8, name="cat", axis=1)
    floats = b.node("Concat", [f, f], "floats", (2, 8, 4), name="floats", axis=1)
    g = b.graph(cat, also, floats)

    run = run_pass_unchanged(g, NAME, fuse_concat_tables)

    assert run.not_fusing == [
        f"{NAME}: Not fusing PWN(shared) with cat: PWN(shared)'s output is read by other layers too",
        f"{NAME}: Not fusing PWN(two) with cat: PWN(two) reads more than one INT8 tensor and one-value constants",
        f"{NAME}: Not fusing PWN(wide) with cat: PWN(wide) broadcasts its input or its type is not the Concat's",
        f"{NAME}: Not fusing PWN(unsigned) with cat: PWN(unsigned) broadcasts its input or its type is not the "
        "Concat's"]
