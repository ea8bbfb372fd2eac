"""ONNX's Attention (opset 23-25) and RotaryEmbedding (opset 23, and onnxruntime's com.microsoft one) unfolded at
import: against onnxruntime running the op itself (rel 1e-4), the one fused layer kiln's passes make of them on its
own kernels, the origin layer info keeps, and the refusals. onnx's own node cases for both run in
tests/conformance (windows, nonpad_kv_seqlen, fp16, the expanded function bodies)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.errors import UnsupportedOpError
from tests.conftest import assert_close_to_ort, init, rand, run_ort

OWN = "-openvino,-onnxruntime"
B, S, D = 2, 6, 8
vi = helper.make_tensor_value_info


def attention_model(shapes: dict[str, list], outputs=("y",), opset: int = 23, mask_type=TensorProto.FLOAT,
                    **attrs) -> onnx.ModelProto:
    names = ["q", "k", "v", "mask" if "mask" in shapes else "", *(["past_k", "past_v"] if "past_k" in shapes else [])]
    inputs = [vi(n, mask_type if n == "mask" else TensorProto.FLOAT, shapes[n]) for n in names if n]
    node = helper.make_node("Attention", names, list(outputs), name="attn", **attrs)
    graph = helper.make_graph([node], "attention", inputs, [vi(o, TensorProto.FLOAT, None) for o in outputs if o])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def check(model, feeds, **build):
    engine = kiln.build(model, autotune=False, tactic_sources=OWN,
                        input_shapes={k: v.shape for k, v in feeds.items()}, **build)
    got, want = engine.run(feeds), run_ort(model, feeds)
    for out, expected in zip([o for o in model.graph.output], want):
        assert_close_to_ort(np.asarray(got[out.name]), expected)
    return engine


def attention_layers(engine) -> list:
    return [l for l in engine.plan.layers if l.op_type == "Attention"]


BNSH = {"q": [B, 4, S, D], "k": [B, 4, S, D], "v": [B, 4, S, D]}
GQA = {"q": [B, 4, S, D], "k": [B, 2, S, D], "v": [B, 2, S, D]}


def feeds_for(shapes, seed=0):
    return {n: rand(s, seed + i) for i, (n, s) in enumerate(shapes.items()) if n != "mask"}


@pytest.mark.parametrize("shapes, attrs", [(BNSH, {}), (BNSH, {"is_causal": 1}), (GQA, {"is_causal": 1}),
                                           (GQA, {"scale": 0.3})], ids=["mha", "causal", "gqa-causal", "gqa-scale"])
def test_four_d_attention_is_one_attention_layer(shapes, attrs):
    engine = check(attention_model(shapes, **attrs), feeds_for(shapes))
    (layer,) = attention_layers(engine)
    assert layer.tactic_name == "kiln.attention_c" and "attn" in layer.origin


def test_bool_mask_with_a_row_masked_throughout_gives_zeros_not_nan():
    """The spec (and onnxruntime): a query row with no key allowed is 0; an all -inf softmax alone is NaN, which the
    next layer's P·V would spread to every row."""
    mask = np.ones((B, 1, S, S), bool)
    mask[1, :, :, :2] = False
    mask[1, :, 0, :] = False
    shapes = {**BNSH, "mask": [B, 1, S, S]}
    feeds = {**feeds_for(shapes), "mask": mask}
    engine = check(attention_model(shapes, mask_type=TensorProto.BOOL), feeds)
    out = engine.run(feeds)["y"]
    assert np.all(out[1, :, 0] == 0) and np.isfinite(out).all()
    assert len(attention_layers(engine)) == 1


def test_float_mask_and_causal_rule_add_up():
    shapes = {**BNSH, "mask": [B, 1, S, S]}
    engine = check(attention_model(shapes, is_causal=1), {**feeds_for(shapes), "mask": rand((B, 1, S, S), 9)})
    assert len(attention_layers(engine)) == 1


def test_three_d_grouped_query_attention_splits_and_merges_heads():
    shapes = {"q": [B, S, 32], "k": [B, S, 16], "v": [B, S, 24]}
    engine = check(attention_model(shapes, q_num_heads=4, kv_num_heads=2, is_causal=1), feeds_for(shapes))
    assert len(attention_layers(engine)) == 1


