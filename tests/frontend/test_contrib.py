"""onnxruntime's transformer contrib ops (what its transformers optimizer and Optimum's O1-O3 write) unfolded at
import: each against onnxruntime running the contrib op itself (rel 1e-4 unless stated), the layers kiln's passes
fuse them back into, the origins layer info keeps, and clear refusals for what is not unfolded."""
from __future__ import annotations


import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.tactics.onednn_conv import bf16_available
from tests.conftest import assert_close_to_ort, cosine, init, rand, run_ort

H, HEADS, B, S = 32, 4, 2, 8
vi = helper.make_tensor_value_info


def ms_model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "contrib", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def ms(op, inputs, outputs, name, **attrs):
    return helper.make_node(op, inputs, outputs, name=name, domain="com.microsoft", **attrs)


def check(model, feeds, rel=1e-4, **build):
    engine = kiln.build(model, autotune=False, **build)
    got, want = engine.run(feeds), run_ort(model, feeds)
    for out, expected in zip(model.graph.output, want):
        assert_close_to_ort(np.asarray(got[out.name]), expected, rel)
    return engine


def dense_then(op_nodes, extra_inits=(), outputs=None):
    """x [B,S,H] @ w -> a, then the contrib nodes reading a (and x as the residual)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="dense")] + op_nodes
    inits = [init("w", rand((H, H), 1) * 0.3), *extra_inits]
    return ms_model(nodes, [vi("x", TensorProto.FLOAT, [B, S, H])],
                    outputs or [vi("y", TensorProto.FLOAT, [B, S, H])], inits)


@pytest.mark.parametrize("op, attrs, with_bias", [("Gelu", {}, False), ("BiasGelu", {}, True),
                                                  ("FastGelu", {}, True), ("FastGelu", {}, False),
                                                  ("QuickGelu", {"alpha": 1.5}, False)])
def test_gelus_become_the_dense_layers_epilogue(op, attrs, with_bias):
    inputs = ["a", "b"] if with_bias else ["a"]
    model = dense_then([ms(op, inputs, ["y"], "act", **attrs)], [init("b", rand((H,), 2))])
    engine = check(model, {"x": rand((B, S, H), 3)}, tactic_sources="-openvino,-onnxruntime")
    # x * sigmoid(1.5 x) is a pointwise program of its own
    assert [l.name for l in engine.plan.layers] == (["dense", "PWN(act)"] if op == "QuickGelu" else ["dense + act"])
    assert all("act" in l.origin for l in engine.plan.layers if "act" in l.name)


def test_skip_layer_norm_takes_the_dense_bias_back_and_fuses_the_residual():
    """onnxruntime's optimizer moves the dense layer's bias into SkipLayerNormalization: unfolded, the bias goes back
    into the product; output 3 (the sum, read by the LayerNorm and the caller) is kept, the residual Add fused into
    the product's store (MatMulEltwiseSumFusion) since the LayerNorm is not its sole reader."""
    nodes = [ms("SkipLayerNormalization", ["a", "x", "gamma", "beta", "bias"], ["y", "", "", "sum"], "skip_ln",
                epsilon=1e-5)]
    inits = [init("gamma", rand((H,), 4)), init("beta", rand((H,), 5)), init("bias", rand((H,), 6))]
    model = dense_then(nodes, inits, [vi("y", TensorProto.FLOAT, [B, S, H]), vi("sum", TensorProto.FLOAT, [B, S, H])])
    engine = check(model, {"x": rand((B, S, H), 3)}, tactic_sources="-openvino,-onnxruntime")
    assert [(l.op_type, l.name) for l in engine.plan.layers] == [("MatMul", "dense + skip_ln"),
                                                                   ("LayerNormalization", "skip_ln/norm")]


