"""Transformer fusions on real exports of a BERT-style layer (both exporters, static and dynamic shapes):
q || k || v merge, one Attention layer, residual + LayerNorm, GELU inside the FFN's MatMul; and the reasons
logged when attention does not fuse."""
from __future__ import annotations

import logging
import math
import warnings

import numpy as np
import onnx
import pytest
import torch

import kiln
from tests.conftest import assert_close_to_ort, make_model, run_ort
from kiln.trt.vocab import parameter_type

HIDDEN, HEADS = 64, 4


class BertLayer(torch.nn.Module):
    """One post-LN encoder layer written as BERT writes it (separate Q/K/V projections, extended mask)."""

    def __init__(self):
        super().__init__()
        lin = torch.nn.Linear
        self.q, self.k, self.v, self.o = lin(HIDDEN, HIDDEN), lin(HIDDEN, HIDDEN), lin(HIDDEN, HIDDEN), lin(HIDDEN, HIDDEN)
        self.ln1, self.ln2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.fc1, self.fc2 = lin(HIDDEN, 4 * HIDDEN), lin(4 * HIDDEN, HIDDEN)

    def heads(self, x):
        b, s, _ = x.shape
        return x.view(b, s, HEADS, HIDDEN // HEADS).permute(0, 2, 1, 3)

    def forward(self, x, mask):
        ext = (1.0 - mask[:, None, None, :]) * -10000.0
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HIDDEN // HEADS) + ext
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v).permute(0, 2, 1, 3).reshape(x.shape)
        h = self.ln1(self.o(ctx) + x)
        return self.ln2(self.fc2(torch.nn.functional.gelu(self.fc1(h))) + h)


