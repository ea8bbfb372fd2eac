"""Runs of layers on kiln's oneDNN primitives execute as one C call (kiln.runtime.chains): the same bytes as the
layers run one by one, against onnxruntime too; a residual summed in place shares a dying buffer inside the chain,
takes a dying one from before it only when no one else holds it, and is copied otherwise; tensors read after the
chain are new per inference; a dynamic engine gets buffers per input shape; a layer whose layout differs ends the
chain; contexts on two threads do not share buffers; a failing call names its layer."""
from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.errors import Error
from kiln.runtime.chains import FIELDS, Chain
from kiln.runtime.interpreter import _run_step
from kiln.tactics import onednn_prim
from kiln.tactics.onednn_conv import bf16_available
from tests.conftest import assert_close_to_ort, init, make_model, on_threads, rand, run_ort

pytestmark = pytest.mark.skipif(not onednn_prim.available(), reason="oneDNN's C API is not installed here")
C = 8


def conv(name, src, dst, seed, c_in=C):
    return helper.make_node("Conv", [src, f"{name}_w"], [dst], name=name, pads=[1, 1, 1, 1]), \
        init(f"{name}_w", rand((C, c_in, 3, 3), seed) * 0.2)


def model(residual: str, hw=6, tail="Identity", dims=None):
    """a = conv_a(pre); b = conv_b(a); y = tail(relu(conv_c(b) + residual)), `pre` = relu(x) ("r" in the
    table below); a tail "Mul" reads `a` again after the convolutions."""
    nodes, inits = [helper.make_node("Relu", ["x"], ["r"], name="pre")], []
    for name, src, dst, seed in [("conv_a", "r", "a", 0), ("conv_b", "a", "b", 1), ("conv_c", "b", "c", 2)]:
        node, w = conv(name, src, dst, seed)
        nodes.append(node)
        inits.append(w)
    nodes += [helper.make_node("Add", ["c", residual], ["s"], name="add"),
              helper.make_node("Relu", ["s"], ["t"], name="relu")]
    nodes.append(helper.make_node("Mul", ["t", "a"], ["y"], name="mul") if tail == "Mul" else
                 helper.make_node("Identity", ["t"], ["y"], name="out"))
    dims = dims or [1, C, hw, hw]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)], inits)


def chains(context) -> list[Chain]:
    return [item for item in context.interpreter.program if isinstance(item, Chain)]


def run_both_ways(engine, feeds):
    """(chained outputs, layer-by-layer outputs): an observer runs every layer on its own kernel."""
    context = engine.create_execution_context()
    chained = context.execute(feeds)
    return chained, context.execute(feeds, observe=lambda name, tensor: None), context


@pytest.mark.parametrize("residual, tail, aliased, copied", [
    ("a", "Identity", True, False),   # a dies at conv_c: its buffer takes the output
    ("a", "Mul", False, True),        # a is read again after the chain: copied into the output
    ("b", "Identity", False, True),   # b is also conv_c's input: summing into it would change what conv_c reads
    ("r", "Identity", False, False),  # r (made channel-major before the chain) dies at conv_c: donated
])
def test_a_chain_gives_the_bytes_of_its_layers_run_one_by_one(residual, tail, aliased, copied):
    onnx_model = model(residual, tail=tail)
    engine = kiln.build(onnx_model, tactic_sources="onednn,kiln", autotune=False)
    x = rand((1, C, 6, 6), 3)
    x_before = x.copy()
    chained, one_by_one, context = run_both_ways(engine, {"x": x})
    [chain] = chains(context)
    assert [c.layer for c in chain.calls] == [l.name for l in engine.plan.layers[chain.start:chain.stop]]
    assert len(chain.calls) == 3, [(l.name, l.tactic_name) for l in engine.plan.layers]
    fused = chain.calls[2]
    assert (fused.residual == residual) == (residual != "r") and (fused.y in chain.alias) == aliased
    assert chain.donated == ({2} if residual == "r" else set())
    [run] = chain.runs.values()
    assert (run.calls[FIELDS * 2 + 4] > 0) == copied
    for _ in range(2):   # again, on the buffers the first inference made
        np.testing.assert_array_equal(chained["y"], one_by_one["y"])
        assert_close_to_ort(chained["y"], run_ort(onnx_model, {"x": x_before})[0])
        np.testing.assert_array_equal(x, x_before)
        chained = context.execute({"x": x})