def test_skip_layer_norm_without_the_sum_is_one_skip_layer_norm_layer():
    nodes = [ms("SkipLayerNormalization", ["a", "x", "gamma"], ["y"], "skip_ln")]
    engine = check(dense_then(nodes, [init("gamma", rand((H,), 4))]), {"x": rand((B, S, H), 3)})
    assert [(l.op_type, l.origin) for l in engine.plan.layers][-1] == ("SkipLayerNormalization", ("skip_ln",))


def test_simplified_layer_norms_are_rms_norms():
    nodes = [ms("SkipSimplifiedLayerNormalization", ["a", "x", "gamma"], ["n", "", "", "sum"], "skip_rms",
                epsilon=1e-6),
             helper.make_node("SimplifiedLayerNormalization", ["sum", "gamma"], ["y"], name="rms", epsilon=1e-6),
             helper.make_node("Add", ["n", "y"], ["z"], name="out")]
    model = dense_then(nodes, [init("gamma", rand((H,), 4))], [vi("z", TensorProto.FLOAT, [B, S, H])])
    engine = check(model, {"x": rand((B, S, H), 3)})
    # both normalize the same sum with the same gamma and epsilon: CommonSubexpressionElimination keeps one
    assert sum(l.op_type == "RMSNormalization" for l in engine.plan.layers) == 1
    apart = kiln.build(model, autotune=False, disabled_passes=["CommonSubexpressionElimination"])
    assert sum(l.op_type == "RMSNormalization" for l in apart.plan.layers) == 2


def test_fused_matmul():
    model = dense_then([ms("FusedMatMul", ["a", "w2"], ["y"], "fused", alpha=0.5, transB=1)],
                       [init("w2", rand((H, H), 7))])
    check(model, {"x": rand((B, S, H), 3)})


def test_bias_add_against_its_definition():
    """BiasAdd (diffusers' UNet) has no onnxruntime CPU kernel: checked against X + bias + skip in numpy."""
    model = dense_then([ms("BiasAdd", ["a", "b", "x"], ["y"], "bias_add")], [init("b", rand((H,), 2))])
    x = rand((B, S, H), 3)
    want = x @ (rand((H, H), 1) * 0.3) + rand((H,), 2) + x
    assert_close_to_ort(kiln.build(model, autotune=False).run({"x": x})["y"], want)


def embed_model(with_mask=True, with_segments=True, with_positions=False):
    inputs = ["ids", "segments" if with_segments else "", "words", "positions", "segment_table" if with_segments else "",
              "gamma", "beta", "mask" if with_mask else "", "position_ids" if with_positions else ""]
    while not inputs[-1]:
        inputs.pop()
    node = ms("EmbedLayerNormalization", inputs, ["y", "mask_index"], "embed", epsilon=1e-5)
    sum_mask = helper.make_node("Cast", ["mask_index"], ["mask_float"], name="cast", to=TensorProto.FLOAT)
    graph_inputs = [vi("ids", TensorProto.INT32, [B, S])] + \
        ([vi("segments", TensorProto.INT32, [B, S])] if with_segments else []) + \
        ([vi("mask", TensorProto.INT32, [B, S])] if with_mask else []) + \
        ([vi("position_ids", TensorProto.INT32, [1, S])] if with_positions else [])
    inits = [init("words", rand((50, H), 1)), init("positions", rand((S * 2, H), 2)),
             init("segment_table", rand((2, H), 3)), init("gamma", rand((H,), 4)), init("beta", rand((H,), 5))]
    return ms_model([node, sum_mask], graph_inputs, [vi("y", TensorProto.FLOAT, [B, S, H]),
                                                     vi("mask_float", TensorProto.FLOAT, [B])], inits)


@pytest.mark.parametrize("with_mask, with_segments, with_positions", [(True, True, False), (False, False, False),
                                                                      (True, True, True)])
