"""QMatMulShuffleFusion on IR graphs: the INT8 Shuffles around a product of two INT8 activations (a Q/DQ
attention's head split and merge) become its a_steps, b_steps and out_steps; shared or weight-side
shuffles stay."""
from __future__ import annotations

import numpy as np

from kiln.passes.qmatmul_steps import fuse_product_shuffles
from tests.passes.ir_builder import IRBuilder, expected, run_pass, run_pass_unchanged

NAME = "QMatMulShuffleFusion"
QUANT = {"x_scale": 0.1, "x_zero_point": 128, "x_dtype": "uint8", "w_scale": [0.1], "w_zero_point": [128]}
SPLIT = [{"reshape": [1, 6, 2, 4]}, {"transpose": [0, 2, 1, 3]}]


def test_head_split_and_merge_join_the_scores_product():
    b = IRBuilder()
    q, k = b.input("q", (1, 6, 8), np.uint8), b.input("k", (1, 6, 8), np.uint8)
    heads = b.shuffle(q, "heads", (1, 2, 6, 4), SPLIT)
    keys = b.shuffle(k, "keys", (1, 2, 4, 6), [{"reshape": [1, 6, 2, 4]}, {"transpose": [0, 2, 3, 1]}])
    scores = b.node("QMatMul", [heads, keys], "scores", (1, 2, 6, 6), domain="kiln", quant=QUANT)
    g = b.graph(b.shuffle(scores, "merged", (1, 6, 12), [{"transpose": [0, 2, 1, 3]}, {"reshape": [1, 6, 12]}]))

    run = run_pass(g, NAME, fuse_product_shuffles)

    (layer,) = g.nodes
    assert (layer.op_type, layer.name, [v.name for v in layer.inputs]) == \
        ("QMatMul", "heads + keys + scores + merged", ["q", "k"])
    assert layer.attrs == {"quant": QUANT, "a_steps": SPLIT,
                           "b_steps": [{"reshape": [1, 6, 2, 4]}, {"transpose": [0, 2, 3, 1]}],
                           "out_steps": [{"transpose": [0, 2, 1, 3]}, {"reshape": [1, 6, 12]}]}
    assert layer.origin == ("heads", "keys", "scores", "merged") and g.outputs[0].shape == (1, 6, 12)
    assert (run.stat.matches, run.stat.layers_before, run.stat.layers_after) == (3, 4, 1)


def test_dynamic_head_split_and_merge_join_the_product_too():
    """The steps' targets copy (0) or infer (-1) the dynamic sequence; the kernel applies them per call."""
    b = IRBuilder()
    d = b.input("d", (1, 6, 8), np.uint8, dyn_dims=(1,))
    split = [{"reshape": [1, -1, 2, 4]}, {"transpose": [0, 2, 1, 3]}]
    dynamic = b.shuffle(d, "dynamic", (1, 2, 6, 4), split, dyn_dims=(2,))
    per_key = b.node("QMatMul", [dynamic, b.input("v", (1, 2, 4, 6), np.uint8)], "per_key", (1, 2, 6, 6),
                     dyn_dims=(2,), domain="kiln", quant=QUANT)
    merge = [{"transpose": [0, 2, 1, 3]}, {"reshape": [1, -1, 12]}]
    g = b.graph(b.shuffle(per_key, "merged", (1, 6, 12), merge, dyn_dims=(1,)))

    run = run_pass(g, NAME, fuse_product_shuffles)

    (layer,) = g.nodes
    assert (layer.name, [v.name for v in layer.inputs]) == ("dynamic + per_key + merged", ["d", "v"])
    assert layer.attrs == {"quant": QUANT, "a_steps": split, "out_steps": merge}
    assert (g.outputs[0].shape, g.outputs[0].dyn_dims) == ((1, 6, 12), (1,))
    assert (run.stat.matches, run.stat.layers_before, run.stat.layers_after) == (2, 3, 1)


def test_shared_and_weight_side_shuffles_stay():
    b = IRBuilder()
    x = b.input("x", (1, 6, 8), np.uint8)
    shared = b.shuffle(x, "shared", (1, 2, 6, 4), SPLIT)
    twice = b.node("QMatMul", [shared, shared], "twice", (1, 2, 6, 6), domain="kiln", quant=QUANT)
    rows = b.shuffle(x, "rows", (6, 8), [{"reshape": [6, 8]}])
    by_weights = b.node("QMatMul", [rows, b.const("w", np.ones((8, 4)), np.int8)], "by_weights", (6, 4),
                        domain="kiln", quant=QUANT)
    heads = b.shuffle(x, "heads", (1, 2, 6, 4), SPLIT)
    also = b.node("Identity", [heads], "also", (1, 2, 6, 4), dtype=np.uint8)   # a live second reader
    read = b.node("QMatMul", [heads, b.input("k", (1, 2, 4, 6), np.uint8)], "read", (1, 2, 6, 6), domain="kiln",
                  quant=QUANT)
    g = b.graph(twice, by_weights, also, read)

    run = run_pass_unchanged(g, NAME, fuse_product_shuffles)

    assert run.stat.matches == 0
