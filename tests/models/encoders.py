"""Small transformer encoders (HF BERT / DistilBERT / MiniLM-shaped, and hand-written blocks) and an ONNX export
helper that can mark batch and sequence dimensions dynamic.

    model = make("bert", attn="eager")                       # eval mode, seeded random weights
    feeds = inputs("bert", batch=2, seq=16)                   # dict of numpy arrays, valid ids, mask with zeros
    proto = export(model, feeds, "bert.onnx", "legacy")       # ModelProto (file written too)

Every model is wrapped so that it takes its inputs positionally, in the order of `model.input_names`, and
returns a tuple in the order of `model.output_names`; those names are the ONNX graph's input/output names.

Fresh HF models have LayerNorm weight 1 / bias 0 and Linear biases 0 (and the dynamo exporter then shares one
zero initializer among all of them); `_randomize` gives every LayerNorm and Linear bias random values, so a
broken bias or LayerNorm fold cannot pass. initializer_range is raised to 0.1 so the attention probabilities
are far from uniform (with the default 0.02 the softmax is nearly flat and a masking bug would barely show).
"""
from __future__ import annotations

import inspect
import math
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn
import torch.nn.functional as F

VOCAB = 100
MAX_POSITIONS = 64


# ---------------------------------------------------------------------------------------------- HF wrappers
class HFEncoder(nn.Module):
    """Positional-argument wrapper around a HF encoder returning a plain tuple (both exporters need this:
    transformers 5 has `use_cache` etc. between `attention_mask` and `token_type_ids`)."""

    def __init__(self, model: nn.Module, input_names: tuple[str, ...], output_names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.input_names = input_names
        self.output_names = output_names

    def forward(self, *args):
        out = self.model(**dict(zip(self.input_names, args)))
        return tuple(getattr(out, name) for name in self.output_names)


def _randomize(model: nn.Module) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                if m.weight is not None:
                    m.weight.uniform_(0.5, 1.5)
                if m.bias is not None:
                    m.bias.uniform_(-0.2, 0.2)
            elif isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.uniform_(-0.1, 0.1)


def make_bert(seed: int = 0, attn: str = "eager", layers: int = 2, hidden: int = 64, heads: int = 4,
              intermediate: int = 128, pooler: bool = True, token_type_ids: bool = True, vocab: int = VOCAB,
              max_positions: int = MAX_POSITIONS) -> HFEncoder:
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=intermediate, max_position_embeddings=max_positions, type_vocab_size=2,
                     initializer_range=0.1, attn_implementation=attn)
    bert = BertModel(cfg, add_pooling_layer=pooler)
    _randomize(bert)
    ins = ("input_ids", "attention_mask") + (("token_type_ids",) if token_type_ids else ())
    outs = ("last_hidden_state",) + (("pooler_output",) if pooler else ())
    return HFEncoder(bert, ins, outs).eval()


def make_minilm(seed: int = 0, attn: str = "eager") -> HFEncoder:
    """MiniLM-L6 shape (6 layers, 12 heads, FFN 4x), shrunk to hidden 96 (head dim 8)."""
    return make_bert(seed, attn, layers=6, hidden=96, heads=12, intermediate=384, pooler=False)


def make_distilbert(seed: int = 0, attn: str = "eager") -> HFEncoder:
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(seed)
    cfg = DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                           max_position_embeddings=MAX_POSITIONS, initializer_range=0.1, attn_implementation=attn)
    model = DistilBertModel(cfg)
    _randomize(model)
    return HFEncoder(model, ("input_ids", "attention_mask"), ("last_hidden_state",)).eval()


# ------------------------------------------------------------------------------------------ hand-written
class ManualEncoderLayer(nn.Module):
    """Post-LN BERT layer written out: Q/K/V Linear, (QK^T)/sqrt(d) + additive mask, softmax, @V, output Linear,
    residual + LayerNorm, GELU FFN, residual + LayerNorm."""

    def __init__(self, d: int, heads: int, ffn: int):
        super().__init__()
        self.h, self.dk = heads, d // heads
        self.q, self.k, self.v, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x, bias):                       # x (B, S, D); bias (B, 1, 1, S) additive
        b, s, d = x.shape
        q = self.q(x).view(b, s, self.h, self.dk).transpose(1, 2)
        k = self.k(x).view(b, s, self.h, self.dk).transpose(1, 2)
        v = self.v(x).view(b, s, self.h, self.dk).transpose(1, 2)
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.dk) + bias, dim=-1)
        a = (p @ v).transpose(1, 2).reshape(b, s, d)
        x = self.ln1(x + self.o(a))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class ManualEncoder(nn.Module):
    """Embedding + position embedding + LayerNorm, N manual layers; the old BERT mask idiom
    (1 - mask[:, None, None, :].float()) * -10000."""

    input_names = ("input_ids", "attention_mask")
    output_names = ("last_hidden_state",)

    def __init__(self, d: int = 64, heads: int = 4, ffn: int = 128, layers: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(MAX_POSITIONS, d)
        self.ln = nn.LayerNorm(d)
        self.layers = nn.ModuleList([ManualEncoderLayer(d, heads, ffn) for _ in range(layers)])

    def forward(self, input_ids, attention_mask):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.ln(self.tok(input_ids) + self.pos(pos))
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.layers:
            x = layer(x, bias)
        return (x,)


class MHAEncoder(nn.Module):
    """Pre-LN block built on nn.MultiheadAttention (packed in_proj, key_padding_mask) + GELU FFN, on float
    input embeddings."""

    input_names = ("inputs_embeds", "attention_mask")
    output_names = ("last_hidden_state",)

    def __init__(self, d: int = 64, heads: int = 4, ffn: int = 128):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d))

    def forward(self, x, attention_mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, key_padding_mask=attention_mask == 0, need_weights=False)
        x = x + a
        return (x + self.ffn(self.ln2(x)),)