def test_embed_layer_norm(with_mask, with_segments, with_positions):
    rng = np.random.default_rng(0)
    feeds = {"ids": rng.integers(0, 50, (B, S)).astype(np.int32), "segments": rng.integers(0, 2, (B, S)).astype(np.int32),
             "mask": np.array([[1] * S, [1] * 5 + [0] * (S - 5)], np.int32),
             "position_ids": rng.integers(0, 2 * S, (1, S)).astype(np.int32)}
    model = embed_model(with_mask, with_segments, with_positions)
    names = {i.name for i in model.graph.input}
    check(model, {k: v for k, v in feeds.items() if k in names})


def attention_model(mask_rank: int | None, unidirectional=0, bias=True, sizes=None, attention_bias=False):
    widths = sizes or [H, H, H]
    inputs = ["x", "w", "b" if bias else "", "mask" if mask_rank else "", "", "attention_bias" if attention_bias else ""]
    while not inputs[-1]:
        inputs.pop()
    attrs = {"num_heads": HEADS, "unidirectional": unidirectional}
    if sizes:
        attrs["qkv_hidden_sizes"] = sizes
    mask_shape = {1: [B], 2: [B, S], 3: [B, S, S]}.get(mask_rank)
    graph_inputs = [vi("x", TensorProto.FLOAT, [B, S, H])] + \
        ([vi("mask", TensorProto.INT32, mask_shape)] if mask_rank else []) + \
        ([vi("attention_bias", TensorProto.FLOAT, [1, HEADS, S, S])] if attention_bias else [])
    inits = [init("w", rand((H, sum(widths)), 1) * 0.5), init("b", rand((sum(widths),), 2) * 0.1)]
    return ms_model([ms("Attention", inputs, ["y"], "attention", **attrs)], graph_inputs,
                    [vi("y", TensorProto.FLOAT, [B, S, widths[2]])], inits)


def attention_feeds(mask_rank):
    masks = {1: np.array([S, 5], np.int32), 2: np.array([[1] * S, [1] * 5 + [0] * (S - 5)], np.int32),
             3: (np.random.default_rng(4).random((B, S, S)) > 0.3).astype(np.int32)}
    feeds = {"x": rand((B, S, H), 3), "attention_bias": rand((1, HEADS, S, S), 5)}
    if mask_rank:
        feeds["mask"] = masks[mask_rank]
    return feeds


@pytest.mark.parametrize("mask_rank, unidirectional", [(None, 0), (1, 0), (2, 0), (3, 0), (2, 1), (None, 1)])
def test_attention_becomes_kilns_attention(mask_rank, unidirectional):
    model = attention_model(mask_rank, unidirectional)
    feeds = {k: v for k, v in attention_feeds(mask_rank).items() if k in {i.name for i in model.graph.input}}
    engine = check(model, feeds, tactic_sources="-openvino,-onnxruntime")
    kinds = [l.op_type for l in engine.plan.layers]
    assert kinds.count("Attention") == 1 and kinds.count("MatMul") == 1
    assert all(l.origin == ("attention",) for l in engine.plan.layers if l.op_type in ("Attention", "MatMul"))


def test_attention_with_attention_bias_and_unequal_v_width():
    model = attention_model(2, sizes=[H, H, 2 * H], attention_bias=True)
    check(model, attention_feeds(2))


@pytest.mark.skipif(not bf16_available(), reason="this CPU has no native BF16 arithmetic (AVX512-BF16 or AMX): "
                    "attention is not granted BF16 here")
def test_attention_with_bf16_is_granted_on_kilns_kernels():
    model = attention_model(2)
    feeds = {k: v for k, v in attention_feeds(2).items() if k != "attention_bias"}
    engine = kiln.build(model, bf16=True, tactic_sources="-openvino,-onnxruntime", precision_constraints="prefer",
                        autotune=False)
    layer = next(l for l in engine.plan.layers if l.op_type == "Attention")
    assert layer.precision == "BF16" and layer.tactic_name.startswith("kiln.attention")
    assert cosine(engine.run(feeds)["y"], run_ort(model, feeds)[0]) > 0.999