class Encoder(torch.nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(BertLayer() for _ in range(layers))

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x


def export(tmp_path, exporter: str, dynamic: bool = False) -> str:
    path = tmp_path / f"bert_{exporter}_{dynamic}.onnx"
    args = (torch.randn(2, 16, HIDDEN), torch.ones(2, 16))
    names = {"input_names": ["x", "mask"], "output_names": ["y"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            axes = {"x": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"}} if dynamic else None
            torch.onnx.export(Encoder().eval(), args, str(path), dynamic_axes=axes, dynamo=False, opset_version=17,
                              **names)
        else:
            dims = {0: torch.export.Dim("b", max=8), 1: torch.export.Dim("s", max=128)}
            shapes = {"x": dims, "mask": dims} if dynamic else None
            torch.onnx.export(Encoder().eval(), args, str(path), dynamic_shapes=shapes, dynamo=True, verbose=False,
                              **names)
    return str(path)


def feeds(batch=2, seq=16, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.float32)
    mask[0, seq // 2:] = 0
    return {"x": rng.standard_normal((batch, seq, HIDDEN)).astype(np.float32), "mask": mask}


PER_LAYER = ["MatrixMultiply", "Attention", "MatrixMultiply", "Normalization", "MatrixMultiply", "MatrixMultiply",
             "Normalization"]


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_bert_layer_is_seven_layers_and_matches_onnxruntime(tmp_path, caplog, exporter):
    caplog.set_level(logging.DEBUG, logger="kiln.build")
    path = export(tmp_path, exporter)
    engine = kiln.build(path, autotune=False)
    # the extended mask (1 - m) * -1e4 is computed once (Unsqueeze Shuffle, PWN) and shared by both layers
    assert [parameter_type(l) for l in engine.plan.layers] == ["Shuffle", "PointWise"] + PER_LAYER * 2
    merged = [l for l in engine.plan.layers if " || " in l.name]
    assert len(merged) == 2 and merged[0].name.count(" || ") == 2   # q || k || v
    attn = [l for l in engine.plan.layers if l.op_type == "Attention"]
    assert len(attn) == 2 and all(l.attrs["scale"] == pytest.approx(0.25) for l in attn)
    assert len(attn[0].args) == 4   # q, k, v from the merged projection, and the mask
    assert len({a.name for a in attn[0].args[:3]}) == 1 and "MatMul" not in attn[0].name.split(" + ")[0]
    ffn = [l for l in engine.plan.layers if l.attrs.get("activation", {}).get("op") == "Gelu"]
    assert len(ffn) == 2
    assert "AttentionFusion: Fusing" in caplog.text and "MatMulHorizontalMerge: Fusing" in caplog.text
    f = feeds()
    assert_close_to_ort(engine.run(f)["y"], run_ort(path, f)[0])


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_fused_encoder_with_dynamic_shapes_and_regions(tmp_path, exporter):
    path = export(tmp_path, exporter, dynamic=True)
    profile = {"x": ((1, 1, HIDDEN), (2, 16, HIDDEN), (4, 48, HIDDEN)), "mask": ((1, 1), (2, 16), (4, 48))}
    for autotune in (False, True):
        engine = kiln.build(path, profiles=[profile], autotune=autotune, avg_timing=1, min_timing=1)
        inner = [i for l in engine.plan.layers for i in (l.inner or (l,))]
        assert sum(l.op_type == "Attention" for l in inner) == 2
        for batch, seq in [(2, 16), (1, 1), (4, 48), (3, 29)]:
            f = feeds(batch, seq, seed=batch * seq)
            assert_close_to_ort(engine.run(f)["y"], run_ort(path, f)[0])


def test_each_tactic_source_runs_the_fused_attention(tmp_path):
    path = export(tmp_path, "legacy")
    f = feeds()
    for source in ("torch", "onnxruntime"):
        engine = kiln.build(path, tactic_sources=frozenset({source}), regions=False, avg_timing=1, min_timing=1)
        assert any(l.op_type == "Attention" for l in engine.plan.layers)
        assert_close_to_ort(engine.run(f)["y"], run_ort(path, f)[0])


def test_attention_does_not_fuse_when_probabilities_are_an_output(caplog):
    from onnx import TensorProto, helper

    caplog.set_level(logging.DEBUG, logger="kiln.build")
    shape = [1, 2, 8, 8]
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["s"], name="qk"),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1, name="softmax"),
             helper.make_node("MatMul", ["p", "v"], ["o"], name="pv")]
    io = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)   # noqa: E731
    model = make_model(nodes, [io("q"), io("kt"), io("v")], [io("o"), io("p")])
    engine = kiln.build(model, autotune=False)
    assert not any(l.op_type == "Attention" for l in engine.plan.layers)
    assert "Not fusing softmax with its consumers: its output is not multiplied by V" in caplog.text
    rng = np.random.default_rng(0)
    f = {n: rng.standard_normal(shape).astype(np.float32) for n in ("q", "kt", "v")}
    for got, want in zip([engine.run(f)[n] for n in ("o", "p")], run_ort(model, f)):
        assert_close_to_ort(got, want)


class VaeAttentionBlock(torch.nn.Module):
    """The attention block of latent-diffusion VAEs (LDM's AttnBlock): GroupNorm, 1x1 convolutions to Q, K, V on the
    [B, C, H, W] map, bmm(q [B, HW, C], k [B, C, HW]) scaled, softmax, bmm(v, probabilitiesᵀ), 1x1 projection,
    residual."""

    def __init__(self, channels: int = 32):
        super().__init__()
        torch.manual_seed(1)
        self.norm = torch.nn.GroupNorm(8, channels, eps=1e-6)
        self.q, self.k, self.v, self.proj = (torch.nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, c, hh, ww = q.shape
        w = torch.bmm(q.reshape(b, c, hh * ww).permute(0, 2, 1), k.reshape(b, c, hh * ww)) * (int(c) ** -0.5)
        w = torch.softmax(w, dim=2)
        h = torch.bmm(v.reshape(b, c, hh * ww), w.permute(0, 2, 1)).reshape(b, c, hh, ww)
        return x + self.proj(h)


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_a_vae_attention_block_is_one_attention_layer_and_matches_onnxruntime(tmp_path, exporter):
    from tests.models.nets import export as export_net

    path = tmp_path / f"vae_attention_{exporter}.onnx"
    x = torch.randn(1, 32, 6, 10)
    export_net(VaeAttentionBlock().eval(), x, path, exporter)
    engine = kiln.build(str(path), tactic_sources="-openvino,-onnxruntime", avg_timing=1, min_timing=1)
    assert [l.op_type for l in engine.plan.layers if l.op_type != "Reformat"] == \
        ["GroupNormalization", "Conv", "Conv", "Conv", "Attention", "Conv"]
    (attention,) = [l for l in engine.plan.layers if l.op_type == "Attention"]
    assert attention.attrs["scale"] == pytest.approx(32 ** -0.5)
    f = {"input": x.numpy()}
    assert_close_to_ort(engine.run(f)["output"], run_ort(str(path), f)[0])


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
def test_torchs_multihead_attention_reads_q_k_v_from_its_packed_projection(tmp_path, exporter):
    """nn.MultiheadAttention (a pre-LN block with a key padding mask) exports its packed in_proj, unflattened and
    transposed to [3, ...], then Gather 0, 1, 2: the Attention layer reads the projection through slice steps, so
    no Gather (each a copy of a third of it) and no shared shuffle stays in the plan."""
    from tests.models import encoders

    model = encoders.make("mha")
    feeds = encoders.inputs(model, batch=2, seq=16)
    path = tmp_path / f"mha_{exporter}.onnx"
    encoders.export(model, feeds, path, exporter)
    engine = kiln.build(str(path), autotune=False, tactic_sources="-openvino,-onnxruntime")
    ops = [l.op_type for l in engine.plan.layers]
    assert ops.count("Attention") == 1 and "Gather" not in ops
    (attention,) = [l for l in engine.plan.layers if l.op_type == "Attention"]
    assert all(any("slice" in step for step in attention.attrs[key]) for key in ("q_steps", "k_steps", "v_steps"))
    assert_close_to_ort(engine.run(feeds)["last_hidden_state"], run_ort(str(path), feeds)[0])



@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("batch", [1, 2])
def test_multihead_attentions_batch_first_transposes_leave_the_residual_to_out_proj(tmp_path, exporter, batch):
    """nn.MultiheadAttention(batch_first=True) transposes [B, S, D] to [S, B, D] around its products. out_proj's
    reshape and transpose back move into the Attention layer's output steps, so the residual Add joins out_proj; at
    batch 1 the transpose before in_proj only moves a size-1 axis and sinks into the Attention layer's steps."""
    from tests.models import encoders

    model = encoders.make("mha")
    feeds = encoders.inputs(model, batch=batch, seq=16)
    path = tmp_path / f"mha_{exporter}_{batch}.onnx"
    encoders.export(model, feeds, path, exporter)
    engine = kiln.build(str(path), autotune=False, tactic_sources="-openvino,-onnxruntime")
    in_proj = ["Shuffle", "MatMul"] if batch > 1 else ["MatMul"]   # the transpose copies once, before the product
    assert [l.op_type for l in engine.plan.layers] == ["LayerNormalization", "PointWise", *in_proj, "Shuffle",
                                                       "Expand", "Attention", "MatMul", "LayerNormalization",
                                                       "MatMul", "MatMul"]
    attention, out_proj = engine.plan.layers[-5:-3]
    residual = "/Add" if exporter == "legacy" else "node_add"
    assert out_proj.name.endswith(f" + {residual}") and out_proj.inputs[1].name == "inputs_embeds"
    assert attention.attrs["out_steps"][-1] == ({"transpose": [1, 0, 2]} if batch > 1 else {"reshape": [1, 16, 64]})
    assert_close_to_ort(engine.run(feeds)["last_hidden_state"], run_ort(str(path), feeds)[0])


class TanhGeluMlp(torch.nn.Module):
    """fc1 -> GELU's tanh form as `form` writes it -> fc2 (BERT's TensorFlow original, GPT-2's gelu_new, torch's
    approximate="tanh", which exporters spell out before opset 20)."""

    def __init__(self, form: str):
        super().__init__()
        torch.manual_seed(1)
        self.form, self.fc1, self.fc2 = form, torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        h, c = self.fc1(x), math.sqrt(2.0 / math.pi)
        if self.form == "torch":
            g = torch.nn.functional.gelu(h, approximate="tanh")
        elif self.form == "gpt2":
            g = 0.5 * h * (1.0 + torch.tanh(c * (h + 0.044715 * torch.pow(h, 3.0))))
        else:   # tensorflow's BERT: cdf first, then times x
            g = h * (0.5 * (1.0 + torch.tanh(c * (h + 0.044715 * h * h * h))))
        return self.fc2(g)


@pytest.mark.parametrize("exporter", ["legacy", "dynamo"])
@pytest.mark.parametrize("form", ["torch", "gpt2", "tensorflow"])
def test_tanh_gelu_becomes_the_first_products_activation(tmp_path, form, exporter):
    path = tmp_path / f"mlp_{form}_{exporter}.onnx"
    x = torch.randn(2, 16, HIDDEN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(TanhGeluMlp(form).eval(), (x,), str(path), input_names=["x"], output_names=["y"],
                          dynamo=exporter == "dynamo", opset_version=17 if exporter == "legacy" else 18)
    assert any(n.op_type == "Tanh" for n in onnx.load(str(path)).graph.node)   # spelled out, not Gelu (opset 20)
    engine = kiln.build(str(path), autotune=False, tactic_sources="-openvino,-onnxruntime")
    assert [l.op_type for l in engine.plan.layers] == ["MatMul", "MatMul"]
    assert engine.plan.layers[0].attrs["activation"] == {"op": "Gelu", "attrs": {"approximate": "tanh"}}
    f = {"x": x.numpy()}
    assert_close_to_ort(engine.run(f)["y"], run_ort(str(path), f)[0])