def test_past_keys_are_concatenated_into_present_outputs_and_shift_the_causal_rule():
    shapes = {**GQA, "past_k": [B, 2, 3, D], "past_v": [B, 2, 3, D]}
    model = attention_model(shapes, outputs=("y", "present_k", "present_v"), is_causal=1)
    feeds = feeds_for(shapes)
    engine = check(model, feeds)
    got = engine.run(feeds)
    np.testing.assert_array_equal(got["present_k"], np.concatenate([feeds["past_k"], feeds["k"]], axis=2))
    assert len(attention_layers(engine)) == 1


def test_dynamic_batch_and_sequence():
    shapes = {"q": ["b", 4, "s", D], "k": ["b", 2, "s", D], "v": ["b", 2, "s", D]}
    model = attention_model(shapes, is_causal=1)
    engine = kiln.build(model, autotune=False, tactic_sources=OWN,
                        profiles=[{n: ((1, h, 1, D), (2, h, 6, D), (3, h, 9, D)) for n, h in (("q", 4), ("k", 2),
                                                                                                ("v", 2))}])
    for b, s in ((1, 1), (3, 9), (2, 5)):
        feeds = {"q": rand((b, 4, s, D), 1), "k": rand((b, 2, s, D), 2), "v": rand((b, 2, s, D), 3)}
        assert_close_to_ort(engine.run(feeds)["y"], run_ort(model, feeds)[0])


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_softcap_and_qk_matmul_output_run_unfused(mode):
    """softcap (tanh between the scores and the bias) and the scores output keep the layers apart: correct, slower."""
    shapes = {**BNSH, "mask": [B, 1, S, S]}
    model = attention_model(shapes, outputs=("y", "", "", "scores"), softcap=2.0, qk_matmul_output_mode=mode)
    engine = check(model, {**feeds_for(shapes), "mask": rand((B, 1, S, S), 9)})
    assert not attention_layers(engine)