@pytest.mark.parametrize("change, message", [
    (lambda n: n.input.extend(["", "past"]), "past state input"),
    (lambda n: n.output.append("present"), "present output"),
    (lambda n: n.attribute.append(helper.make_attribute("do_rotary", 1)), "do_rotary")])
def test_attention_with_a_kv_cache_is_refused_with_the_reason(change, message):
    model = attention_model(None)
    change(model.graph.node[0])
    with pytest.raises(kiln.UnsupportedOpError, match=f"node 'attention' has op type 'Attention' .*{message}"):
        kiln.build(model, autotune=False)


def mha_model(bias=True, mask_rank=None, attention_bias=False, keys=S + 3, unidirectional=0, scale=None, v_width=H):
    """MultiHeadAttention on projected q [B,S,H], k [B,keys,H], v [B,keys,v_width] (cross-attention where keys != S)."""
    inputs = ["q", "k", "v", "bias" if bias else "", "mask" if mask_rank else "", "ab" if attention_bias else ""]
    while not inputs[-1]:
        inputs.pop()
    attrs = {"num_heads": HEADS, "unidirectional": unidirectional, **({"scale": scale} if scale else {})}
    mask_shape = {1: [B], 2: [B, keys], 3: [B, S, keys]}.get(mask_rank)
    graph_inputs = [vi("q", TensorProto.FLOAT, [B, S, H]), vi("k", TensorProto.FLOAT, [B, keys, H]),
                    vi("v", TensorProto.FLOAT, [B, keys, v_width])] + \
        ([vi("mask", TensorProto.INT32, mask_shape)] if mask_rank else []) + \
        ([vi("ab", TensorProto.FLOAT, [1, HEADS, S, keys])] if attention_bias else [])
    model = ms_model([ms("MultiHeadAttention", inputs, ["y"], "mha", **attrs)], graph_inputs,
                     [vi("y", TensorProto.FLOAT, [B, S, v_width])], [init("bias", rand((2 * H + v_width,), 2) * 0.1)])
    masks = {1: np.array([keys, 5], np.int32), 2: np.array([[1] * keys, [1] * 5 + [0] * (keys - 5)], np.int32),
             3: (np.random.default_rng(4).random((B, S, keys)) > 0.3).astype(np.int32)}
    feeds = {"q": rand((B, S, H), 3), "k": rand((B, keys, H), 4), "v": rand((B, keys, v_width), 5),
             "mask": masks.get(mask_rank), "ab": rand((1, HEADS, S, keys), 6)}
    return model, {k: v for k, v in feeds.items() if k in {i.name for i in graph_inputs}}


@pytest.mark.parametrize("case", [{}, {"mask_rank": 1}, {"mask_rank": 2}, {"mask_rank": 3}, {"attention_bias": True},
                                  {"keys": S, "unidirectional": 1}, {"bias": False, "scale": 0.3},
                                  {"v_width": 2 * H}])
def test_multi_head_attention_becomes_kilns_attention(case):
    """Self- and cross-attention, every mask form, attention_bias, causal, an explicit scale and a wider V; the
    scale and the bias split are read from the shapes and folded at build."""
    model, feeds = mha_model(**case)
    engine = check(model, feeds, tactic_sources="-openvino,-onnxruntime")
    kinds = [l.op_type for l in engine.plan.layers]
    assert kinds.count("Attention") == 1 and "MatMul" not in kinds and "Softmax" not in kinds
    assert all(l.origin == ("mha",) for l in engine.plan.layers)


@pytest.mark.parametrize("change, message", [
    (lambda n: n.input.extend(["", "", "", "past_k"]), "past_key input"),
    (lambda n: n.output.extend(["present_k"]), "present_key/present_value/qk outputs"),
    (lambda n: n.input.__delitem__(slice(1, None)), "only 3-D query, key and value")])
