"""A convolution's fused residual add accumulates into the residual's buffer only where that tensor dies at
the convolution: never into a caller's array, a tensor read again later, or one the layer also reads as input."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from tests.conftest import assert_close_to_ort, make_model, run_ort

C = 8


def _conv(name, src, dst, seed):
    w = np.random.default_rng(seed).standard_normal((C, C, 3, 3)).astype(np.float32) * 0.2
    return helper.make_node("Conv", [src, f"{name}_w"], [dst], name=name, pads=[1, 1, 1, 1]), \
        numpy_helper.from_array(w, f"{name}_w")


def _model(kind: str, hw: int):
    """a = conv_a(x); b = conv_b(a); y = relu(conv_c(b) + residual) (+ a again for "read_later")."""
    nodes, inits = [], []
    for name, src, dst, seed in [("conv_a", "x", "a", 0), ("conv_b", "a", "b", 1), ("conv_c", "b", "c", 2)]:
        node, w = _conv(name, src, dst, seed)
        nodes.append(node)
        inits.append(w)
    residual = {"dies_here": "a", "read_later": "a", "caller_input": "x", "also_input": "b"}[kind]
    nodes += [helper.make_node("Add", ["c", residual], ["s"], name="add"),
              helper.make_node("Relu", ["s"], ["r"], name="relu")]
    if kind == "read_later":
        nodes.append(helper.make_node("Mul", ["r", "a"], ["y"], name="mul"))
    else:
        nodes.append(helper.make_node("Identity", ["r"], ["y"], name="out"))
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, hw, hw])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C, hw, hw])], inits)


def context_input_buffer(x: np.ndarray) -> int:
    return x.__array_interface__["data"][0]


@pytest.mark.parametrize("kind, hw, donated", [
    ("dies_here", 6, True), ("read_later", 6, False), ("also_input", 6, False),
    ("caller_input", 6, True),    # the residual is the input's NHWC copy: kiln's own buffer
    ("caller_input", 1, False),   # 1x1 pixels: NCHW is NHWC, the "copy" is a view of the caller's array
])
def test_residual_buffer_is_reused_only_when_safe(kind, hw, donated):
    model = _model(kind, hw)
    engine = kiln.build(model, tactic_sources={"torch-onednn", "torch"}, autotune=False)
    fused = [l for l in engine.plan.layers if l.tactic_name == "onednn.conv2d_nhwc_prepacked" and len(l.args) > 3]
    assert len(fused) == 1, [l.name for l in engine.plan.layers]
    residual_name, out_name = fused[0].args[3].name, fused[0].outputs[0].name
    x = np.random.default_rng(3).standard_normal((1, C, hw, hw)).astype(np.float32)
    x_before = x.copy()
    buffers = {}
    context = engine.create_execution_context()
    for _ in range(2):   # a second run must not see the first one's buffers
        y = context.execute({"x": x}, observe=lambda n, t: buffers.setdefault(n, t.untyped_storage().data_ptr()))
        assert_close_to_ort(y["y"], run_ort(model, {"x": x_before})[0])
        np.testing.assert_array_equal(x, x_before)
        assert (buffers[out_name] == buffers.get(residual_name, context_input_buffer(x))) == donated
        buffers.clear()


@pytest.mark.parametrize("kind, donated", [("dies_here", True), ("read_later", False), ("caller_input", True)])
def test_whole_plan_timing_runs_the_plan_as_the_executor_does(kind, donated, monkeypatch):
    """The builder times candidate plans with regions.plan_runner (the plan interpreter): it must drop dead
    tensors and donate exactly where the executor does, or a plan is timed with more memory traffic than it has
    when it runs."""
    import torch

    import kiln.runtime.interpreter as interpreter_module
    from kiln.planning.regions import plan_runner

    model = _model(kind, 6)
    engine = kiln.build(model, tactic_sources={"torch-onednn", "torch"}, autotune=False)
    x = np.random.default_rng(3).standard_normal((1, C, 6, 6)).astype(np.float32)
    keep = {t.name for t in engine.plan.outputs}
    expected = engine.run({"x": x})["y"]
    checks = []   # the run-time ownership check is made only where the plan donates

    def counting(tensor, env, original=interpreter_module.sole_owner):
        checks.append(original(tensor, env))
        return checks[-1]
    monkeypatch.setattr(interpreter_module, "sole_owner", counting)
    run = plan_runner(list(engine.plan.layers), {}, engine.plan.weights, 17, {"x": torch.from_numpy(x)}, keep=keep)
    with torch.inference_mode():
        env = run()
    assert set(env) == {"x"} | keep   # everything else was dropped after its last reader
    np.testing.assert_allclose(env["y"].numpy(), expected, rtol=1e-6, atol=1e-6)
    assert checks == ([True] if donated else []), (kind, checks)