def test_a_residual_from_before_the_chain_is_donated_only_when_no_one_else_holds_it():
    engine = kiln.build(model("r"), tactic_sources="onednn,kiln", autotune=False)
    context = engine.create_execution_context()
    [chain] = chains(context)
    assert chain.donated == {2}
    x = rand((1, C, 6, 6), 4)
    expected = run_ort(model("r"), {"x": x})[0]
    assert_close_to_ort(context.execute({"x": x})["y"], expected)
    [run] = chain.runs.values()
    assert run.calls[FIELDS * 2 + 4] == 0   # the residual's buffer was the chain's alone: taken, not copied
    env = context.check_inputs({"x": x})
    for step in context.interpreter.steps[:chain.start]:
        _run_step(step, env, None, None)
    residual = chain.calls[2].residual
    env["held elsewhere"] = env[residual][:]   # a second tensor on the residual's buffer
    held = env[residual].clone()
    chain.run(env)
    assert run.calls[FIELDS * 2 + 4] > 0   # copied: the other holder still sees the residual
    np.testing.assert_array_equal(env["held elsewhere"].numpy(), held.numpy())


@pytest.mark.parametrize("hw, copied", [
    (5, False),   # the residual is the input's channel-major copy: kiln's own buffer, donated
    (1, True),    # 1x1 pixels: channel-major is NCHW, the "copy" is a view of the caller's array
])
def test_the_callers_input_is_never_written_by_a_chain(hw, copied):
    nodes = []
    inits = []
    for name, src, dst, seed in [("conv_a", "x", "a", 0), ("conv_b", "a", "b", 1)]:
        node, w = conv(name, src, dst, seed)
        nodes.append(node)
        inits.append(w)
    nodes.append(helper.make_node("Add", ["b", "x"], ["y"], name="add"))
    dims = [1, C, hw, hw]
    onnx_model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)], inits)
    engine = kiln.build(onnx_model, tactic_sources="onednn,kiln", autotune=False)
    x = rand(dims, 5)
    x_before = x.copy()
    chained, one_by_one, context = run_both_ways(engine, {"x": x})
    [chain] = chains(context)
    assert chain.donated == {1}
    [run] = chain.runs.values()
    assert (run.calls[FIELDS + 4] > 0) == copied
    np.testing.assert_array_equal(chained["y"], one_by_one["y"])
    assert_close_to_ort(chained["y"], run_ort(onnx_model, {"x": x_before})[0])
    np.testing.assert_array_equal(x, x_before)


def test_a_dynamic_engine_gets_buffers_per_input_shape():
    onnx_model = model("a", dims=["n", C, "h", "w"])
    engine = kiln.build(onnx_model, tactic_sources="onednn,kiln", autotune=False,
                        min_shapes=f"x:1x{C}x4x4", opt_shapes=f"x:1x{C}x6x6", max_shapes=f"x:2x{C}x9x9")
    context = engine.create_execution_context()
    for shape in [(1, C, 6, 6), (2, C, 9, 9), (1, C, 4, 7), (1, C, 6, 6)]:
        x = rand(shape, sum(shape))
        assert_close_to_ort(context.execute({"x": x})["y"], run_ort(onnx_model, {"x": x})[0])
    [chain] = chains(context)
    assert len(chain.runs) == 3


def test_a_product_reading_rows_ends_a_chain_of_channel_major_convolutions():
    """A MatMul by a constant reads the convolution's output as rows of its last axis (NCHW order), the
    convolution writes it channel-major: the product is not chained to it."""
    nodes, inits = [], []
    for name, src, dst, seed in [("conv_a", "x", "a", 0), ("conv_b", "a", "b", 1)]:
        node, w = conv(name, src, dst, seed)
        nodes.append(node)
        inits.append(w)
    nodes.append(helper.make_node("MatMul", ["b", "m"], ["y"], name="matmul"))
    inits.append(init("m", rand((6, 4), 9)))
    onnx_model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, 6, 6])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C, 6, 4])], inits)
    engine = kiln.build(onnx_model, tactic_sources="onednn,kiln", autotune=False)
    assert engine.plan.layers[-1].tactic_name == "onednn.linear_primitive"
    x = rand((1, C, 6, 6), 6)
    chained, one_by_one, context = run_both_ways(engine, {"x": x})
    assert [[c.layer for c in chain.calls] for chain in chains(context)] == [["conv_a", "conv_b"]]
    np.testing.assert_array_equal(chained["y"], one_by_one["y"])
    assert_close_to_ort(chained["y"], run_ort(onnx_model, {"x": x})[0])