def test_multi_head_attention_with_a_kv_cache_or_packed_inputs_is_refused(change, message):
    model, _ = mha_model(bias=False)
    change(model.graph.node[0])
    with pytest.raises(kiln.UnsupportedOpError, match=f"op type 'MultiHeadAttention' .*{message}"):
        kiln.build(model, autotune=False)


def test_an_undeclared_mask_rank_is_refused_with_the_reason():
    model = attention_model(2)
    del model.graph.input[1].type.tensor_type.shape.dim[:]
    model.graph.input[1].type.tensor_type.ClearField("shape")
    with pytest.raises(kiln.UnsupportedOpError, match="rank of its mask_index 'mask' is not declared"):
        kiln.build(model, autotune=False)


def test_a_model_without_contrib_ops_is_not_copied():
    from kiln.frontend.contrib import unfold_contrib_ops

    model = attention_model(None)
    model.graph.node[0].domain = "example.other"
    assert unfold_contrib_ops(model) is model


@pytest.mark.parametrize("opt_level, multi_head", [(0, False), (1, False), (0, True)])
def test_an_onnxruntime_optimized_bert_builds_as_the_plain_export_does(tmp_path, opt_level, multi_head):
    """A small HF BERT, exported, then put through onnxruntime's transformers optimizer (Attention, SkipLayerNorm,
    BiasGelu at opt_level 0; SkipLayerNorm, Gelu and Reshape -> Gemm -> Reshape at 1; MultiHeadAttention in place
    of Attention with --use_multi_head_attention): the same outputs as onnxruntime's runs of the optimized model,
    and the same heavy layers as the plain export."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    from tests.models import encoders

    model = encoders.make_bert(layers=2, hidden=64, heads=4, intermediate=128)
    feeds = encoders.inputs(model, batch=2, seq=16)
    feeds["attention_mask"][1, 10:] = 0
    plain = tmp_path / "bert.onnx"
    encoders.export(model, feeds, plain, "legacy")
    options = FusionOptions("bert")
    options.use_raw_attention_mask(True)
    options.use_multi_head_attention = multi_head
    optimized = optimizer.optimize_model(str(plain), model_type="bert", num_heads=4, hidden_size=64,
                                         optimization_options=options, opt_level=opt_level).model
    ops = {n.op_type for n in optimized.graph.node if n.domain == "com.microsoft"}
    if opt_level == 0:
        assert {"MultiHeadAttention" if multi_head else "Attention", "SkipLayerNormalization", "BiasGelu"} <= ops
    else:   # onnxruntime's own fusions run first and leave its Python fusions less to match
        assert "SkipLayerNormalization" in ops
        assert any(n.op_type == "Gemm" and "MatMulAddFusion" in n.name for n in optimized.graph.node)
    names = {i.name for i in optimized.graph.input}
    feeds = {k: v for k, v in feeds.items() if k in names}
    engine = check(optimized, feeds, tactic_sources="-openvino,-onnxruntime")
    baseline = kiln.build(str(plain), autotune=False, tactic_sources="-openvino,-onnxruntime")

    def heavy(e):   # the layers doing the work: products, attention, normalizations
        return [l.op_type for l in e.plan.layers if l.op_type in ("MatMul", "Gemm", "Attention", "LayerNormalization",
                                                                  "SkipLayerNormalization")]
    encoder_layer = ["MatMul", "Attention", "MatMul", "SkipLayerNormalization", "MatMul", "MatMul",
                     "SkipLayerNormalization"]   # Q||K||V, attention, O, + residual and LN, FFN1, FFN2, + residual and LN
    assert heavy(engine) == heavy(baseline) == ["LayerNormalization", *encoder_layer, *encoder_layer, "Gemm"]
    assert len(engine.plan.layers) <= len(baseline.plan.layers) + 4   # + each Attention's own mask (2 tiny layers)