def make_manual(seed: int = 0) -> ManualEncoder:
    torch.manual_seed(seed)
    m = ManualEncoder()
    _randomize(m)
    return m.eval()


def make_mha(seed: int = 0) -> MHAEncoder:
    torch.manual_seed(seed)
    m = MHAEncoder()
    _randomize(m)
    with torch.no_grad():
        m.attn.in_proj_bias.uniform_(-0.1, 0.1)
    return m.eval()


MODELS = {
    "bert": make_bert,
    "minilm": make_minilm,
    "distilbert": make_distilbert,
    "manual": lambda seed=0, attn=None: make_manual(seed),
    "mha": lambda seed=0, attn=None: make_mha(seed),
}


def make(name: str, seed: int = 0, attn: str = "eager") -> nn.Module:
    """`name` in MODELS; `attn` ("eager" | "sdpa") selects the HF attention implementation (ignored otherwise)."""
    return MODELS[name](seed=seed, attn=attn)


def inputs(model: nn.Module, batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """Feeds for `model`: token ids in [1, VOCAB); attention mask 1 with right padding on every row but the
    first (row i keeps seq - 3*i tokens, at least 1); token types 0 then 1 from the middle; embeddings ~N(0,1)."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    for i in range(1, batch):
        mask[i, max(1, seq - 3 * i):] = 0
    feeds = {}
    for name in model.input_names:
        if name == "input_ids":
            feeds[name] = rng.integers(1, VOCAB, (batch, seq)).astype(np.int64)
        elif name == "attention_mask":
            feeds[name] = mask
        elif name == "token_type_ids":
            tt = np.zeros((batch, seq), np.int64)
            tt[:, seq // 2:] = 1
            feeds[name] = tt
        elif name == "inputs_embeds":
            feeds[name] = rng.standard_normal((batch, seq, 64)).astype(np.float32)
        else:
            raise KeyError(name)
    return feeds


# ------------------------------------------------------------------------------------------------ export
def export(model: nn.Module, example_inputs, path, exporter: str = "legacy", dynamic: bool = False,
           opset: int | None = None):
    """Export `model` to `path`; returns the loaded ModelProto (IR version capped for onnxruntime).

    example_inputs: a dict name -> array/tensor (as from `inputs`) or a tuple in `model.input_names` order.
    exporter="legacy": TorchScript exporter, opset 17 (unless `opset`), do_constant_folding=False.
    exporter="dynamo": torch.export based exporter at torch's default opset (unless `opset`).
    dynamic=True marks dim 0 ("batch") and dim 1 ("seq") of every input dynamic, and the same dims of every
        3-D output (batch only for 2-D outputs such as pooler_output): dynamic_axes for legacy, dynamic_shapes
        with torch.export.Dim for dynamo. Use an example with batch >= 2 and seq >= 2 (torch.export
        specializes dimensions of size 0/1).
    """
    from tests.models.nets import load_for_ort

    names = list(model.input_names)
    if isinstance(example_inputs, dict):
        args = tuple(torch.as_tensor(np.asarray(example_inputs[n])) for n in names)
    else:
        args = tuple(torch.as_tensor(np.asarray(a)) if not isinstance(a, torch.Tensor) else a for a in example_inputs)
    out_names = list(model.output_names)
    path = Path(path)
    kwargs = dict(input_names=names, output_names=out_names)
    if opset is not None:
        kwargs["opset_version"] = opset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            if dynamic:
                axes = {n: {0: "batch", 1: "seq"} for n in names}
                with torch.no_grad():
                    outs = model(*args)
                for n, o in zip(out_names, outs):
                    axes[n] = {0: "batch", 1: "seq"} if o.dim() >= 3 else {0: "batch"}
                kwargs["dynamic_axes"] = axes
            kwargs.setdefault("opset_version", 17)
            torch.onnx.export(model, args, str(path), dynamo=False, do_constant_folding=False, **kwargs)
        elif exporter == "dynamo":
            if dynamic:
                batch = torch.export.Dim("batch", min=1, max=64)
                seq = torch.export.Dim("seq", min=1, max=MAX_POSITIONS)
                specs = tuple({0: batch, 1: seq} for _ in names)
                params = inspect.signature(model.forward).parameters.values()
                varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
                kwargs["dynamic_shapes"] = (specs,) if varargs else specs   # forward(*args) takes one tuple
            torch.onnx.export(model, args, str(path), dynamo=True, external_data=False, verbose=False, **kwargs)
        else:
            raise ValueError(f"unknown exporter {exporter!r}")
    return load_for_ort(path)


def fold_weight_transposes(model):
    """`model` (a ModelProto, edited in place) with each Transpose of an initializer folded into a new initializer
    (the original dropped when nothing else reads it): the legacy export without constant folding keeps nn.Linear's
    weights behind one, and onnxruntime's quantize_dynamic quantizes only initializer weights."""
    from onnx import numpy_helper

    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    keep, transposed = [], set()
    for node in model.graph.node:
        if node.op_type == "Transpose" and node.input[0] in weights:
            transposed.add(node.input[0])
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            folded = weights[node.input[0]].transpose(perm).copy()
            model.graph.initializer.append(numpy_helper.from_array(folded, node.output[0]))
        else:
            keep.append(node)
    del model.graph.node[:]
    model.graph.node.extend(keep)
    read = {i for n in keep for i in n.input} | {o.name for o in model.graph.output}
    for t in [t for t in model.graph.initializer if t.name in transposed - read]:
        model.graph.initializer.remove(t)
    return model