def test_opset_25_windows_and_nonpad_lengths():
    shapes = {**GQA}
    names = ["q", "k", "v", "", "", "", "nonpad"]
    node = helper.make_node("Attention", names, ["y"], name="attn", is_causal=1, left_window_size=2)
    graph = helper.make_graph([node], "attention", [vi(n, TensorProto.FLOAT, s) for n, s in shapes.items()] +
                              [vi("nonpad", TensorProto.INT64, [B])], [vi("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)])
    check(model, {**feeds_for(shapes), "nonpad": np.array([4, 6], np.int64)})


@pytest.mark.parametrize("attrs, shapes, message", [
    ({}, {"q": [B, S, 32], "k": [B, S, 32], "v": [B, S, 32]}, "need the q_num_heads and kv_num_heads"),
    ({}, {"q": [B, 3, S, D], "k": [B, 2, S, D], "v": [B, 2, S, D]}, "q heads 3 are not a multiple of the kv heads 2"),
    ({}, {**BNSH, "mask": [B, 1, S, S]}, "attn_mask 'mask' is INT32"),
])
def test_refusals_name_the_node_and_reason(attrs, shapes, message):
    model = attention_model(shapes, mask_type=TensorProto.INT32, **attrs)
    with pytest.raises(UnsupportedOpError, match=message) as info:
        kiln.build(model)
    assert "attn" in str(info.value)


def test_past_key_without_past_value_is_refused():
    names = ["q", "k", "v", "", "past_k"]
    node = helper.make_node("Attention", names, ["y"], name="attn")
    shapes = {**BNSH, "past_k": [B, 4, 3, D]}
    graph = helper.make_graph([node], "g", [vi(n, TensorProto.FLOAT, s) for n, s in shapes.items()],
                              [vi("y", TensorProto.FLOAT, None)])
    with pytest.raises(UnsupportedOpError, match="past_key and past_value must be given together"):
        kiln.build(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


# ---- RotaryEmbedding ---------------------------------------------------------------------------------------------
N, H = 3, 16
POSITIONS = np.array([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]], np.int64)


def rotary_model(x_shape, half: int, positions_shape, ms: bool = False, **attrs) -> onnx.ModelProto:
    angles = rand((12, half), 5)
    inits = [init("cos", np.cos(angles)), init("sin", np.sin(angles))]
    inputs = [vi("x", TensorProto.FLOAT, x_shape), vi("pos", TensorProto.INT64, positions_shape)]
    names = ["x", "pos", "cos", "sin"] if ms else ["x", "cos", "sin", "pos"]
    node = helper.make_node("RotaryEmbedding", names, ["y"], name="rope", domain="com.microsoft" if ms else "",
                            **attrs)
    graph = helper.make_graph([node], "rotary", inputs, [vi("y", TensorProto.FLOAT, None)], inits)
    opsets = [helper.make_opsetid("", 23)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize("x_shape, attrs", [([B, N, S, H], {}), ([B, S, N * H], {"num_heads": N})],
                         ids=["bnsh", "3d"])
def test_rotary_embedding_is_one_rotary_layer(x_shape, attrs):
    engine = check(rotary_model(x_shape, H // 2, [B, S], **attrs), {"x": rand(x_shape, 1), "pos": POSITIONS})
    rotary = [l for l in engine.plan.layers if l.op_type == "RotaryEmbedding"]
    assert len(rotary) == 1 and rotary[0].tactic_name == "kiln.rotary" and "rope" in rotary[0].origin


@pytest.mark.parametrize("attrs, half", [({"interleaved": 1}, H // 2), ({"rotary_embedding_dim": 8}, 4),
                                         ({"rotary_embedding_dim": 8, "interleaved": 1}, 4)],
                         ids=["interleaved", "partial", "partial-interleaved"])
def test_rotary_embedding_interleaved_and_partial(attrs, half):
    check(rotary_model([B, N, S, H], half, [B, S], **attrs), {"x": rand((B, N, S, H), 1), "pos": POSITIONS})


@pytest.mark.parametrize("x_shape, attrs", [([B, S, N * H], {"num_heads": N}), ([B, N, S, H], {})],
                         ids=["3d", "bnsh"])
def test_onnxruntime_rotary_embedding_with_a_start_position(x_shape, attrs):
    """com.microsoft's inputs come in another order, and a 1-element position_ids is the first position."""
    model = rotary_model(x_shape, H // 2, [1], ms=True, **attrs)
    check(model, {"x": rand(x_shape, 1), "pos": np.array([2], np.int64)})
    check(rotary_model(x_shape, H // 2, [B, S], ms=True, **attrs), {"x": rand(x_shape, 1), "pos": POSITIONS})


def test_packed_batching_rotary_is_refused():
    model = rotary_model([B, S, N * H], H // 2, [B, S], ms=True, num_heads=N, is_packed_batching=1)
    with pytest.raises(UnsupportedOpError, match="is_packed_batching"):
        kiln.build(model)


def test_cast_like_takes_the_element_type_of_its_second_input():
    nodes = [helper.make_node("CastLike", ["x", "like"], ["y"], name="cast")]
    graph = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [4]), vi("like", TensorProto.INT32, [1])],
                              [vi("y", TensorProto.INT32, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    feeds = {"x": np.array([1.7, -2.2, 3.0, 40.5], np.float32), "like": np.zeros(1, np.int32)}
    got = kiln.build(model).run(feeds)["y"]
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, run_ort(model, feeds)[0])


def static_cache_decode_model() -> onnx.ModelProto:
    """One decode step on a static KV cache (opset 24): TensorScatter writes the new K/V at each row's position, and
    Attention reads the cache up to nonpad_kv_seqlen."""
    shapes = {"q": [B, 4, 1, D], "k": [B, 2, 1, D], "v": [B, 2, 1, D], "k_cache": [B, 2, 10, D],
              "v_cache": [B, 2, 10, D]}
    nodes = [helper.make_node("TensorScatter", ["k_cache", "k", "write_at"], ["k_present"], name="k_write"),
             helper.make_node("TensorScatter", ["v_cache", "v", "write_at"], ["v_present"], name="v_write"),
             helper.make_node("Attention", ["q", "k_present", "v_present", "", "", "", "lengths"], ["y"], name="attn",
                              is_causal=1)]
    inputs = [vi(n, TensorProto.FLOAT, s) for n, s in shapes.items()] + \
        [vi("write_at", TensorProto.INT64, [B]), vi("lengths", TensorProto.INT64, [B])]
    outputs = [vi(o, TensorProto.FLOAT, None) for o in ("y", "k_present", "v_present")]
    return helper.make_model(helper.make_graph(nodes, "decode", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 24)])


def test_static_cache_decode_step_scatters_and_attends_up_to_the_lengths():
    model = static_cache_decode_model()
    feeds = {n: rand(s, i) for i, (n, s) in enumerate({"q": (B, 4, 1, D), "k": (B, 2, 1, D), "v": (B, 2, 1, D),
                                                        "k_cache": (B, 2, 10, D), "v_cache": (B, 2, 10, D)}.items())}
    feeds |= {"write_at": np.array([3, 6], np.int64), "lengths": np.array([4, 7], np.int64)}
    engine = check(model, feeds)
    assert len(attention_layers(engine)) == 1
    feeds["write_at"] = np.array([3, 10], np.int64)
    with pytest.raises(kiln.Error, match="layer 'k_write'.*run past the cache's 10 positions"):
        engine.run(feeds)


def test_tensor_scatter_update_that_does_not_fit_is_refused_at_build():
    node = helper.make_node("TensorScatter", ["cache", "update"], ["y"], name="write")
    graph = helper.make_graph([node], "g", [vi("cache", TensorProto.FLOAT, [1, 2, 4, 3]),
                                            vi("update", TensorProto.FLOAT, [1, 1, 2, 3])],
                              [vi("y", TensorProto.FLOAT, None)])
    with pytest.raises(kiln.Error, match=r"'write'.*update \[1, 1, 2, 3\] does not fit the cache \[1, 2, 4, 3\]"):
        kiln.build(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)]))


def test_window_alone_can_mask_a_row_throughout_and_it_gives_zeros():
    """left_window_size 0 with one key: queries past it see nothing (a bias but no mask input)."""
    shapes = {"q": [1, 2, 4, D], "k": [1, 2, 1, D], "v": [1, 2, 1, D]}
    model = attention_model(shapes, opset=25, left_window_size=0)
    engine = check(model, feeds_for(shapes))
    assert np.all(engine.run(feeds_for(shapes))["y"][:, :, 1:] == 0)


def test_head_counts_known_only_at_build_time():
    shapes = {"q": ["b", "hq", "s", D], "k": ["b", "hk", "s", D], "v": ["b", "hk", "s", D]}
    check(attention_model(shapes, is_causal=1), {"q": rand((B, 4, 5, D), 1), "k": rand((B, 2, 5, D), 2),
                                                 "v": rand((B, 2, 5, D), 3)})


def test_grouped_keys_that_are_also_the_values():
    node = helper.make_node("Attention", ["q", "k", "k"], ["y"], name="attn")
    graph = helper.make_graph([node], "g", [vi("q", TensorProto.FLOAT, GQA["q"]), vi("k", TensorProto.FLOAT, GQA["k"])],
                              [vi("y", TensorProto.FLOAT, None)])
    check(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]),
          {"q": rand(GQA["q"], 1), "k": rand(GQA["k"], 2)})


def test_three_d_query_with_four_d_keys_is_refused_with_the_models_opset():
    shapes = {"q": [B, S, 32], "k": [B, 4, S, D], "v": [B, 4, S, D]}
    with pytest.raises(UnsupportedOpError, match=r"'attn'.*opset 23\): Q is 3-D but K is not"):
        kiln.build(attention_model(shapes, q_num_heads=4, kv_num_heads=4))


@pytest.mark.parametrize("position_shape, attrs", [([], {"num_heads": N}), ([1], {})],
                         ids=["scalar-start", "num-heads-0"])
def test_onnxruntime_rotary_scalar_start_and_heads_of_the_rotary_width(position_shape, attrs):
    model = rotary_model([B, S, N * H], H // 2, position_shape, ms=True, **attrs)
    check(model, {"x": rand((B, S, N * H), 1), "pos": np.array(2, np.int64).reshape(position_shape)})


def test_two_unfolded_nodes_of_one_name_do_not_collide():
    """ONNX does not require unique node names; the values each unfolding makes must still be distinct."""
    angles = rand((12, H // 2), 5)
    inits = [init("cos", np.cos(angles)), init("sin", np.sin(angles))]
    nodes = [helper.make_node("RotaryEmbedding", [x, "cos", "sin", "pos"], [f"y{x}"], name="rope") for x in "ab"]
    graph = helper.make_graph(nodes, "g", [vi("a", TensorProto.FLOAT, [B, N, S, H]),
                                           vi("b", TensorProto.FLOAT, [B, N, S, H]),
                                           vi("pos", TensorProto.INT64, [B, S])],
                              [vi("ya", TensorProto.FLOAT, None), vi("yb", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    feeds = {"a": rand((B, N, S, H), 1), "b": rand((B, N, S, H), 2), "pos": POSITIONS}
    check_against_reference(model, feeds)   # onnxruntime refuses repeated node names
    engine = kiln.build(model, tactic_sources=OWN)
    assert [l.origin for l in engine.plan.layers if l.op_type == "RotaryEmbedding"] == [("rope",), ("rope",)]


def check_against_reference(model, feeds):
    """For forms onnxruntime refuses (a mask shorter than the keys): onnx's reference implementation."""
    from onnx.reference import ReferenceEvaluator

    engine = kiln.build(model, autotune=False, tactic_sources=OWN,
                        input_shapes={k: v.shape for k, v in feeds.items()})
    got = engine.run(feeds)
    for out, want in zip(model.graph.output, ReferenceEvaluator(model).run(None, feeds)):
        np.testing.assert_allclose(np.asarray(got[out.name]), want, rtol=1e-4, atol=1e-5)


def test_mask_shorter_than_the_keys_is_padded_with_minus_inf():
    shapes = {**BNSH, "mask": [B, 1, S, 4]}
    check_against_reference(attention_model(shapes), {**feeds_for(shapes), "mask": rand((B, 1, S, 4), 9)})


def test_mask_as_long_as_the_new_keys_is_padded_past_the_cache():
    shapes = {**GQA, "past_k": [B, 2, 3, D], "past_v": [B, 2, 3, D], "mask": [B, 1, S, S]}
    model = attention_model(shapes, outputs=("y", "present_k", "present_v"))
    check_against_reference(model, {**feeds_for(shapes), "mask": rand((B, 1, S, S), 9)})


def test_head_size_known_only_at_build_time_gives_the_default_scale():
    shapes = {n: [B, 4, S, "d"] for n in "qkv"}
    check(attention_model(shapes), {n: rand((B, 4, S, 16), i) for i, n in enumerate("qkv")})


def test_right_window_without_causal_rule():
    check(attention_model(BNSH, opset=25, right_window_size=1, left_window_size=2), feeds_for(BNSH))


def test_chained_attention_and_rotary_after_attention():
    """The ranks of an unfolded Attention's outputs feed the next unfolding (4-D in, 4-D out)."""
    angles = rand((12, D // 2), 5)
    nodes = [helper.make_node("Attention", ["q", "k", "v"], ["y1"], name="a1"),
             helper.make_node("Attention", ["y1", "k", "v"], ["y2"], name="a2"),
             helper.make_node("RotaryEmbedding", ["y2", "cos", "sin", "pos"], ["y"], name="rope")]
    graph = helper.make_graph(nodes, "g", [vi(n, TensorProto.FLOAT, s) for n, s in BNSH.items()] +
                              [vi("pos", TensorProto.INT64, [B, S])], [vi("y", TensorProto.FLOAT, None)],
                              [init("cos", np.cos(angles)), init("sin", np.sin(angles))])
    engine = check(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]),
                   {**feeds_for(BNSH), "pos": POSITIONS})
    assert len(attention_layers(engine)) == 2


def test_scaled_onnxruntime_rotary_is_refused():
    with pytest.raises(UnsupportedOpError, match="a scale other than 1"):
        kiln.build(rotary_model([B, S, N * H], H // 2, [B, S], ms=True, num_heads=N, scale=0.5))


def test_circular_tensor_scatter_wraps_around_the_cache():
    node = helper.make_node("TensorScatter", ["cache", "update", "write_at"], ["y"], name="write", mode="circular")
    graph = helper.make_graph([node], "g", [vi("cache", TensorProto.FLOAT, [2, 3, 10, 4]),
                                            vi("update", TensorProto.FLOAT, [2, 3, 2, 4]),
                                            vi("write_at", TensorProto.INT64, [2])], [vi("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    feeds = {"cache": rand((2, 3, 10, 4), 1), "update": rand((2, 3, 2, 4), 2), "write_at": np.array([9, 3], np.int64)}
    got = kiln.build(model, tactic_sources=OWN).run(feeds)["y"]
    np.testing.assert_array_equal(got, run_ort(model, feeds)[0])
    np.testing.assert_array_equal(got[0, :, [9, 0]], feeds["update"][0].transpose(1, 0, 2))


@pytest.mark.parametrize("target", [TensorProto.FLOAT16, TensorProto.INT64, TensorProto.BOOL])
def test_cast_like_to_other_types(target):
    nodes = [helper.make_node("CastLike", ["x", "like"], ["y"], name="cast")]
    graph = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [4]), vi("like", target, [1])],
                              [vi("y", target, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    like = np.zeros(1, onnx.helper.tensor_dtype_to_np_dtype(target))
    feeds = {"x": np.array([0.0, -2.2, 3.0, 40.5], np.float32), "like": like}
    got = kiln.build(model).run(feeds)["y"]
    assert got.dtype == like.dtype
    np.testing.assert_array_equal(got, run_ort(model, feeds)[0])