def test_contexts_on_two_threads_have_buffers_of_their_own():
    onnx_model = model("a")
    engine = kiln.build(onnx_model, tactic_sources="onednn,kiln", autotune=False)
    inputs = [rand((1, C, 6, 6), seed) for seed in range(2)]
    expected = [run_ort(onnx_model, {"x": x})[0] for x in inputs]
    results, errors = [[], []], []

    def serve(k):
        context = engine.create_execution_context()
        try:
            for _ in range(50):
                results[k].append(context.execute({"x": inputs[k]})["y"])
        except Exception as exc:   # reported below: an assertion in a thread would not fail the test
            errors.append(exc)

    on_threads(serve, 2)
    assert not errors
    for k in range(2):
        assert len(results[k]) == 50
        for y in results[k]:
            assert_close_to_ort(y, expected[k])


def test_a_failing_call_names_its_layer():
    engine = kiln.build(model("a"), tactic_sources="onednn,kiln", autotune=False)
    context = engine.create_execution_context()
    x = rand((1, C, 6, 6), 7)
    context.execute({"x": x})
    [chain] = chains(context)
    [run] = chain.runs.values()

    def fails_at_second(n, handles, calls, slots, failed):
        ctypes.c_int64.from_address(failed).value = 1
        return 5

    run.run_c = fails_at_second
    with pytest.raises(Error, match=r"layer 'conv_b' \(Conv\) failed: .*status 5"):
        context.execute({"x": x})


