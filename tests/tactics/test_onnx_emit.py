"""kiln.tactics.onnx_emit: layers and regions written back as ONNX for an external library keep the model's own
opset. Ops kiln's passes create that are newer than it (Gelu: 20, LayerNormalization: 17) are written in the
older form, so the region's original nodes (ReduceMean's `axes` attribute before opset 18) stay valid."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, checker, helper

import kiln
from kiln.tactics.onnx_emit import Emitter
from tests.conftest import assert_close_to_ort, force_plan, init, make_model, rand, run_ort


def encoder_block(opset: int):
    """MatMul -> erf GELU -> the decomposed LayerNorm exporters write -> ReduceMean(axes attribute) over tokens."""
    s2 = np.float32(np.sqrt(2.0))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Div", ["m", "s2"], ["md"]), helper.make_node("Erf", ["md"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["m", "e1"], ["g0"]),
             helper.make_node("Mul", ["g0", "half"], ["g"]),
             helper.make_node("ReduceMean", ["g"], ["mu"], axes=[-1]), helper.make_node("Sub", ["g", "mu"], ["d"]),
             helper.make_node("Pow", ["d", "two"], ["d2"]), helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
             helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
             helper.make_node("Div", ["d", "sd"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["ng"]),
             helper.make_node("Add", ["ng", "beta"], ["ln"]),
             helper.make_node("ReduceMean", ["ln"], ["y"], axes=[1], keepdims=0)]
    inits = [init("w", rand((16, 32), 1)), init("s2", s2), init("one", np.float32(1)), init("half", np.float32(0.5)),
             init("two", np.float32(2)), init("eps", np.float32(1e-5)), init("gamma", rand((32,), 2) + 1),
             init("beta", rand((32,), 3))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 16])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])], inits, opset=opset)


@pytest.mark.parametrize("opset", [13, 17])
def test_region_with_fused_gelu_and_layernorm_runs_at_the_models_opset(opset, monkeypatch):
    model = encoder_block(opset)
    force_plan(monkeypatch, "onnxruntime")
    engine = kiln.build(model, tactic_sources={"onnxruntime"}, avg_timing=1, min_timing=1)
    (region,) = [layer for layer in engine.plan.layers if layer.inner]
    inner = {layer.op_type for layer in region.inner}
    assert "LayerNormalization" in inner and any("Gelu" in str(l.attrs.get("activation")) or l.op_type == "Gelu"
                                                   for l in region.inner), inner
    feeds = {"x": rand((2, 8, 16), 4)}
    assert_close_to_ort(engine.run(feeds)["y"], run_ort(model, feeds)[0])


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("opset", [13, 20])
def test_emitted_gelu_and_layernorm_match_torch(opset, approximate):
    e = Emitter(opset)
    x = e.add_input("x", (3, 4, 8), "float32")
    gamma, beta = rand((8,), 1) + 1, rand((8,), 2)
    y = e.layer_norm([e.node("Gelu", [x], {"approximate": approximate}), e.add_weight("gamma", gamma),
                      e.add_weight("beta", beta)], {"axis": 2, "epsilon": 1e-5}, rank=3)
    e.rename_result(y, "y")
    e.add_output("y", "float32")
    model = e.model()
    context = checker.C.CheckerContext()
    context.ir_version, context.opset_imports = model.ir_version, {"": opset}
    for node in model.graph.node:   # every node valid in the model's opset (attributes included)
        checker.check_node(node, context)
    ops = {n.op_type for n in model.graph.node}
    assert ("Gelu" in ops) == (opset >= 20) and ("LayerNormalization" in ops) == (opset >= 17)
    xs = rand((3, 4, 8), 3) * 3
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": xs})[0]
    want = torch.nn.functional.layer_norm(torch.nn.functional.gelu(torch.from_numpy(xs), approximate=approximate),
                                          (8,), torch.from_numpy(gamma), torch.from_numpy(beta), 1e-5)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


def test_emitted_int8_conv_with_fused_residual_matches_its_reference():
    """A QConv that absorbed an INT8 residual sum is written back as DQ(x), DQ(W), Conv, + DQ(r), ReLU, Q: the
    form an OpenVINO or onnxruntime region compiles (a raw INT8 residual added to a float would not type-check)."""
    from kiln.tactics.onnx_emit import emit
    from kiln.tactics.reference import ReferenceTactic
    from tests.tactics.test_onednn_int8 import conv_view, quant

    g = torch.Generator().manual_seed(6)
    w = torch.randint(-127, 128, (8, 8, 3, 3), generator=g, dtype=torch.int8)
    x = torch.randint(0, 256, (1, 8, 6, 6), generator=g, dtype=torch.uint8)
    r = torch.randint(0, 256, (1, 8, 6, 6), generator=g, dtype=torch.uint8)
    view = conv_view(tuple(x.shape), w, q=quant(w_scale=[0.003] * 8, r=(0.03, 7)), act="Relu",
                     residual=tuple(r.shape))
    model, external = emit(view, 17)
    assert not external
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x0": x.numpy(), "x3": r.numpy()})[0]
    want = ReferenceTactic().prepare(view)([x, None, None, r])[0].numpy()
    assert got.dtype == np.uint8 and np.abs(got.astype(int) - want.astype(int)).max() <= 1
