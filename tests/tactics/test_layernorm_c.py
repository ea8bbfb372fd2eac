"""kiln's C LayerNorm (kiln.tactics.layernorm_c): LayerNormalization over one or several trailing axes and the
fused residual sum (SkipLayerNormalization) match onnxruntime inside built engines, rows vary on dynamic
leading axes, and layers it cannot run are declined."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln.tactics import codegen
from kiln.tactics.base import LayerView
from kiln.tactics.layernorm_c import LAYERNORM_TACTIC, LayerNormTactic
from tests.conftest import assert_close_to_ort, init, make_model, rand, run_ort

pytestmark = pytest.mark.skipif(not codegen.available(), reason="no C compiler")


def layernorm_model(shape, axis: int, bias: bool, residual: bool):
    """[Add(x, r) ->] LayerNormalization(axis) -> Mul by 2 (a consumer, so the LayerNorm is not an output)."""
    norm = shape[axis:]
    nodes = [helper.make_node("Add", ["x", "r"], ["s"])] if residual else []
    nodes += [helper.make_node("LayerNormalization", ["s" if residual else "x", "g"] + (["b"] if bias else []),
                               ["n"], axis=axis, epsilon=1e-6),
              helper.make_node("Mul", ["n", "two"], ["y"])]
    inputs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(shape)) for k in (["x", "r"] if residual else ["x"])]
    inits = [init("g", rand(norm, 1) + 1), init("two", np.float32(2))] + ([init("b", rand(norm, 2))] if bias else [])
    return make_model(nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))], inits)


@pytest.mark.parametrize("shape, axis, bias, residual", [
    ((1, 128, 768), -1, True, True),    # BERT's residual + LayerNorm
    ((2, 7, 96), -1, True, False),
    ((3, 5, 6, 4), -2, False, False),   # two normalized axes, no bias
    ((4, 33), 1, True, True),           # an odd row length
])
def test_engine_layernorm_matches_onnxruntime(shape, axis, bias, residual):
    model = layernorm_model(shape, axis, bias, residual)
    engine = kiln.build(model, tactic_sources=frozenset({"kiln"}), autotune=False)
    norms = [l for l in engine.plan.layers if l.op_type in ("LayerNormalization", "SkipLayerNormalization")]
    assert [l.op_type for l in norms] == ["SkipLayerNormalization" if residual else "LayerNormalization"]
    assert norms[0].tactic_name == LAYERNORM_TACTIC
    feeds = {"x": rand(shape, 3) * 4 + 1}
    if residual:
        feeds["r"] = rand(shape, 4)
    assert_close_to_ort(engine.run(feeds)["y"], run_ort(model, feeds)[0], rel=1e-5)


def view(op="LayerNormalization", shape=(2, 8, 16), dynamic=((0, 1),), outputs=("float32",), dtype="float32",
         scale=None, **attrs):
    domain = "kiln" if op == "SkipLayerNormalization" else ""
    acts = 2 if op == "SkipLayerNormalization" else 1
    scale = torch.ones(shape[-1]) if scale is None else scale
    consts = {acts: scale, acts + 1: torch.zeros(shape[-1])}
    return LayerView(op, domain, attrs, (shape,) * acts + (tuple(scale.shape), (shape[-1],)),
                     (dtype,) * acts + ("float32", "float32"), consts, outputs, input_dynamic=dynamic * acts)


def test_rows_follow_dynamic_leading_axes():
    g = torch.randn(16)
    layer = view("SkipLayerNormalization", scale=g, epsilon=1e-5)
    kernel = LayerNormTactic().prepare(layer)
    for shape in [(2, 8, 16), (1, 3, 16), (5, 1, 16)]:
        x, r = torch.randn(shape), torch.randn(shape)
        want = torch.nn.functional.layer_norm(x + r, (16,), g, torch.zeros(16), 1e-5)
        torch.testing.assert_close(kernel([x, r, None, None])[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", [
    view(stash_type=11),                                    # statistics in double: torch's kernel
    view(dynamic=((0, 2),)),                                # the normalized axis varies
    view(outputs=("float32", "float32", "float32")),        # Mean / InvStdDev outputs wanted
    view(dtype="float16"),
    view(scale=torch.ones(1)),                              # a broadcast scale
    view(axis=0),                                           # normalizes the (dynamic) batch axis
], ids=["stash", "dynamic-axis", "three-outputs", "fp16", "broadcast-scale", "axis0"])
def test_declines_what_it_cannot_run(layer):
    assert not LayerNormTactic().supports(layer)
    assert LayerNormTactic().supports(view())