def qdq_silu_convs(layers=3):
    """x -> Q/DQ -> [Conv (s8 weights) -> Q/DQ -> SiLU -> Q/DQ] x layers: each SiLU becomes its convolution's
    output table (kiln.passes.qproduct_table)."""
    def qdq(src, dst, scale, zero_point, tag):
        inits.extend([init(f"{tag}_s", np.float32(scale)), init(f"{tag}_zp", np.uint8(zero_point))])
        nodes.extend([helper.make_node("QuantizeLinear", [src, f"{tag}_s", f"{tag}_zp"], [f"{tag}_q"]),
                      helper.make_node("DequantizeLinear", [f"{tag}_q", f"{tag}_s", f"{tag}_zp"], [dst])])
    nodes, inits = [], []
    qdq("x", "t0", 0.05, 128, "in")
    for i in range(layers):
        w = np.clip(np.rint(rand((C, C, 3, 3), i) * 20), -127, 127).astype(np.int8)
        inits.extend([init(f"w{i}", w), init(f"w{i}_s", np.float32(0.01)), init(f"w{i}_zp", np.int8(0))])
        nodes.extend([helper.make_node("DequantizeLinear", [f"w{i}", f"w{i}_s", f"w{i}_zp"], [f"wd{i}"]),
                      helper.make_node("Conv", [f"t{i}", f"wd{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1])])
        qdq(f"c{i}", f"cd{i}", 0.05, 128, f"c{i}")
        nodes.extend([helper.make_node("Sigmoid", [f"cd{i}"], [f"sg{i}"]),
                      helper.make_node("Mul", [f"cd{i}", f"sg{i}"], [f"m{i}"])])
        qdq(f"m{i}", f"t{i + 1}", 0.03, 10, f"m{i}")
    dims = [1, C, 6, 6]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                      [helper.make_tensor_value_info(f"t{layers}", TensorProto.FLOAT, dims)], inits)


def test_int8_output_tables_are_mapped_inside_the_chain():
    onnx_model = qdq_silu_convs()
    engine = kiln.build(onnx_model, tactic_sources="onednn,kiln", autotune=False)
    x = rand((1, C, 6, 6), 11)
    chained, one_by_one, context = run_both_ways(engine, {"x": x})
    [chain] = chains(context)
    tabled = [c for c in chain.calls if c.link.table is not None]
    # the last SiLU ends in FP32 (the model's output): a lookup layer of its own after the chain
    assert len(chain.calls) == 3 and len(tabled) == 2, [(l.name, l.tactic_name) for l in engine.plan.layers]
    np.testing.assert_array_equal(chained[engine.output_names[0]], one_by_one[engine.output_names[0]])
    expected = run_ort(onnx_model, {"x": x})[0]
    got = chained[engine.output_names[0]]
    off = np.abs(got - expected)   # rounding differences carried through three quantized layers: rare, small
    assert off.max() <= 2 * 0.03 + 1e-6 and np.mean(off > 1e-6) <= 0.05


def test_a_tensor_read_both_cast_and_as_it_is_ends_the_chain():
    """A chain input the first primitive casts to bf16 and a later one adds as its FP32 residual would need two
    buffers: the chain ends before the second reader (where no cast happens, one buffer serves both)."""
    import torch
    from types import SimpleNamespace as Fake

    from kiln.runtime.chains import find_chains
    from kiln.tactics.onednn_prim import R_ADD, R_NONE, ChainLink

    def step(x, y, stored, residual=None):
        link = ChainLink(None, threading.Lock(), torch.bfloat16, torch.bfloat16, torch.channels_last,
                         R_ADD if residual else R_NONE)
        args = (("tensor", x), ("weight", f"{y}_w"), ("none", "")) + ((("tensor", residual),) if residual else ())
        return Fake(kernel=Fake(chain_link=link), into_concat=None, concat_rest=None, outputs=(y,), args=args,
                    free=(), in_place=None, layer=Fake(name=y, op_type="Conv", inputs=(Fake(dtype=stored),)))

    cast = [step("x", "a", "float32"), step("a", "b", "bfloat16", residual="x")]
    assert find_chains(cast, set()) == []
    stored_bf16 = [step("x", "a", "bfloat16"), step("a", "b", "bfloat16", residual="x")]
    assert [(c.start, c.stop) for c in find_chains(stored_bf16, set())] == [(0, 2)]


@pytest.mark.skipif(not bf16_available(), reason="this CPU has no native BF16 arithmetic: no BF16 LayerNorm")
def test_a_layernorm_of_kiln_joins_the_chain_of_its_linear_layers():
    """kiln's BF16 LayerNorm (a C kernel with a CallLink) runs inside the chain of the linear layers around it,
    reading its residual as the plan stores it: the chain covers all four layers, and gives the bytes of the
    layers run one by one (a second run too: its parameters are made once per input shape)."""
    h = helper.make_node
    nodes = [h("MatMul", ["x", "w0"], ["a0"], name="fc0"), h("MatMul", ["a0", "w1"], ["a"], name="fc1"),
             h("Add", ["a", "a0"], ["s"], name="res"), h("LayerNormalization", ["s", "g", "b"], ["n"], name="ln"),
             h("MatMul", ["n", "w2"], ["y"], name="fc2")]
    inits = [init(f"w{k}", rand((64, 64), k) * 0.1) for k in range(3)] + \
        [init("g", rand((64,), 3) + 1), init("b", rand((64,), 4))]
    info = helper.make_tensor_value_info
    model = make_model(nodes, [info("x", TensorProto.FLOAT, [1, 16, 64])], [info("y", TensorProto.FLOAT, [1, 16, 64])],
                       inits)
    engine = kiln.build(model, bf16=True, tactic_sources="onednn,kiln", accuracy="off", autotune=False)
    assert [l.tactic_name for l in engine.plan.layers] == ["onednn.linear_primitive_bf16"] * 2 + \
        ["kiln.layernorm_rows_bf16", "onednn.linear_primitive_bf16"]
    feeds = {"x": rand((1, 16, 64), 5)}
    chained, one_by_one, context = run_both_ways(engine, feeds)
    assert [[c.layer for c in chain.calls] for chain in chains(context)] == [["fc0", "fc1", "res + ln", "fc2"]]
    np.testing.assert_array_equal(chained["y"], one_by_one["y"])
    np.testing.assert_array_equal(context.execute(feeds)["y"], one_by_one["y"])
    got, want = chained["y"].astype(np.float64).ravel(), run_ort(model, feeds)[0].astype(np.float64).ravel()
    assert got @ want / (np.linalg.norm(got) * np.linalg.norm(want)) > 0.999
